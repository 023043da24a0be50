"""Store lookups off the caller's thread, many requests' in one ``batch_is_exist``.

Why: a lookup is a round trip to the master (0.2 to 1 ms on loopback, more after idle or while
the master is busy). Asked inside vLLM's scheduling step, once per request, 64 requests arriving
together held every running request's next token for tens of milliseconds
(docs/benchmarks/no-reuse.md, "Scheduler stall").

The caller (vLLM's scheduler thread; the router's store view) queues lookups and flushes them:

    q = LookupQueue(client.exists, "scheduler")
    lk = q.submit(keys, answer, timeout_s)   # queued, nothing sent yet
    q.flush()                                # everything queued goes to the master as one batch
    ...                                      # later (the next scheduling step):
    lk.done, lk.result                       # answer(rcs) of this lookup's keys, computed on the thread
    lk.expired()                             # unanswered past its deadline: the caller counts a miss
    lk.cancel()                              # no longer wanted: skipped if not asked yet

``answer`` runs on the lookup thread with the status codes of the lookup's own keys, in order
(1 present, 0 absent, negative: an error, read as absent); it may ask the master more through the
same client (a lookup whose meaning needs a second round trip) and must not touch the caller's
state: its result is read back on the caller's thread. A batch of more than ``max_keys`` keys goes
in several calls. The thread sleeps on a condition until a flush: it never polls, so an engine
that looks nothing up pays nothing for it. A lookup whose deadline passed before its batch was
sent is not asked at all. Nothing here raises into the caller: an exception of the client or of
``answer`` makes that lookup done with ``error`` set (and ``result`` None).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvcore.log import get_logger

logger = get_logger("mcstore.batchlookup")

MAX_KEYS_PER_CALL = 8192  # keys per batch_is_exist: a 64-request step of 32K-token prompts is 8K keys


class Lookup:
    """One queued lookup; ``done`` is set last, after ``result``/``error``/``seconds``."""

    __slots__ = ("keys", "answer", "deadline", "submitted", "result", "error", "seconds", "done", "cancelled")

    def __init__(self, keys: Sequence[str], answer: Callable[[Sequence[int]], Any], deadline: float):
        self.keys, self.answer, self.deadline = keys, answer, deadline
        self.submitted = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # the round trip(s) of its batch, on the lookup thread
        self.done = False
        self.cancelled = False

    def expired(self, now: float | None = None) -> bool:
        """Unanswered past the deadline (the answer may still come; the caller counts a miss)."""
        return not self.done and (time.monotonic() if now is None else now) >= self.deadline

    def cancel(self) -> None:
        self.cancelled = True


class LookupQueue:
    """Lookups queued by one caller thread, asked by a thread of their own (started at the
    first flush). ``exists(keys) -> [int]``: the store client's ``batch_is_exist``."""

    def __init__(self, exists: Callable[[list[str]], list[int]], name: str, max_keys: int = MAX_KEYS_PER_CALL):
        self._exists, self.name, self.max_keys = exists, name, max_keys
        self._queued: list[Lookup] = []
        self._batches: deque[list[Lookup]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.batches = 0  # batches asked (flushes that found the thread busy go with the next one)
        self.calls = 0  # batch_is_exist calls made

    def submit(self, keys: Sequence[str], answer: Callable[[Sequence[int]], Any], timeout_s: float) -> Lookup:
        lk = Lookup(keys, answer, time.monotonic() + timeout_s)
        self._queued.append(lk)
        return lk

    def flush(self) -> int:
        """Send everything queued since the last flush as one batch; how many lookups."""
        if not self._queued:
            return 0
        batch, self._queued = self._queued, []
        with self._cv:
            if self._stop:
                for lk in batch:
                    lk.error, lk.done = RuntimeError("lookup queue closed"), True
                return len(batch)
            self._batches.append(batch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"mcstore-lookup-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()
        return len(batch)

    def wait(self, lk: Lookup, timeout_s: float) -> bool:
        """Block until ``lk`` is done or ``timeout_s`` passed (a blocking caller: the router's
        store view); whether it is done."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while not lk.done:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the lookup thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._batches and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                # Batches flushed while the previous one was out go together: one more call, not several.
                batch = [lk for b in self._batches for lk in b]
                self._batches.clear()
            self._ask(batch)
            with self._cv:
                self._cv.notify_all()  # blocking callers (wait)

    def _ask(self, batch: list[Lookup]) -> None:
        now = time.monotonic()
        live = []
        for lk in batch:
            if lk.cancelled or now >= lk.deadline:
                lk.done = True  # expired or cancelled before it was asked: no answer
            else:
                live.append(lk)
        if not live:
            return
        keys = [k for lk in live for k in lk.keys]
        t0 = time.perf_counter()
        rcs: list[int] = []
        error = None
        try:
            for i in range(0, len(keys), self.max_keys):
                rcs += self._exists(keys[i:i + self.max_keys])
                self.calls += 1
        except Exception as e:  # noqa: BLE001 - a failed call is an unanswered lookup, never a crash
            error = e
            logger.warning("mcstore: store lookup of %d keys failed: %s", len(keys), e)
        self.batches += 1
        seconds = time.perf_counter() - t0
        off = 0
        for lk in live:
            n = len(lk.keys)
            mine, off = rcs[off:off + n], off + n
            t1 = time.perf_counter()
            if error is None and len(mine) == n:
                try:
                    lk.result = lk.answer(mine)
                except Exception as e:  # noqa: BLE001
                    lk.error = e
            else:
                lk.error = error or RuntimeError(f"batch_is_exist answered {len(rcs)} of {len(keys)} keys")
            lk.seconds = seconds + time.perf_counter() - t1
            lk.done = True
