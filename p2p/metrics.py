"""Telemetry of the P2P tier: ``vllm:mctier_p2p_*`` on vLLM's /metrics.

Counters (label ``kind``): bytes{pulled}, descriptors{pulled}, pulls{ok,failed,release},
failures{bootstrap,peer,timeout,transfer,remote,protocol,invalid_params}, retries{transfer},
holds{opened,released,expired,aborted,early_release,duplicate}, rejected{undecodable,
unknown_transfer,tp_mismatch,bad_range,fingerprint,prompt_mismatch,overload,unsigned,
bad_signature,expired,register} (prefill side channel and bootstrap server), refused{unsigned,bad_signature,expired,
body_mismatch,malformed,replayed} (requests whose transfer parameters the scheduler refused:
the request is computed locally, or not held). Histograms: query, metadata, transfer, ack,
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
        "holds": "Prefill-side block holds by outcome (opened, released, expired, aborted, early_release, duplicate)",
        "rejected": "Prefill side channel and bootstrap server: messages rejected (undecodable, unknown_transfer, "
                    "tp_mismatch, bad_range, fingerprint, prompt_mismatch, overload, unsigned, bad_signature, expired, "
                    "register)",
        "refused": "Requests whose transfer parameters were refused (unsigned, bad_signature, expired, "
                   "malformed, replayed): computed locally, or not held",
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
