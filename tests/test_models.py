"""The test-model builder: the small model's shape picked by measured speed, recorded beside it."""

from __future__ import annotations

import json

import pytest

from multi.cli.models import TARGET_S, build, describe, pick_rung

pytestmark = pytest.mark.unit


def rows(*seconds):
    return [{"shape": {"layers": i}, "engine_s": s} for i, s in enumerate(seconds)]


def test_pick_rung_takes_the_cheapest_rung_in_the_band():
    lo, hi = TARGET_S
    assert (lo, hi) == (1.0, 3.0)
    assert pick_rung(rows(0.3, 0.9, 2.0))["engine_s"] == 2.0  # the first at 1 s or more
    assert pick_rung(rows(0.3, 1.1, 2.5))["engine_s"] == 1.1  # (measuring stops there in practice)
    assert pick_rung(rows(0.3, 0.8, 6.0))["engine_s"] == 0.8  # 6 s overshoots: the rung below
    assert pick_rung(rows(0.1, 0.2))["engine_s"] == 0.2  # nothing reaches the band: the largest
    assert pick_rung(rows(4.0))["engine_s"] == 4.0  # the cheapest rung is already too slow: nothing smaller


def test_build_records_the_spec_and_reuses_it(tmp_path):
    out = build("tiny", tmp_path / "tiny", dtype="float32")
    rec = json.loads((out / "mctier-spec.json").read_text())
    assert rec["shape"]["layers"] == 2 and rec["shape"]["hidden"] == 256 and rec["params"] > 0
    assert "float32" not in json.dumps(rec["key"])  # tiny is not sized by measuring: any dtype loads it
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert build("tiny", tmp_path / "tiny", dtype="bfloat16") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights  # reused, not rebuilt
    assert describe(out).startswith("tiny: 2 layers, hidden 256")
    # An explicit shape skips the measuring and is part of what is reused.
    fixed = build("small", tmp_path / "fixed", layers=2, hidden=256, heads=4, kv_heads=2)
    assert "measured" not in json.loads((fixed / "mctier-spec.json").read_text())
