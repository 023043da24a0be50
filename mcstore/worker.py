"""Store tier, worker side (runs in the Worker process).

Loads and saves run on two background threads, off the forward path, straight
between the registered KV pages and the store (zero copy). A stored object is one
chunk of one TP rank: the chunk's pages in canonical order (layer-major, then
block order; see ``KVGeometry.ranges``), so its bytes do not depend on the block
ids it was saved from or is loaded into. A chunk needed from block ``first`` on only
is fetched whole into host staging, its pages copied by :mod:`kvcore.pages`.

A read that outlasts the master's read lease (``--default_kv_lease_ttl``) fails:
Mooncake's batch get returns LEASE_EXPIRED for it (the object may have been evicted
and its memory reused while the bytes were in flight). Like an eviction, that is a
miss: the chunk and the ones after it are recomputed (``failures:load_lease_expired``).

With ``verify_checksums`` (opt-in) an object ends in a 12-byte trailer
(:mod:`mcstore.objects`: xxh3-64 of the pages, magic); a load whose bytes do not match it is a load error, so no
corrupted or half-overwritten chunk is ever used as KV, whatever went wrong
between the save and the load.

Results are kept per request: ``get_finished`` returns the requests whose load
ended (success or not) and those finished requests whose saves all ended;
``get_block_ids_with_load_errors`` returns the blocks that could not be filled
in the same step.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import Counter, deque

from kvcore.errors import ConfigError, cause_of, is_missing, is_no_space
from kvcore.geometry import KVGeometry
from kvcore.log import get_logger
from kvcore.pages import PageViews
from kvcore.platform import current as current_platform
from kvcore.platform import wait_fence
from kvcore.tier import LoadReport, LoadReports
from mcstore.objects import TRAILER as _TRAILER
from mcstore.objects import pack_trailer, read_cause, trailer, trailer_ok  # noqa: F401  (tests import trailer here)
from mcstore.client import StoreClient
from mcstore.config import StoreConfig
from mcstore.keys import KeySpace
from mcstore.metrics import StoreStats
from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata

logger = get_logger("mcstore.worker")

_PREEMPT_WAIT_S = 5.0
_TRAILER_SLOTS = 4096  # chunks per put/get call when verifying


class StoreWorker:
    def __init__(self, cfg: StoreConfig, keys: KeySpace, block_size: int, num_blocks: int,
                 rank: int, *, load: bool, save: bool):
        self.cfg = cfg
        self.keys = keys
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.num_blocks = num_blocks
        self.rank = rank
        self.load_enabled = load
        self.save_enabled = save
        self.client = StoreClient(cfg, f"worker{rank}", segment=True)
        self.stats = StoreStats()
        self.reports = LoadReports()  # one per ended load, for a composite's calibration
        self.geo: KVGeometry | None = None
        self.chunk_bytes = 0
        self._lock = threading.Condition()
        self._load_q: queue.Queue = queue.Queue()
        self._save_q: deque = deque()
        self._save_q_chunks = 0
        self._saving: SaveJob | None = None
        self._tainted: set[int] = set()
        self._pending_saves: Counter[str] = Counter()
        self._finished_waiting: set[str] = set()
        self._done_loads: dict[str, list[int]] = {}
        self._step_errors: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._staging = None
        self._full_until = 0.0  # until then the store counts as full (see _save)
        self.verify = cfg.verify_checksums
        if self.verify and current_platform().device_type != "cpu":
            # The digest reads the pages with the CPU; device KV would need a staging copy.
            raise ConfigError("mcstore: verify_checksums needs host-resident KV (the CPU platform)")
        self.trailer = _TRAILER.size if self.verify else 0
        self._save_trailers = self._load_trailers = None

    # -- set-up --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.geo = KVGeometry.from_kv_caches(kv_caches, self.num_blocks)
        self.pages = PageViews(kv_caches, self.geo)  # partial-chunk copies, on the KV's own device
        self.chunk_bytes = self.chunk_blocks * self.geo.block_bytes
        # The store's register_buffer takes no location: Mooncake finds where the memory is.
        for buf in self.geo.buffers:
            self.client.register(buf.addr, buf.size)
        if self.verify:
            import torch

            # Registered trailer slots (RDMA needs every source/target registered).
            self._save_trailers = torch.zeros(_TRAILER_SLOTS * _TRAILER.size, dtype=torch.uint8)
            self._load_trailers = torch.zeros(_TRAILER_SLOTS * _TRAILER.size, dtype=torch.uint8)
            for t in (self._save_trailers, self._load_trailers):
                self.client.register(t.data_ptr(), t.numel())
        # Region r of a stored chunk starts after the chunk's pages of regions < r.
        self._region_off, off = [], 0
        for r in self.geo.regions:
            self._region_off.append(off)
            off += self.chunk_blocks * r.page_bytes
        self._start_threads()
        logger.info("mcstore worker: %d KV regions, %d bytes per %d-token chunk",
                    len(self.geo.regions), self.chunk_bytes, self.cfg.chunk_tokens)

    def _start_threads(self) -> None:
        for name, fn in (("load", self._load_loop), ("save", self._save_loop)):
            t = threading.Thread(target=fn, name=f"mcstore-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _ptrs(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        rs = self.geo.ranges(block_ids)
        return [r.addr for r in rs], [r.size for r in rs]

    # -- per-step hooks --------------------------------------------------------------

    def start_load_kv(self, meta: StoreMetadata) -> None:
        now = time.monotonic()
        for job in meta.loads:
            self._load_q.put((job, now + job.timeout_s))

    def wait_for_save(self, meta: StoreMetadata) -> None:
        if not meta.saves:
            return
        fence = current_platform().kv_ready_fence()
        with self._lock:
            for job in meta.saves:
                n = len(job.chunks)
                if self._save_q_chunks + n > self.cfg.save_queue_chunks:
                    self._count("failures:save_queue_full", n)
                    logger.warning("mcstore: save queue full, dropping %d chunk(s) of %s", n, job.req_id)
                    # Still known: the scheduler holds its blocks until we report it finished.
                    self._pending_saves[job.req_id] += 0
                    continue
                self._pending_saves[job.req_id] += 1
                self._save_q.append((job, fence))
                self._save_q_chunks += n
            self._lock.notify_all()

    def handle_preemptions(self, meta: StoreMetadata) -> None:
        """A preempted request's blocks are about to be reused: no save may read them after this."""
        if not meta.preempted:
            return
        gone = set(meta.preempted)
        with self._lock:
            kept = deque()
            for job, fence in self._save_q:
                if job.req_id in gone:
                    self._save_q_chunks -= len(job.chunks)
                    self._pending_saves[job.req_id] -= 1
                    self._count("save_skipped:preempted", len(job.chunks))
                else:
                    kept.append((job, fence))
            self._save_q = kept
            deadline = time.monotonic() + _PREEMPT_WAIT_S
            while self._saving is not None and self._saving.req_id in gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    # The put may read reused blocks: remove what it wrote once it returns.
                    self._tainted.add(id(self._saving))
                    logger.error("mcstore: save of preempted %s still running; its objects will be removed",
                                 self._saving.req_id)
                    break
                self._lock.wait(left)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            for rid in finished_req_ids:
                if rid in self._pending_saves:
                    self._finished_waiting.add(rid)
            sending = {r for r in self._finished_waiting if self._pending_saves[r] <= 0}
            for r in sending:
                self._finished_waiting.discard(r)
                del self._pending_saves[r]
            recving = set(self._done_loads)
            for blocks in self._done_loads.values():
                self._step_errors.update(blocks)
            self._done_loads.clear()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._step_errors = self._step_errors, set()
        return out

    def take_stats(self) -> StoreStats | None:
        with self._lock:
            return self.stats.take()

    def _count(self, key: str, n: float = 1) -> None:
        # Called with or without the lock held (Condition's lock is re-entrant).
        with self._lock:
            self.stats.inc(key, n)

    # -- loads -----------------------------------------------------------------------

    def _load_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job, deadline = self._load_q.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                failed = self._load(job, deadline)
            except Exception as e:  # noqa: BLE001 - a load must end, whatever happened
                logger.exception("mcstore: load of %s failed: %s", job.req_id, e)
                self._count("failures:load_error")
                failed = [b for c in job.chunks for b in c.block_ids]
                self.reports.add(LoadReport("store", job.req_id, 0, 0.0, False))
            with self._lock:
                self._done_loads[job.req_id] = failed

    def _load(self, job: LoadJob, deadline: float) -> list[int]:
        t0 = time.monotonic()
        n = len(job.chunks)
        ok = [False] * n
        gone = False  # the load failed on a chunk no longer there (evicted, lease expired): a miss
        if t0 > deadline:
            cause = "timeout"
        elif not self.client.available:
            cause = "unavailable"
        else:
            cause = None
            full = [i for i, c in enumerate(job.chunks) if c.first == 0 and len(c.block_ids) == self.chunk_blocks]
            want = self.chunk_bytes + self.trailer
            for lo in range(0, len(full), _TRAILER_SLOTS):
                part = full[lo:lo + _TRAILER_SLOTS]
                keys, ptrs, sizes = [], [], []
                for slot, i in enumerate(part):
                    c = job.chunks[i]
                    keys.append(self.keys.key(c.link, self.rank))
                    p, s = self._ptrs(c.block_ids)
                    if self.verify:
                        p.append(self._load_trailers.data_ptr() + slot * _TRAILER.size)
                        s.append(_TRAILER.size)
                    ptrs.append(p)
                    sizes.append(s)
                for slot, (i, rc) in enumerate(zip(part, self.client.get_into(keys, ptrs, sizes))):
                    ok[i] = rc == want
                    if not ok[i]:
                        if cause is None:
                            cause, gone = read_cause(rc, want), is_missing(rc)
                    elif self.verify and not trailer_ok(
                            self._load_trailers.data_ptr() + slot * _TRAILER.size, ptrs[slot][:-1], sizes[slot][:-1]):
                        ok[i] = False
                        cause = cause or "checksum"
            for i, c in enumerate(job.chunks):
                if i not in full:
                    ok[i], why = self._load_partial(c)
                    cause = cause or why
            # An object evicted while we read it may have had its memory reused by a newer
            # put (a Mooncake batch get does not always hold a lease): it must still exist.
            good = [i for i in range(n) if ok[i]]
            if good:
                still = self.client.exists([self.keys.key(job.chunks[i].link, self.rank) for i in good])
                for i, e in zip(good, still):
                    if e != 1:
                        ok[i] = False
                        if cause is None:
                            cause, gone = "evicted_during_load", True
            if time.monotonic() > deadline:
                # Bytes may be in place, but too late to be trusted as on time: recompute.
                cause, gone, ok = "timeout", False, [False] * n
        first_bad = next((i for i in range(n) if not ok[i]), n)
        loaded = job.chunks[:first_bad]
        nblocks = sum(len(c.block_ids) for c in loaded)
        with self._lock:
            self.stats.observe("load", seconds := time.monotonic() - t0)
            if nblocks:
                self.stats.inc("loaded_tokens", nblocks * self.block_size)
                self.stats.inc("loaded_bytes", nblocks * self.geo.block_bytes)
            if first_bad < n:
                self.stats.inc(f"failures:load_{cause or 'error'}")
        self.reports.add(LoadReport("store", job.req_id, nblocks * self.geo.block_bytes, seconds, first_bad == n))
        if first_bad < n:
            # A chunk evicted (or its lease expired) meanwhile is an ordinary miss; the rest is not.
            (logger.info if gone else logger.warning)(
                "mcstore: load of %s failed at chunk %d/%d (%s); those tokens are recomputed",
                job.req_id, first_bad, n, cause)
        return [b for c in job.chunks[first_bad:] for b in c.block_ids]

    def _load_partial(self, c: ChunkIO) -> tuple[bool, str | None]:
        """Blocks ``c.first..`` of a chunk: fetch the whole object into staging, copy the pages."""
        if self._staging is None:
            import torch

            self._staging = torch.empty(self.chunk_bytes + self.trailer, dtype=torch.uint8)
            self.client.register(self._staging.data_ptr(), self._staging.numel())
        base = self._staging.data_ptr()
        want = self.chunk_bytes + self.trailer
        rc = self.client.get_into([self.keys.key(c.link, self.rank)], [[base]], [[want]])[0]
        if rc != want:
            return False, read_cause(rc, want)
        if self.verify and not trailer_ok(base + self.chunk_bytes, [base], [self.chunk_bytes]):
            return False, "checksum"
        # Torch copies, not memmove: on CUDA the pages are device memory (kvcore.pages).
        k = len(c.block_ids)
        for i, (r, off) in enumerate(zip(self.geo.regions, self._region_off)):
            lo = off + c.first * r.page_bytes
            self.pages.write(i, c.block_ids, self._staging[lo:lo + k * r.page_bytes].view(k, r.page_bytes))
        self.pages.wait()  # the pages are complete before the load is reported, staging free again
        return True, None

    # -- saves -----------------------------------------------------------------------

    def _save_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._save_q and not self._stop.is_set():
                    self._lock.wait(0.5)
                if self._stop.is_set():
                    return
                job, fence = self._save_q.popleft()
                self._save_q_chunks -= len(job.chunks)
                self._saving = job
            try:
                wait_fence(fence)
                written = self._save(job)
            except Exception as e:  # noqa: BLE001 - a save must end, whatever happened
                logger.exception("mcstore: save of %s failed: %s", job.req_id, e)
                self._count("failures:save_error")
                written = []
            with self._lock:
                tainted = id(job) in self._tainted
                self._tainted.discard(id(job))
            if tainted and written:
                self.client.store.batch_remove(written, True)
            with self._lock:
                self._saving = None
                self._pending_saves[job.req_id] -= 1
                self._lock.notify_all()

    def _save(self, job: SaveJob) -> list[str]:
        if not self.client.available:
            self._count("save_skipped:unavailable", len(job.chunks))
            return []
        t0 = time.monotonic()
        keys = [self.keys.key(c.link, self.rank) for c in job.chunks]
        exists = self.client.exists(keys)
        todo = [(k, c) for k, c, e in zip(keys, job.chunks, exists) if e != 1]
        if len(todo) < len(keys):
            self._count("save_skipped:exists", len(keys) - len(todo))
        written: list[str] = []
        # Under sustained pressure only the first job waits save_retry_s; jobs behind it try
        # once until a put succeeds again, so their blocks are not held for a queue of waits.
        patient = t0 >= self._full_until
        deadline, delay = t0 + (self.cfg.save_retry_s if patient else 0.0), 0.005
        while todo:
            todo, later = todo[:_TRAILER_SLOTS], todo[_TRAILER_SLOTS:]
            ptrs, sizes = [], []
            for slot, (_, c) in enumerate(todo):
                p, sz = self._ptrs(c.block_ids)
                if self.verify:
                    addr = self._save_trailers.data_ptr() + slot * _TRAILER.size
                    ctypes.memmove(addr, pack_trailer(p, sz), _TRAILER.size)
                    p.append(addr)
                    sz.append(_TRAILER.size)
                ptrs.append(p)
                sizes.append(sz)
            rcs = self.client.put_from([k for k, _ in todo], ptrs, sizes)
            retry = []
            for (k, c), rc in zip(todo, rcs):
                if rc == 0:
                    written.append(k)
                    self._full_until = 0.0
                elif is_no_space(rc):
                    retry.append((k, c))
                else:
                    self._count(f"failures:save_{cause_of(rc)}")
            todo = retry + later
            if retry and time.monotonic() + delay > deadline:
                self._full_until = time.monotonic() + self.cfg.save_retry_s
                self._count("failures:save_no_space", len(retry))
                logger.warning("mcstore: store full (no space), dropped %d chunk(s) of %s",
                               len(retry), job.req_id)
                todo = later
                continue
            if retry:
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        with self._lock:
            self.stats.observe("save", time.monotonic() - t0)
            if written:
                self.stats.inc("saved_tokens", len(written) * self.cfg.chunk_tokens)
                self.stats.inc("saved_bytes", len(written) * (self.chunk_bytes + self.trailer))
        return written

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        self.client.close()
