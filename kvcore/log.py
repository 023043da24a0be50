"""Loggers under vLLM's namespace, so vLLM's handlers and level apply to ours."""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time


def get_logger(name: str) -> logging.Logger:
    # vLLM only configures the "vllm" logger tree; a logger outside it prints nothing
    # inside the engine processes, so ours live under "vllm.mctier". Processes that
    # never imported vLLM (store server, proxy, tools) must not pay ~8 s to import it
    # just for a logger.
    full = f"vllm.mctier.{name}"
    if "vllm" in sys.modules:
        from vllm.logger import init_logger

        return init_logger(full)
    logger = logging.getLogger(full)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


class DegradeWatch:
    """Turns per-request warnings into one error an operator cannot miss: over the last
    ``window`` outcomes, when at least ``min_failed`` failed and they are at least ``ratio`` of
    them, log an ERROR naming the causes, at most once per ``every_s`` seconds.

    A tier that falls back to recomputation on every request still serves correct tokens, so
    nothing else would say that the tier does nothing (the failures are also counted in the
    tier's metrics)."""

    def __init__(self, logger: logging.Logger, what: str, window: int = 20, min_failed: int = 5,
                 ratio: float = 0.5, every_s: float = 60.0, clock=None):
        self.logger, self.what = logger, what
        self.window, self.min_failed, self.ratio, self.every_s = window, min_failed, ratio, every_s
        self._clock = clock or time.monotonic
        self._recent: collections.deque[str | None] = collections.deque(maxlen=window)
        self._last: float | None = None
        self.errors = 0  # ERRORs logged so far
        self._lock = threading.Lock()  # outcomes arrive from several pull threads

    def record(self, cause: str | None) -> bool:
        """One outcome (``None`` for a success, else its cause); True when it logged the error."""
        with self._lock:
            return self._record(cause)

    def _record(self, cause: str | None) -> bool:
        self._recent.append(cause)
        failed = [c for c in self._recent if c is not None]
        if len(failed) < self.min_failed or len(failed) < self.ratio * len(self._recent):
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        self.errors += 1
        causes = ", ".join(f"{c} x{failed.count(c)}" for c in sorted(set(failed)))
        self.logger.error("%s: %d of the last %d failed (%s); each one fell back to recomputation. "
                          "Logged at most every %.0f s.", self.what, len(failed), len(self._recent), causes,
                          self.every_s)
        return True


class Throttle:
    """At most one log line per key every ``every_s`` seconds, with the number of lines held back
    since: what a peer can trigger at will (undecodable or refused messages) must not flood the
    log. ``ready(key)`` -> ``None`` (hold this one back) or the count held back before it."""

    def __init__(self, every_s: float = 10.0, clock=None):
        self.every_s = every_s
        self._clock = clock or time.monotonic
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def ready(self, key: str) -> int | None:
        with self._lock:
            now = self._clock()
            last = self._last.get(key)
            if last is not None and now - last < self.every_s:
                self._held[key] += 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)
