"""bench.tiered_bench's statistics, by hand (the benchmark itself runs in ``make bench``;
its harness in ``make test-bench``)."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.tiered_bench import ratio_interval


def test_the_interval_of_equal_or_scaled_repetitions_is_a_point():
    den = [0.31, 0.45, 0.40, 0.52]
    assert ratio_interval(den, den) == (1.0, 1.0)
    lo, hi = ratio_interval([2 * x for x in den], den)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_the_interval_holds_the_cells_ratio_and_narrows_with_more_repetitions():
    # Two sources of the same plan, each request +-20% around 100 ms (the spread of one plan
    # on the 2-core host): the interval holds the cell's ratio; with three repetitions it is
    # wider than the 10% a target turns on, with sixty it is narrower.
    rnd = random.Random(1)

    def reqs(k):
        return [0.1 * rnd.uniform(0.8, 1.2) for _ in range(k)]

    widths = []
    for k in (3, 60):
        a, b = reqs(k), reqs(k)
        lo, hi = ratio_interval(a, b)
        point = statistics.median(a) / statistics.median(b)
        assert lo <= point <= hi
        widths.append(hi - lo)
    assert widths[0] > 0.1 > widths[1], widths


def test_the_interval_is_seeded_and_refuses_unpaired_repetitions():
    a, b = [0.1, 0.2, 0.15], [0.12, 0.11, 0.2]
    assert ratio_interval(a, b) == ratio_interval(a, b)
    with pytest.raises(ValueError, match="3 and 2 repetitions"):
        ratio_interval(a, b[:2])
    with pytest.raises(ValueError):
        ratio_interval([], [])
