"""The save thread of the store tier's worker and one save job's I/O (:class:`Saves`, mixed into
:class:`mcstore.worker.StoreWorker`, whose save thread runs :meth:`Saves._save_loop`).

Chunks already in the store are skipped (and still announced as stored); the rest go to
the store as zero-copy batch puts from the registered pages, each with its checksum trailer
under ``verify_checksums``. A full store (no space) is retried with backoff for
``save_retry_s`` by the first job under pressure only; jobs behind it try once, so their
blocks are not held for a queue of waits.

The directory entries of the objects (partial hits, :mod:`mcstore.lookup`) ride in the first
put call beside their objects, from a small registered buffer: each Mooncake transfer call
keeps the saving thread polling its status on the engine's core (a separate upsert of the
entries doubled that per save: docs/benchmarks/no-reuse.md). An entry that could not ride
(already there: an upsert replaces it, the last writer wins; no room) is upserted after its
object was written, as before; one that went in but whose object was not written is removed.
"""

from __future__ import annotations

import ctypes
import time

from kvcore.errors import cause_of, is_no_space
from kvcore.log import get_logger
from kvcore.platform import wait_fence
from mcstore.loads import MAX_RANGES_PER_CALL, ranged_batches
from mcstore.objects import TRAILER as _TRAILER, pack_trailer
from mcstore.protocol import SaveJob

logger = get_logger("mcstore.worker")

DIR_BUF_BYTES = 64 << 10  # registered bytes for the directory entries of one put call (a few hundred each)


