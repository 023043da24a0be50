"""A store lookup: which keys to ask about and what the answers mean (:class:`Probe`, no I/O),
and the round trips that drive it (:func:`reach`). The scheduler, ``mctier inspect lookup``,
warmup and the router's store view all use it, so they give the same reach.

The reach of a prompt is its leading whole chunks whose every part exists, then, past them,
the leading blocks of one more stored object that are the prompt's own, found through a
directory entry (:mod:`mcstore.keys`):

1. ``batch_is_exist`` over every part of every whole chunk, plus the directory entries of the
   first chunk and of the chunk after the last whole one (so that a prompt sharing nothing,
   or all its whole chunks, learns in this one call whether a second one is worth it);
2. only if the first missing chunk ``k`` could add a block: a read of the directory entry
   of chunk ``k``'s first block (one ``get_batch`` for every lookup of a batch that needs one,
   :func:`finish_many`). It names an object by its block hashes; the prompt uses the
   leading ``j`` of them that equal its own hashes of chunk ``k``'s blocks;
3. ``batch_is_exist`` over every part of that object (of every such object of a batch, in one
   call): it counts only when all exist (two-phase visibility, as for a whole chunk).

Nothing read is trusted: a directory entry is decoded against its type, its length bounded and
its check compared (:class:`mcstore.keys.Directory`), its first hash must be the prompt's own,
and the object it names is derived from its hashes by this key space, never read from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mcstore.keys import Directory, KeySpace


@dataclass(frozen=True)
class Partial:
    """Leading blocks of one stored object used past the whole chunks: chunk ``index`` of the
    prompt, the object ``link`` (a whole chunk or a part object) of ``blocks`` blocks, of which
    the first ``matched`` are the prompt's."""

    index: int
    link: str
    blocks: int
    matched: int


@dataclass(frozen=True)
class Reach:
    """What the store holds of a prompt: ``chunks`` leading whole chunks, then ``partial``;
    ``tokens`` in all (not capped: the scheduler leaves the last prompt token to the engine)."""

    chunks: int
    partial: Partial | None
    tokens: int
    round_trips: int


