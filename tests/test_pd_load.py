"""bench.pd_load's accounting of a stream's time per output token, by hand (the benchmark
itself runs in ``make bench``)."""

from __future__ import annotations

from pytest import approx

from bench.pd_load import gaps, pct


def test_a_chunk_of_k_tokens_counts_k_tokens_of_its_gap_inside_the_window_only():
    # (time, completion tokens so far): 1 token at 0.0, then +1 at 0.1, +2 at 0.5 (one
    # chunk of two tokens after a 0.4 s stall), +1 at 0.6, +1 at 2.0 (after the window).
    ticks = [(0.0, 1), (0.1, 2), (0.5, 4), (0.6, 5), (2.0, 6)]
    assert gaps(ticks, 0.05, 1.0) == approx([0.1, 0.2, 0.2, 0.1])
    assert gaps(ticks, 0.2, 1.0) == approx([0.2, 0.2, 0.1])  # the chunk at 0.1 is before it
    assert gaps(ticks, 1.0, 3.0) == approx([1.4])
    assert gaps(ticks, 3.0, 4.0) == []
    assert pct([0.1, 0.2, 0.2, 0.1], 0.5) == approx(0.15) and pct([], 0.5) is None
