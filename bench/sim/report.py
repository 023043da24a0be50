"""One simulated run's figures, named as the real replay names them (``bench.trace_replay``).

- ``ttft_*``, ``tpot_*``: percentiles over the served requests (seconds);
- ``slo_attainment``: requests whose time to first token is at most ``slo``, over all
  requests (a rejected one misses); ``goodput``: those requests per second of the trace;
- ``hit_local``, ``hit_store``, ``computed``: fractions of all served input tokens
  that came from the computing instance's prefix cache, were loaded from the store, or
  were computed; ``hit_store_ssd`` the part of ``hit_store`` read from SSD;
  ``reuse = hit_local + hit_store``; ``reuse_of_ideal``: ``reuse`` over the reuse an
  unbounded cache gives the same requests (:func:`bench.trace.ideal_reuse`);
- ``engine_*`` and ``recomputed_share``: the same tokens counted per engine, as the real
  replay reads them from ``/metrics``: a handed-off prompt also on its decode instance
  (its own prefix-cache hit, its store load, the P2P pull, and its last token computed).
"""

from __future__ import annotations

from bench.sim.cluster import Result
from bench.trace import Request, ideal_reuse


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile by linear interpolation (numpy's default), None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], reqs: list[Request], block: int, slo: float) -> dict:
    served = [r for r in results if r.first is not None]
    ttft = [r.ttft for r in served]
    tpot = [r.tpot for r in served if r.tpot is not None]
    tokens = sum(r.n for r in served) or 1
    span = (max(r.arrival for r in results) - min(r.arrival for r in results)) if results else 0.0
    ok = sum(1 for t in ttft if t <= slo)
    ideal = ideal_reuse([q for q, r in zip(reqs, results) if r.first is not None], block)
    reuse = sum(r.local + r.store for r in served) / tokens
    out = {"requests": len(results), "served": len(served),
           "rejected": sum(1 for r in results if r.kind == "reject"),
           "slo_s": slo, "slo_attainment": ok / len(results) if results else 0.0,
           "goodput_rps": ok / span if span > 0 else None,
           "hit_local": sum(r.local for r in served) / tokens,
           "hit_store": sum(r.store for r in served) / tokens,
           "hit_store_ssd": sum(r.store_ssd for r in served) / tokens,
           "computed": sum(r.computed for r in served) / tokens,
           "reuse": reuse, "ideal_reuse": ideal, "reuse_of_ideal": reuse / ideal if ideal > 0 else None,
           "p2p_tokens": sum(r.p2p for r in served),
           # Engine-level, as bench.trace_replay counts from /metrics: a handoff's prompt on
           # the decode instance too (its own hit, its store load, the pull, its last token).
           "engine_local": sum(r.local + r.d_local for r in served) / tokens,
           "engine_store": sum(r.store + r.d_store for r in served) / tokens,
           "engine_p2p": sum(r.p2p for r in served) / tokens,
           "recomputed_share": sum(r.computed + (r.kind == "pd") for r in served) / tokens,
           "routes": {k: sum(1 for r in results if r.kind == k) for k in ("pd", "direct", "reject")}}
    for q in (0.5, 0.9, 0.99):
        out[f"ttft_p{round(q * 100)}"] = pct(ttft, q)
        out[f"tpot_p{round(q * 100)}"] = pct(tpot, q)
    return out
