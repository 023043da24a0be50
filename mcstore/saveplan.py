"""Which of a request's blocks the store tier saves, step by step: the scheduler's half of a
save (:class:`SavePlans`, mixed into :class:`mcstore.scheduler.StoreScheduler`).

Each step, the full prompt chunks a request completed (not known to be stored) go to the
worker as a :class:`~mcstore.protocol.SaveJob`; once all its full prompt blocks are computed,
those past its last whole chunk go as one part object (the tail a later turn of the
conversation extends). With partial hits, each object has its directory entry (its block
hashes, :class:`mcstore.keys.Directory`), which lets a later prompt that shares only its
leading blocks find it (:mod:`mcstore.lookup`).
"""

from __future__ import annotations

from kvcore.vllm_glue import request_block_ids, request_group_block_ids
from mcstore.keys import Directory
from mcstore.protocol import ChunkIO, DirEntry, SaveJob


class SavePlans:
    """Needs of the host: ``_reqs`` (request id -> state with ``request``, ``hashes``,
    ``links``, ``present``, ``partial``, ``save_next``, ``tail_saved``, ``saves``), ``keys``,
    ``cfg``, ``block_size``, ``chunk_blocks``, ``partial``, ``groups``, ``stats``, ``events`` and
    the bound KV cache manager."""

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
        if self.groups is not None:  # each KV cache group's object, at its own block ids (mcstore.groups)
            chunks, saved = self._group_chunks(st, rid, first, done)
        else:
            blocks = request_block_ids(self._kv_cache_manager, rid)
            chunks = [ChunkIO(st.links[c], c, blocks[c * cb:(c + 1) * cb]) for c in range(first, done)]
            saved = range(first, done)
        if self.events is not None:
            for c in saved:
                self.events.planned(rid, st.links[c], c, req)
        st.save_next = max(st.save_next, done)
        if tail:
            c = len(st.links)
            link = self.keys.part_link(st.hashes[c * cb + tail - 1], tail)
            chunks.append(ChunkIO(link, c, blocks[c * cb:c * cb + tail], 0, tail))
            st.tail_saved = True
        if not chunks:
            return None
        dirs = [self._dir_entry(st, c) for c in chunks] if self.partial else []
        st.saves += 1
        return SaveJob(rid, chunks, dirs)

    def _group_chunks(self, st, rid: str, first: int, done: int) -> tuple[list[ChunkIO], list[int]]:
        """Every group's objects of chunks ``[first, done)``, and those chunks; a chunk whose
        blocks vLLM no longer holds (a sliding group's, freed behind the window) is skipped."""
        blocks = request_group_block_ids(self._kv_cache_manager, rid)
        chunks, saved = [], []
        for c in range(first, done):
            ios = self.groups.save_ios(st.links[c], c, blocks)
            if ios is None:
                self.stats.inc("save_skipped:window")
                continue
            chunks += ios
            saved.append(c)
        return chunks, saved

    def _dir_entry(self, st, c: ChunkIO) -> DirEntry:
        """The directory entry naming object ``c`` of the request by its block hashes."""
        hs = st.hashes[c.index * self.chunk_blocks:c.index * self.chunk_blocks + len(c.block_ids)]
        return DirEntry(c.link, self.keys.dir_key(hs[0]), Directory.of(hs).encode())
