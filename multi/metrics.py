"""Telemetry of the composite: its own counters plus each child's stats, one record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.metrics import MetricSpec, TierPromMetrics, TierStats, prom_class
from kvcore.vllm_glue import KVConnectorPromMetrics, KVConnectorStats

SPEC = MetricSpec(
    prefix="mctier_tiered",
    counters={
        "decisions": "Requests planned, by chosen plan (kind = recompute, store, p2p, store+p2p).",
        "planned_tokens": "Prompt tokens planned, by source (kind = local, store, p2p, recompute).",
        "forced": "Requests that forced a source with kv_source (kind = the source).",
        "load_failures": "Planned loads that failed and fell back to recomputation (kind = source).",
        "estimate_error": "Sum of |estimated - actual| / actual of completed loads (kind = source).",
        "estimate_samples": "Completed loads compared with their estimate (kind = source).",
    },
    ops={
        "load_store": "Measured store load time of planned requests.",
        "load_p2p": "Measured P2P pull time of planned requests (including the wait for the prefill).",
        "forward": "Measured forward passes used to calibrate the prefill-speed model.",
    },
)
TieredOwnPromMetrics: type[TierPromMetrics] = prom_class(SPEC)


@dataclass
class TieredStats(KVConnectorStats):
    """``data = {"own": TierStats.data, "store": {...}, "p2p": {...}, "samples": [...]}``.

    ``samples`` are (source, bytes or token features, seconds) measurements the worker
    took; the scheduler feeds them to the calibration."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"own": TierStats().data, "store": {}, "p2p": {}, "samples": []}

    def own_inc(self, key: str, n: float = 1) -> None:
        TierStats(data=self.data["own"]).inc(key, n)

    def own_observe(self, op: str, seconds: float) -> None:
        TierStats(data=self.data["own"]).observe(op, seconds)

    def is_empty(self) -> bool:
        return not (self.data["store"] or self.data["p2p"] or self.data["samples"]) and TierStats(
            data=self.data["own"]).is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is None or other.is_empty():
            return self
        self.data["own"] = TierStats(data=self.data["own"]).aggregate(TierStats(data=other.data["own"])).data
        for child in ("store", "p2p"):
            mine, theirs = self.data[child], other.data.get(child) or {}
            if theirs:
                self.data[child] = (TierStats(data=mine).aggregate(TierStats(data=theirs)).data
                                    if mine else theirs)
        self.data["samples"].extend(other.data.get("samples", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {f"tiered_{k}": v for k, v in TierStats(data=self.data["own"]).reduce().items()}
        for child in ("store", "p2p"):
            if self.data[child]:
                out.update({f"{child}_{k}": v for k, v in TierStats(data=self.data[child]).reduce().items()})
        return out


class TieredPromMetrics(KVConnectorPromMetrics):
    """Our counters plus the children's, each under its own metric prefix."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues,
                 children: dict[str, type[KVConnectorPromMetrics]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        args = (vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._own = TieredOwnPromMetrics(*args)
        self._children = {name: cls(*args) for name, cls in children.items()}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0):
        if not transfer_stats_data:
            return
        self._own.observe(transfer_stats_data.get("own"), engine_idx)
        for name, prom in self._children.items():
            if transfer_stats_data.get(name):
                prom.observe(transfer_stats_data[name], engine_idx)
