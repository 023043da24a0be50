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

Two ways to keep the caller's thread cheap (issue 47: the scheduling step of 64 arrivals spent
1.6 to 3 ms building keys, 25 to 45 us a request, and a step that waited for its batch could not
get the GIL back from this thread, busy in Python, for milliseconds):

- ``keys`` may be a callable, called on the lookup thread: the caller queues a lookup in O(1)
  and the hashing that names its keys runs here, while the step does not wait for it;
- ``answer_many`` (the queue's): answers a batch's lookups together, e.g. every directory read
  of the batch in one call (:func:`mcstore.lookup.finish_many`); each lookup's ``answer`` is
  then what ``answer_many`` needs to know of it, ``answer_many([(answer, rcs), ...], pause)``
  gives their results in order.

The thread's Python work goes in slices of at most :data:`SLICE_S`; between slices it sleeps
:data:`YIELD_S` (``pause``), which hands the GIL to a thread that waits for it (the scheduler,
back from its forward pass) at once instead of after the interpreter's 5 ms switch interval.
A caller that marks its own busy time (:meth:`LookupQueue.busy`, until :meth:`LookupQueue.idle`:
the scheduler from its step's first hook to the end of the step) has the GIL to itself then:
the thread works only while the caller waits in :meth:`LookupQueue.wait`, and at its next slice
boundary past that wait's end it sleeps until the caller is idle again (at most
:data:`MAX_BACKOFF_S`), so a step's wait ends when it should, not when the thread lets go.
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
SLICE_S = 0.0002  # the lookup thread's Python work between two hand-overs of the GIL
YIELD_S = 0.00005  # a sleep: long enough for a thread that waits for the GIL to take it
PRIOR_CALL_S = 0.0003  # a batch_is_exist of a few hundred keys, loopback, idle master
PRIOR_LOOKUP_S = 0.000025  # a lookup's keys (4 chunks' SHA-256 links, 2 directory keys) and answer
MAX_BACKOFF_S = 0.05  # the longest the thread holds off for a busy caller (one that never says idle)


class Lookup:
    """One queued lookup; ``done`` is set last, after ``result``/``error``/``seconds``."""

    __slots__ = ("keys", "answer", "deadline", "submitted", "result", "error", "seconds", "done", "cancelled")

    def __init__(self, keys: Sequence[str] | Callable[[], Sequence[str]], answer: Any, deadline: float):
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
    """Lookups queued by one caller thread, asked by a thread of their own (started with the
    queue: it sleeps until a flush). ``exists(keys) -> [int]``: the store client's
    ``batch_is_exist``; ``answer_many``: see the module docstring."""

    def __init__(self, exists: Callable[[list[str]], list[int]], name: str, max_keys: int = MAX_KEYS_PER_CALL,
                 answer_many: Callable[[list[tuple[Any, Sequence[int]]], Callable[[], None]], list[Any]] | None = None):
        self._exists, self.name, self.max_keys = exists, name, max_keys
        self._answer_many = answer_many
        self._slice_t0 = 0.0
        # The caller's busy time (busy/idle/wait): plain attributes, set by the caller, read here.
        self._busy = False
        self._busy_t0 = 0.0
        self._free_until = 0.0  # the end of the caller's current wait (monotonic)
        self._idle = threading.Event()  # set while the caller is not busy: the thread blocks on it
        self._idle.set()
        # What a batch costs this thread (working, not held off): seconds a call and a lookup,
        # averaged (expected_s); until a batch was asked, what they cost on a 2-core Xeon host.
        self._call_s, self._per_lookup_s, self._measured = PRIOR_CALL_S, PRIOR_LOOKUP_S, False
        self._held_s = 0.0  # of the current batch, held off or handing over the GIL
        self._last_rpc_s = 0.0
        self._queued: list[Lookup] = []
        self._batches: deque[list[Lookup]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.batches = 0  # batches asked (flushes that found the thread busy go with the next one)
        self.calls = 0  # batch_is_exist calls made
        # Started now, not at the first flush: a thread's start (0.1 to 0.3 ms) is no step's cost.
        self._thread = threading.Thread(target=self._run, name=f"mcstore-lookup-{name}", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[str] | Callable[[], Sequence[str]], answer: Any, timeout_s: float) -> Lookup:
        """Queue a lookup (O(1)): ``keys`` or a callable that names them on the lookup thread;
        ``answer(rcs)``, or with ``answer_many`` what it takes of this lookup."""
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
            self._cv.notify()
        return len(batch)

    def queued(self) -> int:
        """Lookups submitted and not flushed yet."""
        return len(self._queued)

    def expected_s(self, n: int) -> float:
        """How long a batch of ``n`` lookups is expected to take from its flush (the last
        batches' average cost, the caller never holding the thread off): a caller's wait that
        cannot see it answered is not worth waiting."""
        return self._call_s + n * self._per_lookup_s

    def busy(self) -> None:
        """The caller's busy time starts (O(1); again while busy: nothing): the thread keeps off
        the GIL from its next slice boundary, except while the caller waits."""
        if not self._busy:
            self._busy_t0 = time.monotonic()
            self._idle.clear()
            self._busy = True

    def idle(self) -> None:
        """The caller's busy time ends: the thread works freely (in slices)."""
        if self._busy:
            self._busy = False
            self._idle.set()

    def wait(self, lk: Lookup, timeout_s: float) -> bool:
        """Block until ``lk`` is done or ``timeout_s`` passed (a blocking caller: the router's
        store view; the scheduler's step); whether it is done."""
        end = time.monotonic() + timeout_s
        self._free_until = end
        busy = self._busy
        if busy:
            self._idle.set()  # a thread held off since an earlier wait of this busy time works again
        try:
            with self._cv:
                while not lk.done:
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)
            return True
        finally:
            if busy and self._busy:
                self._idle.clear()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._idle.set()
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

    def _pause(self) -> None:
        """End of a slice of Python work: past :data:`SLICE_S` since the last hand-over, let a
        thread that waits for the GIL have it."""
        if self._busy:
            now = time.monotonic()
            if now >= self._free_until:
                # Blocked on a lock, not polling: the GIL is the caller's until it is idle (no race
                # for it at each wake-up), or the back-off's cap.
                t = time.perf_counter()
                self._idle.wait(max(0.0, self._busy_t0 + MAX_BACKOFF_S - now))
                self._slice_t0 = time.perf_counter()
                self._held_s += self._slice_t0 - t
                return
        t = time.perf_counter()
        if t - self._slice_t0 >= SLICE_S:
            time.sleep(YIELD_S)
            self._slice_t0 = time.perf_counter()
            self._held_s += self._slice_t0 - t

    def _ask(self, batch: list[Lookup]) -> None:
        t0 = self._slice_t0 = time.perf_counter()
        self._held_s = 0.0
        calls = self.calls
        self._answer(batch)
        asked = sum(1 for lk in batch if lk.error is None and lk.result is not None)
        if asked:  # what this batch cost the thread, working (averaged: e.g. a slow master's)
            work = max(0.0, time.perf_counter() - t0 - self._held_s)
            call = min(work, self._last_rpc_s)
            a, self._measured = (0.3 if self._measured else 1.0), True
            self._call_s += a * (call * max(1, self.calls - calls) - self._call_s)
            self._per_lookup_s += a * ((work - call) / asked - self._per_lookup_s)

    def _answer(self, batch: list[Lookup]) -> None:
        now = time.monotonic()
        live = []
        for lk in batch:
            if lk.cancelled or now >= lk.deadline:
                lk.done = True  # expired or cancelled before it was asked: no answer
                continue
            if callable(lk.keys):  # named here, off the caller's thread
                try:
                    lk.keys = lk.keys()
                except Exception as e:  # noqa: BLE001 - that lookup fails, not the batch
                    lk.error, lk.done = e, True
                    continue
                self._pause()
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
        self._last_rpc_s = seconds / max(1, -(-len(keys) // self.max_keys))
        self._slice_t0 = time.perf_counter()
        if error is None and len(rcs) != len(keys):
            error = RuntimeError(f"batch_is_exist answered {len(rcs)} of {len(keys)} keys")
        if error is not None:
            for lk in live:
                lk.error, lk.seconds = error, seconds
                lk.done = True
            return
        mine, off = [], 0
        for lk in live:
            n = len(lk.keys)
            mine.append(rcs[off:off + n])
            off += n
        if self._answer_many is not None:
            t1 = time.perf_counter()
            try:
                results = self._answer_many([(lk.answer, m) for lk, m in zip(live, mine)], self._pause)
                if len(results) != len(live):
                    raise RuntimeError(f"answer_many gave {len(results)} results for {len(live)} lookups")
            except Exception as e:  # noqa: BLE001 - every lookup of the batch fails, not the thread
                results, error = None, e
            seconds += time.perf_counter() - t1
            for i, lk in enumerate(live):
                if results is None:
                    lk.error = error
                elif isinstance(results[i], BaseException):
                    lk.error = results[i]
                else:
                    lk.result = results[i]
                lk.seconds = seconds
                lk.done = True
            return
        for lk, m in zip(live, mine):
            t1 = time.perf_counter()
            try:
                lk.result = lk.answer(m)
            except Exception as e:  # noqa: BLE001
                lk.error = e
            lk.seconds = seconds + time.perf_counter() - t1
            lk.done = True
            self._pause()
