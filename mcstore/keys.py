"""Store keys: one link per ``chunk_tokens``-token chunk, a SHA-256 hash of everything before it.

Every link comes from a chain of **block hashes**, one per ``block_tokens``-token block (the
engine's block size), each a hash of everything up to the end of its block: chunk ``i``'s link
is ``H(fingerprint, hash of its last block)``. Two ways to get the block hashes, fixed per key
space (the choice is in the fingerprint):

- **vLLM's block hashes** (key spaces with :class:`VllmBlockHashes`: engines whose
  ``--prefix-caching-hash-algo`` is ``sha256``, vLLM's default). vLLM already hashes every
  request's full blocks, chained, on its input thread (``Request.block_hashes``: pickle plus
  SHA-256, from a seed that is ``PYTHONHASHSEED`` or vLLM's fixed default, the cache salt,
  LoRA name and path, multimodal and prompt-embedding hashes folded in): 128 short hashes for
  a 32K-token prompt instead of digesting 32K token ids in the scheduler's lookup, about 5
  times faster (docs/benchmarks/store-hit.md). Tools without an engine
  recompute vLLM's hashes with :func:`vllm_sha256_block_hashes`, the same bytes (a test holds
  it to vLLM's own hasher).
- **Our own chain** otherwise (other hash algorithms: ``xxhash`` is not collision resistant and
  ``sha256_cbor`` is not reproduced here), and in engine-less tests and benchmarks:

``seed = H(fingerprint, isolation keys)``; ``block[i] = H(block[i-1], tokens of block i)``
(:func:`chain`), the tokens digested as their MessagePack array (msgspec's encoding: each int in
its shortest form, the same bytes on every host; a decoder recovers the list, so two different
blocks never digest the same bytes). It replaced int64 little-endian in key version 2: fewer
bytes to digest, a faster chain (docs/benchmarks/store-hit.md).

Besides whole chunks, two kinds of keys let a reader use stored blocks past the last whole
chunk it shares with a writer (key version 4; :mod:`mcstore.lookup` reads them):

- a **part object** holds the leading ``n < chunk_blocks`` blocks of a chunk: the full blocks
  of a saved prompt past its last whole chunk, ``{link of its last block}-b{n}``
  (:meth:`KeySpace.part_link`), one per TP rank and stage as for a chunk;
- a **directory** entry per saved chunk or part, keyed by the hash of its *first* block
  (:meth:`KeySpace.dir_key`; that hash covers everything before the chunk too), lists the
  object's block hashes (:class:`Directory`). A reader whose chunk ``k`` is missing asks for
  the directory of its own chunk ``k``'s first block and loads as many leading blocks of the
  named object as match its own hashes. One entry per first block: the last writer wins.
The fingerprint digests everything that makes stored bytes (in)compatible:
model identity, dtype, KV layout, block size, layer count, KV heads, head size,
sliding window (when vLLM keeps such layers as full attention), TP size, PP size and
split, and chunk size (``kvcore.vllm_glue.kv_fingerprint_fields``). Isolation keys
(cache_salt, LoRA name, multimodal hashes) go into the seed, so two requests that
differ in any of them never share an object. Only ``hashlib``: deterministic across
processes and hosts.

One object per rank part of a chunk, a rank part being what one worker holds: with one pipeline
stage ``{prefix}/{fp16}/{link hex}/tp{rank}`` (TP rank ``rank``; these keys never change),
with ``pp_size > 1`` ``{prefix}/{fp16}/{link hex}/pp{stage}tp{rank}``. With KV cache groups
(vLLM's hybrid allocator on: any layout but one full-attention group, :mod:`mcstore.groups`)
one object per group too, ``g{group}`` before the stage and rank (``.../g1tp0``). A stage's object
holds its own layers only, ``fields["pp_layers"][stage]`` of the fingerprint (vLLM's split
of the model's decoder layers), so stages never share an object. A chunk is present only
when all ``tp_size * pp_size`` parts are, and the fingerprint holds ``tp_size``,
``pp_size`` and the split: an engine of another layout has other keys altogether and
never reads this layout's objects.

Published metadata, for the operator tools (``mcstore.tools``): every engine's
connector writes its key space to ``{prefix}/{fp16}/meta`` (:class:`EngineMeta`)
when it starts, and the store server writes the master's admin address to
:data:`MASTER_INFO_KEY` (:class:`MasterInfo`).
"""

from __future__ import annotations

import hashlib
import json
import operator
import pickle
from collections.abc import Sequence
from typing import Any

import msgspec

