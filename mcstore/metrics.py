"""Store tier telemetry: one spec shared by the stats record and Prometheus
(metric names ``vllm:mctier_store_<counter>_total{kind=...}`` and
``vllm:mctier_store_<op>_seconds``)."""

from __future__ import annotations

from kvcore.metrics import MetricSpec, TierStats, prom_class

SPEC = MetricSpec(
    prefix="mctier_store",
    counters={
        "lookups": "Store lookups by outcome (kind=hit|miss|unavailable)",
        "hit_tokens": "Prompt tokens the store could supply at lookup",
        "loaded_tokens": "Tokens loaded from the store into KV blocks",
        "loaded_bytes": "Bytes loaded from the store",
        "saved_tokens": "Tokens saved to the store",
        "saved_bytes": "Bytes saved to the store",
        "save_skipped": "Chunks not saved (kind=exists|unavailable)",
        "failures": "Failed store operations by cause (kind=load_<cause>|save_<cause>)",
    },
    ops={
        "lookup": "Duration of one request's store lookup",
        "load": "Duration of one request's store load",
        "save": "Duration of one save batch",
    },
)


class StoreStats(TierStats):
    pass


StorePromMetrics = prom_class(SPEC)
