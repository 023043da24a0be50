"""Scheduler -> worker messages of the store tier (pickled inside vLLM's
per-step connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvcore.vllm_glue import KVConnectorMetadata


class ChunkIO(msgspec.Struct, array_like=True, frozen=True):
    """Blocks ``[first, first+len(block_ids))`` of stored object ``link``, in these block ids.

    The object is a whole chunk (``blocks == 0``) or a part object of ``blocks`` blocks, the
    leading blocks of chunk ``index`` (:mod:`mcstore.keys`). A save always covers the whole
    object (``first == 0``); a load may cover part of one (when a local prefix hit or an
    explicit range starts or ends inside it, or a reader shares only its leading blocks).
    With KV cache groups (``mcstore.groups``) each group has an object per chunk, ``group``'s
    blocks only; a sliding-window group's holds the chunk's trailing ``blocks`` blocks.
    """

    link: str
    index: int
    block_ids: list[int]
    first: int = 0
    blocks: int = 0
    group: int = 0


class DirEntry(msgspec.Struct, array_like=True, frozen=True):
    """A directory entry (``mcstore.keys.Directory``, encoded) to write once object ``link`` is
    saved; the first TP rank of the first stage writes it."""

    link: str
    key: str
    value: bytes


class LoadJob(msgspec.Struct, array_like=True):
    req_id: str
    chunks: list[ChunkIO]
    timeout_s: float
    sync: bool = False  # vLLM scheduled the request in this step: the worker ends the load before the forward
    tokens: int = 0  # tokens the load makes computed (counted with KV cache groups, whose objects hold fewer blocks)


class SaveJob(msgspec.Struct, array_like=True):
    req_id: str
    chunks: list[ChunkIO]
    dirs: list[DirEntry] = msgspec.field(default_factory=list)
    # The scheduler holds the job's sliding-window blocks (vLLM frees them behind the window
    # while the request runs) until every worker reports this id done (mcstore.groups); -1: none.
    pin: int = -1


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
