"""The hybrid-allocator benchmark's pure parts (bench.hybrid_memory), by hand: what a KV usage
reading stands for, the pairing of the arms into on/off ratios, the table, and the line of a
log that names a refusal. The benchmark itself runs in ``make bench``; its harness in
``make test-bench``."""

from __future__ import annotations

import pytest

from bench.hybrid_memory import kv_bytes, pairs, refusal, retention, table

pytestmark = pytest.mark.unit

GIB = 1 << 30


def test_a_usage_reading_is_blocks_of_the_pool_less_the_null_block():
    # 32,768 blocks of 32 KiB in 1 GiB; the gauge divides by the 32,767 blocks but the null one.
    blocks, nbytes = kv_bytes(69 / 32767, 32768, GIB)
    assert blocks == pytest.approx(69) and nbytes == pytest.approx(69 * 32768)
    assert kv_bytes(None, 32768, GIB) is None and kv_bytes(0.5, 1, GIB) is None


def _row(model, arm, n, rep, kv, saved, loaded, ttft, match=True):
    return {"model": model, "arm": arm, "tokens": n, "rep": rep, "kv_bytes_decode": kv, "kv_blocks_decode": kv / 100,
            "kv_bytes_peak": kv, "saved_bytes_master": saved, "loaded_bytes": loaded, "hit_ttft_s": ttft,
            "saved_objects": 8, "ref_hit_ttft_s": 0.02, "ref_miss_ttft_s": 0.1, "hit_cached": n, "tokens_match": match}


def test_pairs_take_medians_per_arm_and_the_ratio_on_over_off():
    rows = [_row("m", "on", 2048, 0, 100.0, 10.0, 5.0, 0.030), _row("m", "off", 2048, 0, 200.0, 16.0, 10.0, 0.020),
            _row("m", "on", 2048, 1, 300.0, 10.0, 5.0, 0.050, match=False),
            _row("m", "off", 2048, 1, 200.0, 16.0, 10.0, 0.040)]
    (p,) = pairs(rows)
    assert p["reps"] == 2
    assert p["kv_bytes_decode"] == {"on": 200.0, "off": 200.0, "on/off": 1.0}
    assert p["saved_bytes_master"]["on/off"] == pytest.approx(10 / 16)
    assert p["hit_ttft_s"]["on/off"] == pytest.approx(0.040 / 0.030)
    assert p["tokens_match"] == {"on": False, "off": True}


def test_an_arm_that_did_not_run_has_no_ratio_and_the_table_names_the_refusal():
    rows = [_row("tiny-swa-all", "on", 2048, 0, 196608.0, 1.05e6, 1.3e5, 0.029)]
    (p,) = pairs(rows)
    assert p["loaded_bytes"] == {"on": 1.3e5, "off": None, "on/off": None}
    result = {"date": "2026-12-05T20:00+00:00", "commit": "abc1234", "chunk_tokens": 256, "block_tokens": 32,
              "reps": 1, "refused": {"tiny-swa-all/off": "engine: ValueError: no"},
              "machine": {"cpu": "Xeon", "isa": ["avx512f"], "dtype": "float32", "cores": 2}}
    md = table([p], result)
    lines = md.splitlines()
    body = [x for x in lines if x.startswith("| tiny-swa-all")]
    assert len(body) == 1 and "0.20 / - (-)" in body[0] and "| yes / - |" in body[0]
    assert "abc1234" in md and "Xeon" in md and "float32" in md
    assert "Refused: tiny-swa-all/off (hybrid allocator off): `engine: ValueError: no`" in md


def test_the_refusal_is_the_last_line_that_says_why():
    log = "INFO starting\nERROR x: ValueError: first\nINFO more\nERROR y: ValueError: the reason\nINFO exiting\n"
    assert refusal(log) == "ERROR y: ValueError: the reason"
    assert refusal("") == "no log"


def test_the_reference_keeps_sliding_checkpoints_only_where_it_has_a_sliding_group(tmp_path):
    mixed, every = tmp_path / "mixed", tmp_path / "every"
    mixed.mkdir()
    every.mkdir()
    (mixed / "config.json").write_text('{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}')
    (every / "config.json").write_text('{"sliding_window": 64}')
    flag = ["--prefix-cache-retention-interval", "256"]
    assert retention(str(mixed), "on") == flag and retention(str(mixed), "off") == []
    assert retention(str(every), "on") == flag == retention(str(every), "off")
