"""KV cache groups in the P2P handoff (vLLM's hybrid allocator on: ``P2PConnector`` declares
``SupportsHMA``).

Each group has its own block table, so the handoff moves each group's blocks at that group's
block ids, on both sides (:mod:`kvcore.kvgroups` says which blocks a group keeps):

- a full-attention group: every block the decode side did not find in its own prefix cache;
- a sliding-window group of window ``w``: only the blocks from ``first_kept(n)`` on, ``n`` the
  prompt's length (from ``first_kept(n - 1)``, the window of the prompt's last token, which the
  decode recomputes, when the decode allocated that block). vLLM 0.32 allocates the decode's
  blocks before those as the null block (the tokens are outside the window of every token still
  to compute), so they are neither pulled nor held for a pull.

Decode side, :func:`plan`: ``[(start_block, local block ids)]``, one per group, the blocks of
``[start, ceil(n / block_size))``; a decode block inside that range that is null (a layout the
plan does not expect) fails the handoff as a whole instead of leaving a block unfilled.
Prefill side, :func:`held`: each group's block ids of the prompt's blocks (null blocks where
vLLM already freed them); the side channel serves a group's range only when none of its blocks
is null (:func:`serve_ranges`), so a freed block is never read as if it held the KV.

vLLM reports load failures of several groups only per request (``failed_recving``: its
``_handle_invalid_blocks`` raises on block ids with more than one group), so a failed grouped
pull fails the whole request, which vLLM recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.kvgroups import NULL_BLOCK, KVGroup

MAX_GROUPS = 64  # KV cache groups a pull may name (a model has a few)


def plan(groups: Sequence[KVGroup], block_ids: Sequence[Sequence[int]], first: int,
         prompt_tokens: int) -> list[tuple[int, list[int]]]:
    """Per group, ``(start_block, local block ids)`` of the blocks a handoff of a prompt's first
    ``prompt_tokens`` tokens fills (the whole prompt for the P2P tier alone, all but its last
    token in a composite's plan), of which the ``first`` leading blocks came from the decode's
    own prefix cache. ValueError when a block to fill is missing or null."""
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block tables for {len(groups)} KV cache groups")
    total = -(-prompt_tokens // groups[0].block_size)
    out = []
    for g, ids in zip(groups, block_ids):
        # The decode recomputes the prompt's last token, whose window may reach one block further
        # back than first_kept(n): vLLM allocates that block when it counts n - 1 tokens loaded (a
        # composite's plan), a null block when it counts n (it then reads no KV there).
        start = min(total, max(first, g.first_kept(max(0, prompt_tokens - 1))))
        must = min(total, max(first, g.first_kept(prompt_tokens)))
        while start < must and ids[start] == NULL_BLOCK:
            start += 1
        blocks = [int(b) for b in ids[start:total]]
        if len(blocks) < total - start or NULL_BLOCK in blocks:
            raise ValueError(f"KV cache group {g.index}: decode blocks [{start}, {total}) are not all allocated "
                             f"(null or missing: {list(ids[start:total])[:8]})")
        out.append((start, blocks))
    return out


def held(block_ids: Sequence[Sequence[int]], prompt_tokens: int, block_size: int) -> list[list[int]]:
    """Each group's block ids of the prompt's blocks, as the prefill side holds them."""
    n = -(-prompt_tokens // block_size)
    return [[int(b) for b in ids[:n]] for ids in block_ids]


def serve_ranges(hold: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]]) -> list[int] | str:
    """The prefill's block ids for a pull of ``ranges`` (``(start, count)`` per group, in group
    order), flattened group after group; or why the pull cannot be served."""
    if len(ranges) != len(hold):
        return f"asked for {len(ranges)} KV cache groups but the prefill holds {len(hold)}"
    out: list[int] = []
    for gi, ((start, count), ids) in enumerate(zip(ranges, hold)):
        end = start + count
        if start < 0 or count < 0 or end > len(ids):
            return f"group {gi}: asked for blocks [{start}, {end}) but the prefill holds {len(ids)}"
        part = ids[start:end]
        if NULL_BLOCK in part:
            return (f"group {gi}: blocks [{start}, {end}) include blocks the prefill already freed (behind its "
                    f"sliding window)")
        out.extend(part)
    return out


def pair_groups(geometries: Sequence, local: Sequence[Sequence[int]], regions: Sequence,
                remote: Sequence[int]) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """(local addrs, remote addrs, lengths, each group's span of them) of a grouped pull: group
    ``i``'s ``local[i]`` block ids paired with its share of the prefill's ``remote`` ids (group
    after group), over that group's layers only (``geometries[i]``, a
    :class:`kvcore.geometry.KVGeometry`; the prefill's ``regions`` are every layer's). With the
    hybrid allocator the groups' layers share KV tensors and a block id is a page of one group's
    layers: pairing all layers would write a group's pages with another's. ValueError when the
    prefill's answer does not fit."""
    if len(remote) != sum(len(ids) for ids in local):
        raise ValueError(f"the prefill sent {len(remote)} block ids for {sum(len(i) for i in local)} asked")
    if NULL_BLOCK in remote:
        raise ValueError("the prefill sent the null block as a block holding KV")
    by_layer: dict[str, list] = {}
    for r in regions:
        by_layer.setdefault(r.layer, []).append(r)
    src, dst, lens, spans, at = [], [], [], [], 0
    for geo, ids in zip(geometries, local, strict=True):
        theirs = [r for name in dict.fromkeys(r.layer for r in geo.regions) for r in by_layer.get(name, ())]
        lo, rr, ln = geo.pair_ranges(ids, theirs, remote[at:at + len(ids)])
        spans.append((len(lens), len(lens) + len(ln)))
        src += lo
        dst += rr
        lens += ln
        at += len(ids)
    return src, dst, lens, spans


