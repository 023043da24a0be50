"""KV cache groups on the store tier's scheduler side (vLLM's hybrid allocator on).

Each group of a chunk is its own object (``KeySpace.groups`` names it in the key), holding that
group's pages at that group's block ids (:mod:`kvcore.kvgroups` says which a group keeps):

- a full-attention group's object holds the chunk's every block;
- a sliding-window group's holds only the chunk's last ``min(chunk_blocks, tail_blocks)``
  blocks: what a hit ending at the chunk's end needs of it. Its blocks further back are outside
  the window of any such hit, vLLM frees them as the request runs, and a load gets null blocks
  for them, so they are neither saved nor loaded.

A chunk counts as stored when every group's object (every part) exists (:mod:`mcstore.lookup`);
a hit is then cut back (:meth:`StoreGroups.usable`) until each sliding group's kept blocks
below it are stored, which holds at every chunk boundary. Part objects and directory entries
(hits inside a chunk) are off for such layouts.

vLLM frees a sliding group's blocks behind the window while the request still runs, before the
worker's save (which starts at the next step) has read them: :class:`Pins` holds a reference to
each saved sliding block (``BlockPool.touch``, as vLLM's own ``MooncakeStoreConnector`` does)
until every worker reports the save job done, and keeps the engine stepping meanwhile
(``has_pending_push_work``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.kvgroups import NULL_BLOCK, KVGroup
from mcstore.protocol import ChunkIO, SaveJob


class StoreGroups:
    def __init__(self, groups: Sequence[KVGroup], chunk_blocks: int):
        self.groups = list(groups)
        self.cb = chunk_blocks
        self.block_size = self.groups[0].block_size
        # Blocks of a chunk each group's object holds: its trailing ones.
        self.keep = [chunk_blocks if g.window is None else min(chunk_blocks, g.tail_blocks()) for g in self.groups]
        self.sliding = any(g.window is not None for g in self.groups)

    def _io(self, link: str, c: int, gi: int, ids: list[int], first: int) -> ChunkIO:
        k = self.keep[gi]
        return ChunkIO(link, c, ids, first, 0 if k == self.cb else k, self.groups[gi].index)

    def save_ios(self, link: str, c: int, block_ids: Sequence[Sequence[int]]) -> list[ChunkIO] | None:
        """Every group's object of chunk ``c``; None when a block it needs is not the request's
        any more (a null block: vLLM freed it)."""
        out = []
        end = (c + 1) * self.cb
        for gi, k in enumerate(self.keep):
            ids = list(block_ids[gi][end - k:end])
            if len(ids) < k or NULL_BLOCK in ids:
                return None
            out.append(self._io(link, c, gi, ids, 0))
        return out

    def load_ios(self, link: str, c: int, lo: int, hi: int, end_tokens: int,
                 block_ids: Sequence[Sequence[int]]) -> list[ChunkIO]:
        """Each group's blocks ``[lo, hi)`` (block positions inside chunk ``c``) that a load ending
        at token ``end_tokens`` fills: a sliding group's from ``first_kept(end_tokens)`` on only."""
        out = []
        for gi, (g, k) in enumerate(zip(self.groups, self.keep)):
            start = max(lo, g.first_kept(end_tokens))
            if start >= hi:
                continue
            obj0 = (c + 1) * self.cb - k  # the object's first block position
            ids = list(block_ids[gi][start:hi])
            if start < obj0 or len(ids) < hi - start or NULL_BLOCK in ids:
                raise ValueError(f"mcstore: group {g.index} blocks [{start}, {hi}) of chunk {c} are not all "
                                 f"stored or not all the request's")
            out.append(self._io(link, c, gi, ids, start - obj0))
        return out

    def usable(self, hit: int, present: int, chunk_tokens: int) -> tuple[int, int]:
        """``(hit, present)`` cut back to the longest hit whose every group's kept blocks are stored
        (``present`` leading chunks of every group are)."""
        while hit > 0 and not all(self._covered(g, k, hit, present) for g, k in zip(self.groups, self.keep)):
            present = min(present, -(-hit // chunk_tokens)) - 1
            hit = max(0, present * chunk_tokens)
        return hit, present

    def _covered(self, g: KVGroup, k: int, hit: int, present: int) -> bool:
        cb = self.cb
        return all(b // cb < present and b % cb >= cb - k
                   for b in range(g.first_kept(hit), -(-hit // self.block_size)))


class Pins:
    """References the scheduler holds on save jobs' sliding-window blocks (module docstring)."""

    def __init__(self, groups: StoreGroups, workers: int):
        self.sliding = [gi for gi, g in enumerate(groups.groups) if g.window is not None]
        self.index = {groups.groups[gi].index for gi in self.sliding}
        self.workers = workers
        self._next = 0
        self._held: dict[int, tuple[list, int]] = {}  # job pin -> (blocks, workers yet to report)

    def pin(self, job: SaveJob, pool) -> None:
        """Hold the job's sliding-group blocks until its save ended on every worker."""
        ids = list(dict.fromkeys(b for c in job.chunks if c.group in self.index for b in c.block_ids))
        if not ids or pool is None:
            return
        blocks = [pool.blocks[b] for b in ids]
        pool.touch(blocks)
        job.pin = self._next
        self._held[self._next] = (blocks, self.workers)
        self._next += 1

    def done(self, pins: Sequence[int], pool) -> None:
        """Workers report these jobs ended (saved, failed or dropped): release what all did."""
        for p in pins:
            entry = self._held.get(p)
            if entry is None:
                continue
            blocks, left = entry
            if left > 1:
                self._held[p] = (blocks, left - 1)
                continue
            del self._held[p]
            pool.free_blocks(reversed(blocks))

    def pending(self) -> bool:
        return bool(self._held)
