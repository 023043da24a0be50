"""The router's books and what it learns: per instance, the requests in flight (queued
prefill work, decode occupancy), its cost model and fit (:mod:`multi.router.fits`), and the
honesty window (:mod:`multi.router.honesty`). :class:`multi.router.choose.Chooser` adds the
estimates and the choice; the router (:mod:`multi.router.forward`) and the cluster simulator
(``bench/sim``) call the bookkeeping in the same order: :meth:`Ledger.begin` when a route
starts, :meth:`Ledger.prefill_done` when a handoff's prefill answered,
:meth:`Ledger.first_token`, :meth:`Ledger.end`, then :meth:`Ledger.learn_request`.

Learning: a request's measured time on the instance that computed it (a handoff's prefill
request, a direct request's time to first token), less the predicted store load before its
compute, teaches that instance's fit with the wait features it had when it was routed
(all zero when nothing else ran there: a speed sample); the time from a handoff's prefill
answer to its first token, less the decode instance's predicted part after the transfer
(its last token's compute and the prefill work routed to it before), is a ``p2p`` load
sample of the prefill instance's model; every streamed answer's predicted and actual time
to first token go to the honesty window. Formulas: ``docs/design/cost-model.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from mcstore.config import LOAD_PRIOR as STORE_PRIOR
from multi.calibration import OnlineFit
from multi.policy import CostModel, LoadSample, PolicyConfig, TierReach
from multi.router.admission import LateBudget
from multi.router.fits import InstanceFit
from multi.router.honesty import Honesty
from multi.router.instances import Instance
from p2p.config import LOAD_PRIOR as P2P_PRIOR


@dataclass
class Route:
    kind: str  # "pd" (prefill + decode), "direct" (decode alone or a plain instance), "reject"
    prefill: Instance | None
    target: Instance | None  # decode or plain instance
    seconds: float  # the score the choice compared (compute on a busy decode instance weighted)
    plan: str  # the cost model's plan name
    reason: str
    retry_after: int = 0
    # What the index knew (tokens): for metrics and learning.
    cached_prefill: int = 0
    cached_target: int = 0
    store: int = 0
    store_check: str | None = None  # how the store's reach was settled (multi.router.storeview)
    store_events: int | None = None  # what the store tier's KV events said, in tokens (None: not used)
    # The estimate without the wait, and the wait's features on the instance that waits
    # (the prefill instance of a handoff, else the target, Chooser.wait_features).
    base_s: float = 0.0
    wait_features: list[float] = field(default_factory=list)
    own_s: float = 0.0  # this request's compute on the waiting instance at its fit's anchor (a wait feature)
    predicted: float = 0.0  # its time to first token, unweighted (admission, metrics, honesty)
    tail_s: float = 0.0  # a handoff's predicted part on the decode instance after the transfer
    fixed_s: float = 0.0  # the waiting instance's predicted loads before its compute
    compute: tuple[int, int] = (0, 0)  # its compute: (new tokens, cached tokens before them)
    # The kv policy's score of every route it weighed, by "direct URL" or "pd PREFILL_URL"
    # (the decision log), and the best predicted TTFT of each kind (multi.router.honesty).
    candidates: dict[str, float] = field(default_factory=dict)
    alternatives: dict[str, float] = field(default_factory=dict)
    mode: str = ""  # the policy that chose: the router's, or kv's fallback
    slo: float | None = None  # its TTFT target in seconds (admission), None without one
    margin: float | None = None  # admission's margin on ``predicted`` (multi.router.admission)
    risky: bool = False  # admitted at risk: it meets its target as estimated, not with the margin


class Ledger:
    """Per instance: its cost model, its fit, the requests in flight; and the honesty window
    (module docstring)."""

    def __init__(self, bytes_per_token: float, cfg: PolicyConfig | None = None):
        self.bytes_per_token = bytes_per_token
        self.cfg = cfg or PolicyConfig()
        self.models: dict[str, CostModel] = {}
        self.fits: dict[str, InstanceFit] = {}
        self.honesty = Honesty()
        self.late = LateBudget()  # admission's budget for routes admitted at risk

    def floor_s(self) -> float:
        """The instance fits' floor in seconds (:data:`multi.router.choose.WAIT_FLOOR_S`)."""
        return 1.0

    def model(self, inst: Instance) -> CostModel:
        m = self.models.get(inst.url)
        if m is None:
            cfg = self.cfg
            if inst.role == "plain":
                cfg = PolicyConfig(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__},
                                      "local_compute_weight": 1.0})
            # Its load fits weighted by the sample, not the prediction: they learn from whole requests,
            # queueing included; weighted by the prediction, the simulated router reused less
            # (docs/benchmarks/decisions.md). Its compute is the instance fit's (multi.router.fits).
            m = self.models[inst.url] = CostModel(cfg, fit=functools.partial(OnlineFit, relative_to="sample"))
            m.prefill.coef = self.fit(inst).compute_coef.copy()
        return m

    def seed(self, inst: Instance, compute: list[float], weight: float, scale_s: float | None = None) -> None:
        """The start-up probe's ``[step, token, attn]`` of ``inst`` and its time of a long
        prompt (:mod:`multi.router.probe`, :meth:`multi.router.fits.InstanceFit.seed`)."""
        self.fit(inst).seed(compute, weight, scale_s)
        self.model(inst).prefill.coef = self.fit(inst).compute_coef.copy()

    def seed_handoff(self, prefill: Instance, seconds: float, tokens: int) -> None:
        """The probe's handoff through ``prefill``: ``seconds`` from its prefill's answer to
        the decode's, for ``tokens`` tokens of KV, less the decode's compute; the ``p2p``
        fit's latency becomes that less the bytes at the prior's bandwidth."""
        fit = self.model(prefill).load_fit("p2p", P2P_PRIOR)
        per_byte = float(fit.coef[1])
        fit.reseed([max(0.0, seconds - tokens * self.bytes_per_token * per_byte), per_byte], weight=2.0)

    def fit(self, inst: Instance) -> InstanceFit:
        f = self.fits.get(inst.url)
        if f is None:
            f = self.fits[inst.url] = InstanceFit(self.cfg, self.floor_s())
        return f

    # -- estimates -----------------------------------------------------------------------

    def wait_features(self, inst: Instance, now: float, own_s: float) -> list[float]:
        """``[busy, k_i * own_i, w_i, decoding_i]`` of the wait (:mod:`multi.router.choose`)."""
        k = inst.outstanding
        return [1.0 if k > 0 else 0.0, k * own_s, inst.queue_s(now), float(len(inst.decoding))]

    def wait_s(self, inst: Instance, now: float, own_s: float) -> float:
        return self.fit(inst).wait_s(self.wait_features(inst, now, own_s))

    def _store_tiers(self, s: int) -> list[TierReach]:
        """The store as a tier reaching ``s`` tokens (none when it holds nothing)."""
        return [TierReach("store", s, prior=STORE_PRIOR)] if s > 0 else []

    # -- bookkeeping (the router and bench/sim both call these) ---------------------------

    def begin(self, route: Route, inst: Instance, n: int, cached: int, rid: str, now: float) -> bool:
        """A routed request starts on ``inst`` (the prefill instance of a handoff, else the
        target): its predicted work is queued there (with its TTFT deadline, ``now`` plus
        ``route.slo``, when it has a target) and it counts as outstanding on ``inst``
        and, for a handoff, on the decode instance. Returns whether ``inst`` had nothing
        else in flight (a sample taken alone needs no wait modelled)."""
        alone = not inst.inflight and not inst.decoding
        inst.inflight[rid] = (self.prefill_work(inst, n, cached), now)
        if route.slo is not None:  # what a later prefill batched with it must not push it past
            inst.deadlines[rid] = now + route.slo
        if route.risky:
            self.late.inflight.add(rid)
        inst.outstanding += 1
        if route.kind == "pd":
            route.target.outstanding += 1
        return alone

    def prefill_done(self, inst: Instance, rid: str, now: float | None = None) -> bool:
        """A handoff's prefill on ``inst`` succeeded (at ``now``, the clock of
        :meth:`Instance.queue_s`; None: unknown): its work there is over, so it leaves
        ``inst``'s queue and outstanding count now, not when the decode instance's answer
        ends (the decode runs elsewhere). Returns whether nothing else was in flight on
        ``inst`` (with :meth:`begin`'s answer: the prefill ran alone)."""
        if not inst.depart(rid, now):
            return False
        inst.outstanding -= 1
        return not inst.inflight

    def first_token(self, route: Route, inst: Instance, rid: str, now: float | None = None) -> None:
        """The request's first token is out (at ``now``, as :meth:`prefill_done`): its prefill
        leaves ``inst``'s queue (a direct route) and it decodes on the target until :meth:`end`."""
        if route.kind == "pd":
            route.target.decoding.add(rid)
        elif inst.depart(rid, now):
            inst.decoding.add(rid)

    def end(self, route: Route, inst: Instance, rid: str, now: float | None = None) -> None:
        """The request's answer is over (its last token, or a failure; at ``now``, as
        :meth:`prefill_done`)."""
        self.late.inflight.discard(rid)  # its lateness is known now (learn_request records it)
        if inst.depart(rid, now) or (route.kind != "pd" and rid in inst.decoding):
            inst.outstanding -= 1
        inst.decoding.discard(rid)
        if route.kind == "pd":
            route.target.outstanding -= 1
            route.target.decoding.discard(rid)

    def learn_request(self, route: Route, inst: Instance, n: int, cached: int, alone: bool,
                      ttft_s: float | None, prefill_s: float | None) -> None:
        """What one answered request teaches (``ttft_s`` None for an answer not streamed, no
        first token seen): a handoff's prefill time (``prefill_s``) teaches ``inst``'s fit and
        the rest of its time to first token, less the decode instance's predicted part, its
        ``p2p`` load fit; a direct request's time to first token teaches the target's fit;
        taken alone as a speed sample (:meth:`learn_prefill`), else with the wait it had
        (:meth:`learn_queued`). Every streamed answer goes to the honesty window, and one
        with a target to admission's lateness budget."""
        # The store load ([its cache, S), before its compute) is inside the time it took: its
        # predicted share is taken out, left in it skews the compute fit (docs/benchmarks/sim-cluster.md).
        own = route.cached_prefill if route.kind == "pd" else route.cached_target
        loaded = 0.0
        if route.store > own and (route.kind == "pd" or "store" in route.plan):
            loaded = self.model(inst).load_s(self._store_tiers(route.store)[0],
                                             (route.store - own) * self.bytes_per_token)
        measured = prefill_s if route.kind == "pd" else ttft_s
        if measured is not None and route.wait_features:  # no features: a retry, estimated elsewhere
            self.learn_prefill(inst, n, cached, measured - loaded, alone)
            if not alone:
                self.learn_queued(inst, route, n, cached, measured - loaded)
        if route.kind == "pd" and prefill_s is not None and ttft_s is not None:
            self.learn_transfer(inst, n - max(route.cached_target, route.store), ttft_s - prefill_s - route.tail_s)
        if ttft_s is not None:
            self.honesty.record(route.kind, route.predicted, ttft_s, route.alternatives)
            if route.slo is not None:
                self.late.record(ttft_s, route.slo)

    # -- learning ------------------------------------------------------------------------

    def prefill_work(self, inst: Instance, n: int, cached: int) -> float:
        """Predicted compute seconds of a prefill of ``n`` tokens with ``cached`` of them
        already there (what :meth:`Instance.queue_s` counts down)."""
        return self.model(inst).compute_s(min(cached, n - 1), n)

    def _learn(self, inst: Instance, n: int, cached: int, wait_x: list[float], seconds: float) -> None:
        if not self.cfg.calibrate or n <= cached:
            return
        c = min(cached, n - 1)
        f = self.fit(inst)
        f.learn(n - c, c, wait_x, seconds)
        self.model(inst).prefill.coef = f.compute_coef.copy()

    def learn_prefill(self, inst: Instance, n: int, cached: int, seconds: float, alone: bool) -> None:
        """A compute of ``n - cached`` tokens measured while nothing else of the router's ran
        on ``inst`` (``alone``; else nothing: :meth:`learn_queued` takes it)."""
        if alone:
            self._learn(inst, n, cached, [0.0, 0.0, 0.0, 0.0], seconds)

    def learn_queued(self, inst: Instance, route: Route, n: int, cached: int, seconds: float) -> None:
        """A compute measured with other requests on ``inst``: with the wait it had."""
        self._learn(inst, n, cached, route.wait_features, seconds)

    def learn_wait(self, route: Route, ttft_s: float) -> None:
        """A direct route's time to first token, with the wait it had (the unit tests' entry
        to :meth:`learn_queued`): less the route's predicted loads, it teaches the target's fit."""
        if route.kind == "direct" and route.wait_features and route.compute[0] > 0:
            new, ctx = route.compute
            self._learn(route.target, new + ctx, ctx, route.wait_features, ttft_s - route.fixed_s)

    def learn_transfer(self, prefill: Instance, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and self.bytes_per_token > 0:
            self.model(prefill).learn(LoadSample("p2p", int(tokens * self.bytes_per_token), seconds))
