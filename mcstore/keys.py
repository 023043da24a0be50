"""Store keys: a SHA-256 hash chain over ``chunk_tokens``-token chunks.

``seed = H(fingerprint, isolation keys)``; ``link[i] = H(link[i-1], tokens of chunk i)``, the
tokens digested as their MessagePack array (msgspec's encoding: each int in its shortest form,
the same bytes on every host; a decoder recovers the list, so two different chunks never digest
the same bytes). It replaced int64 little-endian in key version 2: the chain of a fresh
32K-token prompt took 0.82 ms at the median against 1.34 (1,000 prompts, interleaved, 2026-12-02).
The fingerprint digests everything that makes stored bytes (in)compatible:
model identity, dtype, KV layout, block size, layer count, KV heads, head size,
sliding window (when vLLM keeps such layers as full attention), TP size, PP size and
split, and chunk size (``kvcore.vllm_glue.kv_fingerprint_fields``). Isolation keys
(cache_salt, LoRA name, multimodal hashes) go into the seed, so two requests that
differ in any of them never share an object. Only ``hashlib``: deterministic across
processes and hosts.

One object per part of a chunk, a part being what one worker holds: with one pipeline
stage ``{prefix}/{fp16}/{link hex}/tp{rank}`` (TP rank ``rank``; these keys never change),
with ``pp_size > 1`` ``{prefix}/{fp16}/{link hex}/pp{stage}tp{rank}``. A stage's object
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
from collections.abc import Sequence
from typing import Any

import msgspec

# v2: tokens digested as MessagePack, not int64. An engine of another version has other keys
# altogether (the version is in the fingerprint), so it sees misses, never the other's bytes.
KEY_VERSION = "mctier-store-v2"


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


def chain(start: bytes, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """Links of every *full* chunk of ``tokens``."""
    links, prev = [], start
    for i in range(len(tokens) // chunk_tokens):
        h = hashlib.sha256(prev)
        h.update(_token_bytes(tokens[i * chunk_tokens : (i + 1) * chunk_tokens]))
        prev = h.digest()
        links.append(prev)
    return links


class KeySpace:
    """Key naming for one engine configuration; ``pp_rank`` is the stage whose objects
    :meth:`key` names (a worker's own; the scheduler looks up every stage's)."""

    def __init__(self, fp: str, chunk_tokens: int, tp_size: int = 1, prefix: str = "mct", *,
                 pp_size: int = 1, pp_rank: int = 0):
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pipeline stage {pp_rank} outside pp_size {pp_size}")
        self.fp = fp
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.pp_rank = pp_rank
        self.prefix = f"{prefix}/{fp[:16]}"
        self._key_prefix = prefix

    @property
    def parts(self) -> int:
        """Objects per chunk: one per (stage, TP rank)."""
        return self.tp_size * self.pp_size

    def stage(self, pp_rank: int) -> KeySpace:
        """The same key space naming stage ``pp_rank``'s objects."""
        return KeySpace(self.fp, self.chunk_tokens, self.tp_size, self._key_prefix, pp_size=self.pp_size,
                        pp_rank=pp_rank)

    def links(self, tokens: Sequence[int], cache_salt=None, lora=None, mm_hashes=()) -> list[str]:
        s = seed(self.fp, cache_salt, lora, tuple(mm_hashes))
        return [f"{self.prefix}/{link.hex()}" for link in chain(s, tokens, self.chunk_tokens)]

    def key(self, link: str, rank: int, stage: int | None = None) -> str:
        """The object of TP rank ``rank`` of stage ``stage`` (default: this key space's stage)."""
        if self.pp_size == 1:
            return f"{link}/tp{rank}"
        return f"{link}/pp{self.pp_rank if stage is None else stage}tp{rank}"

    def all_rank_keys(self, links: Sequence[str]) -> list[str]:
        """Chunk-major: chunk i's keys (every stage's, every TP rank's) are ``[i*parts, (i+1)*parts)``."""
        return [self.key(link, r, s) for link in links for s in range(self.pp_size) for r in range(self.tp_size)]


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
    # field (2026-12-02), key versions 1 and 2: tools cannot tell those apart.
    key_version: str | None = None

    def foreign(self) -> bool:
        return foreign_version(self.key_version)

    def key_space(self) -> KeySpace:
        return KeySpace(self.fingerprint, self.chunk_tokens, self.tp_size, self.key_prefix, pp_size=self.pp_size)


def engine_meta(ks: KeySpace, key_prefix: str, model: str | None, fields: dict[str, Any]) -> EngineMeta:
    return EngineMeta(fingerprint=ks.fp, chunk_tokens=ks.chunk_tokens, tp_size=ks.tp_size, pp_size=ks.pp_size,
                      key_prefix=key_prefix, model=model, fields=fields, key_version=KEY_VERSION)


def meta_key(ks: KeySpace) -> str:
    return f"{ks.prefix}/{META_SUFFIX}"


class MasterInfo(msgspec.Struct, kw_only=True):
    """What tools cannot learn from the master's RPC port; published under :data:`MASTER_INFO_KEY`."""

    admin: str  # the master's HTTP admin/metrics base URL
