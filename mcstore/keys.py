"""Store keys: a SHA-256 hash chain over ``chunk_tokens``-token chunks.

``seed = H(fingerprint, isolation keys)``; ``link[i] = H(link[i-1], tokens of chunk i)``.
The fingerprint digests everything that makes stored bytes (in)compatible:
model identity, dtype, KV layout, block size, layer count, KV heads, head size,
TP size and chunk size. Isolation keys (cache_salt, LoRA name, multimodal
hashes) go into the seed, so two requests that differ in any of them never share
an object. Only ``hashlib``: deterministic across processes and hosts.

One object per (chunk, TP rank): ``{prefix}/{fp16}/{link hex}/tp{rank}``.

Published metadata, for the operator tools (``mcstore.tools``): every engine's
connector writes its key space to ``{prefix}/{fp16}/meta`` (:class:`EngineMeta`)
when it starts, and the store server writes the master's admin address to
:data:`MASTER_INFO_KEY` (:class:`MasterInfo`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

KEY_VERSION = "mctier-store-v1"


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


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)  # int64, digested little-endian whatever the host
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


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
    """Key naming for one engine configuration."""

    def __init__(self, fp: str, chunk_tokens: int, tp_size: int = 1, prefix: str = "mct"):
        self.fp = fp
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        self.prefix = f"{prefix}/{fp[:16]}"

    def links(self, tokens: Sequence[int], cache_salt=None, lora=None, mm_hashes=()) -> list[str]:
        s = seed(self.fp, cache_salt, lora, tuple(mm_hashes))
        return [f"{self.prefix}/{link.hex()}" for link in chain(s, tokens, self.chunk_tokens)]

    def key(self, link: str, rank: int) -> str:
        return f"{link}/tp{rank}"

    def all_rank_keys(self, links: Sequence[str]) -> list[str]:
        """Chunk-major: chunk i's keys are ``[i*tp_size, (i+1)*tp_size)``."""
        return [self.key(link, r) for link in links for r in range(self.tp_size)]


# -- published metadata ---------------------------------------------------------------

META_SUFFIX = "meta"
MASTER_INFO_KEY = "mctier/master"


class EngineMeta(msgspec.Struct, kw_only=True):
    """One engine configuration's key space; published under ``{prefix}/{fp16}/meta``."""

    fingerprint: str
    chunk_tokens: int
    tp_size: int
    key_prefix: str = "mct"
    model: str | None = None  # model_id if configured, else the engine's --model
    fields: dict[str, Any] = msgspec.field(default_factory=dict)  # kvcore.vllm_glue.kv_fingerprint_fields

    def key_space(self) -> KeySpace:
        return KeySpace(self.fingerprint, self.chunk_tokens, self.tp_size, self.key_prefix)


def engine_meta(ks: KeySpace, key_prefix: str, model: str | None, fields: dict[str, Any]) -> EngineMeta:
    return EngineMeta(fingerprint=ks.fp, chunk_tokens=ks.chunk_tokens, tp_size=ks.tp_size, key_prefix=key_prefix,
                      model=model, fields=fields)


def meta_key(ks: KeySpace) -> str:
    return f"{ks.prefix}/{META_SUFFIX}"


class MasterInfo(msgspec.Struct, kw_only=True):
    """What tools cannot learn from the master's RPC port; published under :data:`MASTER_INFO_KEY`."""

    admin: str  # the master's HTTP admin/metrics base URL