# v2: tokens digested as MessagePack, not int64. v3: links from vLLM's block hashes where vLLM
# hashes with sha256. v4: every link from a chain of block hashes (our own chain per block, not
# per chunk), part objects and directories. An engine of another version has other keys
# altogether (the version is in the fingerprint), so it sees misses, never the other's bytes.
KEY_VERSION = "mctier-store-v4"


class VllmBlockHashes(msgspec.Struct, frozen=True, kw_only=True):
    """How the engine's vLLM hashes request blocks (``kvcore.vllm_glue.block_hash_scheme``)."""

    algo: str  # "sha256": vLLM's pickle + SHA-256, the only one reproduced here
    seed: str  # what vLLM's NONE_HASH is the hash of: PYTHONHASHSEED, else vLLM's default
    block_size: int  # tokens per block hash (vLLM's hash block size)


_PICKLE = pickle.HIGHEST_PROTOCOL  # as vllm.utils.hashing.sha256


def _vllm_sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE)).digest()


def vllm_sha256_block_hashes(tokens: Sequence[int], scheme: VllmBlockHashes,
                             cache_salt: str | None = None) -> list[bytes]:
    """What vLLM's ``request_block_hasher`` gives a text prompt without LoRA: one hash per full
    block, ``h[i] = sha256(pickle((h[i-1], block tokens, extra keys)))``, ``h[-1]`` the hash of
    the seed; the first block's extra keys are ``(("cache_salt", salt),)`` when salted."""
    if scheme.algo != "sha256":
        raise ValueError(f"vLLM block hashes with {scheme.algo!r} are not reproduced here (only sha256)")
    bs, parent, out = scheme.block_size, _vllm_sha256(scheme.seed), []
    for start in range(0, len(tokens) - bs + 1, bs):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = _vllm_sha256((parent, tuple(map(operator.index, tokens[start:start + bs])), extra))
        out.append(parent)
    return out


