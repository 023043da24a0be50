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
        self.forget = forget
        self.clip = clip
        self.floor = floor
        self.clip_after = clip_after
        self.relative_to = relative_to
        self.samples = 0
        self.clipped = 0

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.coef, np.asarray(x, dtype=float)))

    def _relative_to(self, pred: float, y: float) -> float:
        """What a sample's error is relative to (see the class doc)."""
        if self.relative_to == "sample" or pred <= 0:
            return y
        return min(max(pred, y / self.clip), y * self.clip)

    def update(self, x: list[float], y: float) -> None:
        if not np.isfinite(y) or y <= 0:
            return
        pred = self.predict(x)
        if self.samples >= self.clip_after and pred > 0 and not pred / self.clip <= y <= pred * self.clip:
            self.clipped += 1
            y = min(max(y, pred / self.clip), pred * self.clip)
        w = 1.0 / max(self._relative_to(pred, y), self.floor)  # absolute below the floor
        z = np.asarray(x, dtype=float) / self.scale * w
        self._A = self.forget * self._A + np.outer(z, z)
        self._b = self.forget * self._b + z * (y * w)
        try:
            sol = np.linalg.solve(self._A, self._b)
        except np.linalg.LinAlgError:
            return
        self.coef = np.clip(sol / self.scale, self.lower, self.upper)
        self.samples += 1
