"""Scheduler -> worker metadata of the composite, and the worker's timing samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.vllm_glue import KVConnectorMetadata

STORE, P2P = "store", "p2p"


@dataclass
class TieredMetadata(KVConnectorMetadata):
    store: Any  # the store child's metadata (None when the child is absent)
    p2p: Any  # the P2P child's metadata
    # req_id -> children whose load must finish before the request may run
    loads: dict[str, list[str]] = field(default_factory=dict)
    # req_id -> children that hold the request's blocks after it finished
    sends: dict[str, list[str]] = field(default_factory=dict)
    # This step's forward: (new tokens, context before them) per scheduled request,
    # so the worker can time the forward for the prefill-speed fit.
    step_tokens: list[tuple[int, int]] = field(default_factory=list)
