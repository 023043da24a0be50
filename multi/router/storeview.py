"""The router's exact view of the shared store: the store tier's own lookup.

``StoreView(master, engine_url)`` finds the key space the engines of ``engine_url``'s
model published in the store when they started (:func:`mcstore.tools.published.meta_for_server`),
then answers :meth:`StoreView.reach`: how many leading prompt tokens the store holds, by
the engine's own lookup (:mod:`mcstore.lookup`): whole chunks from one ``batch_is_exist``
over the chunk keys of every TP rank and pipeline stage (a chunk counts only when all its
parts are present, as for the tier), then the leading blocks of a stored object past them
found through its directory entry (two more round trips, only when one may add blocks).

Blocking: the router runs it in a thread under a deadline and uses its approximate store
view when the answer is late or the store is unreachable. The lookup itself goes the store
tier's way (:mod:`mcstore.batchlookup`): on a lookup thread, lookups asked while another is
out going to the master together as one ``batch_is_exist``, and one unanswered within
``timeout_s`` reads as nothing stored.
A key space not published yet (no engine has started its store tier) reads as "nothing
in the store" and is looked up again on the next call, at most every ``retry_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from mcstore.batchlookup import LookupQueue
from mcstore.keys import KeySpace
from mcstore.lookup import Probe, finish

logger = logging.getLogger("mctier.router.store")


class StoreView:
    def __init__(self, master: str, engine_url: str, fingerprint: str | None = None, key_prefix: str = "mct",
                 retry_s: float = 5.0, timeout_s: float = 0.5):
        self.master, self.engine_url = master, engine_url
        self.fingerprint, self.key_prefix, self.retry_s = fingerprint, key_prefix, retry_s
        self.timeout_s = timeout_s
        self._client = None
        self._queue: LookupQueue | None = None
        self._ks: KeySpace | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.lookups = 0
        self.errors = 0

    def _key_space(self) -> KeySpace | None:
        if self._ks is not None or time.monotonic() < self._next_try:
            return self._ks
        from mcstore.client import StoreClient
        from mcstore.tools.published import ServerModel, meta_for_server

        self._next_try = time.monotonic() + self.retry_s
        try:
            if self._client is None:
                self._client = StoreClient.for_tool(self.master, "router")
            meta = meta_for_server(ServerModel(self.engine_url, timeout=5.0), self._client, self._client.admin(),
                                   self.fingerprint, self.key_prefix)
        except Exception as e:  # noqa: BLE001 - ConfigError, Unavailable, Mooncake setup errors: retried later
            logger.info("store view: no key space yet (%s); retrying in %.0fs", e, self.retry_s)
            return None
        self._ks = meta.key_space()
        logger.info("store view: key space %s, chunks of %d tokens, %d parts", meta.fingerprint[:16],
                    self._ks.chunk_tokens, self._ks.parts)
        return self._ks

    def reach(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading prompt tokens the store holds (a multiple of the block size), as the engine's
        lookup finds them; 0 when the master did not answer within ``timeout_s``."""
        with self._lock:
            ks = self._key_space()
            if ks is None or not tokens:
                return 0
            probe = Probe(ks, ks.hashes(tokens, cache_salt=cache_salt), len(tokens))
            if not probe.hashes:
                return 0
            self.lookups += 1
            if self._queue is None:
                self._queue = LookupQueue(self._client.exists, "router")
            client = self._client
            lk = self._queue.submit(probe.first_keys(), lambda rcs: finish(client, probe, rcs).tokens, self.timeout_s)
            self._queue.flush()
            queue = self._queue
        if not queue.wait(lk, self.timeout_s) or lk.result is None:
            self.errors += 1
            return 0
        return lk.result

    def close(self) -> None:
        with self._lock:
            if self._queue is not None:
                self._queue.close()
                self._queue = None
            if self._client is not None:
                self._client.close()
                self._client = None

