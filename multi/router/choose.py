"""The router's choice for one request, from the composite's cost model (:mod:`multi.policy`).

Inputs: the prompt's ``N`` tokens; from the index (:mod:`multi.router.index`) the prefix each
instance holds in its own cache, ``C_p`` for prefill instance ``p`` and ``L_d`` for
decode instance ``d``, and the store's reach ``S`` (0 without a store view). Every
instance has its own :class:`multi.policy.CostModel` (its own measured speed) and its own
wait before a request's first token, ``queue_i``:

    queue_i = a_i + b_i * k_i * own_i + c_i * w_i

with ``k_i`` the requests the router has in flight on it (on a decode or plain instance,
decoding ones included: their steps share the engine with a new prefill; a prefill
instance counts a handoff until its prefill ends, :meth:`Chooser.prefill_done`),
``own_i`` this request's own compute there (``compute_i(cached, N)``), and ``w_i`` the
routed prefill work still ahead on it (the in-flight requests' predicted compute, worked
through in the order sent, minus the time gone,
:meth:`multi.router.instances.Instance.queue_s`). ``(a, b, c)`` start at ``(0, 1, 1)``: each
request in flight delays this one by about its own prefill, since they share the
engine's steps, plus the prefill work ahead. They are fitted online (:class:`multi.calibration.OnlineFit`) to
the measured wait of every streamed answer: its time to first token minus the estimate
without the wait. Under load the fit learns what a request in flight costs the next one;
above capacity ``k`` grows and so does every estimate, which is what admission needs.
The estimates (:meth:`Chooser.pd_estimate`, :meth:`Chooser.direct_estimate`) take these
as records: a :class:`Prompt` (``N``, ``S``) and a :class:`Candidate` per instance (the
instance and the prefix it holds, ``C_p``, ``L_d`` or ``L_e``).

Disaggregated (prefill and decode instances):

- the decode instance: the least loaded, by ``(outstanding + waiting, KV usage)``, ties
  broken by the longest ``L_d``;
- through prefill instance ``p``: the cheapest plan of ``p``'s model that uses the
  handoff, with the tiers ``store [L_d, S)`` and ``p2p [.., N-1)`` where the p2p tier
  carries ``remote_cached = C_p`` and ``remote_queue_s = queue_p``, so
  ``seconds = queue_p + own_p + transfer(bytes to decode)`` with ``own_p`` the cheaper
  for ``p`` of ``load_p([C_p, S)) + compute_p(S, N)`` and ``compute_p(C_p, N)``
  (:meth:`multi.policy.CostModel.remote_own_s`), and the decode instance's store load
  ``[L_d, S)`` alongside, whichever is longer;
- direct, no prefill instance (``d``'s connector loads ``[L_d, S)`` from the store and
  recomputes the rest): ``queue_d`` plus the cheapest plan of ``d``'s model without the
  handoff, whose recomputation is weighted as the connector weighs it
  (:meth:`multi.policy.CostModel.weighted`, with ``busy = k_d``): compute on a decode
  instance delays the decode batch it serves; an idle one's first ``idle_compute_s``
  delay nobody;
- the route is the cheapest of these.

Data-parallel (``plain`` instances): for each instance ``e``,
``queue_e + min plan(N, L_e, store)`` with ``local_compute_weight = 1`` (a plain engine
only serves whole requests); the cheapest wins.

``round-robin`` and ``least-outstanding`` pick the same way the old proxy did (P/D pair,
or a plain instance) and still estimate, so predicted-against-actual metrics exist for
them too.

Admission (:mod:`multi.router.admission`): with a TTFT target ``T`` (``--ttft-slo`` or per
request), a route whose estimate exceeds ``T`` is rejected before any engine works on it,
with ``Retry-After = ceil(estimate - T)`` seconds (at least 1). Ties (equal estimates,
e.g. an idle pool) go to the instance with fewer requests in flight, then in turn.

Learning (:meth:`Chooser.learn_prefill`, :meth:`Chooser.learn_transfer`): a prefill's
time on a prefill instance, or a direct request's time to first token, measured while
that instance had no other routed work in flight, is a forward sample for that instance
(queued samples would teach it the queue, not its speed; the store load, when there is
one, is inside it); the time from a prefill's end to the decode's first token is a
``p2p`` load sample of the prefill instance's model.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field

from mcstore.config import LOAD_PRIOR as STORE_PRIOR
from multi.calibration import OnlineFit
from multi.policy import CostModel, ForwardSample, Inputs, LoadSample, Plan, PolicyConfig, TierReach
from multi.router.admission import rejection
from multi.router.instances import Instance, Pool
from p2p.config import LOAD_PRIOR as P2P_PRIOR

POLICIES = ("kv", "least-outstanding", "round-robin")
WAIT_FLOOR_S = 1.0  # the wait fit's OnlineFit floor (see Chooser.wait_s)


@dataclass(frozen=True)
class Prompt:
    """A request as the estimates see it: ``tokens`` prompt tokens (``N``), the leading
    ``store`` of them held by the store (``S``; 0 without a store view)."""

    tokens: int
    store: int = 0


@dataclass(frozen=True)
class Candidate:
    """An instance a request may use, and the prefix of the prompt it holds in its own
    cache, in tokens (``C_p`` for a prefill instance, ``L_d`` for a decode instance, ``L_e``
    for a plain one)."""

    instance: Instance
    cached: int = 0


@dataclass
class Route:
    kind: str  # "pd" (prefill + decode), "direct" (decode alone or a plain instance), "reject"
    prefill: Instance | None
    target: Instance | None  # decode or plain instance
    seconds: float  # predicted TTFT
    plan: str  # the cost model's plan name
    reason: str
    retry_after: int = 0
    # What the index knew (tokens): for metrics and learning.
    cached_prefill: int = 0
    cached_target: int = 0
    store: int = 0
    # The estimate without the wait, and the wait's features on the instance that waits
    # (the prefill instance of a handoff, else the target, Chooser.wait_features): what
    # learn_wait needs.
    base_s: float = 0.0
    wait_features: list[float] = field(default_factory=list)
    own_s: float = 0.0  # this request's compute on the waiting instance (a wait feature)
    # The kv policy's estimate of every route it weighed (seconds), by "direct URL" or
    # "pd PREFILL_URL": what the decision log (``mctier proxy --decision-log``) records.
    candidates: dict[str, float] = field(default_factory=dict)


class Chooser:
    def __init__(self, policy: str, bytes_per_token: float, cfg: PolicyConfig | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.bytes_per_token = bytes_per_token
        self.cfg = cfg or PolicyConfig()
        self.models: dict[str, CostModel] = {}
        self.waits: dict[str, OnlineFit] = {}
        self._rr = itertools.count()
        self._turn = itertools.count()

    def model(self, inst: Instance) -> CostModel:
        m = self.models.get(inst.url)
        if m is None:
            cfg = self.cfg
            if inst.role == "plain":
                cfg = PolicyConfig(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__},
                                      "local_compute_weight": 1.0})
            # Weighted by the sample, not the prediction: it learns from whole requests, queueing
            # included; weighted by the prediction, the simulated router reused less (docs/benchmarks/decisions.md).
            m = self.models[inst.url] = CostModel(cfg, fit=functools.partial(OnlineFit, relative_to="sample"))
        return m

    # -- estimates -----------------------------------------------------------------------

    def wait_features(self, inst: Instance, now: float, own_s: float) -> list[float]:
        """``[1, k_i * own_i, w_i]`` of the module's wait formula, for the fit's ``(a, b, c)``."""
        return [1.0, inst.outstanding * own_s, inst.queue_s(now)]

    def wait_s(self, inst: Instance, now: float, own_s: float) -> float:
        fit = self.waits.get(inst.url)
        if fit is None:
            # Not clipped and quick to forget: admission must follow waits that swing by orders of
            # magnitude within seconds. Waits under WAIT_FLOOR_S count by their absolute error, above it
            # relative to the sample: weighted relatively, near-0 waits drove the queue's coefficient
            # to 0 (docs/benchmarks/sim-cluster.md).
            fit = self.waits[inst.url] = OnlineFit([0.0, 1.0, 1.0], lower=[0.0, 0.0, 0.0],
                                                   upper=[30.0, 30.0, 10.0], scale=[1.0, 1.0, 1.0],
                                                   forget=0.9, clip=float("inf"), floor=WAIT_FLOOR_S,
                                                   relative_to="sample")
        return fit.predict(self.wait_features(inst, now, own_s))

    def _store_tiers(self, s: int) -> list[TierReach]:
        """The store as a tier reaching ``s`` tokens (none when it holds nothing)."""
        return [TierReach("store", s, prior=STORE_PRIOR)] if s > 0 else []

    def pd_estimate(self, prompt: Prompt, prefill: Candidate, decode: Candidate, now: float,
                    wait: bool = True) -> Plan:
        """The cheapest handoff plan through ``prefill`` to ``decode`` (the module's formulas;
        ``parts`` carries ``queue_s`` and ``own_s``), or, when ``decode`` already holds all
        but the last token, :meth:`direct_estimate` on it. ``wait=False`` leaves the wait out."""
        n, s = prompt.tokens, prompt.store
        p, c_p, d, l_d = prefill.instance, prefill.cached, decode.instance, decode.cached
        own = self.model(p).compute_s(min(max(s, c_p), n - 1), n)
        q = self.wait_s(p, now, own) if wait else 0.0
        tiers = self._store_tiers(s) + [TierReach("p2p", n - 1, remote_prefill=True, prior=P2P_PRIOR,
                                                  remote_cached=c_p, remote_queue_s=q)]
        plans = [x for x in self.model(p).plans(Inputs(prompt_tokens=n, local_tokens=l_d, tiers=tiers,
                                                       bytes_per_token=self.bytes_per_token, busy=d.outstanding))
                 if x.tokens("p2p") > 0]
        if plans:
            best = min(plans, key=lambda x: x.seconds)
            best.parts.update(queue_s=q, own_s=own)
            return best
        # The decode instance already holds all but the last token: nothing to hand off.
        return self.direct_estimate(prompt, decode, now, wait)

    def direct_estimate(self, prompt: Prompt, target: Candidate, now: float, wait: bool = True) -> Plan:
        """The cheapest plan of the whole request on ``target`` (a decode or plain instance,
        no handoff) plus its wait (``parts``: ``queue_s``, ``own_s``)."""
        n, s, e, l_e = prompt.tokens, prompt.store, target.instance, target.cached
        x = Inputs(prompt_tokens=n, local_tokens=min(l_e, n - 1), tiers=self._store_tiers(s),
                   bytes_per_token=self.bytes_per_token, busy=e.outstanding)
        best = min(self.model(e).plans(x), key=lambda p: p.seconds)
        own = self.model(e).compute_s(min(max(l_e, s), n - 1), n)
        q = self.wait_s(e, now, own) if wait else 0.0
        return Plan(best.name, best.segments, best.seconds + q, {**best.parts, "queue_s": q, "own_s": own})

    # -- the choice ----------------------------------------------------------------------

    def choose(self, pool: Pool, n: int, match, store: int, slo: float | None,
               now: float | None = None) -> Route | None:
        """The route of a request of ``n`` prompt tokens, ``store`` of them in the store;
        ``match(inst)`` is the index's cached prefix on ``inst`` in tokens. A route that misses
        the TTFT target ``slo`` (seconds; None: no target) comes back as a ``reject``
        (:func:`multi.router.admission.rejection`). None when no instance is healthy. ``now``
        (``time.monotonic()`` unless given) is the clock of :meth:`Instance.queue_s`; the
        cluster simulator (``bench/sim``) passes its own."""
        now = time.monotonic() if now is None else now
        prompt = Prompt(max(n, 1), store)
        if pool.disaggregated:
            route = self._choose_pd(pool, prompt, match, now)
        else:
            route = self._choose_plain(pool, prompt, match, now)
        if route is None:
            return None
        waiter = route.prefill or route.target
        route.wait_features = self.wait_features(waiter, now, route.own_s)
        route.base_s = route.seconds - self.wait_s(waiter, now, route.own_s)
        rejected = rejection(route.seconds, slo)
        if rejected is not None:
            reason, retry_after = rejected
            return Route("reject", route.prefill, route.target, route.seconds, route.plan, reason,
                         retry_after=retry_after, store=store, candidates=route.candidates)
        return route

    def _choose_pd(self, pool: Pool, prompt: Prompt, match, now: float) -> Route | None:
        n, store = prompt.tokens, prompt.store
        prefills, decodes = pool.role("prefill"), pool.role("decode")
        if not decodes:
            return None
        if self.policy == "round-robin":
            k = next(self._rr)
            d = decodes[k % len(decodes)]
            p = prefills[k % len(prefills)] if prefills else None
        elif self.policy == "least-outstanding":
            d = min(decodes, key=lambda i: i.outstanding)
            p = min(prefills, key=lambda i: i.outstanding) if prefills else None
        else:
            d = min(decodes, key=lambda i: (i.outstanding + i.waiting, round(i.kv_usage, 2), -match(i)))
            p = None
        l_d = match(d)
        if self.policy != "kv":
            if p is None:
                return None
            plan = self.pd_estimate(prompt, Candidate(p, match(p)), Candidate(d, l_d), now)
            return Route("pd", p, d, plan.seconds, plan.name, self.policy, cached_prefill=match(p),
                         cached_target=l_d, store=store, own_s=plan.parts["own_s"])
        direct = self.direct_estimate(prompt, Candidate(d, l_d), now)
        # (estimate, requests in flight, turn): equal estimates go to the less busy, then in turn.
        cands = [(direct.seconds, d.outstanding, 0,
                  Route("direct", None, d, direct.seconds, direct.name,
                        "decode instance and store cover the prompt" if max(l_d, store) >= n - 1
                        else "handoff does not pay", cached_target=l_d, store=store,
                        own_s=direct.parts["own_s"]))]
        turn = next(self._turn)
        for j in range(len(prefills)):
            p = prefills[(turn + j) % len(prefills)]
            c_p = match(p)
            plan = self.pd_estimate(prompt, Candidate(p, c_p), Candidate(d, l_d), now)
            if plan.tokens("p2p") > 0:
                reason = "prefill instance's cache" if c_p > max(store, l_d) else "least queued prefill"
                cands.append((plan.seconds, p.outstanding, j + 1,
                              Route("pd", p, d, plan.seconds, plan.name, reason, cached_prefill=c_p,
                                    cached_target=l_d, store=store, own_s=plan.parts["own_s"])))
        best = min(cands, key=lambda c: c[:3])[3]
        best.candidates = {f"{c[3].kind} {(c[3].prefill or c[3].target).url}": c[0] for c in cands}
        return best

    def _choose_plain(self, pool: Pool, prompt: Prompt, match, now: float) -> Route | None:
        store = prompt.store
        plain = pool.role("plain")
        if not plain:
            return None
        if self.policy == "round-robin":
            e = plain[next(self._rr) % len(plain)]
        elif self.policy == "least-outstanding":
            e = min(plain, key=lambda i: i.outstanding)
        else:
            turn = next(self._turn)
            order = [plain[(turn + j) % len(plain)] for j in range(len(plain))]
            est = {i.url: self.direct_estimate(prompt, Candidate(i, match(i)), now).seconds for i in order}
            e = min(order, key=lambda i: (est[i.url], i.outstanding))
        l_e = match(e)
        plan = self.direct_estimate(prompt, Candidate(e, l_e), now)
        reason = self.policy if self.policy != "kv" else (
            "instance's cache" if l_e > 0 else "least queued")
        route = Route("direct", None, e, plan.seconds, plan.name, reason, cached_target=l_e, store=store,
                      own_s=plan.parts["own_s"])
        if self.policy == "kv":
            route.candidates = {f"direct {u}": s for u, s in est.items()}
        return route

    # -- bookkeeping (the router and bench/sim both call these) ---------------------------

    def begin(self, route: Route, inst: Instance, n: int, cached: int, rid: str, now: float) -> bool:
        """A routed request starts on ``inst`` (the prefill instance of a handoff, else the
        target): its predicted work is queued there and it counts as outstanding on ``inst``
        and, for a handoff, on the decode instance. Returns whether ``inst`` had nothing
        else in flight (a sample taken alone teaches speed, not queueing)."""
        alone = not inst.inflight
        inst.inflight[rid] = (self.prefill_work(inst, n, cached), now)
        inst.outstanding += 1
        if route.kind == "pd":
            route.target.outstanding += 1
        return alone

    def prefill_done(self, inst: Instance, rid: str) -> bool:
        """A handoff's prefill on ``inst`` succeeded: its work there is over, so it leaves
        ``inst``'s queue and outstanding count now, not when the decode instance's answer
        ends (the decode runs elsewhere). Returns whether nothing else was in flight on
        ``inst`` (with :meth:`begin`'s answer: the prefill ran alone)."""
        if inst.inflight.pop(rid, None) is None:
            return False
        inst.outstanding -= 1
        return not inst.inflight

    def end(self, route: Route, inst: Instance, rid: str) -> None:
        """The request's answer is over (its last token, or a failure)."""
        if inst.inflight.pop(rid, None) is not None:
            inst.outstanding -= 1
        if route.kind == "pd":
            route.target.outstanding -= 1

    def learn_request(self, route: Route, inst: Instance, n: int, cached: int, alone: bool,
                      ttft_s: float | None, prefill_s: float | None) -> None:
        """What one answered request teaches: a handoff's prefill time (``prefill_s``, the
        prefill request's own duration) is a forward sample of ``inst`` and the rest of its
        time to first token a ``p2p`` load sample; a direct request's time to first token is
        a forward sample; and the time to first token teaches the wait fit. ``ttft_s`` is
        None for an answer that was not streamed (no first token seen)."""
        # The store load ([its cache, S), before its compute) is inside the time it took: its
        # predicted share is taken out, left in it skews the forward fit (docs/benchmarks/sim-cluster.md).
        own = route.cached_prefill if route.kind == "pd" else route.cached_target
        loaded = 0.0
        if route.store > own and (route.kind == "pd" or "store" in route.plan):
            loaded = self.model(inst).load_s(self._store_tiers(route.store)[0],
                                             (route.store - own) * self.bytes_per_token)
        if route.kind == "pd" and prefill_s is not None:
            self.learn_prefill(inst, n, cached, prefill_s - loaded, alone)
            if ttft_s is not None:
                self.learn_transfer(inst, n - max(route.cached_target, route.store), ttft_s - prefill_s)
        elif route.kind != "pd" and ttft_s is not None:
            self.learn_prefill(inst, n, cached, ttft_s - loaded, alone)
        if ttft_s is not None:
            self.learn_wait(route, ttft_s)

    # -- learning ------------------------------------------------------------------------

    def prefill_work(self, inst: Instance, n: int, cached: int) -> float:
        """Predicted compute seconds of a prefill of ``n`` tokens with ``cached`` of them
        already there (what :meth:`Instance.queue_s` counts down)."""
        return self.model(inst).compute_s(min(cached, n - 1), n)

    def learn_prefill(self, inst: Instance, n: int, cached: int, seconds: float, alone: bool) -> None:
        if alone and n > cached:
            c = min(cached, n - 1)
            self.model(inst).learn(ForwardSample([n - c], [c], seconds))

    def learn_wait(self, route: Route, ttft_s: float) -> None:
        """A streamed answer's time to first token teaches the waiting instance's wait fit."""
        waited = ttft_s - route.base_s
        fit = self.waits.get((route.prefill or route.target).url)
        if self.cfg.calibrate and fit is not None and route.wait_features and waited > 0.005:
            fit.update(route.wait_features, waited)

    def learn_transfer(self, prefill: Instance, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and self.bytes_per_token > 0:
            self.model(prefill).learn(LoadSample("p2p", int(tokens * self.bytes_per_token), seconds))