class SendPins:
    """Prefill side: the sliding-window blocks a handoff has yet to send, held past vLLM freeing
    them.

    A prefill request that generates more than its first token (a router that does not cap it
    at one, as ``mctier proxy`` does) keeps running after its prompt is computed, and vLLM frees
    its sliding groups' blocks behind the window as it goes (``remove_skipped_blocks``), also the
    ones the decode needs (from ``first_kept(prompt)`` on). At the first step that sees the
    prompt computed (:meth:`step`, from ``build_connector_meta``: before any later step frees
    them) those blocks get a reference of ours (``BlockPool.touch``, as the store tier's
    :class:`mcstore.groups.Pins`); :meth:`fill` puts them back in the finished request's block
    table where vLLM has null blocks by then; they are freed when the hold ends (:meth:`sent`) or
    at once when nothing is held (:meth:`finished`)."""

    def __init__(self, groups: Sequence[KVGroup]):
        self.groups = list(groups)
        self.sliding = [i for i, g in enumerate(self.groups) if g.window is not None]
        self._watch: dict[str, object] = {}  # req_id -> request whose prompt is not computed yet
        self._pinned: dict[str, tuple[dict[int, tuple[int, list[int]]], list]] = {}  # req_id -> (pins, blocks)
        self._held: dict[str, list] = {}  # req_id -> pinned blocks of a hold not yet sent

    def watch(self, request) -> None:
        if self.sliding:
            self._watch[request.request_id] = request

    def step(self, kv_cache_manager) -> None:
        """Pin the window blocks of each watched request whose prompt is computed."""
        if not self._watch or kv_cache_manager is None:
            return
        pool = kv_cache_manager.block_pool
        for rid, req in list(self._watch.items()):
            n = len(req.prompt_token_ids or ())
            if req.num_computed_tokens < n:
                continue
            del self._watch[rid]
            ids = kv_cache_manager.get_block_ids(rid)
            total = -(-n // self.groups[0].block_size)
            pins = {}
            for gi in self.sliding:
                lo = self.groups[gi].first_kept(n)
                part = [int(b) for b in ids[gi][lo:total]]
                if len(part) == total - lo and NULL_BLOCK not in part:  # else: already freed, not served
                    pins[gi] = (lo, part)
            blocks = [pool.blocks[b] for _, part in pins.values() for b in part]
            if blocks:
                pool.touch(blocks)
                self._pinned[rid] = (pins, blocks)

    def fill(self, req_id: str, per_group: list[list[int]]) -> list[list[int]]:
        """``per_group`` with the pinned blocks where vLLM's block table has null blocks now."""
        pins, _ = self._pinned.get(req_id, ({}, []))
        out = [list(ids) for ids in per_group]
        for gi, (lo, part) in pins.items():
            for i, b in enumerate(part):
                if lo + i < len(out[gi]) and out[gi][lo + i] == NULL_BLOCK:
                    out[gi][lo + i] = b
        return out

    def finished(self, req_id: str, held: bool, pool) -> None:
        """The request finished: its pins last until its hold is sent, or end now."""
        self._watch.pop(req_id, None)
        entry = self._pinned.pop(req_id, None)
        if entry is None:
            return
        if held:
            self._held[req_id] = entry[1]
        elif pool is not None:
            pool.free_blocks(reversed(entry[1]))

    def sent(self, req_id: str, pool) -> None:
        blocks = self._held.pop(req_id, None)
        if blocks and pool is not None:
            pool.free_blocks(reversed(blocks))

    def pending(self) -> int:
        """Requests with pinned blocks (for tests and debugging)."""
        return len(self._pinned) + len(self._held)
