"""bench.trace: Mooncake's published traces load, and the scaler keeps their sharing
structure (which requests share how many leading blocks, in what order) while dividing
lengths and rates; vLLM's own timed_trace loader turns a scaled file into prompts that
share exactly those prefixes."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from bench import trace as T


@pytest.fixture(scope="module")
def conversation():
    return T.load("conversation")


def test_published_traces_load_with_their_documented_figures(conversation):
    # The README's table: 12,031 requests, 37.4% reusable (this module caps at N-1, the
    # README at N: the same to the first decimal).
    assert len(conversation) == 12031
    assert round(T.ideal_reuse(conversation, 512), 3) == pytest.approx(0.374, abs=0.001)
    syn = T.load("synthetic")
    assert len(syn) == 3993
    assert round(T.ideal_reuse(syn, 512), 3) == pytest.approx(0.651, abs=0.001)


def test_scaling_keeps_every_pairs_shared_prefix_and_the_order(conversation):
    orig = T.sample(conversation, 40)[:150]
    scaled = T.scale(orig, len_factor=8, out_factor=8, time_factor=0.1)
    assert len(scaled) == len(orig)
    shared = 0
    for i, j in itertools.combinations(range(len(orig)), 2):
        k = T.common_blocks(orig[i], orig[j])
        assert T.common_blocks(scaled[i], scaled[j]) == k
        shared += k > 1
    assert shared > 100  # the window does share (conversations), so the check above has teeth
    for o, s in zip(orig, scaled):
        nb = len(o.hash_ids)
        assert len(s.hash_ids) == nb
        assert (nb - 1) * 64 < s.input_length <= nb * 64 and s.input_length == math.ceil(o.input_length / 8)
        assert s.output_length == max(1, round(o.output_length / 8))
        assert s.timestamp_ms == pytest.approx((o.timestamp_ms - orig[0].timestamp_ms) * 0.1)
    # The reusable fraction changes by the rounding of lengths only.
    assert T.ideal_reuse(scaled, 64) == pytest.approx(T.ideal_reuse(orig, 512), abs=0.01)
    # Ids are renumbered densely in order of first appearance.
    seen = sorted({h for r in scaled for h in r.hash_ids})
    assert seen == list(range(len(seen))) and scaled[0].hash_ids[0] == 0


def test_sampling_keeps_whole_sharing_groups(conversation):
    buckets = [T.sample(conversation, 40, bucket=b) for b in range(40)]
    assert sum(len(b) for b in buckets) == len(conversation)  # a partition
    keys = [{r.hash_ids[:2] for r in b} for b in buckets]
    for a, b in itertools.combinations(keys, 2):
        assert not a & b  # no group split across buckets
    assert T.sample(conversation, 40) == buckets[0]  # stable across runs (crc32, not hash())
    # One group in 40 keeps the conversations: its reuse is the hour's, not a window's.
    assert T.ideal_reuse(buckets[0], 512) > 0.3
    assert T.ideal_reuse(T.window(conversation, 0, 150), 512) < 0.1


def test_bad_input_is_refused_with_the_reason(tmp_path):
    r = T.Request(0.0, 1000, 10, (1, 2))
    with pytest.raises(ValueError, match="must divide the block size 512"):
        T.scale([r], len_factor=3)
    with pytest.raises(ValueError, match="not the published format"):
        T.scale([T.Request(0.0, 2000, 10, (1, 2))])
    with pytest.raises(ValueError, match="outside the trace"):
        T.window([r], 5)
    with pytest.raises(FileNotFoundError, match="conversation, synthetic"):
        T.load(str(tmp_path / "nope.jsonl"))


def test_written_file_replays_in_vllms_timed_trace_with_the_shared_prefixes(tmp_path, conversation):
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import TimedTrace

    from tests.harness import model_dir

    scaled = T.scale(T.sample(conversation, 40)[:40], len_factor=8, out_factor=8, time_factor=0.1)
    path = tmp_path / "w.jsonl"
    T.write(scaled, path)
    assert [json.loads(x)["hash_ids"] for x in path.read_text().splitlines()] == [list(r.hash_ids) for r in scaled]
    assert T.load(str(path)) == [T.Request(round(r.timestamp_ms, 3), r.input_length, r.output_length, r.hash_ids)
                                 for r in scaled]
    ds = TimedTrace(dataset_path=str(path), random_seed=0, timed_trace_chunk_hash_size=64,
                    timed_trace_sec_multiplier=0.001, timed_trace_label_timestamp="timestamp",
                    timed_trace_label_input_length="input_length", timed_trace_label_output_length="output_length",
                    timed_trace_label_hash_ids="hash_ids")
    samples = ds.sample(AutoTokenizer.from_pretrained(str(model_dir("tiny"))), num_requests=len(scaled))
    assert [s.prompt_len for s in samples] == [r.input_length for r in scaled]
    assert [s.timestamp for s in samples] == pytest.approx([r.timestamp_ms / 1e3 for r in scaled], abs=1e-6)
    checked = 0
    for (a, sa), (b, sb) in itertools.combinations(zip(scaled, samples), 2):
        k = T.common_blocks(a, b)
        if k * 64 < min(a.input_length, b.input_length):
            n = k * 64
            assert sa.prompt[:n] == sb.prompt[:n]
            assert sa.prompt[n:n + 64] != sb.prompt[n:n + 64]  # the first unshared block differs
            checked += k > 0
    assert checked > 20
