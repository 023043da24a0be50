"""Store tier, worker side: the load path (a mixin of :class:`mcstore.worker.StoreWorker`,
whose state it uses: the client, key space, geometry, locks and result sets).

Whole chunks go straight from the store into the registered KV pages, in batch gets of
at most ``MAX_RANGES_PER_CALL`` buffer ranges (:func:`ranged_batches`), one range per run
of consecutive blocks per KV region. Once an engine's cache has cycled, the blocks vLLM
gives a request no longer form ascending runs and a chunk becomes up to one range per block
per region; Mooncake's TCP transport pays per range. So a chunk with more than
``stage_above_ranges_per_region`` ranges per region (default 4) is fetched as one range into a
host staging buffer and its pages copied into place (:mod:`kvcore.pages`), as many chunks per
Mooncake get as the buffer holds (``load_staging_size``, 64 MB) and one indexed copy per KV
region for them all. Every read checks the object's size: a whole chunk's, or a part
object's (``ChunkIO.blocks`` blocks). Staging about halves a scattered chunk's load and batching the staged
gets halves it again, while at 1 to 3 ranges per region staging lost to its copy: hence the
default between the two (docs/benchmarks/store-phases.md). An object needed only in part (from
block ``first`` on, or its leading blocks: another prompt's chunk that this one shares up to a
block inside it) and a part object are fetched whole into staging too, then the blocks needed
copied: one object per load at most, so a ranged get (Mooncake has one) would save little.

A read that outlasts the master's read lease (``--default_kv_lease_ttl``) fails:
Mooncake's batch get returns LEASE_EXPIRED for it (the object may have been evicted
and its memory reused while the bytes were in flight). Like an eviction, that is a
miss: the chunk and the ones after it are recomputed (``failures:load_lease_expired``).
An object evicted while we read it may have had its memory reused by a newer put, so
loaded objects must still exist afterwards (``load_recheck``); a load that ends past
its deadline is not trusted either.
"""

from __future__ import annotations

import queue
import time

from kvcore.errors import is_missing
from kvcore.log import get_logger
from kvcore.tier import LoadReport
from mcstore.objects import TRAILER as _TRAILER, read_cause, trailer_ok
from mcstore.protocol import ChunkIO, LoadJob

logger = get_logger("mcstore.loads")

_TRAILER_SLOTS = 4096  # chunks per get call when verifying (StoreWorker registers as many trailer slots)
MAX_RANGES_PER_CALL = 1024  # buffer ranges per Mooncake batch get or put (see ranged_batches)


def ranged_batches(ranges: list[int]) -> list[list[int]]:
    """Chunk indices grouped into batch calls of at most ``MAX_RANGES_PER_CALL`` buffer ranges
    (and ``_TRAILER_SLOTS`` chunks); ``ranges[j]``: chunk ``j``'s buffer ranges, its trailer
    included. A chunk with more ranges than the cap goes alone.

    Why: Mooncake 0.3.13 fails the ranges of one batch call past about the 2,048th
    (TRANSFER_FAIL; once a SIGSEGV of the calling process; ``tests/test_store_integration.py``),
    and a churned engine's blocks scatter to tens of ranges per chunk
    (docs/benchmarks/store-phases.md)."""
    out: list[list[int]] = []
    part: list[int] = []
    total = 0
    for j, n in enumerate(ranges):
        if part and (total + n > MAX_RANGES_PER_CALL or len(part) == _TRAILER_SLOTS):
            out.append(part)
            part, total = [], 0
        part.append(j)
        total += n
    if part:
        out.append(part)
    return out


