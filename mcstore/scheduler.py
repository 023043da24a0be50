"""Store tier, scheduler side (runs in the EngineCore process).

The tier's half of the scheduler-side contract (``kvcore.tier``; the connector
facade exposes it, ``release`` is a no-op there), kept apart from vLLM's hooks:

``lookup(request, local_tokens=0) -> int | None``
    Prompt tokens ``[0, n)`` the store can supply: the longest prefix of full chunks whose
    every part exists (every TP rank of every pipeline stage, of every KV cache group:
    :mod:`mcstore.groups`, which also cuts a hit back to where each sliding-window group's
    blocks are stored), then the leading blocks of one more stored object that are the
    request's own (a writer's chunk or saved prompt tail that diverges from this prompt, or
    ends, inside the chunk; not with groups), capped so the last prompt token is left to the
    engine; None while the answer is not in yet
    (ask again at a later step). What is asked and what the answers mean: :mod:`mcstore.lookup`
    (one ``batch_is_exist``, two more round trips only when a directory entry may add blocks).
    A lookup is queued when vLLM adds the request (``on_new_request``, or the first call), in
    O(1) (keys made on the lookup thread: :mod:`mcstore.reqstate`); the step's first call sends
    every queued one to the master in one batch (:mod:`mcstore.batchlookup`) and waits for it, at
    most ``lookup_wait_ms`` per step in all, only for this step's lookups and when the last
    batches say they are answered in that time; later answers are used at a later step.
    Unanswered within ``lookup_timeout_ms``: a miss; 0 at once while the master is unreachable,
    and 0 at once, the lookup given up, when it is not answered yet and the store's recent yield
    says the tokens past the ``local_tokens`` of the engine's own prefix cache are worth less than
    a step of delay; while it says so of a whole prompt, most requests are not asked at all
    (:mod:`mcstore.lookupgate`, ``lookup_defer_min_tokens``, ``lookup_probe_every``; a request
    with ``kv_transfer_params`` is routed by its sender, neither gated nor counted).
    ``lookup_blocking`` asks at once. Keys: from vLLM's block hashes where the key space says so
    (``mcstore.keys``), else the token ids.
``plan_load(request, start, end, block_ids)``
    Load tokens ``[start, end)`` (``start`` block aligned, ``end <= lookup``) into the
    request's blocks; ``block_ids``: its block list by block position (with KV cache groups,
    one such list per group). The worker reports the
    request in ``finished_recving`` and any block it could not fill in
    ``get_block_ids_with_load_errors`` (with groups: the request in ``failed_recving``).
``reserve_sync(request, start, end) -> bool``
    Whether that load may end inside the step that schedules the request (below), counted
    in the step's budget if so: a composite asks before answering vLLM ``load_async``.

As a connector of its own, ``get_num_new_matched_tokens`` answers ``(None, False)`` while the
request's lookup is not answered (vLLM asks again in the next step). A load within
``sync_load_max`` bytes is synchronous: ``get_num_new_matched_tokens`` answers
``load_async=False``, vLLM schedules the request in the same step, and the worker ends the load
before that step's forward (a failed block is reported in the same step). Larger loads, and
any while a background load is under way, run in the background: the request waits in
``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``.

Saves are planned here too (:mod:`mcstore.saveplan`): every step, each scheduled request's newly
completed full prompt chunks (not known to be stored) go to the worker, and once all its
full prompt blocks are computed, those past its last whole chunk as one part object (the
tail a later turn of the conversation extends), each with its directory entry.
"""

from __future__ import annotations

import time
from typing import Any

from kvcore.log import get_logger
from kvcore.platform import current as current_platform
from kvcore.tier import load_deadline_s
from mcstore.batchlookup import LookupQueue
from mcstore.client import StoreClient
from mcstore.config import StoreConfig
from mcstore.events import StoreEvents
from mcstore.groups import Pins, StoreGroups
from mcstore.keys import KeySpace
from mcstore.lookup import Probe, Reach, reach
from mcstore.lookupgate import LookupGate
from mcstore.metrics import StoreStats
from mcstore.protocol import ChunkIO, LoadJob, StoreMetadata
from mcstore.reqstate import Ask, ReqState, answer_batch, hashed_blocks
from mcstore.reset import CacheReset
from mcstore.saveplan import SavePlans

logger = get_logger("mcstore.scheduler")


