"""The router's ``/metrics``: every metric declared once here, in its own registry.

- ``mctier_router_decisions_total{route, reason}``: routes taken (``pd``, ``direct``,
  ``reject``) and why (the chooser's reason, or the policy's name);
- ``mctier_router_ttft_seconds{kind}``: predicted and actual time to first token of
  answered requests (``kind`` = ``predicted`` / ``actual``), and
  ``mctier_router_ttft_error_ratio``: actual over predicted;
- ``mctier_router_ttft_error_ratio_by_kind{kind}``: the same per route kind (``direct``, ``pd``);
- ``mctier_router_estimate_drift{kind}``: the honesty window's median |ln(actual/predicted)|
  per route kind (:mod:`multi.router.honesty`), ``mctier_router_fallback{policy}``: 1 for the
  policy the ``kv`` policy falls back to while its estimates drift (``kv`` while it decides
  itself), ``mctier_router_fallbacks_total``: fallbacks entered;
- ``mctier_router_probe_seconds{instance, what}``: the start-up probe's measurements
  (``step``, ``token``: the fitted compute; ``handoff``: the handoff's fixed cost);
- ``mctier_router_rejections_total``: admission rejections (429);
- ``mctier_router_retries_total``: requests retried on another prefill instance;
- ``mctier_router_released_holds_total``: prefill holds released because their decode failed;
- ``mctier_router_requests_total{status}``: answered requests by HTTP status;
- ``mctier_router_index_blocks{view, kind}``: blocks in the index per view (an instance
  URL or ``store``) and kind (``approx``: what the router sent there; ``exact``: what the
  instance's KV events say it holds; for ``store``, what the store tier's events say the
  store holds), ``mctier_router_index_capacity_blocks{view}``;
- ``mctier_router_store_checks_total{outcome}``: how each request's store reach was settled
  (:mod:`multi.router.storeview`): ``short`` (an instance's cache leaves less than a chunk: not
  looked up, the approximate view), ``skipped`` (the store tier's events say the store holds none
  of the prompt: no lookup), ``confirmed`` / ``stale`` (they said some and the lookup agreed /
  found less), ``unfiltered`` (looked up without the events), ``unanswered`` (lookup late or
  failed);
- ``mctier_router_intake_seconds{phase}``: the router's own time on a request before it is sent
  on, per phase: ``tokenize`` (reading the body and the prompt's token ids), ``hash`` (its block
  hashes), ``store`` (the store reach, :mod:`multi.router.storeview`), ``choose`` (the choice and
  its booking);
- ``mctier_router_event_lag_seconds{instance}``: age of the last KV event batch, and
  ``mctier_router_events{instance, kind}``: the subscribers' counters (events, batches,
  gaps, replays, replay_failures, unknown_parent; store_stored, store_removed,
  store_unmapped: the store tier's blocks placed in / removed from the store view, removals no
  mapping resolved) and ``stale`` (1: exact view unusable);
- ``mctier_router_queue_seconds{instance}``: routed prefill work still ahead per instance;
  ``mctier_router_instance_healthy{instance, role}``; ``mctier_router_outstanding{instance}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_INTAKE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("mctier_router_decisions", "Routes taken, by route and reason",
                                 ["route", "reason"], registry=r)
        self.ttft = Histogram("mctier_router_ttft_seconds", "Predicted and actual time to first token",
                              ["kind"], buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_ratio = Histogram("mctier_router_ttft_error_ratio", "Actual over predicted time to first token",
                                    buckets=_RATIO_BUCKETS, registry=r)
        self.ttft_kind_ratio = Histogram("mctier_router_ttft_error_ratio_by_kind",
                                         "Actual over predicted time to first token per route kind", ["kind"],
                                         buckets=_RATIO_BUCKETS, registry=r)
        self.drift = Gauge("mctier_router_estimate_drift", "Median |ln(actual/predicted)| TTFT per route kind "
                           "over the recent window", ["kind"], registry=r)
        self.fallback = Gauge("mctier_router_fallback", "1 for the policy deciding (kv, or its fallback)", ["policy"],
                              registry=r)
        self.fallbacks = Counter("mctier_router_fallbacks", "Fallbacks of the kv policy entered", registry=r)
        self._switches = 0
        self.probe = Gauge("mctier_router_probe_seconds", "The start-up probe's measurements per instance",
                           ["instance", "what"], registry=r)
        self.rejections = Counter("mctier_router_rejections", "Requests rejected by admission (429)", registry=r)
        self.retries = Counter("mctier_router_retries", "Requests retried on another prefill instance", registry=r)
        self.released = Counter("mctier_router_released_holds", "Prefill holds released after their decode failed",
                                registry=r)
        self.requests = Counter("mctier_router_requests", "Answered requests by HTTP status", ["status"], registry=r)
        self.index_blocks = Gauge("mctier_router_index_blocks", "Blocks in the KV index per view and kind",
                                  ["view", "kind"], registry=r)
        self.index_capacity = Gauge("mctier_router_index_capacity_blocks", "Capacity of each index view in blocks",
                                    ["view"], registry=r)
        self.store_checks = Counter("mctier_router_store_checks", "How each request's store reach was settled",
                                    ["outcome"], registry=r)
        self.intake = Histogram("mctier_router_intake_seconds", "The router's time on a request before it is "
                                "sent on, per phase", ["phase"], buckets=_INTAKE_BUCKETS, registry=r)
        self.event_lag = Gauge("mctier_router_event_lag_seconds", "Age of the last KV event batch per instance",
                               ["instance"], registry=r)
        self.events = Gauge("mctier_router_events", "KV event subscriber counters per instance",
                            ["instance", "kind"], registry=r)
        self.queue = Gauge("mctier_router_queue_seconds", "Routed prefill work still ahead per instance",
                           ["instance"], registry=r)
        self.healthy = Gauge("mctier_router_instance_healthy", "1 while an instance is in rotation",
                             ["instance", "role"], registry=r)
        self.outstanding = Gauge("mctier_router_outstanding", "Requests in flight per instance", ["instance"],
                                 registry=r)

    def set_honesty(self, state: dict) -> None:
        """The honesty check's state (:meth:`multi.router.honesty.Honesty.state`)."""
        for policy in ("kv", "least-outstanding", "direct", "handoff"):
            self.fallback.labels(policy).set(1 if state["mode"] == policy else 0)
        for kind, d in state["drift"].items():
            self.drift.labels(kind).set(d)
        self.fallbacks.inc(state["switches"] - self._switches)
        self._switches = state["switches"]

    def render(self) -> bytes:
        return generate_latest(self.registry)
