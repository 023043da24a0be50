"""Whether a request waits for its store lookup: the store's recent yield against a step's wait.

A non-blocking lookup that is not answered when vLLM first asks holds its request a step or two:
4 to 6 ms of time to first token a request on the fast CPU class where nothing is ever found
(docs/benchmarks/no-reuse.md). With ``local`` of the ``n`` prompt tokens in the engine's own prefix
cache and ``T = lookup_defer_min_tokens``, a request waits when

    n - local >= T                          the store could save a step's worth (T tokens)
    share * (n - local) >= T * MIN_SHARE    and is expected to save at least MIN_SHARE of that

``share``: the fraction of the tokens past the prefix cache that recent lookups found in the store,
an exponentially weighted mean over answers with weight ``1 / WINDOW`` (``share <- share + (found /
asked - share) / WINDOW``). It starts at 1, so a fresh engine, and one whose store keeps finding,
waits exactly as the first condition alone says; after answers in a row that found nothing, a
request with one chunk past its cache stops waiting at the 33rd (``(15/16)^33 < 1/8``), one with
three chunks and 5 tokens at the 50th (``(15/16)^50 < 1/8 * 64/197`` for chunks of 64), a longer
one later. A lookup given up is not cancelled: its answer, when it comes, still updates ``share``
(:meth:`LookupGate.watch`, at most ``MAX_WATCHED`` at once).

While the second condition fails for a prompt with nothing cached (``local = 0``), a new request is
not looked up at all, except one in ``probe_every`` (``lookup_probe_every``): that one is asked and
not waited for, so ``share`` rises again when the store starts to have hits (one probe that finds a
whole prompt is enough). ``probe_every = 0`` turns the gate off (``share`` stays 1).

A request that came with ``kv_transfer_params`` (``steered``: a P/D handoff's, a composite's
``kv_source``) is neither gated nor counted: its sender chose where its KV comes from (a decode
instance's lookups of prompts its prefill instance is computing would close the gate on it, and a
client that asks for the store means it: tests/test_multihost.py).
"""

from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 16  # answers: a workload change is followed within about this many lookups
MIN_SHARE = 1 / 8  # of a step's worth of tokens, what the store must be expected to save
MAX_WATCHED = 64  # given-up lookups whose answers are still awaited; older ones are dropped


class LookupGate:
    def __init__(self, min_tokens: int, probe_every: int):
        self.min_tokens = min_tokens  # lookup_defer_min_tokens
        self.probe_every = probe_every
        self.share = 1.0
        self._skipped = 0  # requests not asked since the last probe
        self._watched: deque[tuple[Any, int, int]] = deque()  # (Lookup, n, local)

    def worth_waiting(self, n: int, local: int, steered: bool = False) -> bool:
        """Whether a request with ``n - local`` prompt tokens past its prefix cache waits for its
        lookup (both conditions above; the first only for a ``steered`` request)."""
        return n - local >= self.min_tokens and (steered or self._expected(n - local))

    def _expected(self, tokens: int) -> bool:
        return self.share * tokens >= self.min_tokens * MIN_SHARE

    def ask(self, n: int) -> bool:
        """Whether a new request of ``n`` prompt tokens is looked up at all: while the store is
        expected to save enough of it, and for every ``probe_every``-th request otherwise."""
        if self.probe_every <= 0 or self._expected(n):
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def note(self, found: int, n: int, local: int) -> None:
        """A lookup's answer: ``found`` leading prompt tokens in the store (``n`` in the prompt,
        ``local`` in the engine's prefix cache when vLLM asked)."""
        if self.probe_every <= 0:
            return
        asked = n - local
        if asked > 0:
            self.share += (max(0, min(found, n) - local) / asked - self.share) / WINDOW

    def watch(self, lk: Any, n: int, local: int) -> None:
        """A lookup given up unanswered: its answer counts in :meth:`note` when it comes."""
        if self.probe_every <= 0:
            lk.cancel()
            return
        if len(self._watched) >= MAX_WATCHED:
            self._watched.popleft()[0].cancel()
        self._watched.append((lk, n, local))

    def poll(self) -> None:
        """Count the watched lookups answered since the last call; drop the expired ones (the
        scheduler calls it once a step)."""
        for _ in range(len(self._watched)):
            lk, n, local = self._watched.popleft()
            if lk.done:
                if lk.error is None and lk.result is not None:
                    self.note(lk.result[0].tokens, n, local)
            elif not lk.expired():
                self._watched.append((lk, n, local))

    def close(self) -> None:
        while self._watched:
            self._watched.popleft()[0].cancel()
