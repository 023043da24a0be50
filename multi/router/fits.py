"""What the router learns per instance: one fit of a request's own compute and its wait
there together, from every answer, and the start-up probe's seeding of it.

A request's time on instance ``i`` before its first token (a handoff's prefill request on
its prefill instance; a direct request's time to first token), less the loads before its
compute, is modelled as

    y = step + token * n + attn * n * (c + n / 2)                    (its own compute)
      + a * busy + b * k * own + c_w * w + d * decoding               (its wait)

for ``n`` new tokens after ``c`` cached ones; ``busy`` is 1 while ``i`` has a request of
the router in flight, ``k`` the requests in flight there, ``own`` the request's own compute
at the prior's (or the probe's) coefficients (:meth:`InstanceFit.anchor_compute_s`), ``w``
the routed prefill work still ahead (:meth:`Instance.queue_s`) and ``decoding`` the
requests past their first token there (its decode occupancy: each adds to every step of
the engine). The seven coefficients are one :class:`multi.calibration.OnlineFit`
(forgetting 0.9, no clipping), so that answers measured under concurrency teach the speed
as well as the wait instead of being discarded: the queue ahead is in the features. A
sample's error counts relative to the wait it had (its seconds less its predicted
compute, at least :data:`MIN_WAIT_S`), and absolutely below ``floor`` seconds: weighted
relatively, near-0 waits drove the queue's coefficients to 0
(docs/benchmarks/sim-cluster.md, ``tests/test_sim.py``). Under a steady load the wait's
features barely move and are collinear with the compute's: the solve keeps every coefficient
within its bounds (``bounded``; clipping the free solution undid half of a trade between
collinear coefficients), and a ridge that never fades (:data:`RIDGE` samples' worth, on
every coefficient) keeps the split near the anchor (the prior or the probe's measurement).

Priors: the compute terms from :class:`multi.policy.PolicyConfig` (``prefill_*``), the wait
``(a, b, c_w, d) = (0, 1, 1, 0)``: each request in flight delays this one by about its own
compute, plus the work ahead. The start-up probe (:mod:`multi.router.probe`) replaces both
with measurements: the compute from :func:`probe_compute`, the wait ``(0, 0, 1, 0)`` (the
work ahead is worked through at the measured speed).

:func:`probe_compute` fits ``step`` and ``token`` to the probe's timings of prompts of two
lengths, with ``attn`` scaled from its prior as ``token`` is (both are the machine's
arithmetic rate): with ``r = attn_prior / token_prior`` and ``g(n) = n + r * n^2 / 2``,

    token = (t2 - t1) / (g(n2) - g(n1)),   step = t1 - token * g(n1),   attn = r * token

(least squares over all timings when more than two lengths are given).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from multi.calibration import OnlineFit
from multi.policy import PolicyConfig, forward_features

COMPUTE_LOWER, COMPUTE_UPPER, COMPUTE_SCALE = [0.0, 1e-7, 0.0], [5.0, 1.0, 1e-3], [1.0, 1e3, 1e6]
WAIT_PRIOR = [0.0, 1.0, 1.0, 0.0]
PROBED_WAIT = [0.0, 0.0, 1.0, 0.0]
WAIT_LOWER, WAIT_UPPER, WAIT_SCALE = [0.0, 0.0, 0.0, 0.0], [30.0, 30.0, 10.0, 1.0], [1.0, 0.1, 0.1, 10.0]
MIN_WAIT_S = 0.005  # the smallest wait a sample's error counts relative to
RIDGE = 0.3  # samples' worth, on every coefficient (module docstring)


class InstanceFit:
    """The joint fit of one instance (module docstring); ``floor`` is the fit's floor in
    seconds (:data:`multi.router.choose.WAIT_FLOOR_S`)."""

    def __init__(self, cfg: PolicyConfig, floor: float):
        prior = [cfg.prefill_step_s, cfg.prefill_token_s, cfg.prefill_attn_s] + WAIT_PRIOR
        self.floor = floor
        self.fit = OnlineFit(prior, lower=COMPUTE_LOWER + WAIT_LOWER, upper=COMPUTE_UPPER + WAIT_UPPER,
                             scale=COMPUTE_SCALE + WAIT_SCALE, forget=0.9, clip=float("inf"), floor=floor,
                             relative_to="sample", ridge=RIDGE, bounded=True)
        self.probed = False

    @property
    def compute_coef(self) -> np.ndarray:
        return self.fit.coef[:3]

    def anchor_compute_s(self, new_tokens: int, cached: int) -> float:
        """A compute's seconds at the prior's (or the probe's) coefficients: the ``own`` of the
        wait's ``k * own`` feature. At the learned ones the feature would move with the fit
        it feeds, and the fit chase itself (under a steady load it drifted to the constants)."""
        if new_tokens <= 0:
            return 0.0
        anchor = self.fit.anchor[:3]
        return float(np.dot(anchor, forward_features([new_tokens], [cached])))

    def wait_s(self, wait_x: Sequence[float]) -> float:
        return float(np.dot(self.fit.coef[3:], np.asarray(wait_x, dtype=float)))

    def learn(self, new_tokens: int, cached: int, wait_x: Sequence[float], seconds: float) -> None:
        """One measured ``seconds``; its error counts relative to the wait it had (at least
        :data:`MIN_WAIT_S`), absolutely below the fit's floor (module docstring)."""
        x = forward_features([new_tokens], [cached])
        waited = seconds - float(np.dot(self.compute_coef, x))
        self.fit.update(x + list(wait_x), seconds, relative_to=max(waited, MIN_WAIT_S))

    def seed(self, compute: Sequence[float], weight: float, scale_s: float | None = None) -> None:
        """The probe's measurement: the compute coefficients and :data:`PROBED_WAIT`; and,
        with ``scale_s`` (the probe's time of a long prompt), the floor becomes
        ``min(floor, max(scale_s, MIN_WAIT_S))``: a wait is near 0 relative to this
        instance's own request times, not to another machine's."""
        self.fit.reseed(list(compute) + PROBED_WAIT, weight)
        if scale_s is not None and scale_s > 0:
            self.fit.floor = min(self.floor, max(scale_s, MIN_WAIT_S))
        self.probed = True


def probe_compute(samples: Sequence[tuple[int, float]], cfg: PolicyConfig) -> list[float] | None:
    """``[step, token, attn]`` from ``(prompt tokens, seconds)`` timings of uncached prompts
    of at least two lengths (module docstring), clipped to the compute fit's bounds; None when
    the timings cannot give a positive per-token cost (e.g. one length only)."""
    if len({n for n, _ in samples}) < 2:
        return None
    r = cfg.prefill_attn_s / cfg.prefill_token_s if cfg.prefill_token_s > 0 else 0.0
    g = np.array([n + r * n * n / 2 for n, _ in samples], dtype=float)
    t = np.array([s for _, s in samples], dtype=float)
    X = np.stack([np.ones_like(g), g], axis=1)
    (step, token), *_ = np.linalg.lstsq(X, t, rcond=None)
    if not token > 0:
        return None
    coef = np.clip([max(step, 0.0), token, r * token], COMPUTE_LOWER, COMPUTE_UPPER)
    return [float(x) for x in coef]
