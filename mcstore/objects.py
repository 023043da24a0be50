"""A stored object (one chunk of one TP rank) as bytes, and what reading one can say.

The object is the chunk's pages in canonical order (:mod:`mcstore.worker`), with
``verify_checksums`` (opt-in) followed by a 12-byte trailer: the xxh3-64 digest of
those pages, then :data:`MAGIC`. A load whose pages do not match the trailer is a
load error.
"""

from __future__ import annotations

import ctypes
import struct

import xxhash

from kvcore.errors import cause_of, is_invalid_params

TRAILER = struct.Struct("<QI")  # xxh3-64 of the pages, magic
MAGIC = 0x4D435432  # "MCT2"


def digest(addrs: list[int], sizes: list[int]) -> int:
    """xxh3-64 of the memory ranges ``(addrs[i], sizes[i])``, in order."""
    # xxh3 runs near memory bandwidth; CRC32 (zlib) halved save/load throughput.
    h = xxhash.xxh3_64()
    for addr, size in zip(addrs, sizes):
        h.update((ctypes.c_char * size).from_address(addr))
    return h.intdigest()


def pack_trailer(addrs: list[int], sizes: list[int]) -> bytes:
    """The trailer of the pages in the memory ranges ``(addrs[i], sizes[i])``."""
    return TRAILER.pack(digest(addrs, sizes), MAGIC)


def trailer(data: bytes) -> bytes:
    """The trailer a worker appends to ``data`` (for tools and tests writing our format)."""
    return TRAILER.pack(xxhash.xxh3_64_intdigest(data), MAGIC)


def trailer_ok(trailer_addr: int, addrs: list[int], sizes: list[int]) -> bool:
    """True when the trailer at ``trailer_addr`` matches the pages in those memory ranges."""
    found, magic = TRAILER.unpack(ctypes.string_at(trailer_addr, TRAILER.size))
    return magic == MAGIC and found == digest(addrs, sizes)


def read_cause(rc: int, expected: int) -> str:
    """Why a read of an object of ``expected`` bytes that returned ``rc`` failed ("ok" if it did not)."""
    if rc >= 0:
        return "size_mismatch" if rc != expected else "ok"
    if is_invalid_params(rc):
        return "size_mismatch"  # Mooncake: "buffer too small" for an object of another size
    return cause_of(rc)
