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
    def __init__(
        self,
        prior: list[float],
        lower: list[float],
        upper: list[float],
        scale: list[float],
        prior_weight: float = 3.0,
        forget: float = 0.97,
        clip: float = 4.0,
    ):
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
        self.samples = 0
        self.clipped = 0

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.coef, np.asarray(x, dtype=float)))

    def update(self, x: list[float], y: float) -> None:
        if not np.isfinite(y) or y <= 0:
            return
        pred = self.predict(x)
        if self.samples >= 3 and pred > 0 and not pred / self.clip <= y <= pred * self.clip:
            self.clipped += 1
            y = min(max(y, pred / self.clip), pred * self.clip)
        z = np.asarray(x, dtype=float) / self.scale
        self._A = self.forget * self._A + np.outer(z, z)
        self._b = self.forget * self._b + z * y
        try:
            sol = np.linalg.solve(self._A, self._b)
        except np.linalg.LinAlgError:
            return
        self.coef = np.clip(sol / self.scale, self.lower, self.upper)
        self.samples += 1