class Probe:
    """One prompt's lookup, from its block hashes (``hashes``: its full blocks', at the key
    space's ``block_tokens``; the prompt has ``num_tokens`` tokens). ``partial=False`` asks for
    whole chunks only (as before key version 4); ``links``: the chunks' links if known already."""

    def __init__(self, ks: KeySpace, hashes: Sequence[bytes], num_tokens: int, partial: bool = True,
                 links: list[str] | None = None):
        self.ks = ks
        self.num_tokens = num_tokens
        self.hashes = hashes[:num_tokens // ks.block_tokens]
        self.links = ks.links_from_block_hashes(self.hashes, num_tokens) if links is None else links
        self.partial = partial and ks.chunk_blocks > 1
        self.chunk_keys = ks.all_rank_keys(self.links)
        # Directory entries asked about in the first call: the first chunk's and the one after
        # the last whole chunk (chunk index -> position in that call's answers).
        self._dirs = {}
        if self.partial:
            for k in dict.fromkeys((0, len(self.links))):
                if self._has_block(k):
                    self._dirs[k] = len(self.chunk_keys) + len(self._dirs)

    def _has_block(self, k: int) -> bool:
        """Whether the prompt has a full block at the start of chunk ``k``."""
        return k * self.ks.chunk_blocks < len(self.hashes)

    def first_keys(self) -> list[str]:
        """What the first ``batch_is_exist`` asks."""
        return self.chunk_keys + [self.ks.dir_key(self.hashes[k * self.ks.chunk_blocks]) for k in self._dirs]

    def present(self, rcs: Sequence[int]) -> int:
        """Leading whole chunks whose every part exists, from the first call's answers."""
        n, present = self.ks.parts, 0
        while present < len(self.links) and all(rc == 1 for rc in rcs[present * n:(present + 1) * n]):
            present += 1
        return present

    def directory_key(self, present: int, rcs: Sequence[int] | None, usable_tokens: int) -> str | None:
        """The directory entry to read after ``present`` whole chunks, None when it cannot add
        a token below ``usable_tokens`` or the first call (its answers ``rcs``, if given) found
        it absent."""
        ks = self.ks
        if not self.partial or not self._has_block(present) or present * ks.chunk_tokens >= usable_tokens:
            return None
        pos = self._dirs.get(present)
        if pos is not None and rcs is not None and rcs[pos] != 1:
            return None
        return ks.dir_key(self.hashes[present * ks.chunk_blocks])

    def match(self, present: int, raw: bytes | None) -> Partial | None:
        """The object a directory entry (``raw``, None when absent) names, with how many of its
        leading blocks are this prompt's; None when it names nothing usable."""
        ks = self.ks
        d = Directory.decode(raw, ks.chunk_blocks) if raw else None
        if d is None:
            return None
        mine = self.hashes[present * ks.chunk_blocks:(present + 1) * ks.chunk_blocks]
        j = 0
        while j < min(len(mine), len(d.hashes)) and mine[j] == d.hashes[j]:
            j += 1
        if j == 0:
            return None
        return Partial(present, ks.object_link(d.hashes), len(d.hashes), j)

    def part_keys(self, p: Partial) -> list[str]:
        return self.ks.all_rank_keys([p.link])

    def reach(self, present: int, partial: Partial | None = None, round_trips: int = 1) -> Reach:
        tokens = present * self.ks.chunk_tokens + (partial.matched * self.ks.block_tokens if partial else 0)
        return Reach(present, partial, tokens, round_trips)


def _no_pause() -> None:
    pass


def reach(client, probe: Probe, usable_tokens: int | None = None) -> Reach:
    """Drive ``probe`` through ``client`` (a :class:`mcstore.client.StoreClient`: ``exists``
    and ``fetch``): one to three round trips to the master (module docstring). A partial
    object is looked for only if it could add a token below ``usable_tokens`` (default: the
    prompt's tokens; the engine's last token is its own to compute)."""
    return finish(client, probe, client.exists(probe.first_keys()), usable_tokens)


def finish(client, probe: Probe, rcs: Sequence[int], usable_tokens: int | None = None) -> Reach:
    """:func:`reach` from the answers ``rcs`` to ``probe.first_keys()`` (asked in a batch with
    other lookups, :mod:`mcstore.batchlookup`): the second and third round trips, if needed."""
    return finish_many(client, [(probe, rcs, usable_tokens)])[0]


def finish_many(client, items: Sequence[tuple[Probe, Sequence[int], int | None]],
                pause: Callable[[], None] | None = None) -> list[Reach]:
    """:func:`finish` of several lookups at once (one step's batch): at most two more round
    trips for all of them together, whatever their number: one ``get_batch`` of every
    directory entry to read (``client.fetch_many``), one ``batch_is_exist`` over the parts of
    every object those entries name. ``items``: ``(probe, rcs, usable_tokens)`` each, ``rcs``
    the answers to ``probe.first_keys()``; the reaches in that order. ``pause()`` is called
    between items (the lookup thread's hand-over of the GIL, :mod:`mcstore.batchlookup`)."""
    pause = pause or _no_pause
    out: list[Reach | None] = [None] * len(items)
    reads = []  # (item index, present, directory key)
    for i, (probe, rcs, usable) in enumerate(items):
        present = probe.present(rcs)
        key = probe.directory_key(present, rcs, probe.num_tokens if usable is None else usable)
        if key is None:
            out[i] = probe.reach(present)
        else:
            reads.append((i, present, key))
        pause()
    if reads:
        max_bytes = max(64 + items[i][0].ks.chunk_blocks * 40 for i, _, _ in reads)
        keys = [key for _, _, key in reads]
        many = getattr(client, "fetch_many", None)
        raws = many(keys, max_bytes) if many is not None else [client.fetch(k, max_bytes) for k in keys]
        found = []  # (item index, present, partial, its part keys)
        for (i, present, _), raw in zip(reads, raws):
            probe = items[i][0]
            part = probe.match(present, raw)
            if part is None:
                out[i] = probe.reach(present, round_trips=2)
            else:
                found.append((i, present, part, probe.part_keys(part)))
            pause()
        if found:
            rcs = client.exists([k for *_, keys in found for k in keys])
            off = 0
            for i, present, part, keys in found:
                mine, off = rcs[off:off + len(keys)], off + len(keys)
                ok = len(mine) == len(keys) and all(rc == 1 for rc in mine)
                out[i] = items[i][0].reach(present, part if ok else None, round_trips=3)
    return out  # type: ignore[return-value]
