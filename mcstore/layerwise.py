"""Store tier, worker side: layer-wise synchronous loads (``layerwise_load``; a mixin of
:class:`mcstore.worker.StoreWorker`, whose client, geometry, lock and result sets it uses).

A synchronous load (``sync_load_max``) otherwise waits for all of its bytes before the step's
forward pass: at 32K tokens the hit took the floor plus the whole get
(docs/benchmarks/store-divergence.md). Here the step's eligible loads become one
:class:`LayerUnit`: ``start_load_kv`` queues it and returns; the load thread opens one Mooncake
get session for all its objects (the master's replica lookup, once), then reads the objects'
byte ranges of layer group 0, 1, ... in layer order (:func:`layer_spans`, :func:`span_pieces`:
an object is the chunk's pages region-major, so a layer's pages are byte ranges of it at
computable offsets); vLLM calls ``wait_for_layer_load`` before each attention layer, and that
waits, until the unit's deadline, only for the group holding that layer.

Verification (``verify_checksums``): the digest runs incrementally, each group's pages after
they arrive (in object order, so it equals the whole object's), and the trailer comes with the
last group. A mismatch, like any other failure, is known when the load thread finishes, which
``get_finished`` waits for (bounded as :meth:`StoreWorker._wait_sync` is: Mooncake may still
write into the pages until its get returns); the failed blocks go to this step's
``get_block_ids_with_load_errors``. vLLM 0.32's scheduler (``_handle_invalid_blocks``,
``_update_requests_with_invalid_blocks``) then rewinds a running request to its first failed
block, skips that step's sampled token for it, and computes from there, as for any failed
synchronous load: the forward that read the bad bytes produced nothing that is kept. So no check
waits before the last layer's attention: it would only delay the step.

Whole-object loads remain for background loads, scattered (staged) chunks, part objects and
chunks needed from a later block on, and layouts with KV cache groups (vLLM takes only
whole-request failures there). A step whose forward did not call ``wait_for_layer_load`` for
every layer would have read pages that may not have arrived: its layer-wise loads are reported
failed (recomputed) and layer-wise loading is switched off for the process.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import xxhash

from kvcore.errors import cause_of, is_missing
from kvcore.geometry import Region, block_runs
from kvcore.log import get_logger
from mcstore.loads import _TRAILER_SLOTS, ranged_batches
from mcstore.objects import MAGIC, TRAILER, read_cause
from mcstore.protocol import LoadJob

logger = get_logger("mcstore.layerwise")

_OUT_OF_RANGE = -600  # Mooncake's INVALID_PARAMS: what a ranged read past an object's end returns


def layer_spans(regions: Sequence[Region], groups: int) -> list[tuple[int, int]]:
    """Region index ranges ``[a, b)`` of ``groups`` consecutive groups of layers (fewer when
    there are fewer layers), as even in layers as integer division makes them, in region
    order. A layer's regions (K and V on some layouts) are never split; ValueError if a
    layer's regions are not consecutive."""
    starts, seen = [], set()
    for i, r in enumerate(regions):
        if i == 0 or r.layer != regions[i - 1].layer:
            if r.layer in seen:
                raise ValueError(f"layer {r.layer}'s KV regions are not consecutive")
            seen.add(r.layer)
            starts.append(i)
    n = len(starts)
    g = max(1, min(groups, n))
    bounds = [starts[(k * n) // g] for k in range(g)] + [len(regions)]
    return list(zip(bounds[:-1], bounds[1:]))


def region_offsets(regions: Sequence[Region]) -> list[int]:
    """Per region, the bytes of one block of the regions before it: in a stored object of ``n``
    blocks region ``r``'s pages start ``n * region_offsets(regions)[r]`` bytes in."""
    out, off = [], 0
    for r in regions:
        out.append(off)
        off += r.page_bytes
    return out


def span_pieces(regions: Sequence[Region], pre: Sequence[int], block_ids: Sequence[int],
                span: tuple[int, int]) -> tuple[list[int], list[int], list[int]]:
    """(page addresses, sizes, offsets in the object) that load regions ``span[0]..span[1]-1`` of
    a whole stored object of ``len(block_ids)`` blocks into blocks ``block_ids`` (the object's
    block ``k`` into ``block_ids[k]``). Region ``r``'s page of object block ``k`` is at offset
    ``n * pre[r] + k * page_bytes``; a run of consecutive block ids of a dense region is one
    piece, as in ``KVGeometry.ranges``. In order, the pieces are the object's bytes
    ``[n * pre[span[0]], n * pre[span[1]])`` (the end of the pages for the last region)."""
    n = len(block_ids)
    addrs, sizes, offs = [], [], []
    for ri in range(*span):
        r = regions[ri]
        base = n * pre[ri]
        dense = r.block_stride == r.page_bytes
        k = 0
        for first, count in block_runs(block_ids) if dense else ((b, 1) for b in block_ids):
            addrs.append(r.base + first * r.block_stride)
            sizes.append(count * r.page_bytes)
            offs.append(base + k * r.page_bytes)
            k += count
    return addrs, sizes, offs


class LayerUnit:
    """One step's layer-wise loads. ``done``: layer groups whose bytes are in (or given up);
    ``ended``: the load thread is through (its gets returned, results booked in
    ``_done_loads``); ``given_up``: a layer's wait passed the deadline, so every block of the
    unit is reported failed; ``waited``: the layers vLLM waited for."""

    def __init__(self, jobs: list[LoadJob], t0: float):
        self.jobs = jobs
        self.t0 = t0
        self.deadline = t0 + min(job.timeout_s for job in jobs)
        self.done = 0
        self.ended = False
        self.given_up = False
        self.waited: set[str] = set()
        self.wait_s = 0.0


class LayerLoads:
    def _layers_setup(self) -> None:
        """After register_kv_caches: the layer groups (none when off or with KV cache groups)."""
        self._unit: LayerUnit | None = None
        self._spans: list[tuple[int, int]] = []
        self._group_of: dict[str, int] = {}
        if not self.cfg.layerwise_load or self.groups:
            return
        try:
            self._spans = layer_spans(self.geo.regions, self.cfg.layerwise_load_groups)
        except ValueError as e:
            logger.warning("mcstore: layer-wise loads off: %s", e)
            return
        self._group_of = {r.layer: g for g, (a, b) in enumerate(self._spans) for r in self.geo.regions[a:b]}

    def _layerwise(self, job: LoadJob) -> bool:
        """Whether ``job`` loads layer by layer: synchronous, whole chunks only, none scattered."""
        if not (self._spans and job.sync and job.chunks):
            return False
        for c in job.chunks:
            if c.first or c.blocks or c.group or len(c.block_ids) != self.chunk_blocks:
                return False
            if 0 < self.stage_above < len(self.geo.ranges(c.block_ids)):
                return False  # scattered: one range into staging is faster (mcstore.loads)
        return True

    def _start_layers(self, jobs: list[LoadJob], t0: float) -> None:
        """Queue ``jobs`` as this step's :class:`LayerUnit`, ahead of the step's background loads."""
        self._end_layers()  # an earlier step's unit whose results nobody collected (vLLM always does)
        self._unit = LayerUnit(jobs, t0)
        self._load_q.put((self._unit, None))

    def wait_layer(self, layer: str) -> None:
        """vLLM's ``wait_for_layer_load``: block until ``layer``'s group is in, or the unit's
        deadline (then the unit is given up: its blocks are all reported failed)."""
        u = self._unit
        g = self._group_of.get(layer)
        if u is None or g is None:
            return
        u.waited.add(layer)
        if u.done > g:
            return
        t = time.monotonic()
        with self._lock:
            while u.done <= g and not u.given_up:
                left = u.deadline - time.monotonic()
                if left <= 0:
                    u.given_up = True
                    logger.warning("mcstore: layer-wise load of %s past its deadline at %s; recomputed",
                                   [j.req_id for j in u.jobs], layer)
                    break
                self._lock.wait(left)
        u.wait_s += time.monotonic() - t

    def _end_layers(self) -> None:
        """At the end of the step (``get_finished``): wait for the unit's load thread to be
        through, then move its failed blocks to this step's load errors."""
        u = self._unit
        if u is None:
            return
        unwaited = set(self._group_of) - u.waited
        with self._lock:
            warned = False
            while not u.ended:
                left = u.deadline - time.monotonic()
                if left <= 0 and not warned:
                    warned = True
                    logger.warning("mcstore: layer-wise load of %s past its deadline; waiting for "
                                   "Mooncake's get to return", [j.req_id for j in u.jobs])
                self._lock.wait(left if left > 0 else 1.0)
            self._unit = None
            for job in u.jobs:
                failed = self._done_loads.pop(job.req_id, None)
                if failed is None or u.given_up or unwaited:  # None: never booked (logged)
                    failed = [b for c in job.chunks for b in c.block_ids]
                self._step_errors.update(failed)
            self.stats.observe("phase:load_layer_wait", u.wait_s)
            if u.given_up:
                self.stats.inc("failures:load_layer_timeout")
        if unwaited:
            # The forward may have read pages before their bytes arrived: never again.
            logger.error("mcstore: the forward pass did not wait for layers %s; layer-wise loads off, "
                         "this step's recomputed", sorted(unwaited)[:4])
            self._spans, self._group_of = [], {}

    def _run_layers(self, u: LayerUnit) -> None:
        """The load thread's part of unit ``u``; always ends it."""
        items = [(j, c) for j, job in enumerate(u.jobs) for c in job.chunks]
        ok = [True] * len(items)
        why: dict[int, tuple[str, bool]] = {}  # job -> the first failure's (cause, gone)
        try:
            self._fetch_layers(u, items, ok, why)
        except Exception as e:  # noqa: BLE001 - a load must end, whatever happened
            logger.exception("mcstore: layer-wise load failed: %s", e)
            for i, (j, _) in enumerate(items):
                ok[i] = False
                why.setdefault(j, ("error", False))
        with self._lock:
            u.done = 1 << 30  # every group is as in as it will be: no layer waits any longer
            self._lock.notify_all()
        pos = 0
        try:
            for j, job in enumerate(u.jobs):
                n = len(job.chunks)
                cause, gone = why.get(j, (None, False))
                failed = self._book_load(job, ok[pos:pos + n], cause, gone, u.t0)
                pos += n
                with self._lock:
                    self._done_loads[job.req_id] = failed
        except Exception as e:  # noqa: BLE001 - the step waits for u.ended: it must come
            logger.exception("mcstore: booking a layer-wise load failed: %s", e)
        finally:
            with self._lock:
                u.ended = True
                self._lock.notify_all()

    def _fetch_layers(self, u: LayerUnit, items: list, ok: list[bool], why: dict) -> None:
        """Group by group, the unit's objects' byte ranges into their pages (``ok[i]`` := item
        ``i`` arrived whole and verified; a failed chunk fails the rest of its job's)."""
        self._observe_phase("load_queue", max(0.0, time.monotonic() - u.t0))

        def fail(i: int, cause: str, gone: bool = False) -> None:
            j = items[i][0]
            why.setdefault(j, (cause, gone))
            for k in range(i, len(items)):
                if items[k][0] == j:
                    ok[k] = False

        if time.monotonic() > u.deadline or not self.client.available:
            for i in range(len(items)):
                fail(i, "timeout" if self.client.available else "unavailable")
            return
        keys = [self._key(c) for _, c in items]
        with self._phase("load_session"):
            rcs = self.client.session_start(keys)
        try:
            for i, rc in enumerate(rcs):
                if rc != 0 and ok[i]:
                    fail(i, cause_of(rc), is_missing(rc))
            self._count_io("load", [self._ptrs(c.block_ids)[0] for _, c in items])  # as one whole get's
            digests = [self._digest_start(k) for k in keys] if self.verify else None
            pre, last = self._region_pre, len(self._spans) - 1
            t_start = time.monotonic()
            for g, span in enumerate(self._spans):
                live = [i for i in range(len(items)) if ok[i]]
                if u.given_up or time.monotonic() > u.deadline:
                    break
                per = [span_pieces(self.geo.regions, pre, items[i][1].block_ids, span) for i in live]
                tail = self.verify and g == last
                for batch in ranged_batches([len(p[0]) + tail for p in per]):
                    self._get_group(batch, live, per, keys, tail, digests, fail)
                with self._lock:
                    u.done = g + 1
                    self._lock.notify_all()
                if g == 0:
                    self._observe_phase("load_layer_first", time.monotonic() - t_start)
            self._observe_phase("load_layers", time.monotonic() - t_start)
            if u.given_up or time.monotonic() > u.deadline:
                for i in range(len(items)):
                    if ok[i]:
                        fail(i, "timeout")
                return
            self._check_sizes(items, keys, ok, fail)
        finally:
            self.client.session_end(keys)
        good = [i for i in range(len(items)) if ok[i]]
        if good:
            # As for whole loads (mcstore.loads): an object evicted meanwhile may have been overwritten.
            with self._phase("load_recheck"):
                still = self.client.exists([keys[i] for i in good])
            for i, e in zip(good, still):
                if e != 1 and ok[i]:
                    fail(i, "evicted_during_load", True)

    def _get_group(self, batch, live, per, keys, tail, digests, fail) -> None:
        """One ranged get of the chunks ``live[k]`` for ``k`` in ``batch`` (their pieces ``per[k]``;
        ``tail``: also each object's trailer, into a registered slot), then the digests."""
        obj = self.chunk_blocks * self.geo.block_bytes
        ks, ptrs, sizes, offs = [], [], [], []
        for slot, k in enumerate(batch):
            a, s, o = per[k]
            if tail:
                a, s, o = a + [self._load_trailers.data_ptr() + slot * TRAILER.size], s + [TRAILER.size], o + [obj]
            ks.append(keys[live[k]])
            ptrs.append(a)
            sizes.append(s)
            offs.append(o)
        assert len(batch) <= _TRAILER_SLOTS
        rcs = self.client.get_ranges(ks, ptrs, sizes, offs)
        for slot, (k, rc) in enumerate(zip(batch, rcs)):
            i, want = live[k], sum(sizes[slot])
            if rc != want:
                fail(i, read_cause(rc, want), is_missing(rc))
            elif digests is not None:
                a, s = per[k][0], per[k][1]
                for addr, size in zip(a, s):
                    digests[i].update((ctypes.c_char * size).from_address(addr))
                if tail:
                    found, magic = TRAILER.unpack(ctypes.string_at(ptrs[slot][-1], TRAILER.size))
                    if magic != MAGIC or found != digests[i].intdigest():
                        fail(i, "checksum")

    @staticmethod
    def _digest_start(key: str):
        """An xxh3-64 state over ``key`` as :func:`mcstore.objects.digest` starts it."""
        h = xxhash.xxh3_64()
        k = key.encode()
        h.update(len(k).to_bytes(4, "little") + k)
        return h

    def _check_sizes(self, items, keys, ok, fail) -> None:
        """Ranged reads do not see an object larger than ours (a whole-object get does): one byte
        at our end must be out of range (Mooncake checks that against the session's replicas)."""
        live = [i for i in range(len(items)) if ok[i]]
        if not live:
            return
        end = self.chunk_blocks * self.geo.block_bytes + self.trailer
        probe = self._load_trailers if self.verify else self._size_probe()
        for lo in range(0, len(live), MAX_PROBES):
            part = live[lo:lo + MAX_PROBES]
            rcs = self.client.get_ranges([keys[i] for i in part], [[probe.data_ptr()]] * len(part),
                                         [[1]] * len(part), [[end]] * len(part))
            for i, rc in zip(part, rcs):
                if rc != _OUT_OF_RANGE:
                    fail(i, "size_mismatch" if rc >= 0 else cause_of(rc), is_missing(rc))

    def _size_probe(self):
        """A registered byte for :meth:`_check_sizes` without checksums (allocated at first use)."""
        if getattr(self, "_probe_buf", None) is None:
            import torch

            self._probe_buf = torch.zeros(64, dtype=torch.uint8)
            self.client.register(self._probe_buf.data_ptr(), self._probe_buf.numel())
        return self._probe_buf


MAX_PROBES = 1024  # keys per size-probe call (as MAX_RANGES_PER_CALL)
