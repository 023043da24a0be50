"""bench.pd_load's accounting of a stream's time per output token, by hand (the benchmark
itself runs in ``make bench``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
from pytest import approx

from bench.pd_load import cpu_seconds, gaps, pct, render, summary, tpot


def test_a_chunk_of_k_tokens_counts_k_tokens_of_its_gap_inside_the_window_only():
    # (time, completion tokens so far): 1 token at 0.0, then +1 at 0.1, +2 at 0.5 (one
    # chunk of two tokens after a 0.4 s stall), +1 at 0.6, +1 at 2.0 (after the window).
    ticks = [(0.0, 1), (0.1, 2), (0.5, 4), (0.6, 5), (2.0, 6)]
    assert gaps(ticks, 0.05, 1.0) == approx([0.1, 0.2, 0.2, 0.1])
    assert gaps(ticks, 0.2, 1.0) == approx([0.2, 0.2, 0.1])  # the chunk at 0.1 is before it
    assert gaps(ticks, 1.0, 3.0) == approx([1.4])
    assert gaps(ticks, 3.0, 4.0) == []
    assert pct([0.1, 0.2, 0.2, 0.1], 0.5) == approx(0.15) and pct([], 0.5) is None


def test_a_streams_tpot_is_its_window_time_over_its_tokens_pooled_over_repetitions():
    # Stream 1 above over [0.05, 1.0]: gaps 0.1, 0.2, 0.2, 0.1: 0.6 s for 4 tokens, 0.15.
    ticks = [(0.0, 1), (0.1, 2), (0.5, 4), (0.6, 5), (2.0, 6)]
    assert tpot(gaps(ticks, 0.05, 1.0)) == approx(0.15) and tpot([]) is None
    # Two repetitions of two streams: TPOT percentiles over the four streams, ITL over the
    # six tokens, a stream without tokens in the window left out.
    reps = [{"tpot": [0.1, 0.3], "tpot_before": [0.1, 0.1], "itl": [0.1, 0.1, 0.5], "arrival_ttft": [1.0]},
            {"tpot": [0.2, None], "tpot_before": [0.1, 0.2], "itl": [0.2, 0.2, 0.2], "arrival_ttft": [3.0]}]
    s = summary(reps)
    assert s["streams"] == 3 and s["tpot_p50"] == approx(0.2) and s["tpot_p99"] == approx(0.298)
    assert s["itl_max"] == 0.5 and s["itl_p50"] == approx(0.2) and s["tokens_in_window"] == 6
    assert s["tpot_p50_before"] == approx(0.1) and s["arrival_ttft_p50"] == approx(2.0)
    assert s["control_tpot_p50"] is None  # no repetition had a control window
    # The control windows (no arrivals) pooled over repetitions: one rep with none of its own.
    reps[0]["control"] = {"tpot": [0.05, 0.07], "arrival_ttft": []}
    reps[1]["control"] = {"tpot": [None, 0.09], "arrival_ttft": []}
    s = summary(reps)
    assert s["control_tpot_p50"] == approx(0.07) and s["control_tpot_p99"] == approx(0.0896)
    assert s["tpot_p50"] == approx(0.2)  # the arrivals' windows are unchanged by it


def test_cores_are_the_median_share_per_process_over_repetitions_and_count_a_tree_or_the_client_alone():
    reps = [{"tpot": [], "tpot_before": [], "itl": [], "arrival_ttft": [], "cores": {"decode-1": 0.9, "client": 0.1}},
            {"tpot": [], "tpot_before": [], "itl": [], "arrival_ttft": [], "cores": {"decode-1": 0.7}},
            {"tpot": [], "tpot_before": [], "itl": [], "arrival_ttft": [], "cores": {"decode-1": 0.8}}]
    assert summary(reps)["cores"] == approx({"client": 0.1, "decode-1": 0.8})
    # A parent that only waits, with a child that spins: the tree's CPU time grows with the
    # child's; a PID that does not exist is left out.
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 3: pass"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        parent_alone = psutil.Process(parent.pid).cpu_times()
        # The same parent under two names: with its child, and alone (as the client is counted).
        names = {"tree": parent.pid, "alone": parent.pid, "gone": 2**22 + 7}
        before = cpu_seconds(names, frozenset({"alone"}))
        time.sleep(0.5)
        after = cpu_seconds(names, frozenset({"alone"}))
        assert "gone" not in before
        assert after["tree"] - before["tree"] > 0.02
        assert after["tree"] > parent_alone.user + parent_alone.system + 0.02
        assert after["alone"] - before["alone"] < 0.02  # the parent only waits
    finally:
        try:
            for child in psutil.Process(parent.pid).children(recursive=True):
                child.kill()
        except psutil.Error:
            pass  # the parent ended with its child
        parent.kill()
        parent.wait(timeout=30)
    assert cpu_seconds({"me": os.getpid()})["me"] > 0


def test_the_report_names_each_process_share_of_the_cores_and_the_target_per_interval():
    def row(name, p99, cores):
        return {"deployment": name, "interval": 2.0, "tpot_p50": p99, "tpot_p99": p99, "tpot_p50_before": 0.007,
                "itl_p99": 0.02, "itl_max": 0.3, "arrival_ttft_p50": 0.9, "arrival_ttft_p90": 1.0, "cores": cores}
    rec = {"args": {"streams": 4, "prompt_len": 2048, "arrivals": 8, "reps": 3}, "date": "d",
           "machine": {"cpu": "c", "dtype": "bfloat16"},
           "rows": [row("one", 0.020, {"one": 0.95, "client": 0.1}),
                    {**row("pd", 0.012, {"prefill-0": 0.9, "decode-1": 0.8, "proxy": 0.2, "client": 0.1}),
                     "control_tpot_p50": 0.0091, "control_tpot_p99": 0.0104},
                    {"deployment": "two", "interval": 2.0, "error": "RuntimeError: boom"}]}
    md = render(rec)
    assert "- one, every 2 s: one 0.95, client 0.10 (total 1.05)" in md
    assert "- pd, every 2 s: prefill-0 0.90, decode-1 0.80, proxy 0.20, client 0.10 (total 2.00)" in md
    assert "| two | 2 | failed: RuntimeError: boom |" in md
    assert "arrivals every 2 s: 0.60x, missed." in md
    assert "| 0.60 | 9.1 / 10.4 |" in md and "| 1.00 | - / - |" in md  # control: pd had one, one had none


def test_neighbour_summary_pools_streams_per_condition_and_compares_with_quiet():
    from bench.neighbour import render, summarise

    rows = [{"condition": "quiet", "tpot": [0.010, 0.012], "a_core_share": 0.02},
            {"condition": "prefilling", "tpot": [0.015, None], "a_core_share": 0.98},
            {"condition": "quiet", "tpot": [0.014], "a_core_share": 0.04},
            {"condition": "prefilling", "tpot": [0.018], "a_core_share": 0.96}]
    res = summarise(rows)
    assert set(res) == {"quiet", "prefilling"}  # spinning was not measured: no row for it
    assert res["quiet"] == approx({"tpot_median_ms": 12.0, "tpot_min_ms": 10.0, "tpot_max_ms": 14.0, "a_core_share": 0.03})
    assert res["prefilling"]["tpot_median_ms"] == approx(16.5) and res["prefilling"]["a_core_share"] == approx(0.97)
    md = render(res, 4, 2, 8.0)
    assert "| prefilling | 0.97 | 16.5 (15.0-18.0) | 1.38 |" in md and "| quiet | 0.03 | 12.0 (10.0-14.0) | 1.00 |" in md
