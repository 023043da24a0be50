"""Composite, scheduler side: plan each request over the configured tiers.

For a request with ``N`` prompt tokens and ``L`` of them in vLLM's prefix cache,
it asks every tier how far it can supply the prompt (``lookup``; while a tier's answer is
not in, vLLM is told to ask again at a later step, as that tier alone would), lets
:mod:`multi.policy` estimate every feasible plan over the tiers (cheapest first)
and pick one (its own compute weighed by the other requests the engine holds,
``Inputs.busy``: the requests it has planned and vLLM has not finished), and drives
each tier the plan uses with its token range:
``tier.plan_load(request, start, end, block_ids, expected_s)`` (the plan's estimate of
that load, which sets its deadline: ``kvcore.tier.load_deadline_s``). A plan that loads from
one tier, not a remote prefill, is synchronous when that tier grants it
(``tier.reserve_sync``: the store within its ``sync_load_max`` budget): vLLM is answered
``load_async=False``, schedules the request in the same step, and the tier's worker ends the
load before that step's forward, as the tier alone would. A tier that had
something for the request but is not used gets ``tier.release(request)`` (a prefill
instance must not hold blocks for nobody). It uses the tiers only through
``kvcore.tier`` (the contract methods and the vLLM hooks it forwards).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvcore.log import get_logger
from kvcore.tier import Tier, blocks_of
from kvcore.vllm_glue import first_group_block_ids
from multi.metrics import TieredStats
from multi.policy import CostModel, Inputs, LoadSample, Plan, PolicyConfig, TierReach, decode_samples, requested_source
from multi.protocol import TieredMetadata

logger = get_logger("multi.scheduler")

# Decode-only forward passes sampled per second (a burst of as many is allowed): what the
# forward-time fit needs of them (its fixed cost per pass). A sample on every decode step made
# the stats record travel (worker, scheduler, API server) and the fit learn at every step, and
# building the step's token list cost the scheduler at every step (docs/benchmarks/no-reuse.md).
DECODE_SAMPLES_PER_S = 20.0


@dataclass
class _Decision:
    plan: Plan
    estimates: dict[str, float]
    reason: str
    local: int
    reach: dict[str, int]  # tier -> its lookup when the plan was made
    ranges: dict[str, tuple[int, int]]  # tier -> [start, end) it loads, in tier order
    busy: int = 0  # other requests the engine held when the plan was made (Inputs.busy)
    loads: list[str] = field(default_factory=list)  # tiers whose load was planned
    counted: bool = False
    sync: bool = False  # its load ends inside the step that schedules it (reserve_sync, this step)

    @property
    def end(self) -> int:
        return max((e for _, e in self.ranges.values()), default=0)


class TieredScheduler:
    def __init__(self, tiers: dict[str, Tier], policy: PolicyConfig, block_size: int, bytes_per_token: float,
                 default_source: str = "auto", grouped: bool = False, sliding: bool = False):
        self.tiers = tiers  # name -> tier connector (scheduler role), cheapest first
        # KV cache groups: tiers get block ids per group, a failed load fails the whole request
        # (no block ids for it: multi.worker); with a sliding-window group a plan loads from one
        # tier at most (_decide).
        self.grouped, self.sliding = grouped, sliding
        self.model = CostModel(policy)
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.default_source = default_source
        self.stats = TieredStats()
        self._decisions: dict[str, _Decision] = {}
        self._loads: dict[str, dict[str, list[int]]] = {}
        self._sync: list[str] = []  # requests whose loads planned in this step are synchronous
        self._sends: dict[str, list[str]] = {}
        # Loads in flight: request -> tier -> (when the load was planned, the plan's estimate
        # of a prefill instance's compute for it, 0 for a tier with none), see load_seconds.
        self._planned: dict[str, dict[str, tuple[float, float]]] = {}
        self._decode_budget = DECODE_SAMPLES_PER_S  # token bucket of decode-only samples (_sampled)
        self._budget_at = time.monotonic()

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        for tier in self.tiers.values():
            tier.bind_kv_cache_manager(kv_cache_manager)

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
            reach = {name: tier.lookup(request, num_computed_tokens) for name, tier in self.tiers.items()}
            if None in reach.values():
                return None, False  # a tier's lookup is out (the store's, non-blocking): ask again later
            d = self._decisions[rid] = self._decide(request, num_computed_tokens, reach)
        ext = d.end - num_computed_tokens
        if ext <= 0:
            return 0, False
        d.sync = self._reserve_sync(request, d)
        return ext, not d.sync

    def _reserve_sync(self, request, d: _Decision) -> bool:
        """Whether the plan's load may end inside the step that schedules the request: it loads
        from one tier (a grant cannot be taken back from one tier when another refuses), not a
        remote prefill, and that tier grants it for this step (``Tier.reserve_sync``)."""
        if len(d.ranges) != 1:
            return False
        ((name, (start, end)),) = d.ranges.items()
        tier = self.tiers[name]
        return not tier.remote_prefill and tier.reserve_sync(request, start, end)

    def _decide(self, request, local: int, reach: dict[str, int]) -> _Decision:
        n = request.num_prompt_tokens
        force, warning = requested_source(request.kv_transfer_params, self.default_source, self.tiers)
        if warning:
            logger.warning("request %s: %s", request.request_id, warning)
        x = Inputs(prompt_tokens=n, local_tokens=local, bytes_per_token=self.bytes_per_token,
                   tiers=[TierReach(name, reach[name], tier.remote_prefill, tier.load_prior)
                          for name, tier in self.tiers.items()],
                   prefill_elapsed_s=max(0.0, time.time() - getattr(request, "arrival_time", time.time())),
                   # Every request the engine holds passed here first and leaves at request_finished.
                   busy=len(self._decisions) - (request.request_id in self._decisions))
        plan, plans, reason = self.model.choose(x, force)
        if self.sliding and sum(s.source in self.tiers for s in plan.segments) > 1:
            # vLLM allocates a sliding group's blocks before the window of the whole load's end as
            # null: a tier whose range ends earlier would need those. One source per plan.
            single = [p for p in plans if sum(s.source in self.tiers for s in p.segments) <= 1]
            plan = min(single, key=lambda p: p.seconds)
            reason += "; one source (a sliding-window group)"
        if force != "auto":
            self.stats.own_inc(f"forced:{force}")
        ranges = {s.source: (s.start, s.end) for s in plan.segments if s.source in self.tiers}
        d = _Decision(plan, {p.name: round(p.seconds, 6) for p in plans}, reason, local, reach, ranges, x.busy)
        logger.debug("request %s: N=%d L=%d reach=%s -> %s (%s) estimates %s", request.request_id, n, local,
                     reach, plan.name, reason, d.estimates)
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
                self.stats.own_inc(f"planned_tokens:{seg.source}", seg.tokens)
        loads: dict[str, list[int]] = {}
        if num_external_tokens > 0:
            ids = [list(g) for g in blocks.get_block_ids()] if self.grouped else first_group_block_ids(blocks)
            for name, (start, end) in d.ranges.items():
                # The plan's estimate for this tier sets how long the load may take.
                self.tiers[name].plan_load(request, start, end, ids, expected_s=d.plan.parts.get(f"{name}_s"))
                # With groups no block ids: a failed load fails the request (vLLM 0.32 takes no
                # block-level failures with several groups).
                loads[name] = [] if self.grouped else blocks_of(start, end, self.block_size, ids)
                remote = d.plan.parts.get(f"{name}_remote_s", 0.0) if self.tiers[name].remote_prefill else 0.0
                if not d.sync:  # a synchronous load is learned from the worker's timing: nothing waits beyond it
                    self._planned.setdefault(rid, {})[name] = (time.monotonic(), remote)
                d.loads.append(name)
            self._loads[rid] = loads
            if d.sync:
                self._sync.append(rid)
        for name, tier in self.tiers.items():
            if name not in loads and d.reach[name] > 0:
                tier.release(request)

    def build_connector_meta(self, scheduler_output) -> TieredMetadata:
        metas = {name: tier.build_connector_meta(scheduler_output) for name, tier in self.tiers.items()}
        step = []
        if self._sampled(scheduler_output.num_scheduled_tokens, time.monotonic()):
            # Context length before this step's tokens, for the forward-time fit.
            ctx = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            ctx.update(zip(cached.req_ids, cached.num_computed_tokens))
            step = [(n, ctx.get(rid, 0)) for rid, n in scheduler_output.num_scheduled_tokens.items()]
        meta = TieredMetadata(metas, loads=self._loads, sends=self._sends, step_tokens=step, sync=self._sync)
        self._loads, self._sends, self._sync = {}, {}, []
        return meta

    def _sampled(self, scheduled: dict[str, int], now: float) -> bool:
        """Whether this step's forward pass is a calibration sample (the worker times the
        steps whose metadata carries ``step_tokens``): always when it computes prompt tokens,
        else while the decode-only budget lasts (``DECODE_SAMPLES_PER_S``)."""
        if not scheduled:
            return False
        if any(n > 1 for n in scheduled.values()):
            return True
        self._decode_budget = min(DECODE_SAMPLES_PER_S,
                                  self._decode_budget + (now - self._budget_at) * DECODE_SAMPLES_PER_S)
        self._budget_at = now
        if self._decode_budget < 1.0:
            return False
        self._decode_budget -= 1.0
        return True

    # -- results -----------------------------------------------------------------------

    def update_connector_output(self, out) -> None:
        stats, worker_meta = out.kv_connector_stats, getattr(out, "kv_connector_worker_meta", None)
        if stats is None and worker_meta is None:  # most steps: the tiers see the joined results alone
            for tier in self.tiers.values():
                tier.update_connector_output(out)
            return
        tier_data = stats.data.get("tiers", {}) if stats is not None and not stats.is_empty() else {}
        tier_meta = getattr(worker_meta, "tiers", {})
        try:
            # Each tier sees the joined transfer results and only its own stats and worker metadata.
            for name, tier in self.tiers.items():
                data = tier_data.get(name)
                out.kv_connector_stats = type(tier).build_kv_connector_stats(data=data) if data else None
                out.kv_connector_worker_meta = tier_meta.get(name)
                tier.update_connector_output(out)
        finally:
            out.kv_connector_stats, out.kv_connector_worker_meta = stats, worker_meta
        if stats is not None and not stats.is_empty():
            self._learn(stats.data.get("samples", []))
            # Learned: the samples go no further (vLLM would send them on to the API server's
            # stats loggers, which keep every one until their next log line).
            stats.data["samples"] = []
            if stats.is_empty():
                out.kv_connector_stats = None

    def _learn(self, raw: list) -> None:
        try:
            samples = decode_samples(raw)
        except msgspec.ValidationError as e:
            logger.warning("calibration samples not understood (%s); ignored", e)
            return
        for sample in samples:
            timed = sample.seconds  # by the worker (for a load: the transfer alone)
            if isinstance(sample, LoadSample) and sample.tier in self._planned.get(sample.req_id, {}):
                sample = msgspec.structs.replace(sample, seconds=self.load_seconds(sample))
            kind, est, seconds = self.model.learn(sample)
            logger.debug("learned %s: estimate %.4f s, measured %.4f s, worker's timing %.4f s (%s)",
                         kind, est, seconds, timed, sample)
            if seconds > 0:
                self.stats.own_inc(f"estimate_error:{kind}", abs(est - seconds) / seconds)
                self.stats.own_inc(f"estimate_samples:{kind}")

    def load_seconds(self, sample: LoadSample, now: float | None = None) -> float:
        """What a load cost the request, learned alike for every tier: from the load being
        planned until the scheduler learns it finished, less a prefill instance's compute
        for it (a handoff's), and at least the transfer the worker timed.

        Why whole: the worker times only the transfer (a store's batch get, the Transfer
        Engine's read); the rest of a handoff (the prefill request's overhead, the wait for
        READY, the acknowledgement, the step that reports the pull) is part of what the
        request waits for, and a store load, smaller, is learned alike so that the fits
        compare like with like (docs/benchmarks/decisions.md).

        The prefill instance's own time taken off (its loads and compute,
        :meth:`multi.policy.CostModel.remote_own_s`) is the plan's estimate of it, or the wait
        for READY the tier measured (``waited_s``) when that is shorter: an estimate above the
        real compute would otherwise leave the fit the read alone."""
        per = self._planned.get(sample.req_id, {})
        t0, remote = per.pop(sample.tier)
        if not per:
            self._planned.pop(sample.req_id, None)
        now = time.monotonic() if now is None else now
        if sample.waited_s > 0:
            remote = min(remote, sample.waited_s)
        return max(sample.seconds, now - t0 - remote)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._planned.pop(rid, None)
        d = self._decisions.pop(rid, None)
        holders, params = [], {}
        for name, tier in self.tiers.items():
            hold, p = tier.request_finished(request, block_ids)
            if hold:
                holders.append(name)
            params.update(p or {})
        if holders:
            self._sends[rid] = holders
        if d is not None:
            params["kv_plan"] = [{"start": s.start, "end": s.end, "source": s.source} for s in d.plan.segments]
            params["kv_plan_estimates"] = {"chosen": d.plan.name, "reason": d.reason, "seconds": d.estimates,
                                           "parts": {k: round(v, 6) for k, v in d.plan.parts.items()},
                                           "busy": d.busy}
        return bool(holders), params or None

    def loading_tier(self, request) -> Tier | None:
        """The tier the request's plan loads from (the last, with several), None when none."""
        d = self._decisions.get(request.request_id)
        names = list(d.ranges) if d is not None else []
        return self.tiers[names[-1]] if names else None

    def has_pending_push_work(self) -> bool:
        return any(tier.has_pending_push_work() for tier in self.tiers.values())

    def on_new_request(self, request) -> None:
        for tier in self.tiers.values():
            tier.on_new_request(request)

    def take_events(self):
        for tier in self.tiers.values():
            yield from tier.take_events()

    def reset_cache(self) -> bool:
        """Every tier's reset_cache, and the plans made from lookups of requests that have not
        started a load (asked again, they are planned from new lookups)."""
        ok = [tier.reset_cache() is not False for tier in self.tiers.values()]
        for rid in [rid for rid, d in self._decisions.items() if not d.loads]:
            del self._decisions[rid]
        return all(ok)

    def take_stats(self) -> TieredStats | None:
        """Our counters since the last call, with each tier's scheduler-side stats."""
        for name, tier in self.tiers.items():
            s = tier.get_kv_connector_stats()
            if s is not None and not s.is_empty():
                self.stats.data["tiers"][name] = s.data
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, TieredStats()
        return out

    def shutdown(self) -> None:
        for tier in self.tiers.values():
            tier.shutdown()

