"""The router benchmark's workloads (``vllm bench serve`` arguments and generated datasets)
and what it reads back from each router's decision log (``bench/router_bench.py``).

Workloads (16 output tokens, ``--ignore-eos``; all but ``trace`` and admission closed loop at
``--max-concurrency 4``):

- ``prefix``: ``--dataset-name prefix_repetition``, ``Scale.prefix_len``-token prefixes,
  32-token suffixes, ``Scale.num_prefixes`` prefixes (together ~1.5x one engine's prefix cache);
- ``chat``: ``--dataset-name sharegpt`` from a generated file: conversations whose turn k
  sends the text of turns 1..k, turn-major so that conversations interleave
  (``--disable-shuffle``);
- ``short``: ``--dataset-name random``, 256-token prompts (the P/D overhead case);
- ``noreuse``: ``--dataset-name random``, 1,024-token prompts (nothing shared);
- ``trace``: a scaled window of Mooncake's conversation trace (:mod:`bench.trace`: one in
  80 sharing groups, lengths and outputs / 8, 64-token blocks, arrivals rescaled to
  ``Scale.trace_rate`` requests per second), sent at its timestamps
  (``--dataset-name timed_trace``; the client draws a block's tokens from its hash id with
  Python's ``hash()``, so each run's ``PYTHONHASHSEED`` is its seed: the same sharing
  structure, other tokens, nothing left in the store by an earlier run).

Estimates (:func:`estimates`): from the decision log of a run, the routed requests in the
order they arrived (the warm-up's left out) with a first token seen; ``ratio_after`` is the
median of predicted / actual time to first token (``ttft_predicted_s`` / ``ttft_s``) over
the requests after the first ``settle`` (50 in the full run), ``ratio_all`` over all,
``fallback_share`` the share of requests the kv policy's fallback routed, and ``cold_ttft_s``
the median time to first token of the requests of which nothing was held (no instance's
cache, not the store: ``cached_target``, ``cached_prefill`` and ``store`` all 0).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from bench import trace

SUFFIX, OUTPUT = 32, 16
TRACE_LEN_FACTOR = 8
WORKLOADS = ("prefix", "chat", "short", "noreuse", "trace")


@dataclass(frozen=True)
class Scale:
    cache_blocks: int  # every engine's prefix cache (--num-gpu-blocks-override)
    max_model_len: int  # below cache_blocks * block: vLLM needs room for one longest request
    prefix_len: int
    num_prefixes: int
    prompts: int  # per closed-loop run
    admission_prompts: int
    chat: tuple[int, int, int, int] | None  # conversations, turns, user tokens, assistant tokens per turn
    workloads: tuple[str, ...]
    trace_count: int  # requests of the trace window
    trace_rate: float  # its mean arrival rate, requests per second
    settle: int  # requests before the estimates are judged
    serve_prompts: int  # the vllm bench serve comparison against one plain engine (tiny model)


# All prefixes (with their suffix block) ~1.4-1.5x one engine's cache, each engine's half ~0.7x.
QUICK = Scale(cache_blocks=96, max_model_len=2048, prefix_len=512, num_prefixes=8, prompts=24, admission_prompts=16,
              chat=None, workloads=("prefix",), trace_count=0, trace_rate=0.0, settle=8, serve_prompts=32)
FULL = Scale(cache_blocks=192, max_model_len=4096, prefix_len=1024, num_prefixes=9, prompts=80, admission_prompts=64,
             chat=(16, 5, 80, 40), workloads=WORKLOADS, trace_count=80, trace_rate=1.5, settle=50, serve_prompts=128)


def chat_dataset(path: Path, model: str, seed: int, conversations: int, turns: int, user: int, assistant: int) -> int:
    """Synthetic conversations in ShareGPT's format, one entry per turn: turn k of conversation
    c asks with the text of turns 1..k (user and assistant text from random token ids),
    turn-major so that turns of different conversations interleave. Returns the entry count.
    (``--dataset-name custom`` would take JSONL but needs pandas, which the venv lacks.)"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    rng = random.Random(seed)
    text = lambda n: tok.decode([rng.randrange(4, tok.get_vocab_size()) for _ in range(n)])  # noqa: E731
    history = [""] * conversations
    entries = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += f"user: {text(user)}\n"
            reply = f"assistant: {text(assistant)}\n"  # what "the model said", fixed in advance
            entries.append({"id": f"c{c}t{len(entries)}", "conversations": [
                {"from": "human", "value": history[c] + "assistant:"}, {"from": "gpt", "value": reply}]})
            history[c] += reply
    longest = max(len(tok.encode(e["conversations"][0]["value"]).ids) for e in entries)
    if longest > 1000:  # bench serve drops ShareGPT prompts over 1024 tokens
        raise ValueError(f"chat prompts reach {longest} tokens; ShareGPT sampling keeps <= 1024")
    path.write_text(json.dumps(entries))
    return len(entries)


