"""Scheduler -> worker metadata of the composite (one per engine step), and worker -> scheduler
metadata (each tier's own, when a tier has some)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.vllm_glue import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class TieredMetadata(KVConnectorMetadata):
    # tier name -> that tier's own metadata for this step (what its build_connector_meta gave)
    tiers: dict[str, Any] = field(default_factory=dict)
    # req_id -> {tier name: block ids that tier's planned load fills}; the request may run
    # once every listed tier ended its load
    loads: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # requests among ``loads`` whose load ends before this step's forward (synchronous): the
    # tiers report their failed blocks in this step and never report them finished-receiving
    sync: list[str] = field(default_factory=list)
    # req_id -> tiers that hold the request's blocks after it finished
    sends: dict[str, list[str]] = field(default_factory=dict)
    # This step's forward: (new tokens, context before them) per scheduled request,
    # so the worker can time the forward for the prefill-speed fit.
    step_tokens: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class TieredWorkerMeta(KVConnectorWorkerMetadata):
    # tier name -> what that tier's build_connector_worker_meta gave (vLLM joins the workers')
    tiers: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        for name, theirs in getattr(other, "tiers", {}).items():
            mine = self.tiers.get(name)
            self.tiers[name] = theirs if mine is None else mine.aggregate(theirs)
        return self
