"""bench.pd_load's accounting of a stream's time per output token, by hand (the benchmark
itself runs in ``make bench``)."""

from __future__ import annotations

from pytest import approx

from bench.pd_load import gaps, pct, summary, tpot


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