def fingerprint(fields: dict[str, Any]) -> str:
    """Hex SHA-256 of a canonical JSON of the compatibility fields."""
    blob = json.dumps({"v": KEY_VERSION, **fields}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def seed(fp: str, cache_salt: str | None = None, lora: str | None = None,
         mm_hashes: Sequence[str] = ()) -> bytes:
    h = hashlib.sha256()
    # Length-prefixed fields: no two different (salt, lora, mm) tuples share an encoding.
    for part in (fp, cache_salt, lora, *mm_hashes):
        b = b"\x00" if part is None else b"\x01" + str(part).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    h.update(len(mm_hashes).to_bytes(8, "little"))
    return h.digest()


_encode = msgspec.msgpack.Encoder().encode


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return _encode(tokens)
    except TypeError:  # int-likes (numpy integers): as the ints they stand for
        return _encode([operator.index(t) for t in tokens])


def chain(start: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Our own chain: the hash of every *full* ``block_tokens``-token block of ``tokens``."""
    links, prev = [], start
    for i in range(len(tokens) // block_tokens):
        h = hashlib.sha256(prev)
        h.update(_token_bytes(tokens[i * block_tokens : (i + 1) * block_tokens]))
        prev = h.digest()
        links.append(prev)
    return links


HASH_BYTES = 32  # a block hash: SHA-256, ours and vLLM's


class Directory(msgspec.Struct, array_like=True, frozen=True):
    """What a directory entry holds (MessagePack): the block hashes of one stored object, its
    first block's first, and ``check``, the first 16 bytes of SHA-256 over them, so that a read
    mixing two writers' entries is refused rather than matched."""

    hashes: list[bytes]
    check: bytes

    @classmethod
    def of(cls, hashes: Sequence[bytes]) -> Directory:
        hs = [bytes(h) for h in hashes]
        return cls(hs, hashlib.sha256(b"".join(hs)).digest()[:16])

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: bytes, max_blocks: int) -> Directory | None:
        """The entry in ``raw``, None unless it is well formed: 1 to ``max_blocks`` hashes of
        :data:`HASH_BYTES` bytes each and a matching check."""
        if not raw or len(raw) > 64 + max_blocks * (HASH_BYTES + 4):
            return None
        try:
            d = msgspec.msgpack.decode(raw, type=cls)
        except msgspec.DecodeError:
            return None
        if not 1 <= len(d.hashes) <= max_blocks or any(len(h) != HASH_BYTES for h in d.hashes):
            return None
        return d if hashlib.sha256(b"".join(d.hashes)).digest()[:16] == d.check else None


class KeySpace:
    """Key naming for one engine configuration; ``pp_rank`` is the stage whose objects
    :meth:`key` names (a worker's own; the scheduler looks up every stage's).
    ``block_tokens``: tokens per block hash of our own chain (the engine's block size; default
    the chunk, which leaves no block finer than a chunk); vLLM's hash block size with
    ``block_hashes``."""

    def __init__(self, fp: str, chunk_tokens: int, tp_size: int = 1, prefix: str = "mct", *,
                 pp_size: int = 1, pp_rank: int = 0, block_hashes: VllmBlockHashes | None = None,
                 block_tokens: int | None = None, groups: int = 0):
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pipeline stage {pp_rank} outside pp_size {pp_size}")
        if block_hashes is not None:
            block_tokens = block_hashes.block_size
        block_tokens = block_tokens or chunk_tokens
        if block_tokens <= 0 or chunk_tokens % block_tokens:
            raise ValueError(f"chunk of {chunk_tokens} tokens is not a whole number of "
                             f"{block_tokens}-token {'vLLM ' if block_hashes else ''}hash blocks")
        self.block_hashes = block_hashes
        self.block_tokens = block_tokens
        self.chunk_blocks = chunk_tokens // block_tokens  # block hashes per chunk
        self._fp_bytes = fp.encode()
        self.fp = fp
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.pp_rank = pp_rank
        # KV cache groups whose objects a chunk has, named in the keys (kvcore.kvgroups.named);
        # 0: one full-attention group, keys without a group.
        self.groups = groups
        self.prefix = f"{prefix}/{fp[:16]}"
        self._key_prefix = prefix
        self._suffixes: list[str] | None = None  # all_rank_keys' part suffixes, chunk-major

    @property
    def parts(self) -> int:
        """Objects per chunk: one per (group, stage, TP rank)."""
        return self.tp_size * self.pp_size * max(1, self.groups)

    def stage(self, pp_rank: int) -> KeySpace:
        """The same key space naming stage ``pp_rank``'s objects."""
        return KeySpace(self.fp, self.chunk_tokens, self.tp_size, self._key_prefix, pp_size=self.pp_size,
                        pp_rank=pp_rank, block_hashes=self.block_hashes, block_tokens=self.block_tokens,
                        groups=self.groups)

    def hashes(self, tokens: Sequence[int], cache_salt=None, lora=None, mm_hashes=()) -> list[bytes]:
        """The block hashes of a prompt's full blocks, from its token ids (the tools' way; the
        scheduler of a key space with vLLM block hashes takes the request's own)."""
        if self.block_hashes is None:
            return chain(seed(self.fp, cache_salt, lora, tuple(mm_hashes)), tokens, self.block_tokens)
        if lora or mm_hashes:
            # vLLM's hashes fold in the adapter's path and the multimodal inputs themselves.
            raise ValueError("this key space's links come from vLLM's block hashes: those of a LoRA or "
                             "multimodal request are only known to the engine")
        return vllm_sha256_block_hashes(tokens, self.block_hashes, cache_salt)

    def links(self, tokens: Sequence[int], cache_salt=None, lora=None, mm_hashes=()) -> list[str]:
        """Links of every full chunk of a prompt, from its token ids."""
        return self.links_from_block_hashes(self.hashes(tokens, cache_salt, lora, mm_hashes), len(tokens))

    def links_from_block_hashes(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[str]:
        """Links of the full chunks of the first ``num_tokens`` tokens from the block hashes of
        them (vLLM's ``Request.block_hashes``, or :meth:`hashes`): chunk ``i``'s is
        ``H(fingerprint, hash of its last block)``."""
        per = self.chunk_blocks
        n = min(num_tokens // self.chunk_tokens, len(block_hashes) // per)
        fp, sha, head = self._fp_bytes, hashlib.sha256, self.prefix + "/"
        # A slice and string concatenation instead of an index and an f-string per chunk: about
        # 10% less on the scheduler's lookup path, where the sha256 calls are most of the time
        # (docs/benchmarks/store-hit.md).
        return [head + sha(fp + h).hexdigest() for h in block_hashes[per - 1 : n * per : per]]

    def part_link(self, last_hash: bytes, blocks: int) -> str:
        """The link of a part object: the leading ``blocks`` (fewer than a chunk's) blocks of a
        chunk, the last of them hashed ``last_hash``."""
        if not 0 < blocks < self.chunk_blocks:
            raise ValueError(f"a part object holds 1 to {self.chunk_blocks - 1} blocks, not {blocks}")
        return f"{self.prefix}/{hashlib.sha256(self._fp_bytes + last_hash).hexdigest()}-b{blocks}"

    def object_link(self, hashes: Sequence[bytes]) -> str:
        """The link of the object holding the blocks hashed ``hashes`` (a chunk's leading blocks:
        all of them, a whole chunk, or fewer, a part object)."""
        if len(hashes) == self.chunk_blocks:
            return f"{self.prefix}/{hashlib.sha256(self._fp_bytes + hashes[-1]).hexdigest()}"
        return self.part_link(hashes[-1], len(hashes))

    def dir_key(self, first_hash: bytes) -> str:
        """The directory entry of the chunk whose first block is hashed ``first_hash``."""
        return f"{self.prefix}/d/{hashlib.sha256(self._fp_bytes + b'dir' + first_hash).hexdigest()}"

    def key(self, link: str, rank: int, stage: int | None = None, group: int = 0) -> str:
        """The object of TP rank ``rank`` of stage ``stage`` (default: this key space's stage) of
        KV cache group ``group`` (named only in a key space with ``groups``)."""
        g = f"g{group}" if self.groups else ""
        if self.pp_size == 1:
            return f"{link}/{g}tp{rank}"
        return f"{link}/{g}pp{self.pp_rank if stage is None else stage}tp{rank}"

    def part_of(self, rank: int, stage: int | None = None, group: int = 0) -> int:
        """The part number of that object among a chunk's :attr:`parts`."""
        return (group * self.pp_size + (self.pp_rank if stage is None else stage)) * self.tp_size + rank

    def all_rank_keys(self, links: Sequence[str]) -> list[str]:
        """Chunk-major: chunk i's keys (every group's, stage's and TP rank's) are ``[i*parts, (i+1)*parts)``."""
        # The parts' suffixes, computed once: a lookup asks this per request on the scheduler's
        # path, where a call of :meth:`key` per part cost ~2 us each.
        sfx = self._suffixes
        if sfx is None:
            sfx = self._suffixes = [self.key("", r, s, g) for g in range(max(1, self.groups))
                                    for s in range(self.pp_size) for r in range(self.tp_size)]
        if len(sfx) == 1:
            one = sfx[0]
            return [link + one for link in links]
        return [link + x for link in links for x in sfx]


# -- published metadata ---------------------------------------------------------------

META_SUFFIX = "meta"
MASTER_INFO_KEY = "mctier/master"


def foreign_version(key_version: str | None) -> bool:
    """Another key version than this mctier's (None: not published, unknown): this mctier
    computes other keys for the same prompt, so it would neither find that engine's objects
    nor write ones it reads."""
    return key_version is not None and key_version != KEY_VERSION


class EngineMeta(msgspec.Struct, kw_only=True):
    """One engine configuration's key space; published under ``{prefix}/{fp16}/meta``."""

    fingerprint: str
    chunk_tokens: int
    tp_size: int
    pp_size: int = 1  # absent in what engines before pipeline-parallel keys published
    key_prefix: str = "mct"
    model: str | None = None  # model_id if configured, else the engine's --model
    fields: dict[str, Any] = msgspec.field(default_factory=dict)  # kvcore.vllm_glue.kv_fingerprint_fields
    # KEY_VERSION of the mctier that published it. None in what engines published before the
    # field existed (key versions 1 and 2): tools cannot tell those apart.
    key_version: str | None = None
    block_hashes: VllmBlockHashes | None = None  # links from vLLM's block hashes (key version 3)
    block_tokens: int | None = None  # tokens per block hash of our own chain (key version 4)
    partial_hits: bool = True  # the engine saves part objects and directory entries (StoreConfig.partial_hits)
    groups: int = 0  # KV cache groups named in the keys (KeySpace.groups; 0 before groups were served)

    def foreign(self) -> bool:
        return foreign_version(self.key_version)

    def key_space(self) -> KeySpace:
        return KeySpace(self.fingerprint, self.chunk_tokens, self.tp_size, self.key_prefix, pp_size=self.pp_size,
                        block_hashes=self.block_hashes, block_tokens=self.block_tokens, groups=self.groups)


def engine_meta(ks: KeySpace, key_prefix: str, model: str | None, fields: dict[str, Any],
                partial_hits: bool = True) -> EngineMeta:
    return EngineMeta(fingerprint=ks.fp, chunk_tokens=ks.chunk_tokens, tp_size=ks.tp_size, pp_size=ks.pp_size,
                      key_prefix=key_prefix, model=model, fields=fields, key_version=KEY_VERSION,
                      block_hashes=ks.block_hashes, block_tokens=ks.block_tokens, partial_hits=partial_hits,
                      groups=ks.groups)


def meta_key(ks: KeySpace) -> str:
    return f"{ks.prefix}/{META_SUFFIX}"


class MasterInfo(msgspec.Struct, kw_only=True):
    """What tools cannot learn from the master's RPC port; published under :data:`MASTER_INFO_KEY`."""

    admin: str  # the master's HTTP admin/metrics base URL
