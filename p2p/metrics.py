"""Telemetry of the P2P tier: ``vllm:mctier_p2p_*`` on vLLM's /metrics.

Counters (label ``kind``): bytes{pulled}, descriptors{pulled}, pulls{ok,failed,release},
failures{bootstrap,peer,timeout,transfer,remote,protocol,invalid_params}, retries{transfer},
holds{opened,released,expired,aborted,early_release}, rejected{undecodable,unknown_transfer,
tp_mismatch,bad_range} (prefill side channel). Histograms: query, metadata, transfer, ack,
handoff (decode side) and hold (prefill side: time blocks were held).
"""

from __future__ import annotations

from kvcore.metrics import MetricSpec, TierStats, prom_class

SPEC = MetricSpec(
    prefix="mctier_p2p",
    counters={
        "bytes": "KV bytes moved by the P2P tier",
        "descriptors": "Transfer Engine descriptors (coalesced page runs) issued",
        "pulls": "Handoffs by outcome (ok, failed, release)",
        "failures": "Failed handoffs by cause",
        "retries": "Transfer Engine reads repeated after a failed first try (transfer)",
        "holds": "Prefill-side block holds by outcome (opened, released, expired, aborted)",
        "rejected": "Prefill side channel: messages rejected (undecodable, unknown_transfer, tp_mismatch, bad_range)",
    },
    ops={
        "query": "Bootstrap /query lookup",
        "metadata": "Side-channel request until the prefill side answered READY",
        "transfer": "Transfer Engine batch read",
        "ack": "Completion message until the prefill side acknowledged",
        "handoff": "Whole decode-side handoff",
        "hold": "Time the prefill side held a request's blocks",
    },
)


class P2PStats(TierStats):
    pass


P2PPromMetrics = prom_class(SPEC)