class StoreScheduler(SavePlans, CacheReset):
    def __init__(self, cfg: StoreConfig, keys: KeySpace, block_size: int, *, load: bool, save: bool,
                 client: StoreClient | None = None, block_bytes: int = 0, events: bool = False,
                 groups: StoreGroups | None = None, workers: int = 1):
        self.cfg = cfg
        self.keys = keys
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        # KV cache groups named in the keys (mcstore.groups), None: one full-attention group.
        self.groups = groups
        self.pins = Pins(groups, workers) if groups is not None and groups.sliding else None
        # Blocks finer than a chunk (part objects, directories) where a key space's block hash
        # is one KV block and the keys name no group; otherwise whole chunks only.
        self.partial = (cfg.partial_hits and keys.block_tokens == block_size and self.chunk_blocks > 1
                        and groups is None)
        self.load_enabled = load
        self.save_enabled = save
        # A pure client (no segment): the scheduler only asks what exists.
        self.client = client if client is not None else (
            StoreClient(cfg, "scheduler", segment=False) if load else None)
        self.stats = StoreStats()
        self._reqs: dict[str, ReqState] = {}
        self._loads: list[LoadJob] = []
        self.block_bytes = block_bytes  # KV bytes of one block in one rank's cache (sync_load_max)
        # With KV cache groups, vLLM takes a failed load only for the whole request, and only from
        # one in the background (mcstore.worker.StoreWorker.get_transfer_results): never synchronous.
        self.sync_max = cfg.sync_load_bytes(current_platform().device_type) if block_bytes and groups is None else 0
        self._step_sync = 0  # bytes of the synchronous loads planned for the coming step
        self._granted: set[str] = set()  # requests whose load may be synchronous in the coming step
        self._async_loads: set[str] = set()  # loading in the background, not yet scheduled
        self._kv_cache_manager = None
        # KV events (mcstore.events), at vLLM's hash block size.
        hash_bs = keys.block_hashes.block_size if keys.block_hashes is not None else block_size
        self.events = StoreEvents(keys.parts, hash_bs, cfg.chunk_tokens // hash_bs) if events else None
        self.blocking = cfg.lookup_blocking
        self.gate = LookupGate(cfg.lookup_defer_min_tokens, cfg.lookup_probe_every)
        self.lookups = (LookupQueue(self.client.exists, "scheduler", answer_many=answer_batch(self.client))
                        if self.client is not None else None)
        self._waiting = 0  # lookups queued or asked, not yet answered
        self._wait_s = 0.0 if self.blocking else cfg.lookup_wait_ms / 1e3
        self._wait_left = self._wait_s  # of this step's wait for its lookups
        self._step_start = 0.0  # when the last step's metadata was built: later lookups are this step's

    # -- state -------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _state(self, request) -> ReqState:
        """The request's state; O(1): its block hashes and links are made when first needed
        (on the lookup thread for its lookup)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = ReqState(request, self.keys, hashed_blocks(self.keys, request))
        return st

    # -- composite API ---------------------------------------------------------------

    def lookup(self, request, local_tokens: int = 0) -> int | None:
        if self.lookups is not None:
            self.lookups.busy()  # this step's: the lookup thread keeps off the GIL but while we wait
        st = self._state(request)
        if st.hit is None and st.pending is None:
            self._ask(st)
        if st.hit is not None:
            return st.hit
        lk = st.pending
        if not lk.done and not self.gate.worth_waiting(request.num_prompt_tokens, local_tokens, st.steered):
            # What the store is expected to add past the prefix cache is worth less than the step
            # the request would wait (mcstore.lookupgate); the answer still counts there.
            return self._give_up(st, "lookups:short", None if st.steered else local_tokens)
        if (not lk.done and self._wait_left > 0 and lk.submitted >= self._step_start
                and self.lookups.expected_s(self.lookups.queued()) <= self._wait_left):
            # This step's batch goes now (every request that arrived since the last step is in it)
            # and the step waits for it, at most lookup_wait_ms in all: a master that answers in
            # time saves the request a step; one that does not costs this step no more than that.
            # A lookup sent at an earlier step is not waited for again, nor a batch that the last
            # batches say takes longer than the wait (e.g. 64 arrivals): a burst costs no wait.
            self.lookups.flush()
            t0 = time.monotonic()
            self.lookups.wait(lk, self._wait_left)
            self._wait_left -= time.monotonic() - t0
        if lk.done:
            st.pending = None
            self._waiting -= 1
            if lk.error is not None or lk.result is None:
                self.stats.inc("lookups:failed" if lk.error is not None else "lookups:timeout")
                st.hit = 0
                return 0
            self.stats.observe("lookup_wait", time.monotonic() - lk.submitted)
            r, probe = lk.result
            st.adopt(probe)
            self._found(st, r, lk.seconds)
            if not st.steered:
                self.gate.note(st.hit, request.num_prompt_tokens, local_tokens)
            return st.hit
        if lk.expired():
            # The master did not answer in time: a miss (the answer, if it comes, is dropped).
            return self._give_up(st, "lookups:timeout")
        return None

    def _give_up(self, st: ReqState, counter: str, local: int | None = None) -> int:
        """The request's pending lookup is dropped, a miss; its answer, if it comes, is counted in
        the gate's yield if ``local`` (its prefix cache's tokens) is given, else dropped too."""
        if local is None:
            st.pending.cancel()
        else:
            self.gate.watch(st.pending, st.request.num_prompt_tokens, local)
        st.pending = None
        self._waiting -= 1
        self.stats.inc(counter)
        st.hit = 0
        return 0

    def _ask(self, st: ReqState) -> None:
        """Start the request's lookup: answered at once when there is nothing to ask (no full
        chunk, the master unreachable) or with ``lookup_blocking``; else queued for this step's
        batch (``st.pending``)."""
        if not st.lookable(self.partial):
            st.hit = 0
            return
        if self.client is None or not self.client.available:
            self.stats.inc("lookups:unavailable")
            st.hit = 0
            return
        n = st.request.num_prompt_tokens
        if self.blocking:
            probe = Probe(self.keys, st.hashes, n, self.partial, links=st.links)
            t0 = time.perf_counter()
            self._found(st, reach(self.client, probe, usable_tokens=n - 1), time.perf_counter() - t0)
            return
        if not st.steered and not self.gate.ask(n):  # recent lookups found too little (mcstore.lookupgate)
            self.stats.inc("lookups:gated")
            st.hit = 0
            return
        # The lookup thread makes the keys (Ask.keys) and reads the request only, never its state.
        ask = Ask(self.keys, st.request, st.nblocks, self.partial)
        st.pending = self.lookups.submit(ask.keys, ask, self.cfg.lookup_timeout_ms / 1e3)
        self._waiting += 1

    def on_new_request(self, request) -> None:
        """vLLM added the request (between steps): its lookup joins the coming step's batch."""
        if self.load_enabled and not getattr(request, "skip_reading_prefix_cache", False):
            if self.lookups is not None:
                self.lookups.busy()  # until the step ends (build_connector_meta)
            st = self._state(request)
            if st.hit is None and st.pending is None:
                self._ask(st)

    def _found(self, st: ReqState, r: Reach, seconds: float) -> None:
        """Record a lookup's answer for the request (on the scheduler's thread)."""
        st.present, st.partial = r.chunks, r.partial
        st.hit = max(0, min(r.tokens, st.request.num_prompt_tokens - 1))
        if self.groups is not None:  # a sliding group's kept blocks below the hit must be stored
            st.hit, st.present = self.groups.usable(st.hit, st.present, self.cfg.chunk_tokens)
        if self.events is not None and r.chunks < len(st.links):
            self.events.gone(st.links[r.chunks])  # absent: if this engine announced it, it is removed
        self.stats.observe("lookup", seconds)
        self.stats.inc("lookups:hit" if st.hit else "lookups:miss")
        if st.hit:
            self.stats.inc("hit_tokens", st.hit)
        if r.partial is not None:
            self.stats.inc("partial_hit_tokens", st.hit - r.chunks * self.cfg.chunk_tokens)

    def lookups_waiting(self) -> bool:
        """Whether a request's lookup is queued or asked and not answered yet."""
        return self._waiting > 0

    def plan_load(self, request, start: int, end: int, block_ids: list[int], expected_s: float | None = None) -> None:
        """``block_ids``: the request's block ids, of each KV cache group with ``groups``."""
        st = self._state(request)
        bs, cb = self.block_size, self.chunk_blocks
        if start % bs or end <= start:
            raise ValueError(f"mcstore: load range [{start}, {end}) is empty or not block aligned")
        b0, b1 = start // bs, -(-end // bs)
        last_chunk = -(-b1 // cb)
        p = st.partial
        stored = p.index * cb + p.matched if p is not None else len(st.links) * cb  # blocks a load may cover
        per_group = list(block_ids) if self.groups is not None else [block_ids]
        if b1 > max(stored, st.present * cb) or any(b1 > len(ids) for ids in per_group):
            raise ValueError(f"mcstore: load range [{start}, {end}) beyond the stored blocks "
                             f"({max(stored, st.present * cb)}) or the request's blocks")
        chunks = []
        for c in range(b0 // cb, last_chunk):
            lo, hi = max(b0, c * cb), min(b1, (c + 1) * cb)
            if self.groups is not None:  # each group's object, at that group's block ids
                chunks += self.groups.load_ios(st.links[c], c, lo, hi, end, per_group)
            elif p is not None and c == p.index:  # leading blocks of another prompt's object
                chunks.append(ChunkIO(p.link, c, list(block_ids[lo:hi]), lo - c * cb, 0 if p.blocks == cb else p.blocks))
            else:
                chunks.append(ChunkIO(st.links[c], c, list(block_ids[lo:hi]), lo - c * cb))
        st.load_tried = True
        st.sync = request.request_id in self._granted
        self.stats.inc("loads:sync" if st.sync else "loads:background")
        self._loads.append(LoadJob(request.request_id, chunks, load_deadline_s(self.cfg.load_timeout_s, expected_s),
                                   sync=st.sync, tokens=(b1 - b0) * bs))
        if not st.sync:
            self._async_loads.add(request.request_id)  # until vLLM schedules it (build_connector_meta)

    def reserve_sync(self, request, start: int, end: int) -> bool:
        """Whether a load of tokens ``[start, end)`` may end inside the step that schedules the
        request (:meth:`_sync`), counted in this step's budget if so: what a composite asks
        before it answers vLLM's ``load_async``. The load it plans next runs so."""
        return self.load_enabled and end > start and self._grant(request, start, end - start)

    # -- vLLM hooks ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local = num_computed_tokens
        # vLLM asks again after a load that failed from its first block: answering with the
        # same hit would load the same bad chunk forever. A request that may not read cached KV
        # would not use the answer: not worth a wait.
        if not self.load_enabled or st.load_tried or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        hit = self.lookup(request, num_computed_tokens)
        if hit is None:
            return None, False
        ext = hit - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, not self._grant(request, num_computed_tokens, ext)

    def _grant(self, request, local: int, ext: int) -> bool:
        """:meth:`_sync`, remembered for the request until this step's metadata is built."""
        if self._sync(local, ext):
            self._granted.add(request.request_id)
            return True
        self._granted.discard(request.request_id)
        return False

    def _sync(self, local: int, ext: int) -> bool:
        """Load tokens ``[local, local + ext)`` inside the step that schedules the request (vLLM's
        synchronous load) rather than in the background: while this step's synchronous loads
        stay within ``sync_load_max`` bytes, and only while no background load is under way (the
        worker's one load thread would make the step wait for that one too). A request asked
        about but then not scheduled (no free blocks) still counts, until the step's metadata
        is built. See mcstore.config.SYNC_LOAD_MAX_CPU for why."""
        if not self.sync_max or self._async_loads:
            return False
        bs = self.block_size
        size = (-(-(local + ext) // bs) - local // bs) * self.block_bytes
        if self._step_sync + size > self.sync_max:
            return False
        self._step_sync += size
        return True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        ids = blocks.get_block_ids()
        self.plan_load(request, st.local, st.local + num_external_tokens, ids if self.groups is not None else ids[0])

    def build_connector_meta(self, scheduler_output) -> StoreMetadata:
        if self.lookups is not None:
            self.lookups.flush()  # lookups not sent yet: one batch, answered while the step runs
            self.lookups.idle()  # the step's scheduling is over: the lookup thread works freely
            self.gate.poll()  # once a step, not per request: up to MAX_WATCHED lookups to look at
        self._wait_left = self._wait_s
        self._step_start = time.monotonic()
        meta = StoreMetadata(loads=self._loads, preempted=sorted(scheduler_output.preempted_req_ids or ()))
        self._loads = []
        self._step_sync = 0
        self._granted.clear()
        for req in scheduler_output.scheduled_new_reqs:
            self._async_loads.discard(req.req_id)  # its load ended (or failed): it is scheduled
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                # The worker drops a preempted request's queued saves; offer them again.
                st.save_next = 0
                st.tail_saved = False
        if self.save_enabled:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                job = self._plan_save(rid, n)
                if job is not None:
                    if self.pins is not None:
                        self.pins.pin(job, getattr(self._kv_cache_manager, "block_pool", None))
                    meta.saves.append(job)
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._async_loads.discard(request.request_id)  # aborted: never scheduled (its load may still run)
        if st is not None and st.pending is not None:  # aborted while its lookup was out
            st.pending.cancel()
            self._waiting -= 1
        if self.events is not None and not (st is not None and st.saves):
            self.events.request_done(request.request_id)
        # Blocks stay allocated until the worker reports the saves done.
        return bool(st is not None and st.saves), None

    def update_connector_output(self, out) -> None:
        news = getattr(out, "kv_connector_worker_meta", None)
        if self.pins is not None and news is not None:
            self.pins.done(getattr(news, "saved", ()), self._kv_cache_manager.block_pool)
        if self.events is not None:
            self.events.worker_news(getattr(out, "kv_connector_worker_meta", None))
            for rid in out.finished_sending or ():
                self.events.request_done(rid)

    def take_events(self) -> list:
        return self.events.take() if self.events is not None else []

    def take_stats(self) -> StoreStats | None:
        return self.stats.take()

    def close(self) -> None:
        self.gate.close()
        if self.lookups is not None:
            self.lookups.close()
        if self.client is not None:
            self.client.close()
