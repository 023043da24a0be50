"""One save job's I/O on the store tier's worker (:class:`Saves`, mixed into
:class:`mcstore.worker.StoreWorker`, whose save thread calls :meth:`Saves._save`).

Chunks already in the store are skipped (and still announced as stored); the rest go to
the store as zero-copy batch puts from the registered pages, each with its checksum trailer
under ``verify_checksums``. A full store (no space) is retried with backoff for
``save_retry_s`` by the first job under pressure only; jobs behind it try once, so their
blocks are not held for a queue of waits. Then the directory entries of what was written
(partial hits, :mod:`mcstore.lookup`).
"""

from __future__ import annotations

import ctypes
import time

from kvcore.errors import cause_of, is_no_space
from kvcore.log import get_logger
from mcstore.loads import ranged_batches
from mcstore.objects import TRAILER as _TRAILER, pack_trailer
from mcstore.protocol import SaveJob

logger = get_logger("mcstore.worker")


class Saves:
    """Needs of the host: ``client``, ``keys``, ``cfg``, ``geo``, ``groups``, ``rank``, ``block_size``,
    ``verify`` and ``trailer`` (bytes), ``_save_trailers`` (a host buffer of trailer slots),
    ``_full_until``, ``_lock``, ``stats``, ``_ptrs``, ``_phase``, ``_count``, ``_count_io`` and
    ``_news_of``."""

    def _save(self, job: SaveJob) -> list[str]:
        if not self.client.available:
            self._count("save_skipped:unavailable", len(job.chunks))
            return []
        t0 = time.monotonic()
        keys = [self._key(c) for c in job.chunks]
        obj_bytes = {k: len(c.block_ids) * self._block_bytes(c) + self.trailer for k, c in zip(keys, job.chunks)}
        with self._phase("save_exists"):
            exists = self.client.exists(keys)
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
            with self._phase("save_transfer"):
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
        if job.dirs and written and self.rank == 0 and self.keys.pp_rank == 0:
            self._save_dirs(job, set(written))
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
