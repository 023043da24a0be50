"""Where prompt KV lives, for a KV-aware router: a bounded LRU of block hashes per instance.

The router cannot recompute vLLM's block hashes (they depend on per-process state and
hash settings), so it names blocks by its OWN chain over full ``block_size``-token blocks
of token ids, :func:`chain`. An engine's block and the router's hash correspond when the
router's ``block_size`` is the engine's ``--block-size`` and the salt is the request's
``cache_salt`` (``None`` or ``""``: no salt, as in vLLM).

API a caller drives (``BlockIndex``; every method is thread-safe behind one lock, so KV
event subscriber threads may write while the router reads on its asyncio loop):

- ``set_capacity(instance, blocks)``: the instance's cache size in blocks; each instance
  is an LRU bounded by it (``default_capacity`` until set). Inserting past it evicts the
  least recently used hashes: that is how an approximate view ages, by each instance's
  own cache size.
- ``record(instance, hashes)``: approximate mode, the router sent these blocks there.
- ``stored`` / ``removed`` / ``cleared``: exact mode, fed from the engine's KV events
  (``multi.router.events.EventSubscriber``).
- ``match(instance, hashes) -> int``: how many LEADING hashes the instance holds (the
  prefix it can serve); the matched entries become most recently used.
- ``has``, ``drop``, ``instances``, ``blocks``, ``total_blocks``, ``capacity``.

Instances are plain names (the router uses the instance URL). The router keeps the
approximate and the exact view in two ``BlockIndex`` objects, and names the shared
Mooncake store view ``"store"`` (:data:`STORE`): it is just another instance, nothing is
special-cased.

Memory: at most the sum of the capacities in entries. One entry (a Python int of 64 bits
in an ``OrderedDict``) costs about 140 bytes on CPython 3.11 (measured), so 1M blocks ~ 0.14 GiB.
Nothing here fails on bad input except ``ValueError`` for a negative capacity or a
non-positive block size; unknown instances simply hold nothing.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Part of every hash: changing it changes every chain (the name predates the module's move).
_SEED_DOMAIN = b"mctier.kvindex.chain.v1\0"
STORE = "store"  # the name of the shared store's view (an instance like any other here)


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def seed(salt: str | None = None) -> int:
    """``h[-1]`` of :func:`chain`: the hash every chain starts from, per salt.

    ``""`` is the same as ``None``, as vLLM ignores an empty ``cache_salt``."""
    return _h(_SEED_DOMAIN + (salt or "").encode("utf-8"))


def block_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """``H(parent, tokens)``: one link of the chain (tokens as little-endian int64)."""
    arr = array("q", block_tokens)
    if sys.byteorder != "little":  # the same bytes on every machine
        arr.byteswap()
    return _h(parent.to_bytes(8, "little") + arr.tobytes())


def chain(tokens: Sequence[int], block_size: int, salt: str | None = None,
          *, parent: int | None = None) -> list[int]:
    """One 64-bit hash per FULL block of ``tokens``: ``h[i] = H(h[i-1], block i)``,
    ``h[-1] = seed(salt)`` (or ``parent``, to extend a chain). A partial last block has
    no hash. Deterministic across processes and machines (no ``hash()``)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = seed(salt) if parent is None else parent
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = block_hash(h, tokens[start:start + block_size])
        out.append(h)
    return out


class BlockIndex:
    """Per instance, an LRU (``OrderedDict``, oldest first) of router block hashes."""

    def __init__(self, block_size: int, default_capacity: int = 4096):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if default_capacity < 0:
            raise ValueError(f"default_capacity must be >= 0, got {default_capacity}")
        self.block_size = block_size
        self.default_capacity = default_capacity
        self._lock = threading.Lock()
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._cap: dict[str, int] = {}

    # -- capacity ---------------------------------------------------------------------
    def set_capacity(self, instance: str, blocks: int) -> None:
        """The instance's cache size in blocks; shrinking evicts the oldest at once."""
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        with self._lock:
            self._cap[instance] = blocks
            lru = self._lru.get(instance)
            if lru is not None:
                self._evict(lru, blocks)

    def capacity(self, instance: str) -> int:
        with self._lock:
            return self._cap.get(instance, self.default_capacity)

    @staticmethod
    def _evict(lru: OrderedDict[int, None], cap: int) -> None:
        while len(lru) > cap:
            lru.popitem(last=False)

    # -- writes -----------------------------------------------------------------------
    def _insert(self, instance: str, hashes: Iterable[int]) -> None:
        with self._lock:
            lru = self._lru.get(instance)
            if lru is None:
                lru = self._lru[instance] = OrderedDict()
            for h in hashes:  # in order: the last of a prompt ends most recent
                lru[h] = None
                lru.move_to_end(h)
            self._evict(lru, self._cap.get(instance, self.default_capacity))

    def record(self, instance: str, hashes: Iterable[int]) -> None:
        """Approximate mode: the router sent these blocks to ``instance`` (insert/touch)."""
        self._insert(instance, hashes)

    def stored(self, instance: str, hashes: Iterable[int]) -> None:
        """Exact mode: the engine reported these blocks cached (insert/touch, in order)."""
        self._insert(instance, hashes)

    def removed(self, instance: str, hashes: Iterable[int]) -> None:
        """Exact mode: the engine evicted these blocks; unknown hashes are ignored."""
        with self._lock:
            lru = self._lru.get(instance)
            if lru is not None:
                for h in hashes:
                    lru.pop(h, None)

    def cleared(self, instance: str) -> None:
        """Exact mode: the engine dropped its whole prefix cache (capacity is kept)."""
        with self._lock:
            lru = self._lru.get(instance)
            if lru is not None:
                lru.clear()

    def drop(self, instance: str) -> None:
        """Forget the instance: its entries and its capacity."""
        with self._lock:
            self._lru.pop(instance, None)
            self._cap.pop(instance, None)

    # -- reads ------------------------------------------------------------------------
    def match(self, instance: str, hashes: Sequence[int]) -> int:
        """Number of LEADING ``hashes`` the instance holds (stops at the first miss);
        the matched ones become most recently used, as the engine would touch them."""
        with self._lock:
            lru = self._lru.get(instance)
            if not lru:
                return 0
            n = 0
            for h in hashes:
                if h not in lru:
                    break
                lru.move_to_end(h)
                n += 1
            return n

    def has(self, instance: str, h: int) -> bool:
        """Whether the instance holds ``h``, without touching it."""
        with self._lock:
            lru = self._lru.get(instance)
            return lru is not None and h in lru

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._lru)

    def blocks(self, instance: str) -> int:
        with self._lock:
            lru = self._lru.get(instance)
            return len(lru) if lru is not None else 0

    def total_blocks(self) -> int:
        with self._lock:
            return sum(len(lru) for lru in self._lru.values())