class Loads:
    def _load_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job, deadline = self._load_q.get(timeout=0.5)
            except queue.Empty:
                continue
            if deadline is None:  # a step's layer-wise loads (mcstore.layerwise), which book themselves
                self._run_layers(job)
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
                self._lock.notify_all()  # a synchronous load's step waits for it (StoreWorker._wait_sync)

    def _load(self, job: LoadJob, deadline: float) -> list[int]:
        t0 = time.monotonic()
        self._observe_phase("load_queue", max(0.0, t0 - (deadline - job.timeout_s)))
        n = len(job.chunks)
        ok = [False] * n
        gone = False  # the load failed on a chunk no longer there (evicted, lease expired): a miss
        if t0 > deadline:
            cause = "timeout"
        elif not self.client.available:
            cause = "unavailable"
        else:
            cause = None
            # Whole objects straight into their pages (with groups, a sliding group's too).
            full = [i for i, c in enumerate(job.chunks) if c.first == 0 and (c.blocks == 0 or self.groups)
                    and len(c.block_ids) == (c.blocks or self.chunk_blocks)]
            cause, gone = self._get_whole([job.chunks[i] for i in full], full, ok)
            for i, c in enumerate(job.chunks):
                if i not in full:
                    ok[i], why, missing = self._load_partial(c)
                    if why is not None and cause is None:
                        cause, gone = why, missing
            # An object evicted while we read it may have had its memory reused by a newer
            # put (a Mooncake batch get does not always hold a lease): it must still exist.
            good = [i for i in range(n) if ok[i]]
            if good:
                with self._phase("load_recheck"):
                    still = self.client.exists([self._key(job.chunks[i]) for i in good])
                for i, e in zip(good, still):
                    if e != 1:
                        ok[i] = False
                        if cause is None:
                            cause, gone = "evicted_during_load", True
            if time.monotonic() > deadline:
                # Bytes may be in place, but too late to be trusted as on time: recompute.
                cause, gone, ok = "timeout", False, [False] * n
        return self._book_load(job, ok, cause, gone, t0)

    def _book_load(self, job: LoadJob, ok: list[bool], cause: str | None, gone: bool, t0: float) -> list[int]:
        """Account for load ``job`` started at ``t0`` whose chunk ``i`` arrived whole iff ``ok[i]``
        (the first failure's ``cause``, ``gone``: it was a miss): stats, load report, KV events,
        log. The blocks to recompute: those of the first chunk not ok and of every one after it."""
        n = len(job.chunks)
        first_bad = next((i for i in range(n) if not ok[i]), n)
        loaded = job.chunks[:first_bad]
        nbytes = sum(len(c.block_ids) * self._block_bytes(c) for c in loaded)
        # With groups a failed load is the whole request's (StoreWorker.get_transfer_results).
        ntok = (job.tokens if first_bad == n else 0) if self.groups else sum(len(c.block_ids) for c in loaded) * \
            self.block_size
        with self._lock:
            self.stats.observe("load", seconds := time.monotonic() - t0)
            if ntok:
                self.stats.inc("loaded_tokens", ntok)
                self.stats.inc("loaded_bytes", nbytes)
            if first_bad < n:
                self.stats.inc(f"failures:load_{cause or 'error'}")
        self.reports.add(LoadReport("store", job.req_id, nbytes, seconds, first_bad == n))
        if first_bad < n and gone:
            self._news_of(gone_links=[job.chunks[first_bad].link])  # KV events: no longer stored
        if first_bad < n:
            # A chunk evicted (or its lease expired) meanwhile is an ordinary miss; the rest is not.
            (logger.info if gone else logger.warning)(
                "mcstore: load of %s failed at chunk %d/%d (%s); those tokens are recomputed",
                job.req_id, first_bad, n, cause)
        return [b for c in job.chunks[first_bad:] for b in c.block_ids]

    def _get_whole(self, chunks: list[ChunkIO], idx: list[int], ok: list[bool]) -> tuple[str | None, bool]:
        """Whole chunks straight into their pages (one range per run of consecutive blocks per
        KV region); ``ok[idx[j]]`` := chunk ``j`` arrived whole. The first failure's (cause, gone)."""
        cause, gone = None, False
        per = [self._ptrs(c.block_ids, c.group) for c in chunks]
        # Scattered chunks (more ranges than stage_above_ranges_per_region allows) go through
        # host staging: one range each, then a copy (see the module's docstring for why).
        staged = [j for j, (p, _) in enumerate(per) if 0 < self.stage_above < len(p)]
        end = len(chunks)  # chunks from the first failed one on are recomputed: not fetched
        # One staged batch per object shape (a group's objects of one size).
        for shape in dict.fromkeys((chunks[j].group, chunks[j].blocks) for j in staged):
            js = [j for j in staged if (chunks[j].group, chunks[j].blocks) == shape]
            why, missing, stop = self._get_staged(chunks, js, idx, ok)
            if stop < end:
                cause, gone, end = why, missing, stop
        direct = sorted(set(range(end)) - set(staged))
        for batch in ranged_batches([len(per[j][0]) + self.verify for j in direct]):
            part = [direct[k] for k in batch]
            keys, ptrs, sizes = [], [], []
            for slot, j in enumerate(part):
                keys.append(self._key(chunks[j]))
                p, s = per[j]  # each chunk's lists are used once: appending to them is safe
                if self.verify:
                    p.append(self._load_trailers.data_ptr() + slot * _TRAILER.size)
                    s.append(_TRAILER.size)
                ptrs.append(p)
                sizes.append(s)
            self._count_io("load", ptrs)
            with self._phase("load_transfer"):
                rcs = self.client.get_into(keys, ptrs, sizes)
            for slot, (j, rc) in enumerate(zip(part, rcs)):
                i = idx[j]
                want = self._object_bytes(chunks[j]) + self.trailer
                ok[i] = rc == want
                if not ok[i]:
                    if cause is None:
                        cause, gone = read_cause(rc, want), is_missing(rc)
                elif self.verify and not trailer_ok(
                        self._load_trailers.data_ptr() + slot * _TRAILER.size, ptrs[slot][:-1], sizes[slot][:-1],
                        keys[slot]):
                    ok[i] = False
                    cause = cause or "checksum"
        return cause, gone

    def _get_staged(self, chunks: list[ChunkIO], js: list[int], idx: list[int], ok: list[bool],
                    count_io: bool = True) -> tuple[str | None, bool, int]:
        """Chunks ``chunks[j]`` for ``j`` in ``js`` (ascending; the same ``first`` and block count)
        through host staging: as many whole objects per Mooncake get as the buffer holds (one
        range each), then their pages from ``first`` on copied, one indexed write per KV region
        for all of them. (cause, gone, j) of the first
        chunk that did not arrive whole, (None, False, len(chunks)) if all did; ``ok[idx[j]]``
        := chunk ``j`` arrived whole and is in its pages."""
        stage, stride = self._staging_buffer(), self._slot_bytes()
        obj = self._object_bytes(chunks[js[0]])
        base, want, slots = stage.data_ptr(), obj + self.trailer, stage.numel() // stride
        for lo in range(0, len(js), slots):
            part = js[lo:lo + slots]
            ptrs = [[base + s * stride] for s in range(len(part))]
            if count_io:
                self._count_io("load", ptrs)  # one range per chunk: the whole object, its trailer included
            keys = [self._key(chunks[j]) for j in part]
            with self._phase("load_staging"):
                rcs = self.client.get_into(keys, ptrs, [[want]] * len(part))
            good, cause, gone = 0, None, False
            for s, rc in enumerate(rcs):
                if rc != want:
                    cause, gone = read_cause(rc, want), is_missing(rc)
                    break
                if self.verify and not trailer_ok(base + s * stride + obj, [base + s * stride], [obj], keys[s]):
                    cause = "checksum"
                    break
                good += 1
            if good:
                with self._phase("load_copy"):
                    self._copy_pages([chunks[j] for j in part[:good]])
                    self.pages_g[self._gi(chunks[part[0]].group)].wait()  # complete before the load is reported
                for j in part[:good]:
                    ok[idx[j]] = True
            if cause is not None:
                return cause, gone, part[good]
        return None, False, len(chunks)

    def _object_bytes(self, c: ChunkIO) -> int:
        """Bytes of the pages of the object ``c`` reads from (without the trailer)."""
        return (c.blocks or self.chunk_blocks) * self._block_bytes(c)

    def _key(self, c: ChunkIO) -> str:
        """This rank's object of ``c`` (its group's)."""
        return self.keys.key(c.link, self.rank, group=c.group)

    def _slot_bytes(self) -> int:
        """Bytes between two objects in staging: one object, rounded up to 4 KiB so that every
        slot and page starts aligned (the copy reads them as 8-byte words)."""
        return -(-(self.chunk_bytes + self.trailer) // 4096) * 4096

    def _staging_buffer(self):
        """The registered host staging buffer (``load_staging_size``, at least one object),
        allocated at first use."""
        if self._staging is None:
            import torch

            slots = max(1, self.cfg.load_staging_size // self._slot_bytes())
            self._staging = torch.empty(slots * self._slot_bytes(), dtype=torch.uint8)
            self.client.register(self._staging.data_ptr(), self._staging.numel())
        return self._staging

    def _copy_pages(self, cs: list[ChunkIO]) -> None:
        """Pages ``c.first..`` of the objects in staging slots 0, 1, ... into blocks
        ``c.block_ids``, as many blocks from each. Torch copies, not memmove: on CUDA the
        pages are device memory (kvcore.pages)."""
        k, first, nb = len(cs[0].block_ids), cs[0].first, cs[0].blocks or self.chunk_blocks
        assert all(len(c.block_ids) == k and c.first == first and (c.blocks or self.chunk_blocks) == nb
                   and c.group == cs[0].group for c in cs)
        assert first + k <= nb
        ids = [b for c in cs for b in c.block_ids]
        gi = self._gi(cs[0].group)
        pages = self.pages_g[gi]
        for i, (r, pre) in enumerate(zip(self.geos[gi].regions, self._region_pres[gi])):
            off = nb * pre
            src = self._staging.as_strided((len(cs), k, r.page_bytes), (self._slot_bytes(), r.page_bytes, 1),
                                           off + first * r.page_bytes)
            pages.write(i, ids, src)

    def _load_partial(self, c: ChunkIO) -> tuple[bool, str | None, bool]:
        """Blocks ``[c.first, c.first + len(c.block_ids))`` of an object: the whole object through
        staging (:meth:`_get_staged`), those pages copied; not added to the ``io_*`` counters (as before).
        (arrived whole, the cause if not, whether that cause is a miss: evicted, lease expired)."""
        ok = [False]
        cause, gone, _ = self._get_staged([c], [0], [0], ok, count_io=False)
        return ok[0], cause, gone