class Saves:
    """Needs of the host: ``client``, ``keys``, ``cfg``, ``geo``, ``groups``, ``rank``, ``block_size``,
    ``verify`` and ``trailer`` (bytes), ``_save_trailers`` (a host buffer of trailer slots),
    ``_full_until``, ``_lock``, ``stats``, ``_ptrs``, ``_phase``, ``_count``, ``_count_io`` and
    ``_news_of``; for the save thread also ``_stop``, ``_save_q`` (``(job, fence, queued at, step)``),
    ``_save_q_chunks``, ``_save_ready``, ``_saving``, ``_tainted``, ``_pending_saves``,
    ``_observe_phase`` and ``_job_ended``."""

    def _save_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._stop.is_set() and (not self._save_q or self._save_ready(time.monotonic()) > 0):
                    self._lock.wait(self._save_ready(time.monotonic()) if self._save_q else 0.5)
                if self._stop.is_set():
                    return
                job, fence, queued, _ = self._save_q.popleft()
                self._save_q_chunks -= len(job.chunks)
                self._saving = job
            try:
                wait_fence(fence)
                self._observe_phase("save_queue", time.monotonic() - queued)
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
            elif written:
                self._news_of(stored_keys=written)  # before the request can be reported finished
            with self._lock:
                self._saving = None
                self._pending_saves[job.req_id] -= 1
                self._job_ended(job)
                self._lock.notify_all()

    def _dirs_setup(self) -> None:
        """The registered buffer the directory entries ride in (:meth:`_riders`); only the first TP
        rank of the first stage writes entries."""
        self._dir_buf = None
        if self.save_enabled and self.rank == 0 and self.keys.pp_rank == 0:
            import torch

            self._dir_buf = torch.zeros(DIR_BUF_BYTES, dtype=torch.uint8)
            self.client.register(self._dir_buf.data_ptr(), DIR_BUF_BYTES)

    def _dirs_of(self, job: SaveJob, keys: list[str]) -> dict:
        """Object key -> its directory entry, for the objects of ``keys`` this rank writes entries of."""
        if not job.dirs or self.rank != 0 or self.keys.pp_rank != 0:
            return {}
        mine = set(keys)
        return {k: d for d in job.dirs if (k := self.keys.key(d.link, self.rank)) in mine}

    def _riders(self, pending: dict, call_keys: list[str], ranges: int) -> list[tuple[str, int, int]]:
        """The directory entries that go in this put call beside their objects (taken out of
        ``pending``), copied into the registered buffer: (object key, address, size) each."""
        out, off = [], 0
        buf = getattr(self, "_dir_buf", None)
        for k in call_keys:
            d = pending.get(k)
            n = len(d.value) if d is not None else 0
            if not n or buf is None or off + n > DIR_BUF_BYTES or ranges + len(out) >= MAX_RANGES_PER_CALL:
                continue
            ctypes.memmove(buf.data_ptr() + off, d.value, n)
            out.append((k, buf.data_ptr() + off, n))
            off += n
            del pending[k]
        return out

    def _save(self, job: SaveJob) -> list[str]:
        if not self.client.available:
            self._count("save_skipped:unavailable", len(job.chunks))
            return []
        t0 = time.monotonic()
        keys = [self._key(c) for c in job.chunks]
        obj_bytes = {k: len(c.block_ids) * self._block_bytes(c) + self.trailer for k, c in zip(keys, job.chunks)}
        entries = self._dirs_of(job, keys)
        with self._phase("save_exists"):  # the entries too, in the same call: a put does not replace one
            exists = self.client.exists(keys + [d.key for d in entries.values()])
        exists, there = exists[:len(keys)], {k for k, e in zip(entries, exists[len(keys):]) if e == 1}
        todo = [(k, c) for k, c, e in zip(keys, job.chunks, exists) if e != 1]
        if len(todo) < len(keys):
            self._count("save_skipped:exists", len(keys) - len(todo))
            self._news_of(stored_keys=[k for k, e in zip(keys, exists) if e == 1])  # in the store all the same
        written: list[str] = []
        # Under sustained pressure only the first job waits save_retry_s; jobs behind it try
        # once until a put succeeds again, so their blocks are not held for a queue of waits.
        patient = t0 >= self._full_until
        deadline, delay = t0 + (self.cfg.save_retry_s if patient else 0.0), 0.005
        rng = {k: self._ptrs(c.block_ids, c.group) for k, c in todo}  # each chunk's ranges, computed once
        # Object key -> its entry not sent yet: those not in the store (Mooncake's put of a key
        # already there answers success and leaves the old value: an upsert replaces it).
        pending = {k: d for k, d in entries.items() if k in rng and k not in there}
        dirs_in: set[str] = set()  # object keys whose entry went in with a put
        while todo:
            # The first batch call's worth (mcstore.loads.ranged_batches: bounded ranges and slots).
            n = len(ranged_batches([len(rng[k][0]) + self.verify for k, _ in todo])[0])
            todo, later = todo[:n], todo[n:]
            ptrs, sizes = [], []
            for slot, (k, _) in enumerate(todo):
                p, sz = list(rng[k][0]), list(rng[k][1])  # copies: a retried chunk is sent again
                if self.verify:
                    addr = self._save_trailers.data_ptr() + slot * _TRAILER.size
                    ctypes.memmove(addr, pack_trailer(p, sz, k), _TRAILER.size)
                    p.append(addr)
                    sz.append(_TRAILER.size)
                ptrs.append(p)
                sizes.append(sz)
            self._count_io("save", ptrs)
            riders = self._riders(pending, [k for k, _ in todo], sum(map(len, ptrs))) if pending else []
            with self._phase("save_transfer"):
                rcs = self.client.put_from([k for k, _ in todo] + [entries[k].key for k, _, _ in riders],
                                           ptrs + [[a] for _, a, _ in riders], sizes + [[n] for _, _, n in riders])
            rcs, dir_rcs = rcs[:len(todo)], rcs[len(todo):]
            dirs_in.update(k for (k, _, _), rc in zip(riders, dir_rcs) if rc == 0)
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
        if entries and (written or dirs_in):
            self._end_dirs(job, entries, set(written), dirs_in)
        with self._lock:
            self.stats.observe("save", time.monotonic() - t0)
            if written and self.groups:  # a chunk's tokens once, whatever its groups' objects hold
                index = {k: c.index for k, c in zip(keys, job.chunks)}
                self.stats.inc("saved_tokens", len({index[k] for k in written}) * self.cfg.chunk_tokens)
                self.stats.inc("saved_bytes", sum(obj_bytes[k] for k in written))
            elif written:
                self.stats.inc("saved_tokens", sum(obj_bytes[k] - self.trailer for k in written) // self.geo.block_bytes
                               * self.block_size)
                self.stats.inc("saved_bytes", sum(obj_bytes[k] for k in written))
        return written

    def _end_dirs(self, job: SaveJob, entries: dict, written: set[str], dirs_in: set[str]) -> None:
        """Every written object's entry in the store, and none of an object not written."""
        if written - dirs_in:
            self._save_dirs(job, written - dirs_in)
        stray = [entries[k].key for k in dirs_in - written]
        if stray:
            try:
                self.client.remove(stray, True)
            except Exception as e:  # noqa: BLE001 - a reader checks the object exists all the same
                logger.warning("mcstore: could not remove %d directory entries of unsaved objects: %s", len(stray), e)

    def _save_dirs(self, job: SaveJob, written: set[str]) -> None:
        """The directory entries of the objects this rank just wrote (the first rank of the
        first stage writes them; a reader still checks every part exists). Replaces an entry
        of the same first block: the last writer wins (mcstore.keys)."""
        dirs = [d for d in job.dirs if self.keys.key(d.link, self.rank) in written]
        if not dirs:
            return
        with self._phase("save_dirs"):
            rc = self.client.upsert_small([d.key for d in dirs], [d.value for d in dirs])
        if rc != 0:
            self._count(f"failures:save_dirs_{cause_of(rc)}")
