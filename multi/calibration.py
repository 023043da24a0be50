"""Online calibration of the cost model: small linear fits with forgetting.

Each fit predicts seconds from a few features (e.g. ``[1, bytes]`` for a load,
``[1, tokens, tokens*context]`` for a forward pass). It starts from the config
defaults (as a prior worth ``prior_weight`` samples), forgets old samples
exponentially, clips a sample far from the current prediction before using it
(one outlier never moves it much), and keeps every coefficient within bounds.
"""

from __future__ import annotations

import numpy as np


class OnlineFit:
    """``seconds ~ coef . x``, fitted by least squares on relative errors, with forgetting.

    - Relative errors: each sample is weighted by ``1 / predicted seconds`` (the fit's
      prediction for it before the update, kept within ``clip`` times the sample), so a
      5 ms decode step and a 2 s prefill count alike; plain least squares lets a wrong start
      linger in the short passes (``tests/test_policy.py`` checks starts 0.1x, 10x and 40x
      off).
    - Weighted by the prediction, not by the sample's own seconds: a weight that depends on
      the sample favours the fast samples and prices a spread-out quantity below its median
      (``exp(mu - 1.5 sigma^2)`` for log-normal samples); a weight fixed before the sample is
      seen leaves the fit tending to the recent mean (docs/benchmarks/decisions.md, "The
      calibration fits").
    - ``relative_to="sample"`` keeps the sample's weight, for the router's fits
      (:mod:`multi.router.choose`): its queue wait swings by orders of magnitude between an
      idle and an overloaded pool, and weighted by its prediction a burst of long waits
      discounted the short waits that followed (docs/benchmarks/sim-cluster.md).
    - The prior: the starting coefficients, worth ``prior_weight`` samples (a ridge term
      in the rescaled coordinates), fading with ``forget`` like every sample.
    - Outliers: after the first ``clip_after`` samples (3 by default), a sample more than
      ``clip`` times off the current prediction is clipped to that factor, so one wild sample
      moves the fit little. A fit whose first sample is often wild uses ``clip_after=0``:
      the cost model's load fits, whose first handoff can pay a connection's set-up and
      the remote prefill's misestimate (docs/benchmarks/decisions.md). Then the prior is
      trusted within ``clip`` until samples move it.
    - Bounds: every coefficient stays within ``[lower, upper]``.
    - ``floor`` (seconds): samples shorter than it are weighted as if they took ``floor``,
      for a quantity that is legitimately near 0 (a wait): relative errors would let one
      0.01 s sample outweigh a hundred 1 s ones.
    - ``ridge`` (0 by default; one value or one per coefficient): a pull toward the prior
      worth ``ridge`` samples that never fades, for a fit whose features can be collinear
      for a while (the router's fit of a request's compute and wait together: under a
      steady load the wait's features barely move); without it such a fit's split between
      collinear coefficients wanders.
    - ``bounded`` (off by default): solve within the bounds (:meth:`_solve_bounded`)
      rather than clip the free solution, for a fit with collinear features.
    - :meth:`reseed`: start again from measured coefficients (the router's start-up probe).
    """

    def __init__(
        self,
        prior: list[float],
        lower: list[float],
        upper: list[float],
        scale: list[float],
        prior_weight: float = 0.3,
        forget: float = 0.97,
        clip: float = 4.0,
        floor: float = 0.0,
        clip_after: int = 3,
        relative_to: str = "prediction",
        ridge: float | list[float] = 0.0,
        bounded: bool = False,
    ):
        if relative_to not in ("prediction", "sample"):
            raise ValueError(f"relative_to must be 'prediction' or 'sample', got {relative_to!r}")
        self.coef = np.asarray(prior, dtype=float)
        self.lower = np.asarray(lower, dtype=float)
        self.upper = np.asarray(upper, dtype=float)
        # Features are rescaled so that the normal equations stay well conditioned.
        self.scale = np.asarray(scale, dtype=float)
        n = len(prior)
        self._A = np.eye(n) * prior_weight
        self._b = self._A @ (self.coef * self.scale)
        self.ridge = np.broadcast_to(np.asarray(ridge, dtype=float), (n,)).copy()  # per coefficient
        self._anchor = self.coef * self.scale  # what the ridge pulls toward (rescaled)
        self.bounded = bounded
        self.forget = forget
        self.clip = clip
        self.floor = floor
        self.clip_after = clip_after
        self.relative_to = relative_to
        self.samples = 0
        self.clipped = 0

    def reseed(self, coef: list[float], weight: float) -> None:
        """Start again from ``coef`` (clipped to the bounds), worth ``weight`` samples, as a
        new prior: the router's start-up probe measured them. The sample count restarts, so
        outliers are clipped only after ``clip_after`` new samples."""
        self.coef = np.clip(np.asarray(coef, dtype=float), self.lower, self.upper)
        self._A = np.eye(len(self.coef)) * weight
        self._b = self._A @ (self.coef * self.scale)
        self._anchor = self.coef * self.scale
        self.samples = 0

    @property
    def anchor(self) -> np.ndarray:
        """The coefficients the fit started from (its prior, or its last :meth:`reseed`)."""
        return self._anchor / self.scale

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.coef, np.asarray(x, dtype=float)))

    def _relative_to(self, pred: float, y: float) -> float:
        """What a sample's error is relative to (see the class doc)."""
        if self.relative_to == "sample" or pred <= 0:
            return y
        return min(max(pred, y / self.clip), y * self.clip)

    def update(self, x: list[float], y: float, relative_to: float | None = None) -> None:
        """One sample ``y`` of features ``x``; ``relative_to`` (seconds) overrides what its
        error is relative to (the class doc)."""
        if not np.isfinite(y) or y <= 0:
            return
        pred = self.predict(x)
        if self.samples >= self.clip_after and pred > 0 and not pred / self.clip <= y <= pred * self.clip:
            self.clipped += 1
            y = min(max(y, pred / self.clip), pred * self.clip)
        ref = self._relative_to(pred, y) if relative_to is None else relative_to
        w = 1.0 / max(ref, self.floor)  # absolute below the floor
        z = np.asarray(x, dtype=float) / self.scale * w
        self._A = self.forget * self._A + np.outer(z, z)
        self._b = self.forget * self._b + z * (y * w)
        A, b = self._A, self._b
        if self.ridge.any():
            A, b = A + np.diag(self.ridge), b + self.ridge * self._anchor
        try:
            sol = self._solve_bounded(A, b) if self.bounded else np.linalg.solve(A, b)
        except np.linalg.LinAlgError:
            return
        self.coef = np.clip(sol / self.scale, self.lower, self.upper)
        self.samples += 1

    def _solve_bounded(self, A: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``A x = b`` with every coefficient within its bounds: a coefficient the solution
        puts out of bounds is held at that bound and the others solved again (until none
        is). Clipping the free solution instead breaks the fit where features are collinear:
        the solve trades one coefficient against another, and the clip undoes half of it."""
        lo, hi = self.lower * self.scale, self.upper * self.scale
        x = np.linalg.solve(A, b)
        free = np.ones(len(b), dtype=bool)
        for _ in range(len(b)):
            out = free & ((x < lo) | (x > hi))
            if not out.any():
                break
            x[out] = np.clip(x[out], lo[out], hi[out])
            free &= ~out
            if not free.any():
                break
            x[free] = np.linalg.solve(A[np.ix_(free, free)], b[free] - A[np.ix_(free, ~free)] @ x[~free])
        return x
