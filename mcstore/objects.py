"""A stored object (one chunk of one TP rank) as bytes, and what reading one can say.

The object is the chunk's pages in canonical order (:mod:`mcstore.worker`), with
``verify_checksums`` followed by a 12-byte trailer: the xxh3-64 digest of the object's key
and then its pages, and :data:`MAGIC`. A load whose key and pages do not match the trailer
is a load error: corrupted bytes, and also a whole valid object stored under another key
(a copy, or bytes a buggy writer placed under the wrong key), are never used as KV.

xxh3 is not a MAC: a writer that reaches the master and a segment can still store bytes with a
valid trailer under any key (docs/deploy.md, "Trust model").
"""

from __future__ import annotations

import ctypes
import struct

import xxhash

from kvcore.errors import cause_of, is_invalid_params

TRAILER = struct.Struct("<QI")  # xxh3-64 of the pages, magic
MAGIC = 0x4D435433  # "MCT3": the digest covers the key (MCT2 did not)


def digest(addrs: list[int], sizes: list[int], key: str) -> int:
    """xxh3-64 of ``key`` (UTF-8, length-prefixed) and then the memory ranges ``(addrs[i],
    sizes[i])``, in order."""
    # xxh3 runs near memory bandwidth; CRC32 (zlib) halved save/load throughput.
    h = xxhash.xxh3_64()
    k = key.encode()
    h.update(len(k).to_bytes(4, "little") + k)
    for addr, size in zip(addrs, sizes):
        h.update((ctypes.c_char * size).from_address(addr))
    return h.intdigest()


def pack_trailer(addrs: list[int], sizes: list[int], key: str) -> bytes:
    """The trailer of object ``key`` whose pages are in the memory ranges ``(addrs[i], sizes[i])``."""
    return TRAILER.pack(digest(addrs, sizes, key), MAGIC)


def trailer(data: bytes, key: str) -> bytes:
    """The trailer a worker appends to object ``key``'s pages ``data`` (for tools and tests
    writing our format)."""
    k = key.encode()
    return TRAILER.pack(xxhash.xxh3_64_intdigest(len(k).to_bytes(4, "little") + k + data), MAGIC)


def trailer_ok(trailer_addr: int, addrs: list[int], sizes: list[int], key: str) -> bool:
    """True when the trailer at ``trailer_addr`` matches object ``key`` and its pages in those
    memory ranges."""
    found, magic = TRAILER.unpack(ctypes.string_at(trailer_addr, TRAILER.size))
    return magic == MAGIC and found == digest(addrs, sizes, key)


def read_cause(rc: int, expected: int) -> str:
    """Why a read of an object of ``expected`` bytes that returned ``rc`` failed ("ok" if it did not)."""
    if rc >= 0:
        return "size_mismatch" if rc != expected else "ok"
    if is_invalid_params(rc):
        return "size_mismatch"  # Mooncake: "buffer too small" for an object of another size
    return cause_of(rc)
