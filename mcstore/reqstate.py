"""The store tier scheduler's state of one request (:class:`ReqState`) and its queued lookup
(:class:`Ask`), apart from :mod:`mcstore.scheduler`.

A request's block hashes and links are made when first needed, not when vLLM adds it: its lookup
makes them on the lookup thread (:mod:`mcstore.batchlookup`) and the state adopts them with the
answer, so that queueing a lookup costs the scheduler's step O(1) (issue 47: 64 arrivals spent
1.6 to 3 ms of the step on hashing and keys, docs/benchmarks/no-reuse.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.log import get_logger
from kvcore.vllm_glue import request_cache_salt, request_lora_name, request_mm_hashes
from mcstore.batchlookup import Lookup
from mcstore.keys import KeySpace
from mcstore.lookup import Partial, Probe, finish_many

logger = get_logger("mcstore.reqstate")


_warned = False


def hashed_blocks(ks: KeySpace, request) -> int:
    """How many of the request's full prompt blocks have a block hash to key them by."""
    global _warned
    if ks.block_hashes is None:  # our own chain of its tokens
        return len(request.prompt_token_ids or ()) // ks.block_tokens
    # vLLM hashed the request's blocks on its input thread already; a request whose hashes
    # do not cover its tokens at the key space's hash block size gets no link (a miss,
    # computed and not saved) rather than a link of other tokens.
    hashes = getattr(request, "block_hashes", None) or []
    if len(hashes) != request.num_tokens // ks.block_hashes.block_size:
        if not _warned:
            _warned = True
            logger.warning("mcstore: request %s has %d block hashes for %d tokens at %d tokens a block: "
                           "not looked up or saved (warned once)", request.request_id, len(hashes),
                           request.num_tokens, ks.block_hashes.block_size)
        return 0
    return min(len(hashes), request.num_prompt_tokens // ks.block_tokens)


def block_hashes(ks: KeySpace, request, nblocks: int) -> list[bytes]:
    """The hashes of the request's first ``nblocks`` full prompt blocks (:func:`hashed_blocks`
    counted them): vLLM's, or our own chain of its tokens. Reads the request only: the lookup
    thread calls it too."""
    if not nblocks:
        return []
    if ks.block_hashes is None:
        return ks.hashes(request.prompt_token_ids or [], cache_salt=request_cache_salt(request),
                         lora=request_lora_name(request), mm_hashes=request_mm_hashes(request))
    return list(request.block_hashes[:nblocks])


class Ask:
    """A request's queued lookup: O(1) on the scheduler's thread; its block hashes, links and keys
    (the SHA-256 work: 25 to 45 us a request) are made on the lookup thread (:meth:`keys`), and
    the answer of its batch is ``(Reach, probe)``, the probe's hashes and links adopted by the
    request's state (:meth:`ReqState.adopt`)."""

    __slots__ = ("ks", "request", "nblocks", "partial", "probe")

    def __init__(self, ks: KeySpace, request, nblocks: int, partial: bool):
        self.ks, self.request, self.nblocks, self.partial = ks, request, nblocks, partial
        self.probe: Probe | None = None

    def keys(self) -> list[str]:
        n = self.request.num_prompt_tokens
        self.probe = Probe(self.ks, block_hashes(self.ks, self.request, self.nblocks), n, self.partial)
        return self.probe.first_keys()


def answer_batch(client):
    """The scheduler's ``answer_many``: a batch's lookups with one directory read for all
    (:func:`mcstore.lookup.finish_many`); each result ``(Reach, probe)``."""
    def answer(items, pause):
        reaches = finish_many(client, [(a.probe, rcs, a.request.num_prompt_tokens - 1) for a, rcs in items], pause)
        return [(r, a.probe) for r, (a, _) in zip(reaches, items)]
    return answer


@dataclass
class ReqState:
    request: Any
    ks: KeySpace
    nblocks: int  # full prompt blocks with a hash (at the key space's block_tokens); 0: none usable
    _hashes: list[bytes] | None = None  # made when first needed (or adopted from its lookup)
    _links: list[str] | None = None
    hit: int | None = None  # lookup result in tokens (None: not looked up yet)
    present: int = 0  # leading chunks found in the store at lookup
    partial: Partial | None = None  # the object supplying blocks past them, found at lookup
    local: int = 0  # tokens computed locally when the connector was asked
    save_next: int = 0  # next chunk to consider for saving
    tail_saved: bool = False  # the blocks past the last whole chunk went to the worker (or need not)
    saves: int = 0  # save jobs sent to the worker
    load_tried: bool = False  # one load per request: a failed one is recomputed, not retried
    sync: bool = False  # its load ends inside the step that schedules it (sync_load_max)
    pending: Lookup | None = None  # its lookup, queued or on the lookup thread (not answered yet)
    steered: bool = False  # it came with kv_transfer_params: a P/D handoff's, a kv_source (lookupgate)

    def __post_init__(self):
        self.steered = bool(getattr(self.request, "kv_transfer_params", None))

    @property
    def hashes(self) -> list[bytes]:
        """Block hashes of the prompt's full blocks (the key space's block_tokens)."""
        if self._hashes is None:
            self._hashes = block_hashes(self.ks, self.request, self.nblocks)
        return self._hashes

    @property
    def links(self) -> list[str]:
        """Links of its full chunks."""
        if self._links is None:
            self._links = self.ks.links_from_block_hashes(self.hashes, self.request.num_prompt_tokens)
        return self._links

    def lookable(self, partial: bool) -> bool:
        """Whether it has a full chunk (or with ``partial`` a full block) to look up, without hashing."""
        n = self.nblocks if partial else min(self.nblocks // self.ks.chunk_blocks,
                                             self.request.num_prompt_tokens // self.ks.chunk_tokens)
        return n > 0

    def adopt(self, probe: Probe) -> None:
        """Its hashes and links as its lookup made them (the same; not made twice)."""
        if self._hashes is None:
            self._hashes = probe.hashes
        if self._links is None:
            self._links = probe.links
