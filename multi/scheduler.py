"""Composite, scheduler side: plan each request over the store and P2P tiers.

For a request with ``N`` prompt tokens and ``L`` of them in vLLM's prefix cache,
it asks the store tier how far it can supply (``lookup``, one batched existence
query), asks the P2P tier whether a prefill instance holds the prompt, lets
:mod:`multi.policy` estimate every feasible plan, and drives each tier with its
range: ``store.plan_load(request, L, S, blocks)`` and ``p2p.load(request,
S // block_size, blocks[S // block_size:])``. A request whose plan does not pull
from the prefill instance still releases the blocks held there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.log import get_logger
from kvcore.plan import Source
from kvcore.vllm_glue import first_group_block_ids
from multi.metrics import TieredStats
from multi.policy import Inputs, Model, Plan, PolicyConfig, requested_source
from multi.protocol import P2P, STORE, TieredMetadata

logger = get_logger("multi.scheduler")


@dataclass
class _Decision:
    plan: Plan
    estimates: dict[str, float]
    reason: str
    local: int
    store_end: int
    p2p_end: int
    loads: list[str] = field(default_factory=list)
    counted: bool = False


class TieredScheduler:
    def __init__(self, store, p2p, policy: PolicyConfig, block_size: int, bytes_per_token: float,
                 default_source: str = "auto"):
        self.store = store  # mcstore.scheduler.StoreScheduler or None
        self.p2p = p2p  # p2p.scheduler.P2PScheduler or None
        self.model = Model(policy)
        self.calibrate = policy.calibrate
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.default_source = default_source
        self.stats = TieredStats()
        self._decisions: dict[str, _Decision] = {}
        self._loads: dict[str, list[str]] = {}
        self._sends: dict[str, list[str]] = {}

    # -- planning --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        d = self._decisions.get(rid)
        if d is not None and d.loads:
            # vLLM asks again only after a load failed from the request's first block (or a
            # preemption): planning the same load again would fail again, forever. One load
            # per request; the rest is recomputed (as each tier does on its own).
            return 0, False
        if d is None or d.local != num_computed_tokens:
            d = self._decisions[rid] = self._decide(request, num_computed_tokens)
        ext = max(d.store_end, d.p2p_end) - num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def _decide(self, request, local: int) -> _Decision:
        n = request.num_prompt_tokens
        store_hit = self.store.lookup(request) if self.store is not None else 0
        p2p = bool(self.p2p is not None and self.p2p.lookup(request) > 0)
        force, warning = requested_source(request.kv_transfer_params, self.default_source)
        if warning:
            logger.warning("request %s: %s", request.request_id, warning)
        x = Inputs(prompt_tokens=n, local_tokens=local, store_tokens=store_hit, p2p=p2p,
                   bytes_per_token=self.bytes_per_token,
                   prefill_elapsed_s=max(0.0, time.time() - getattr(request, "arrival_time", time.time())))
        plan, plans, reason = self.model.choose(x, force)
        if force != "auto":
            self.stats.own_inc(f"forced:{force}")
        d = _Decision(plan, {p.name: round(p.seconds, 6) for p in plans}, reason, local,
                      store_end=plan.end_of(Source.STORE), p2p_end=plan.end_of(Source.P2P))
        logger.debug("request %s: N=%d L=%d S=%d p2p=%s -> %s (%s) estimates %s", request.request_id, n, local,
                     store_hit, p2p, plan.name, reason, d.estimates)
        return d

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        d = self._decisions.get(rid)
        if d is None:
            return
        if not d.counted:
            d.counted = True
            self.stats.own_inc(f"decisions:{d.plan.name}")
            for seg in d.plan.segments:
                self.stats.own_inc(f"planned_tokens:{seg.source.value}", seg.tokens)
        if num_external_tokens <= 0:
            if d.p2p_end == 0 and self.p2p is not None and self.p2p.lookup(request) > 0:
                self.p2p.release(request)  # the prefill instance must not hold blocks for nobody
            return
        ids = first_group_block_ids(blocks)
        bs = self.block_size
        if d.store_end > d.local:
            self.store.plan_load(request, d.local, d.store_end, ids)
            d.loads.append(STORE)
        if d.p2p_end > 0:
            first = max(d.store_end, d.local) // bs
            total = -(-request.num_prompt_tokens // bs)
            self.p2p.load(request, first, ids[first:total])
            d.loads.append(P2P)
        elif self.p2p is not None and self.p2p.lookup(request) > 0:
            self.p2p.release(request)
        self._loads[rid] = list(d.loads)

    def build_connector_meta(self, scheduler_output) -> TieredMetadata:
        store_meta = self.store.build_connector_meta(scheduler_output) if self.store is not None else None
        p2p_meta = self.p2p.build_connector_meta() if self.p2p is not None else None
        # Context length before this step's tokens, for the forward-time fit.
        ctx = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        ctx.update(zip(cached.req_ids, cached.num_computed_tokens))
        step = [(n, ctx.get(rid, 0)) for rid, n in scheduler_output.num_scheduled_tokens.items()]
        meta = TieredMetadata(store_meta, p2p_meta, loads=self._loads, sends=self._sends, step_tokens=step)
        self._loads, self._sends = {}, {}
        return meta

    # -- results -----------------------------------------------------------------------

    def update_connector_output(self, out) -> None:
        if self.p2p is not None:
            self.p2p.finished_sending(out.finished_sending)
        stats = out.kv_connector_stats
        if stats is not None and not stats.is_empty():
            self._learn(stats.data.get("samples", []))

    def _learn(self, samples: list) -> None:
        for kind, x, seconds in samples:
            if kind == "forward":
                est = self.model.prefill.predict(x)
                if self.calibrate:
                    self.model.prefill.update(x, seconds)
            elif kind in (STORE, P2P):
                fit = self.model.store if kind == STORE else self.model.p2p
                est = fit.predict([1.0, x])
                if self.calibrate:
                    fit.update([1.0, x], seconds)
            else:
                continue
            if seconds > 0:
                self.stats.own_inc(f"estimate_error:{kind}", abs(est - seconds) / seconds)
                self.stats.own_inc(f"estimate_samples:{kind}")

    def request_finished(self, request, block_ids: list[int], children: dict[str, tuple[bool, dict | None]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        d = self._decisions.pop(rid, None)
        holders = [name for name, (hold, _) in children.items() if hold]
        if holders:
            self._sends[rid] = holders
        params: dict[str, Any] = {}
        for _, p in children.values():
            params.update(p or {})
        if d is not None:
            params["kv_plan"] = [
                {"start": s.start, "end": s.end, "source": s.source.value} for s in d.plan.segments
            ]
            params["kv_plan_estimates"] = {"chosen": d.plan.name, "reason": d.reason, "seconds": d.estimates,
                                           "parts": {k: round(v, 6) for k, v in d.plan.parts.items()}}
        return bool(holders), params or None

    def take_stats(self) -> TieredStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, TieredStats()
        return out