def trace_window(sc: Scale, path: Path) -> int:
    """The scaled trace window (module docstring) written to ``path``; its request count."""
    reqs = trace.scale(trace.window(trace.sample(trace.load("conversation"), 80), 0, sc.trace_count),
                       len_factor=TRACE_LEN_FACTOR, out_factor=8.0)
    span = max(r.timestamp_ms for r in reqs) or 1.0
    target_ms = 1e3 * len(reqs) / sc.trace_rate
    block = trace.BLOCK // TRACE_LEN_FACTOR
    out = []
    for r in reqs:
        n = min(r.input_length, sc.max_model_len - r.output_length - 1)
        out.append(replace(r, timestamp_ms=r.timestamp_ms * target_ms / span, input_length=n,
                           hash_ids=r.hash_ids[:-(-n // block)]))
    trace.write(out, path)
    return len(out)


def dataset_args(workload: str, sc: Scale, model: str, seed: int, runs: Path, name: str) -> list[str]:
    """``vllm bench serve`` arguments of one workload (``admission``: the prefix workload's)."""
    if workload in ("prefix", "admission"):
        n = sc.prompts if workload == "prefix" else sc.admission_prompts
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(n),
                "--prefix-repetition-prefix-len", str(sc.prefix_len), "--prefix-repetition-suffix-len", str(SUFFIX),
                "--prefix-repetition-num-prefixes", str(sc.num_prefixes), "--prefix-repetition-output-len", str(OUTPUT)]
    if workload == "chat":
        path = runs / f"{name}.sharegpt.json"
        n = chat_dataset(path, model, seed, *sc.chat)
        return ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", str(n),
                "--sharegpt-output-len", str(OUTPUT), "--disable-shuffle"]
    if workload == "trace":
        path = runs / f"{name}.trace.jsonl"
        n = trace_window(sc, path)
        return ["--dataset-name", "timed_trace", "--dataset-path", str(path), "--num-prompts", str(n),
                "--timed-trace-chunk-hash-size", str(trace.BLOCK // TRACE_LEN_FACTOR),
                "--timed-trace-sec-multiplier", "0.001"]
    length = 256 if workload == "short" else 1024
    return ["--dataset-name", "random", "--num-prompts", str(sc.prompts), "--random-input-len", str(length),
            "--random-output-len", str(OUTPUT), "--random-range-ratio", "0"]


def serve_args(prompts: int) -> list[str]:
    """The issue's comparison: 1,024-token prefixes, 64-token suffixes, 4 prefixes, 16 output tokens."""
    return ["--dataset-name", "prefix_repetition", "--num-prompts", str(prompts), "--prefix-repetition-prefix-len",
            "1024", "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
            "--prefix-repetition-output-len", str(OUTPUT)]


# The admission target is at least this times the unthrottled run's median TTFT of a prompt
# nothing held (the estimates' +-25% band): admission rejects a request whose estimate
# misses the target, and a rejected prompt is never computed, so under a target an idle
# deployment misses for a new prefix no prefix ever gets cached and every request is
# rejected (docs/benchmarks/router.md: 63 of 63 under 0.51 s with ~0.48 s cold prefills).
COLD_MARGIN = 1.25


def admission_target(p90_s: float, cold_s: float | None) -> float:
    """The admission runs' TTFT target in seconds: the largest of 0.5, ``p90_s`` (the
    unthrottled kv run's p90 TTFT) and :data:`COLD_MARGIN` times ``cold_s`` (its median TTFT
    of prompts nothing held, :func:`estimates`' ``cold_ttft_s``; None: not measured), so that
    above capacity tests the load, not a target an idle deployment misses."""
    return max(0.5, p90_s, COLD_MARGIN * (cold_s or 0.0))


def _median(xs: list[float]) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def estimates(log: Path, skip: int, settle: int, policy: str) -> dict:
    """Predicted against actual TTFT of one run from its decision log (module docstring);
    ``skip`` lines (the warm-up's) are left out."""
    try:
        lines = log.read_text().splitlines()[skip:]
    except OSError:
        return {}
    recs = sorted((json.loads(x) for x in lines if x.strip()), key=lambda d: d["t"])
    timed = [d for d in recs if d.get("ttft_s") and d.get("ttft_predicted_s") and d["status"] == 200]
    ratios = [d["ttft_predicted_s"] / d["ttft_s"] for d in timed]
    after = ratios[settle:]
    modes = [d.get("mode") or policy for d in recs if d["kind"] != "reject"]
    cold = [d["ttft_s"] for d in timed
            if max(d.get("cached_target") or 0, d.get("cached_prefill") or 0, d.get("store") or 0) == 0]
    return {"requests": len(recs), "timed": len(timed), "settle": settle,
            "ratio_all": _median(ratios), "ratio_after": _median(after), "after_n": len(after),
            "cold_ttft_s": _median(cold), "cold_n": len(cold),
            "fallback_share": sum(1 for m in modes if m.startswith("fallback")) / len(modes) if modes else None,
            "kinds": {k: sum(1 for d in recs if d["kind"] == k) for k in ("direct", "pd", "reject")}}
