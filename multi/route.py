"""The router's choice for one request, from the composite's cost model (:mod:`multi.policy`).

Inputs: the prompt's ``N`` tokens; from the index (:mod:`multi.kvindex`) the prefix each
instance holds in its own cache, ``C_p`` for prefill instance ``p`` and ``L_d`` for
decode instance ``d``, and the store's reach ``S`` (0 without a store view). Every
instance has its own :class:`multi.policy.CostModel` (its own measured speed) and its own
wait before a request's first token, ``queue_i``:

    queue_i = a_i + b_i * k_i * own_i + c_i * w_i

with ``k_i`` the requests the router has in flight on it (decoding ones included: their
steps share the engine with a new prefill), ``own_i`` this request's own compute there
(``compute_i(cached, N)``), and ``w_i`` the routed prefill work still ahead on it (each
in-flight request's predicted compute minus its elapsed time,
:meth:`multi.instances.Instance.queue_s`). ``(a, b, c)`` start at ``(0, 1, 1)``: each
request in flight delays this one by about its own prefill, since they share the
engine's steps, plus the prefill work ahead. They are fitted online (:class:`multi.calibration.OnlineFit`) to
the measured wait of every streamed answer: its time to first token minus the estimate
without the wait. Under load the fit learns what a request in flight costs the next one;
above capacity ``k`` grows and so does every estimate, which is what admission needs.

Disaggregated (prefill and decode instances):

- the decode instance: the least loaded, by ``(outstanding + waiting, KV usage)``, ties
  broken by the longest ``L_d``;
- through prefill instance ``p``: the cheapest plan of ``p``'s model that uses the
  handoff, with the tiers ``store [L_d, S)`` and ``p2p [.., N-1)`` where the p2p tier
  carries ``remote_cached = C_p`` and ``remote_queue_s = queue_p``, so
  ``seconds = queue_p + compute_p(max(S, C_p), N) + transfer(bytes to decode)``
  (+ the store load when it runs alongside, whichever is longer);
- direct, no prefill instance (``d``'s connector loads ``[L_d, S)`` from the store and
  recomputes the rest): ``queue_d`` plus the cheapest plan of ``d``'s model without the
  handoff, whose recomputation is weighted by ``local_compute_weight``: compute on a
  decode instance delays the decode batch it serves;
- the route is the cheapest of these.

Data-parallel (``plain`` instances): for each instance ``e``,
``queue_e + min plan(N, L_e, store)`` with ``local_compute_weight = 1`` (a plain engine
only serves whole requests); the cheapest wins.

``round-robin`` and ``least-outstanding`` pick the same way the old proxy did (P/D pair,
or a plain instance) and still estimate, so predicted-against-actual metrics exist for
them too.

Admission: with a TTFT target ``T`` (``--ttft-slo`` or per request), a route whose estimate
exceeds ``T`` is rejected before any engine works on it, with
``Retry-After = ceil(estimate - T)`` seconds (at least 1): roughly when the queue ahead
has drained enough. Ties (equal estimates, e.g. an idle pool) go to the instance with
fewer requests in flight, then in turn.

Learning (:meth:`Chooser.learn_prefill`, :meth:`Chooser.learn_transfer`): a prefill's
time on a prefill instance, or a direct request's time to first token, measured while
that instance had no other routed work in flight, is a forward sample for that instance
(queued samples would teach it the queue, not its speed; the store load, when there is
one, is inside it); the time from a prefill's end to the decode's first token is a
``p2p`` load sample of the prefill instance's model.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from mcstore.config import LOAD_PRIOR as STORE_PRIOR
from multi.calibration import OnlineFit
from multi.instances import Instance, Pool
from multi.policy import CostModel, ForwardSample, Inputs, LoadSample, Plan, PolicyConfig, TierReach
from p2p.config import LOAD_PRIOR as P2P_PRIOR

POLICIES = ("kv", "least-outstanding", "round-robin")


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
    # (the prefill instance of a handoff, else the target): what learn_wait needs.
    base_s: float = 0.0
    wait_x: list[float] = field(default_factory=list)
    own_s: float = 0.0  # this request's compute on the waiting instance (a wait feature)


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
            m = self.models[inst.url] = CostModel(cfg)
        return m

    # -- estimates -----------------------------------------------------------------------

    def wait_x(self, inst: Instance, now: float, own_s: float) -> list[float]:
        return [1.0, inst.outstanding * own_s, inst.queue_s(now)]

    def wait_s(self, inst: Instance, now: float, own_s: float) -> float:
        fit = self.waits.get(inst.url)
        if fit is None:
            # Not clipped and quick to forget: a wait swings by orders of magnitude between an
            # idle pool and an overloaded one, and admission must follow it within seconds.
            fit = self.waits[inst.url] = OnlineFit([0.0, 1.0, 1.0], lower=[0.0, 0.0, 0.0],
                                                   upper=[30.0, 30.0, 10.0], scale=[1.0, 1.0, 1.0],
                                                   forget=0.9, clip=float("inf"))
        return fit.predict(self.wait_x(inst, now, own_s))

    def _store(self, s: int) -> list[TierReach]:
        return [TierReach("store", s, prior=STORE_PRIOR)] if s > 0 else []

    def pd_estimate(self, n: int, p: Instance, c_p: int, d: Instance, l_d: int, s: int, now: float,
                    wait: bool = True) -> Plan:
        own = self.model(p).compute_s(min(max(s, c_p), n - 1), n)
        q = self.wait_s(p, now, own) if wait else 0.0
        tiers = self._store(s) + [TierReach("p2p", n - 1, remote_prefill=True, prior=P2P_PRIOR,
                                            remote_cached=c_p, remote_queue_s=q)]
        plans = [x for x in self.model(p).plans(Inputs(prompt_tokens=n, local_tokens=l_d, tiers=tiers,
                                                       bytes_per_token=self.bytes_per_token))
                 if x.tokens("p2p") > 0]
        if plans:
            best = min(plans, key=lambda x: x.seconds)
            best.parts.update(queue_s=q, own_s=own)
            return best
        # The decode instance already holds all but the last token: nothing to hand off.
        return self.direct_estimate(n, d, l_d, s, now, wait)

    def direct_estimate(self, n: int, e: Instance, l_e: int, s: int, now: float, wait: bool = True) -> Plan:
        x = Inputs(prompt_tokens=n, local_tokens=min(l_e, n - 1), tiers=self._store(s),
                   bytes_per_token=self.bytes_per_token)
        best = min(self.model(e).plans(x), key=lambda p: p.seconds)
        own = self.model(e).compute_s(min(max(l_e, s), n - 1), n)
        q = self.wait_s(e, now, own) if wait else 0.0
        return Plan(best.name, best.segments, best.seconds + q, {**best.parts, "queue_s": q, "own_s": own})

    # -- the choice ----------------------------------------------------------------------

    def choose(self, pool: Pool, n: int, match, store: int, slo: float | None) -> Route | None:
        """The route of a request of ``n`` prompt tokens; ``match(inst)`` is the index's
        cached prefix on ``inst`` in tokens. None when no instance is healthy."""
        now = time.monotonic()
        n = max(n, 1)
        if pool.disaggregated:
            route = self._choose_pd(pool, n, match, store, now)
        else:
            route = self._choose_plain(pool, n, match, store, now)
        if route is None:
            return None
        waiter = route.prefill or route.target
        route.wait_x = self.wait_x(waiter, now, route.own_s)
        route.base_s = route.seconds - self.wait_s(waiter, now, route.own_s)
        if slo is not None and route.seconds > slo:
            return Route("reject", route.prefill, route.target, route.seconds, route.plan,
                         f"estimate {route.seconds:.3f}s > target {slo:.3f}s",
                         retry_after=max(1, math.ceil(route.seconds - slo)), store=store)
        return route

    def _choose_pd(self, pool: Pool, n: int, match, store: int, now: float) -> Route | None:
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
            plan = self.pd_estimate(n, p, match(p), d, l_d, store, now)
            return Route("pd", p, d, plan.seconds, plan.name, self.policy, cached_prefill=match(p),
                         cached_target=l_d, store=store, own_s=plan.parts["own_s"])
        direct = self.direct_estimate(n, d, l_d, store, now)
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
            plan = self.pd_estimate(n, p, c_p, d, l_d, store, now)
            if plan.tokens("p2p") > 0:
                reason = "prefill instance's cache" if c_p > max(store, l_d) else "least queued prefill"
                cands.append((plan.seconds, p.outstanding, j + 1,
                              Route("pd", p, d, plan.seconds, plan.name, reason, cached_prefill=c_p,
                                    cached_target=l_d, store=store, own_s=plan.parts["own_s"])))
        return min(cands, key=lambda c: c[:3])[3]

    def _choose_plain(self, pool: Pool, n: int, match, store: int, now: float) -> Route | None:
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
            e = min(order, key=lambda i: (self.direct_estimate(n, i, match(i), store, now).seconds, i.outstanding))
        l_e = match(e)
        plan = self.direct_estimate(n, e, l_e, store, now)
        reason = self.policy if self.policy != "kv" else (
            "instance's cache" if l_e > 0 else "least queued")
        return Route("direct", None, e, plan.seconds, plan.name, reason, cached_target=l_e, store=store,
                     own_s=plan.parts["own_s"])

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
        if self.cfg.calibrate and fit is not None and route.wait_x and waited > 0.005:
            fit.update(route.wait_x, waited)

    def learn_transfer(self, prefill: Instance, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and self.bytes_per_token > 0:
            self.model(prefill).learn(LoadSample("p2p", int(tokens * self.bytes_per_token), seconds))
