"""The router's view of the shared store: the store tier's KV events, checked by its own lookup.

Two parts. :class:`StoreIndex` is what the store tier's KV events say the store holds (every
instance's ``BlockStored``/``BlockRemoved`` of medium ``mooncake``, placed by the instances'
event subscribers, :mod:`multi.router.events`, in one view shared by all: the store is
cross-instance). :class:`StoreView` is the store tier's own lookup against the master.

How they combine (``Router._store_reach``, :mod:`multi.router.app`). The store's reach ``S`` is
read on one path only: the decision (:mod:`multi.router.choose` weighs the store tier at ``S``
in every plan it compares, and a route's ``store`` is what the chosen instance's connector is
predicted to load). Nothing after the decision reads the view again (the engine's connector does
its own lookup), so "confirm before a route relies on it" and "confirm before the decision" are
the same point, and the events are the first filter on that path, the lookup the confirmation:
- an instance's own cache holds all but less than a chunk of the prompt: no lookup, the router's
  approximate record (``short``; the engine's store tier would not wait for such a lookup either,
  mcstore's ``lookup_defer_min_tokens``);

- the events say the store holds none of the prompt's leading blocks: ``S = 0``, no lookup
  (``skipped``; the common case, a prompt nothing stored, costs the master nothing);
- they say it holds some: the lookup confirms, and ``S`` is the LOOKUP's answer, never the
  events' (``confirmed``); when it finds fewer whole chunks than the events said (an object
  evicted, removed or expired behind the router's back, or an engine that announced what it
  did not store: the router trusts nothing an engine sends) the view drops the blocks from
  there on (``stale``), and when it finds more (a partial object past the whole chunks, which
  the tier does not announce, or a chunk stored before the router listened) it learns them;
- the events cannot be trusted as a filter (an instance without an event stream, or one marked
  stale: events were lost, so a chunk may be stored that the view lacks): every request is
  looked up as before (``unfiltered``);
- a lookup that is late or fails (``unanswered``) falls back to the router's approximate
  record, as before.

What the filter cannot see reads as a miss, never as a wrong answer: chunks stored before the
router's subscribers started and no longer in the engines' replay buffers, chunks stored by
engines that are not behind this router, and partial (tail) objects of a prompt whose first
chunk is not stored. Such a prompt is routed as if the store lacked it; the chosen engine's
connector still finds and loads it (only the estimate is off). ``--store-index-blocks 0`` turns
the filter off (every request looked up, as before the events were used).

Bounds: the view is an LRU of at most ``--store-index-blocks`` router hashes (~140 bytes each);
the subscribers' engine-hash mappings stay bounded by their instances' capacities, a removal no
mapping resolves is counted and left to the lookup.

The lookup (:class:`StoreView`):

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
from multi.router.index import STORE, BlockIndex

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

    @property
    def chunk_tokens(self) -> int | None:
        """The store's chunk size in tokens, once the key space is known."""
        ks = self._ks
        return ks.chunk_tokens if ks is not None else None

    def reach(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading prompt tokens the store holds (a multiple of the block size), as the engine's
        lookup finds them; 0 when the master did not answer within ``timeout_s``."""
        return self.check(tokens, cache_salt) or 0

    def check(self, tokens: Sequence[int], cache_salt: str | None = None) -> int | None:
        """:meth:`reach`, but None when there is no answer (no key space published yet, the
        master late or failing) rather than 0."""
        with self._lock:
            ks = self._key_space()
            if ks is None:
                return None
            probe = Probe(ks, ks.hashes(tokens, cache_salt=cache_salt), len(tokens)) if tokens else None
            if probe is None or not probe.hashes:
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
            return None
        return lk.result

    def close(self) -> None:
        with self._lock:
            if self._queue is not None:
                self._queue.close()
                self._queue = None
            if self._client is not None:
                self._client.close()
                self._client = None



class StoreIndex:
    """What the store tier's KV events say the store holds: one LRU view (:data:`STORE`) of
    router block hashes, written by every instance's event subscriber, read and corrected by
    the router's store check (module docstring)."""

    def __init__(self, block_size: int, capacity: int):
        if capacity <= 0:
            raise ValueError(f"the store index needs a positive capacity, got {capacity}")
        self.index = BlockIndex(block_size, capacity)
        self.index.set_capacity(STORE, capacity)

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def blocks(self) -> int:
        return self.index.blocks(STORE)

    def probable(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the events say the store holds."""
        return self.index.match(STORE, hashes)

    def settle(self, hashes: Sequence[int], probable: int, found: int, chunk_tokens: int) -> str:
        """The lookup found ``found`` leading tokens where the events said ``probable`` blocks:
        ``stale`` (fewer whole chunks than announced; the blocks from ``found`` on are dropped)
        or ``confirmed`` (what it found past the events' blocks is learned)."""
        bs = self.index.block_size
        announced = (probable * bs) // chunk_tokens * chunk_tokens  # the events name whole chunks
        have = min(found, len(hashes) * bs) // bs
        if found < announced:
            self.index.removed(STORE, hashes[have:probable])
            return "stale"
        if have > probable:
            self.index.stored(STORE, hashes[:have])
        return "confirmed"
