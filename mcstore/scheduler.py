"""Store tier, scheduler side (runs in the EngineCore process).

The tier's half of the scheduler-side contract (``kvcore.tier``; the connector
facade exposes it, ``release`` is a no-op there), kept apart from vLLM's hooks:

``lookup(request) -> int``
    Prompt tokens ``[0, n)`` the store can supply: the longest prefix of full
    chunks whose every part exists (every TP rank of every pipeline stage), then the
    leading blocks of one more stored object that are the request's own (a writer's chunk
    or saved prompt tail that diverges from this prompt, or ends, inside the chunk), capped
    so the last prompt token is left to the engine. What is asked and what the answers
    mean is :mod:`mcstore.lookup`: one ``batch_is_exist`` per request, two more round trips
    only when a directory entry may add blocks (cached per request); 0 at once while the
    master is unreachable. The keys come from the request's vLLM block hashes where the key
    space says so (``mcstore.keys``), else from its token ids.
``plan_load(request, start, end, block_ids)``
    Load tokens ``[start, end)`` (``start`` block aligned, ``end <= lookup``) into
    the request's blocks; ``block_ids`` is the request's block list indexed by
    block position. The worker reports the request in ``finished_recving`` and any
    block it could not fill in ``get_block_ids_with_load_errors``.
``reserve_sync(request, start, end) -> bool``
    Whether that load may end inside the step that schedules the request (below), counted
    in the step's budget if so: a composite asks before answering vLLM ``load_async``.

As a connector of its own (vLLM's hooks, not the composite's API), a load within
``sync_load_max`` bytes is synchronous: ``get_num_new_matched_tokens`` answers
``load_async=False``, vLLM schedules the request in the same step, and the worker ends the load
before that step's forward (a failed block is reported in the same step). Larger loads, and
any while a background load is under way, run in the background: the request waits in
``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``.

Saves are planned here too: every step, each scheduled request's newly
completed full prompt chunks (not known to be stored) go to the worker, and once all its
full prompt blocks are computed, those past its last whole chunk as one part object (the
tail a later turn of the conversation extends), each with its directory entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvcore.log import get_logger
from kvcore.platform import current as current_platform
from kvcore.tier import load_deadline_s
from kvcore.vllm_glue import (
    request_block_ids,
    request_cache_salt,
    request_lora_name,
    request_mm_hashes,
)
from mcstore.client import StoreClient
from mcstore.config import StoreConfig
from mcstore.keys import Directory, KeySpace
from mcstore.lookup import Partial, Probe, Reach, reach
from mcstore.metrics import StoreStats
from mcstore.protocol import ChunkIO, DirEntry, LoadJob, SaveJob, StoreMetadata

logger = get_logger("mcstore.scheduler")


@dataclass
class _Req:
    request: Any
    hashes: list[bytes]  # block hashes of the prompt's full blocks (the key space's block_tokens)
    links: list[str]  # of its full chunks
    hit: int | None = None  # lookup result in tokens (None: not looked up yet)
    present: int = 0  # leading chunks found in the store at lookup
    partial: Partial | None = None  # the object supplying blocks past them, found at lookup
    local: int = 0  # tokens computed locally when the connector was asked
    save_next: int = 0  # next chunk to consider for saving
    tail_saved: bool = False  # the blocks past the last whole chunk went to the worker (or need not)
    saves: int = 0  # save jobs sent to the worker
    load_tried: bool = False  # one load per request: a failed one is recomputed, not retried
    sync: bool = False  # its load ends inside the step that schedules it (sync_load_max)


class StoreScheduler:
    def __init__(self, cfg: StoreConfig, keys: KeySpace, block_size: int, *, load: bool, save: bool,
                 client: StoreClient | None = None, block_bytes: int = 0):
        self.cfg = cfg
        self.keys = keys
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        # Blocks finer than a chunk (part objects, directories) where a key space's block hash
        # is one KV block; otherwise whole chunks only.
        self.partial = cfg.partial_hits and keys.block_tokens == block_size and self.chunk_blocks > 1
        self.load_enabled = load
        self.save_enabled = save
        # A pure client (no segment): the scheduler only asks what exists.
        self.client = client if client is not None else (
            StoreClient(cfg, "scheduler", segment=False) if load else None)
        self.stats = StoreStats()
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self.block_bytes = block_bytes  # KV bytes of one block in one rank's cache (sync_load_max)
        self.sync_max = cfg.sync_load_bytes(current_platform().device_type) if block_bytes else 0
        self._step_sync = 0  # bytes of the synchronous loads planned for the coming step
        self._granted: set[str] = set()  # requests whose load may be synchronous in the coming step
        self._async_loads: set[str] = set()  # loading in the background, not yet scheduled
        self._kv_cache_manager = None
        self._warned_hashes = False

    # -- state -------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            hashes = self._hashes(request)
            st = self._reqs[request.request_id] = _Req(
                request, hashes, self.keys.links_from_block_hashes(hashes, request.num_prompt_tokens))
        return st

    def _hashes(self, request) -> list[bytes]:
        """The block hashes of the request's full prompt blocks."""
        if self.keys.block_hashes is None:
            return self.keys.hashes(
                request.prompt_token_ids or [],
                cache_salt=request_cache_salt(request),
                lora=request_lora_name(request),
                mm_hashes=request_mm_hashes(request),
            )
        # vLLM hashed the request's blocks on its input thread already; a request whose hashes
        # do not cover its tokens at the key space's hash block size gets no link (a miss,
        # computed and not saved) rather than a link of other tokens.
        hashes = getattr(request, "block_hashes", None) or []
        if len(hashes) != request.num_tokens // self.keys.block_hashes.block_size:
            if not self._warned_hashes:
                self._warned_hashes = True
                logger.warning("mcstore: request %s has %d block hashes for %d tokens at %d tokens a block: "
                               "not looked up or saved (warned once)", request.request_id, len(hashes),
                               request.num_tokens, self.keys.block_hashes.block_size)
            return []
        return list(hashes[:request.num_prompt_tokens // self.keys.block_tokens])

    # -- composite API ---------------------------------------------------------------

    def lookup(self, request) -> int:
        st = self._state(request)
        if st.hit is not None:
            return st.hit
        st.hit = 0
        if not st.links and not (self.partial and st.hashes):
            return 0
        if self.client is None or not self.client.available:
            self.stats.inc("lookups:unavailable")
            return 0
        t0 = time.perf_counter()
        self._found(st, self._reach(st), time.perf_counter() - t0)
        return st.hit

    def _reach(self, st: _Req) -> Reach:
        """What the store holds of the request (blocking: one to three master round trips;
        :mod:`mcstore.lookup` says what is asked and what the answers mean)."""
        n = st.request.num_prompt_tokens
        return reach(self.client, Probe(self.keys, st.hashes, n, self.partial, links=st.links), usable_tokens=n - 1)

    def _found(self, st: _Req, r: Reach, seconds: float) -> None:
        """Record a lookup's answer for the request."""
        st.present, st.partial = r.chunks, r.partial
        st.hit = max(0, min(r.tokens, st.request.num_prompt_tokens - 1))
        self.stats.observe("lookup", seconds)
        self.stats.inc("lookups:hit" if st.hit else "lookups:miss")
        if st.hit:
            self.stats.inc("hit_tokens", st.hit)
        if r.partial is not None:
            self.stats.inc("partial_hit_tokens", st.hit - r.chunks * self.cfg.chunk_tokens)

    def plan_load(self, request, start: int, end: int, block_ids: list[int], expected_s: float | None = None) -> None:
        st = self._state(request)
        bs, cb = self.block_size, self.chunk_blocks
        if start % bs or end <= start:
            raise ValueError(f"mcstore: load range [{start}, {end}) is empty or not block aligned")
        b0, b1 = start // bs, -(-end // bs)
        last_chunk = -(-b1 // cb)
        p = st.partial
        stored = p.index * cb + p.matched if p is not None else len(st.links) * cb  # blocks a load may cover
        if b1 > max(stored, st.present * cb) or b1 > len(block_ids):
            raise ValueError(f"mcstore: load range [{start}, {end}) beyond the stored blocks "
                             f"({max(stored, st.present * cb)}) or the request's blocks ({len(block_ids)})")
        chunks = []
        for c in range(b0 // cb, last_chunk):
            lo, hi = max(b0, c * cb), min(b1, (c + 1) * cb)
            if p is not None and c == p.index:  # leading blocks of another prompt's object
                chunks.append(ChunkIO(p.link, c, list(block_ids[lo:hi]), lo - c * cb, 0 if p.blocks == cb else p.blocks))
            else:
                chunks.append(ChunkIO(st.links[c], c, list(block_ids[lo:hi]), lo - c * cb))
        st.load_tried = True
        st.sync = request.request_id in self._granted
        self.stats.inc("loads:sync" if st.sync else "loads:background")
        self._loads.append(LoadJob(request.request_id, chunks, load_deadline_s(self.cfg.load_timeout_s, expected_s),
                                   sync=st.sync))
        if not st.sync:
            self._async_loads.add(request.request_id)  # until vLLM schedules it (build_connector_meta)

    def reserve_sync(self, request, start: int, end: int) -> bool:
        """Whether a load of tokens ``[start, end)`` may end inside the step that schedules the
        request (:meth:`_sync`), counted in this step's budget if so: what a composite asks
        before it answers vLLM's ``load_async``. The load it plans next runs so."""
        return self.load_enabled and end > start and self._grant(request, start, end - start)

    # -- vLLM hooks ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        st.local = num_computed_tokens
        # vLLM asks again after a load that failed from its first block: answering with the
        # same hit would load the same bad chunk forever.
        if not self.load_enabled or st.load_tried:
            return 0, False
        ext = self.lookup(request) - num_computed_tokens
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
        self.plan_load(request, st.local, st.local + num_external_tokens, blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output) -> StoreMetadata:
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
                    meta.saves.append(job)
        return meta

    def _plan_save(self, rid: str, num_scheduled: int) -> SaveJob | None:
        st = self._reqs.get(rid)
        if st is None or not st.hashes:
            return None
        req, cb = st.request, self.chunk_blocks
        computed = min(req.num_computed_tokens + num_scheduled, req.num_prompt_tokens)
        done = min(computed // self.cfg.chunk_tokens, len(st.links))
        first = max(st.save_next, st.present)
        # The full blocks past the last whole chunk, once all are computed: unless the lookup
        # found them stored already.
        tail = len(st.hashes) - len(st.links) * cb if self.partial and not st.tail_saved else 0
        if tail and (computed < len(st.hashes) * self.block_size or done < len(st.links)):
            tail = 0  # not computed yet
        elif tail and st.partial is not None and st.partial.index == len(st.links) and st.partial.matched >= tail:
            st.tail_saved, tail = True, 0
        if done <= first and not tail:
            return None
        if self._kv_cache_manager is None:
            raise RuntimeError("mcstore: scheduler connector was not bound to the KV cache manager")
        blocks = request_block_ids(self._kv_cache_manager, rid)
        chunks = [ChunkIO(st.links[c], c, blocks[c * cb:(c + 1) * cb]) for c in range(first, done)]
        st.save_next = max(st.save_next, done)
        if tail:
            c = len(st.links)
            link = self.keys.part_link(st.hashes[c * cb + tail - 1], tail)
            chunks.append(ChunkIO(link, c, blocks[c * cb:c * cb + tail], 0, tail))
            st.tail_saved = True
        dirs = [self._dir_entry(st, c) for c in chunks] if self.partial else []
        st.saves += 1
        return SaveJob(rid, chunks, dirs)

    def _dir_entry(self, st: _Req, c: ChunkIO) -> DirEntry:
        """The directory entry naming object ``c`` of the request by its block hashes."""
        hs = st.hashes[c.index * self.chunk_blocks:c.index * self.chunk_blocks + len(c.block_ids)]
        return DirEntry(c.link, self.keys.dir_key(hs[0]), Directory.of(hs).encode())

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._async_loads.discard(request.request_id)  # aborted: never scheduled (its load may still run)
        # Blocks stay allocated until the worker reports the saves done.
        return bool(st is not None and st.saves), None

    def take_stats(self) -> StoreStats | None:
        return self.stats.take()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
