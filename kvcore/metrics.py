"""Metrics plumbing shared by the tiers: a serialisable stats record that vLLM
aggregates across workers and steps, and a Prometheus adapter for it.

A tier declares its counters and timed operations once (:class:`MetricSpec`);
counter keys may carry one label after a colon (``"failures:lease_expired"``),
which becomes the metric's ``kind`` label. A timed operation named in
``MetricSpec.op_labels`` takes one the same way (``"phase:load_transfer"`` observes
``<prefix>_phase_seconds{phase="load_transfer"}``): one histogram family for the
parts of a whole, so a dashboard can stack them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from kvcore.vllm_glue import KVConnectorPromMetrics, KVConnectorStats


@dataclass
class MetricSpec:
    prefix: str  # e.g. "mctier_store"
    counters: dict[str, str]  # name -> help text
    ops: dict[str, str]  # timed operation -> help text
    op_labels: dict[str, str] = field(default_factory=dict)  # timed operation -> its label's name
    buckets: tuple[float, ...] = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class TierStats(KVConnectorStats):
    """``data = {"counters": {key: n}, "ops": {op: [seconds, ...]}}``."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"counters": {}, "ops": {}}

    def inc(self, key: str, n: float = 1) -> None:
        c = self.data["counters"]
        c[key] = c.get(key, 0) + n

    def observe(self, op: str, seconds: float) -> None:
        self.data["ops"].setdefault(op, []).append(seconds)

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["ops"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is None or other.is_empty():
            return self
        for k, v in other.data.get("counters", {}).items():
            self.inc(k, v)
        for op, xs in other.data.get("ops", {}).items():
            self.data["ops"].setdefault(op, []).extend(xs)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(sorted(self.data["counters"].items()))
        for op, xs in sorted(self.data["ops"].items()):
            if xs:
                out[f"{op}_count"] = len(xs)
                out[f"{op}_avg_ms"] = round(fmean(xs) * 1e3, 3)
                out[f"{op}_max_ms"] = round(max(xs) * 1e3, 3)
        return out

    def take(self) -> TierStats | None:
        """A copy holding everything recorded so far, and a reset; None when empty."""
        if self.is_empty():
            return None
        snap = type(self)(data=self.data)
        self.data = {}
        self.reset()
        return snap


class TierPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters/histograms for one tier, declared by its MetricSpec."""

    spec: MetricSpec

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        p = self.spec.prefix
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:{p}_{name}_total", documentation=doc, labelnames=labelnames + ["kind"]
            )
            for name, doc in self.spec.counters.items()
        }
        self._hists = {
            op: self._histogram_cls(
                name=f"vllm:{p}_{op}_seconds",
                documentation=doc,
                buckets=list(self.spec.buckets),
                labelnames=labelnames + ([self.spec.op_labels[op]] if op in self.spec.op_labels else []),
            )
            for op, doc in self.spec.ops.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0):
        if not transfer_stats_data:
            return
        base = self.per_engine_labelvalues[engine_idx]
        for key, n in transfer_stats_data.get("counters", {}).items():
            name, _, kind = key.partition(":")
            counter = self._counters.get(name)
            if counter is not None and n > 0:
                counter.labels(*base, kind).inc(n)
        for key, xs in transfer_stats_data.get("ops", {}).items():
            op, _, label = key.partition(":")
            hist = self._hists.get(op)
            if hist is not None and (op in self.spec.op_labels) == bool(label):
                child = hist.labels(*base, label) if label else hist.labels(*base)
                for x in xs:
                    child.observe(x)


def prom_class(spec: MetricSpec) -> type[TierPromMetrics]:
    return type(f"{spec.prefix.title().replace('_', '')}PromMetrics", (TierPromMetrics,), {"spec": spec})
