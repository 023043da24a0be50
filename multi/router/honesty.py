"""The check that keeps the ``kv`` policy honest: its predicted time to first token (TTFT)
against the actual one, per route kind, over a recent window; when they drift apart the
policy falls back to the better fixed policy until they agree again.

Every streamed answer adds ``(kind, predicted, actual, alternatives)`` to a window of the
last :attr:`Honesty.window` answers (``kind``: ``direct`` or ``pd``; ``alternatives``: the
best predicted TTFT of each route kind the router weighed for that request). For a kind
with at least ``min_samples`` answers in the window:

    drift_k = |median over the kind's answers of ln(actual / predicted)|
    ratio_k = median of actual / predicted

The drift is the estimates' bias, not their spread: on a shared host single answers spread
by +-30% around unbiased estimates (docs/benchmarks/router.md), which says nothing about
which policy serves better, while a bias makes the router weigh routes wrongly.

**Fallback.** While the ``kv`` policy decides, a kind whose drift exceeds ``enter``
(ln 1.5 by default: its estimates off by more than 1.5x, one way) switches it to the better
fixed policy: in a pool of plain instances ``least-outstanding``; in a P/D pool
``direct`` or ``handoff``, whichever the window says serves sooner, the kind ``k``
minimising

    cost_k = sum over the window's answers that weighed kind k of alternatives_k * ratio_k

(each kind's estimates corrected by that kind's own bias, on the same requests; a kind
with too few answers takes the other kind's ratio). The window restarts at each switch.
The fixed policy still estimates, and the fits still learn from its answers; it hands
back to ``kv`` once it has served ``hold`` answers (32, doubled for each fallback that
follows within ``2 * hold`` answers of the last return, up to 8x) and every kind with
enough answers drifts less than ``leave`` (ln 1.25: the target). The hysteresis between
``enter`` and ``leave`` and the growing hold stop it from flapping.

**Spread.** :meth:`Honesty.spread` is a quantile of a kind's ``|ln(actual / predicted)|`` over
the window: the median says how far one estimate is typically off. The kv policy's tie band
among plain instances is ``exp`` of its 0.9-quantile (:mod:`multi.router.choose`).

**Admission margin.** :meth:`Honesty.margin` is the 0.9-quantile of actual / predicted of
a kind over the window, clamped to [0.8, 3]: admission (:mod:`multi.router.admission`)
compares ``predicted * margin`` with the target, so that about 90% of what it admits meets
it even when the estimates err. Until the window holds ``min_samples`` answers of the kind,
the quantile is taken over its ``n`` answers plus ``min_samples - n`` answers at a prior
ratio (``prior``): the prior rules the first requests, each answer moves the margin, and
with ``min_samples`` answers it is the window's alone. The caller's prior is
:data:`PRIOR_MARGIN` (1.5, ``exp(ENTER)``: the largest bias the check tolerates) while
anything runs on the pool, 1 on an idle pool (what the start-up probe measured):
:mod:`multi.router.admission` says why, with the measurement.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ENTER = math.log(1.5)
LEAVE = math.log(1.25)
MARGIN_Q, MARGIN_MIN, MARGIN_MAX = 0.9, 0.8, 3.0
PRIOR_MARGIN = math.exp(ENTER)  # admission's prior ratio until the window has measured a kind (1.5)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = q * (len(s) - 1)
    lo = math.floor(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


@dataclass
class Answer:
    kind: str
    predicted: float
    actual: float
    alternatives: dict[str, float] = field(default_factory=dict)


class Honesty:
    def __init__(self, disaggregated: bool = True, window: int = 64, min_samples: int = 16,
                 enter: float = ENTER, leave: float = LEAVE, hold: int = 32, enabled: bool = True):
        self.disaggregated = disaggregated
        self.window = deque(maxlen=window)
        self.min_samples, self.enter, self.leave, self.hold = min_samples, enter, leave, hold
        self.enabled = enabled
        self.fallback: str | None = None  # the fixed policy in use, None while kv decides
        self.switches = 0  # fallbacks entered
        self._served = 0  # answers since the last switch
        self._hold = hold
        self._since_return: int | None = None  # answers since the last return to kv

    # -- measures --------------------------------------------------------------------------

    def _ratios(self, kind: str) -> list[float]:
        return [a.actual / a.predicted for a in self.window if a.kind == kind and a.predicted > 0]

    def drift(self, kind: str) -> float | None:
        """|Median ln(actual / predicted)| of ``kind`` over the window; None with too few."""
        r = self._ratios(kind)
        return abs(math.log(_quantile(r, 0.5))) if len(r) >= self.min_samples else None

    def ratio(self, kind: str) -> float | None:
        r = self._ratios(kind)
        return _quantile(r, 0.5) if len(r) >= self.min_samples else None

    def spread(self, kind: str, q: float = 0.5) -> float | None:
        """The ``q``-quantile of ``|ln(actual / predicted)|`` of ``kind`` over the window (the
        median: how far a single estimate is typically off, either way); None with too few
        answers."""
        r = self._ratios(kind)
        return _quantile([abs(math.log(x)) for x in r], q) if len(r) >= self.min_samples else None

    def margin(self, kind: str, prior: float = PRIOR_MARGIN) -> float:
        """0.9-quantile of ``kind``'s actual / predicted over the window, with
        ``min_samples - n`` answers at ``prior`` while it holds only ``n`` (module docstring)."""
        r = self._ratios(kind)
        r += [prior] * max(0, self.min_samples - len(r))
        return min(max(_quantile(r, MARGIN_Q), MARGIN_MIN), MARGIN_MAX)

    def kinds(self) -> list[str]:
        return sorted({a.kind for a in self.window})

    def better_fixed(self) -> str:
        """The fixed policy the window says serves sooner (module docstring)."""
        if not self.disaggregated:
            return "least-outstanding"
        ratios = {k: self.ratio(k) for k in ("direct", "pd")}
        known = [r for r in ratios.values() if r is not None]
        cost = {}
        for k in ("direct", "pd"):
            r = ratios[k] if ratios[k] is not None else (known[0] if known else 1.0)
            xs = [a.alternatives[k] for a in self.window if k in a.alternatives]
            if xs:
                cost[k] = r * sum(xs) / len(xs)
        if not cost:
            return "least-outstanding"
        return "direct" if min(cost, key=cost.get) == "direct" else "handoff"

    # -- the state machine -----------------------------------------------------------------

    def record(self, kind: str, predicted: float, actual: float, alternatives: dict[str, float] | None = None) -> None:
        """One streamed answer; may switch :attr:`fallback` (module docstring)."""
        if not (predicted > 0 and actual > 0 and math.isfinite(predicted) and math.isfinite(actual)):
            return
        self.window.append(Answer(kind, predicted, actual, dict(alternatives or {})))
        self._served += 1
        if self._since_return is not None:
            self._since_return += 1
        if not self.enabled:
            return
        drifts = [d for d in (self.drift(k) for k in self.kinds()) if d is not None]
        if self.fallback is None:
            if drifts and max(drifts) > self.enter:
                recent = self._since_return is not None and self._since_return < 2 * self._hold
                self._hold = min(self._hold * 2, 8 * self.hold) if recent else self.hold
                self.fallback = self.better_fixed()
                self.switches += 1
                self._restart()
        elif self._served >= self._hold and drifts and max(drifts) < self.leave:
            self.fallback = None
            self._since_return = 0
            self._restart()

    def _restart(self) -> None:
        self.window.clear()
        self._served = 0

    def state(self) -> dict:
        """What /metrics and the decision log show."""
        return {"mode": self.fallback or "kv", "switches": self.switches,
                "drift": {k: d for k in ("direct", "pd") if (d := self.drift(k)) is not None}}
