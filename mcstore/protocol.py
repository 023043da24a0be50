"""Scheduler -> worker messages of the store tier (pickled inside vLLM's
per-step connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvcore.vllm_glue import KVConnectorMetadata


class ChunkIO(msgspec.Struct, array_like=True, frozen=True):
    """Blocks ``[first, first+len(block_ids))`` of stored chunk ``link``, in these block ids.

    A save always covers the whole chunk (``first == 0``); a load may cover part
    of one (when a local prefix hit or an explicit range starts or ends inside it).
    """

    link: str
    index: int
    block_ids: list[int]
    first: int = 0


class LoadJob(msgspec.Struct, array_like=True):
    req_id: str
    chunks: list[ChunkIO]
    timeout_s: float
    sync: bool = False  # vLLM scheduled the request in this step: the worker ends the load before the forward


class SaveJob(msgspec.Struct, array_like=True):
    req_id: str
    chunks: list[ChunkIO]


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
