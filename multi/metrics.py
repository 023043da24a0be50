"""Telemetry of the composite: its own counters plus each tier's stats, one record.

Its own metrics are ``vllm:mctier_tiered_*``; each tier's stats keep that tier's own
names (``vllm:mctier_store_*``, ``vllm:mctier_p2p_*``), exported by the tier's own
Prometheus class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvcore.metrics import MetricSpec, TierStats, prom_class
from kvcore.vllm_glue import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "decisions": "Requests planned, by chosen plan (kind = recompute, or the tiers used joined with +).",
    "planned_tokens": "Prompt tokens planned, by source (kind = local, recompute, or a tier).",
    "forced": "Requests that forced a source with kv_source (kind = the source).",
    "load_failures": "Planned loads that failed and fell back to recomputation (kind = tier).",
    "estimate_error": "Sum of |estimated - actual| / actual of measured samples (kind = forward or a tier).",
    "estimate_samples": "Measured samples compared with their estimate (kind = forward or a tier).",
}


def own_spec(tiers: Iterable[str]) -> MetricSpec:
    """The composite's own metrics with these tiers configured (one load histogram per tier)."""
    ops = {f"load_{t}": f"Measured {t} load time of planned requests (from the step that started it "
                        "until the tier reported it; a P2P pull includes the wait for the prefill)."
           for t in tiers}
    ops["forward"] = "Measured forward passes used to calibrate the prefill-speed model."
    return MetricSpec(prefix="mctier_tiered", counters=COUNTERS, ops=ops)


@dataclass
class TieredStats(KVConnectorStats):
    """``data = {"own": TierStats.data, "tiers": {tier name: that tier's stats data},
    "samples": [...]}``.

    ``samples`` are calibration samples the worker measured, encoded by
    ``multi.policy.encode_samples``; the scheduler decodes and learns from them."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"own": TierStats().data, "tiers": {}, "samples": []}

    def own_inc(self, key: str, n: float = 1) -> None:
        TierStats(data=self.data["own"]).inc(key, n)

    def own_observe(self, op: str, seconds: float) -> None:
        TierStats(data=self.data["own"]).observe(op, seconds)

    def is_empty(self) -> bool:
        # Asked several times a step: the dicts themselves, no TierStats built around them.
        d, own = self.data, self.data["own"]
        return not (d["tiers"] or d["samples"] or own.get("counters") or own.get("ops"))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is None or other.is_empty():
            return self
        self.data["own"] = TierStats(data=self.data["own"]).aggregate(TierStats(data=other.data["own"])).data
        for name, theirs in (other.data.get("tiers") or {}).items():
            mine = self.data["tiers"].get(name)
            self.data["tiers"][name] = (TierStats(data=mine).aggregate(TierStats(data=theirs)).data
                                        if mine else theirs)
        self.data["samples"].extend(other.data.get("samples", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {f"tiered_{k}": v for k, v in TierStats(data=self.data["own"]).reduce().items()}
        for name, data in self.data["tiers"].items():
            if data:
                out.update({f"{name}_{k}": v for k, v in TierStats(data=data).reduce().items()})
        return out


class TieredPromMetrics(KVConnectorPromMetrics):
    """Our counters plus each tier's, each tier through its own Prometheus class."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues,
                 tiers: dict[str, KVConnectorPromMetrics | None]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._own = prom_class(own_spec(tiers))(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tiers = {name: prom for name, prom in tiers.items() if prom is not None}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0):
        if not transfer_stats_data:
            return
        self._own.observe(transfer_stats_data.get("own"), engine_idx)
        for name, data in (transfer_stats_data.get("tiers") or {}).items():
            prom = self._tiers.get(name)
            if prom is not None and data:
                prom.observe(data, engine_idx)

