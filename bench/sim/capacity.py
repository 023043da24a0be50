"""Capacity under an SLO: the highest arrival rate a deployment serves within its target.

Mooncake's "75% more requests while adhering to SLOs" compares *effective request
capacity*: the largest request rate at which a deployment still meets its latency
objective, not the share served at one fixed rate. Here, for one variant (cluster, policy,
admission), the capacity is the largest multiplier ``r`` of the trace's arrival rate (the
trace's times divided by ``r``) at which at least ``target`` of all requests (a rejected
one misses) get their first token within ``slo`` seconds.

Search (each step is one whole simulated run):

1. bracket: from ``r = 1``, double while the target is met, halve while it is not, until
   ``lo`` meets it and ``hi = 2 lo`` does not (or ``r`` leaves ``[1/16, 16]``: the
   result then says the bound was hit instead of inventing a number);
2. bisect in ``log r`` until ``hi / lo <= 1 + tol``; the capacity reported is ``lo``,
   a rate that was run and met the target.

Attainment is not strictly monotone in the rate (a different rate routes differently), so
the result is the crossing this search finds, with every run it made in ``runs``.
"""

from __future__ import annotations

import math
from typing import Callable

MIN_RATE, MAX_RATE = 1 / 16, 16.0


def capacity(attainment: Callable[[float], float], target: float = 0.9, tol: float = 0.05) -> dict:
    """``attainment(rate)`` runs the variant at ``rate`` and returns its SLO attainment.

    Returns ``{"rate": lo or None, "bound": None | "below_min" | "above_max", "runs":
    [(rate, attainment), ...]}``; ``rate`` is None only when even ``MIN_RATE`` misses."""
    runs: list[tuple[float, float]] = []

    def ok(r: float) -> bool:
        a = attainment(r)
        runs.append((r, a))
        return a >= target

    r = 1.0
    if ok(r):
        lo, hi = r, None
        while hi is None:
            if lo * 2 > MAX_RATE:
                return {"rate": lo, "bound": "above_max", "runs": runs}
            if ok(lo * 2):
                lo *= 2
            else:
                hi = lo * 2
    else:
        lo, hi = None, r
        while lo is None:
            if hi / 2 < MIN_RATE:
                return {"rate": None, "bound": "below_min", "runs": runs}
            if ok(hi / 2):
                lo = hi / 2
            else:
                hi /= 2
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"rate": lo, "bound": None, "runs": runs}
