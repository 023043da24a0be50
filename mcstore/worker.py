"""Store tier, worker side (runs in the Worker process).

Loads and saves run on two background threads, off the forward path (a synchronous load's
step waits for its load before the forward: ``sync_load_max``; a save starts at the next step),
straight between the registered KV pages and the store (zero copy; except a load of a chunk whose
blocks are scattered, or needed from a later block on, which goes through host staging:
:mod:`mcstore.loads`; with ``layerwise_load`` a synchronous load's step waits per layer
instead: :mod:`mcstore.layerwise`). A stored object is one
chunk of one TP rank: the chunk's pages in canonical order (layer-major, then
block order; see ``KVGeometry.ranges``), so its bytes do not depend on the block
ids it was saved from or is loaded into. The load path is in :mod:`mcstore.loads`.

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

import os
import queue
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager

from kvcore import iocpus
from kvcore.errors import ConfigError
from kvcore.geometry import KVGeometry
from kvcore.log import get_logger
from kvcore.pages import PageViews
from kvcore.platform import current as current_platform
from kvcore.procs import name_thread
from kvcore.tier import LoadReports
from kvcore.vllm_glue import KVConnectorTransferResults
from mcstore.client import StoreClient
from mcstore.config import StoreConfig
from mcstore.events import StoreWorkerMeta, WorkerNews
from mcstore.keys import KeySpace
from mcstore.layerwise import LayerLoads, region_offsets
from mcstore.loads import _TRAILER_SLOTS, Loads
from mcstore.metrics import StoreStats
from mcstore.objects import TRAILER as _TRAILER, pack_trailer, trailer  # noqa: F401  (tests import trailer here)
from mcstore.protocol import SaveJob, StoreMetadata
from mcstore.saves import Saves

logger = get_logger("mcstore.worker")

_PREEMPT_WAIT_S = 5.0
SAVE_HOLD_S = 0.02  # a queued save starts at the next step, or this long after it was queued


class StoreWorker(Loads, LayerLoads, Saves, WorkerNews):
    def __init__(self, cfg: StoreConfig, keys: KeySpace, block_size: int, num_blocks: int,
                 rank: int, *, load: bool, save: bool, events: bool = False, groups: list | None = None):
        self.cfg = cfg
        # KV cache groups (kvcore.kvgroups.KVGroup) whose layers each object holds; None: one
        # group of every registered layer. With groups vLLM takes a failed load for the whole
        # request only (get_transfer_results).
        self.groups = groups
        self._failed_reqs: set[str] = set()
        self.keys = keys
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.num_blocks = num_blocks
        self.rank = rank
        self.load_enabled = load
        self.save_enabled = save
        # The I/O off the engine's compute cores with io_cpus auto or a list (kvcore.iocpus; the
        # default none keeps it there): Mooncake's transfer threads start with the client, ours in _io_thread.
        self.io_cpus = iocpus.resolve(cfg.io_cpus)
        if self.io_cpus:
            logger.info("mcstore worker%d: I/O threads on CPUs %s", rank, sorted(self.io_cpus))
        with iocpus.threads_started_on(self.io_cpus, "mcstore"):
            self.client = StoreClient(cfg, f"worker{rank}", segment=True)
        self.stats = StoreStats()
        self.reports = LoadReports()  # one per ended load, for a composite's calibration
        self.geo: KVGeometry | None = None
        self.chunk_bytes = 0
        self._lock = threading.Condition()
        self._load_q: queue.Queue = queue.Queue()
        self._save_q: deque = deque()  # (job, fence, queued at, step)
        self._save_q_chunks = 0
        self._step = 0  # steps bound so far (next_step)
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
        self.stage_above = 0  # ranges per chunk above which a load goes through staging (0: never)
        if self.verify and current_platform().device_type != "cpu":
            # The digest reads the pages with the CPU; device KV would need a staging copy.
            raise ConfigError("mcstore: verify_checksums needs host-resident KV (the CPU platform)")
        self.trailer = _TRAILER.size if self.verify else 0
        self._save_trailers = self._load_trailers = None
        # KV events (mcstore.events): the chunk parts this worker wrote, the chunks a load found gone.
        self.events = events
        self.part = keys.pp_rank * keys.tp_size + rank
        self._news = StoreWorkerMeta()

    # -- set-up --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        # One geometry per KV cache group, over that group's layers: with vLLM's hybrid allocator
        # the groups' layers share KV tensors, and a block id means a page of one group's layers.
        layers = [g.layers for g in self.groups] if self.groups else [tuple(kv_caches)]
        subsets = [{n: kv_caches[n] for n in names} for names in layers]
        self.geos = [KVGeometry.from_kv_caches(kv, self.num_blocks) for kv in subsets]
        self.pages_g = [PageViews(kv, geo) for kv, geo in zip(subsets, self.geos)]  # partial-object copies
        self.geo, self.pages = self.geos[0], self.pages_g[0]
        self.chunk_bytes = self.chunk_blocks * max(g.block_bytes for g in self.geos)  # the largest object
        # The store's register_buffer takes no location: Mooncake finds where the memory is.
        for addr, size in sorted({(b.addr, b.size) for geo in self.geos for b in geo.buffers}):
            self.client.register(addr, size)
        if self.verify:
            import torch

            # Registered trailer slots (RDMA needs every source/target registered).
            self._save_trailers = torch.zeros(_TRAILER_SLOTS * _TRAILER.size, dtype=torch.uint8)
            self._load_trailers = torch.zeros(_TRAILER_SLOTS * _TRAILER.size, dtype=torch.uint8)
            for t in (self._save_trailers, self._load_trailers):
                self.client.register(t.data_ptr(), t.numel())
        # Region r of a stored object of n blocks starts n * _region_pre[r] bytes in: after the
        # object's pages of regions < r (per group).
        self._region_pres = [region_offsets(geo.regions) for geo in self.geos]
        self._region_pre = self._region_pres[0]
        # Scattered chunks load through host staging (mcstore.loads): the threshold in ranges.
        self.stage_above = int(self.cfg.stage_above_ranges_per_region * len(self.geo.regions))
        self._layers_setup()  # layer-wise loads (mcstore.layerwise)
        self._dirs_setup()  # directory entries ride with their objects' put (mcstore.saves)
        self._start_threads()
        logger.info("mcstore worker: %d KV group(s), %s KV regions, %d bytes per %d-token chunk",
                    len(self.geos), "+".join(str(len(g.regions)) for g in self.geos),
                    sum(self.chunk_blocks * g.block_bytes for g in self.geos), self.cfg.chunk_tokens)

    def _start_threads(self) -> None:
        dev = current_platform().device_type
        for name, fn, nice in (("load", self._load_loop, self.cfg.load_nice(dev)),
                               ("save", self._save_loop, self.cfg.save_nice(dev))):
            t = threading.Thread(target=self._io_thread, args=(fn, nice), name=f"mcstore-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _io_thread(self, loop, nice: int) -> None:
        # Mooncake's batch get and put wait for their transfer by polling its status without a
        # pause (perf shows the calling thread in TcpTransport::getTransferStatus throughout;
        # event-driven completion is a Mooncake build option, off by default). On an engine
        # pinned to one core, that poll takes the core from Mooncake's own TCP thread, which
        # moves the bytes, and from the forward pass. A lower priority for the thread that
        # polls (a per-thread nice value on Linux) leaves the core to both. The thread's own
        # Python work runs at that priority too: a load starts about 1 ms later. Not the lowest
        # priority: while the engine decodes, its forward passes would leave a nice-19 thread
        # almost no core (mcstore.config.*_THREAD_NICE_CPU). Off the compute core (io_cpus) it
        # may need none, but there loads stalled (docs/deploy.md).
        iocpus.pin_this_thread(self.io_cpus, "mcstore")
        name_thread(threading.current_thread().name)  # mcstore-load / mcstore-save in top -H, perf
        if nice:
            try:
                tid = threading.get_native_id()
                # Never a higher priority than the engine's own (that would need privileges).
                os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
            except (OSError, AttributeError) as e:  # not Linux, or not permitted: run as is
                logger.warning("mcstore: could not set the nice value of %s to %d: %s",
                               threading.current_thread().name, nice, e)
        loop()

    def _ptrs(self, block_ids: list[int], group: int = 0) -> tuple[list[int], list[int]]:
        rs = self.geos[self._gi(group)].ranges(block_ids)
        return [r.addr for r in rs], [r.size for r in rs]

    def _gi(self, group: int) -> int:
        """The position of KV cache group ``group`` (its vLLM index) in :attr:`geos`."""
        if not self.groups:
            return 0
        for i, g in enumerate(self.groups):
            if g.index == group:
                return i
        raise ValueError(f"mcstore: no KV cache group {group}")

    def _block_bytes(self, c) -> int:
        """Bytes of one block of chunk object ``c``'s group (every layer of it)."""
        return self.geos[self._gi(c.group)].block_bytes

    # -- per-step hooks --------------------------------------------------------------

    def start_load_kv(self, meta: StoreMetadata) -> None:
        if not meta.loads:
            return
        now = time.monotonic()
        layered = [job for job in meta.loads if self._layerwise(job)]
        if layered:  # first: the forward waits for their first layers (mcstore.layerwise)
            self._start_layers(layered, now)
        for job in meta.loads:
            if job not in layered:
                self._load_q.put((job, now + job.timeout_s))
        sync = [job for job in meta.loads if job.sync and job not in layered]
        if sync:
            self._wait_sync(sync, now)

    def _wait_sync(self, jobs: list, t0: float) -> None:
        """The loads vLLM scheduled in this step (``sync``) end before its forward. They run on
        the load thread all the same (its nice value leaves the core to Mooncake's transfer
        while this thread sleeps); their unfilled blocks go to this step's
        ``get_block_ids_with_load_errors``, and vLLM recomputes from there. Past a job's
        deadline the load counts as failed, but this still waits for Mooncake's get to return:
        until then it may write into the pages (Mooncake's transfer timeout bounds the get, as
        it does a background load)."""
        rids = {job.req_id for job in jobs}
        deadline = t0 + max(job.timeout_s for job in jobs)
        warned = False
        with self._lock:
            while not rids <= self._done_loads.keys():
                left = deadline - time.monotonic()
                if left <= 0 and not warned:
                    warned = True
                    logger.warning("mcstore: synchronous load of %s past its deadline; waiting for "
                                   "Mooncake's get to return", sorted(rids - self._done_loads.keys()))
                self._lock.wait(left if left > 0 else 1.0)
            for rid in rids:
                self._step_errors.update(self._done_loads.pop(rid))

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
                    self._job_ended(job)
                    continue
                self._pending_saves[job.req_id] += 1
                self._save_q.append((job, fence, time.monotonic(), self._step))
                self._save_q_chunks += n
            self._lock.notify_all()

    def quiet(self, meta: StoreMetadata | None) -> bool:
        """:meth:`kvcore.tier.Tier.quiet_step`: ``meta`` asks nothing, and no save is queued or
        running or waits for its request to finish, no load result or news waits to be taken.
        Read unlocked (the I/O threads add under the lock): what they add now is seen next step."""
        return (meta is not None and not (meta.loads or meta.saves or meta.preempted)
                and self._saving is None and getattr(self, "_unit", None) is None  # a layer-wise load
                and not (self._save_q or self._pending_saves or self._done_loads or self._failed_reqs
                         or self._step_errors or self.reports)
                and not (self._news.stored or self._news.gone or self._news.saved) and self.stats.is_empty())

    def next_step(self) -> None:
        """A new step's metadata is bound: the saves queued by earlier steps may start (see
        :meth:`_save_ready`)."""
        self._step += 1  # written on this thread only; the save thread reads it under the lock
        if self._save_q:
            with self._lock:
                self._lock.notify_all()

    def _save_ready(self, now: float) -> float:
        """0 when the first queued save may start, else how long until it may. A save waits for
        the engine's next step (its KV's step has sampled and sent out its tokens by then), or
        SAVE_HOLD_S when no step follows: started at once it took the engine's one core from the
        step's first tokens (docs/benchmarks/no-reuse.md)."""
        _, _, queued, step = self._save_q[0]
        return 0.0 if step < self._step else max(0.0, queued + SAVE_HOLD_S - now)

    def handle_preemptions(self, meta: StoreMetadata) -> None:
        """A preempted request's blocks are about to be reused: no save may read them after this."""
        if not meta.preempted:
            return
        gone = set(meta.preempted)
        with self._lock:
            kept = deque()
            for job, fence, queued, step in self._save_q:
                if job.req_id in gone:
                    self._save_q_chunks -= len(job.chunks)
                    self._pending_saves[job.req_id] -= 1
                    self._count("save_skipped:preempted", len(job.chunks))
                    self._job_ended(job)
                else:
                    kept.append((job, fence, queued, step))
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
        self._end_layers()  # this step's layer-wise loads, into this step's load errors
        if not (finished_req_ids or self._finished_waiting or self._done_loads):
            return None, None  # most steps (read unlocked: a load ending now is reported next step)
        with self._lock:
            for rid in finished_req_ids:
                if rid in self._pending_saves:
                    self._finished_waiting.add(rid)
            sending = {r for r in self._finished_waiting if self._pending_saves[r] <= 0}
            for r in sending:
                self._finished_waiting.discard(r)
                del self._pending_saves[r]
            recving = set(self._done_loads)
            for rid, blocks in self._done_loads.items():
                if blocks and self.groups:
                    self._failed_reqs.add(rid)  # vLLM takes no failed block ids with groups
                else:
                    self._step_errors.update(blocks)
            self._done_loads.clear()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the requests whose load failed when the layout has KV cache
        groups: vLLM refuses failed block ids for several groups (its scheduler raises), and with
        a sliding group a recompute from the failed block would read blocks it freed behind the
        window; so the whole request is recomputed (vLLM's ``failed_recving``)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set()
        if self._failed_reqs:  # written on this thread only (get_finished): read unlocked, most steps
            with self._lock:
                failed, self._failed_reqs = self._failed_reqs, set()
        return KVConnectorTransferResults(finished_sending=sending or set(), finished_recving=recving or set(),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_layers()  # vLLM calls get_finished first; this covers a caller that does not
        if not self._step_errors:  # written on this thread only: read unlocked, most steps
            return set()
        with self._lock:
            out, self._step_errors = self._step_errors, set()
        return out

    def take_stats(self) -> StoreStats | None:
        if self.stats.is_empty():  # read unlocked: a count added now is taken at the next call
            return None
        with self._lock:
            return self.stats.take()

    def _count(self, key: str, n: float = 1) -> None:
        # Called with or without the lock held (Condition's lock is re-entrant).
        with self._lock:
            self.stats.inc(key, n)

    def _observe_phase(self, name: str, seconds: float) -> None:
        with self._lock:
            self.stats.observe(f"phase:{name}", seconds)

    @contextmanager
    def _phase(self, name: str):
        """Time the block as ``phase`` ``name`` (:mod:`mcstore.metrics`), raised or not."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._observe_phase(name, time.monotonic() - t0)

    def _count_io(self, kind: str, ptrs: list[list[int]]) -> None:
        with self._lock:
            self.stats.inc(f"io_chunks:{kind}", len(ptrs))
            self.stats.inc(f"io_ranges:{kind}", sum(map(len, ptrs)))

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        self.client.close()
