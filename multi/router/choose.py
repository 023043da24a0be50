"""The router's choice for one request, from the composite's cost model (:mod:`multi.policy`).

Inputs: the prompt's ``N`` tokens; from the index (:mod:`multi.router.index`) the prefix each
instance holds in its own cache, ``C_p`` for prefill instance ``p`` and ``L_d`` for
decode instance ``d``, and the store's reach ``S`` (0 without a store view). Every
instance has its own :class:`multi.policy.CostModel` (its own measured speed) and its own
wait before a request's first token, ``queue_i``:

    queue_i = a_i * busy_i + b_i * k_i * own_i + c_i * w_i + d_i * decoding_i

with ``k_i`` the requests the router has in flight on it (on a decode or plain instance,
decoding ones included; a prefill instance counts a handoff until its prefill ends,
:meth:`Chooser.prefill_done`), ``busy_i`` 1 when ``k_i > 0``, ``own_i`` this request's own
compute there, ``w_i`` the routed prefill work still ahead on it (worked through in the
order sent, :meth:`multi.router.instances.Instance.queue_s`; a request leaves it at its
first token, :meth:`Chooser.first_token`) and ``decoding_i`` the requests past their first
token there. The compute and the wait coefficients are one fit per instance
(:mod:`multi.router.fits`), learned from every answer, those under concurrency included,
and seeded by the start-up probe (:mod:`multi.router.probe`).

Disaggregated (prefill and decode instances):

- the decode instance: the least loaded, by ``(outstanding + waiting, KV usage)``, ties
  broken by the longest ``L_d``;
- through prefill instance ``p``: the cheapest plan of ``p``'s model that uses the
  handoff, with the tiers ``store [L_d, S)`` and ``p2p [.., N-1)`` where the p2p tier
  carries ``remote_cached = C_p`` and ``remote_queue_s = queue_p``, so
  ``seconds = queue_p + own_p + transfer(bytes to decode)`` with ``own_p`` the cheaper
  for ``p`` of ``load_p([C_p, S)) + compute_p(S, N)`` and ``compute_p(C_p, N)``, and the
  decode instance's store load ``[L_d, S)`` alongside, whichever is longer; then the
  decode instance computes the last token once the prefill work routed to it before has
  cleared: ``+ max(0, w_d - (queue_p + own_p + transfer))``;
- direct, no prefill instance (``d``'s connector loads ``[L_d, S)`` from the store and
  recomputes the rest): ``queue_d`` plus the cheapest plan of ``d``'s model without the
  handoff, whose recomputation is weighted as the connector weighs it
  (:meth:`multi.policy.CostModel.weighted`, with ``busy = k_d``);
- with ``direct_to_prefill`` (``mctier proxy``'s default), also direct on each prefill
  instance ``p``, as on a plain one: ``queue_p`` plus the cheapest plan of ``p``'s model
  from ``C_p`` (an idle prefill instance answers a short request as soon as an engine
  alone would; a decode instance's connector may cost more per request);
- the route is the cheapest of these (``Route.seconds``, the score); ``Route.predicted``
  is the same route's time to first token with the weighting left out (what admission,
  the metrics and :mod:`multi.router.honesty` compare with the answer).

Data-parallel (``plain`` instances): for each instance ``e``, the request's own time to
first token there plus what its prefill costs the requests already there:

    score_e = queue_e + own_e + fixed_e + own_e * pending_e

with ``queue_e + min plan(N, L_e, store)`` (``local_compute_weight = 1``) the first part and
``pending_e`` the requests routed to ``e`` still predicted without their first token
(:meth:`multi.router.instances.Instance.pending`): the engine puts every prompt waiting
when a step starts into that step, so those queued get their first token only after this
prefill too, and the one computing is followed by it in the steps that decode it. Without
that term a conversation's home kept its next turns while its queue cost them less than
recomputing their prefix elsewhere, and the conversations in flight together piled on one
engine (multi-turn chat on plain engines: a predicted wait of 31 ms against round-robin's
9 ms, docs/benchmarks/router.md). Every instance whose score is within a factor ``near`` of the
cheapest counts as equally fast: ``near = exp(spread_0.9)``, the error of nine estimates in ten
measured by the honesty window (:meth:`multi.router.honesty.Honesty.spread` at :data:`NEAR_Q`,
clamped to [1, ``NEAR``]), ``NEAR`` (1.25x, their accuracy target) until it has measured one (with
the median error, a band of 0-9% on the fast CPU class, scores apart by the estimates' noise broke
the alternation of a closed loop's arrivals, docs/benchmarks/router.md). A prompt no instance
holds any of goes in turn (its own, as round-robin's) to the first instance within
:data:`NEW_BAND` of the cheapest score; of other prompts, among those in the band the one holding
the longest prefix ``L_e`` wins, then the one with fewer requests still without their first token
(``inflight``: beside one still prefilling a prompt shares its steps, beside one decoding it waits
a token's step; fewer in flight alone put each arrival beside the request that had just started,
docs/benchmarks/router.md), then in turn. Not by fewer in flight: requests decoding cost an
arrival a token's step, which the score already counts (the wait's ``decoding_i``), and in a
closed loop that tie-break broke the arrivals' alternation, which keeps a conversation's home
beside the others' (multi-turn chat on plain engines, docs/benchmarks/router.md).

Fixed policies (they still estimate, so predicted-against-actual metrics exist for them):
``round-robin`` and ``least-outstanding`` as the earlier proxy (a P/D pair always handing
off, or a plain instance); ``direct``: every request whole on the least loaded decode
instance (in a plain pool: the instance with the fewest requests in flight, ties to the
longest cached prefix, then in turn); ``handoff``: every request through the prefill
instance with the fewest in flight (ties to the longest cached prefix, then in turn) to the
least loaded decode instance. ``kv`` falls back to one of them while its estimates drift
(:mod:`multi.router.honesty`); with ``direct_to_prefill`` its ``direct`` fallback serves a
request whole on the decode or prefill instance with the fewest requests in flight.

Admission (:mod:`multi.router.admission`): with a TTFT target ``T``, a route whose
estimate exceeds ``T`` is rejected before any engine works on it: ``predicted * margin``
(``margin``: :meth:`multi.router.honesty.Honesty.margin`, the honesty window's upper
ratio of actual to predicted, with a prior until the window has measured the route's kind:
1.5 while any instance has a request in flight or decoding, 1 on an idle pool;
:func:`multi.router.admission.estimate_s`), unless ``predicted`` meets ``T`` and the
lateness budget allows a risk (:class:`multi.router.admission.LateBudget`). A route is also rejected when its prefill,
batched with the requests queued and not yet started on the instance that computes it,
would push one admitted with a target past it (:func:`multi.router.admission.pushed_late`;
"not yet started": without its first token, sent at ``t_j``, predicted to start at ``start_j``
and end at ``end_j``, with ``t_j + m * (start_j - t_j) > now`` (its wait counted with
admission's margin ``m``) or ``end_j <= now`` (late:
behind the queue model, its start is not known either)).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from multi.policy import Inputs, Plan, PolicyConfig, TierReach
from multi.router.admission import estimate_s, pushed_late, rejection
from multi.router.honesty import PRIOR_MARGIN
from multi.router.instances import Instance, Pool
from multi.router.ledger import Ledger, Route
from p2p.config import LOAD_PRIOR as P2P_PRIOR

POLICIES = ("kv", "least-outstanding", "round-robin", "direct", "handoff")
WAIT_FLOOR_S = 1.0  # the instance fits' OnlineFit floor (multi.router.fits), read when a fit is made
# Plain instances whose scores are within this factor of the best count as equally fast
# until the honesty window measures the estimates' spread (then exp of its NEAR_Q-quantile,
# at most this): the estimates' own accuracy target (+-25%, multi.router.honesty's LEAVE).
# Among them the choice keeps affinity, then balance: a prompt placed where its prefix is
# not becomes that prefix's home for its later requests (a conversation's next turns), so a
# choice by a difference the estimates cannot vouch for piled conversations on one engine
# (docs/benchmarks/router.md, multi-turn chat on plain engines).
NEAR = 1.25
NEAR_Q = 0.9  # the band: a difference nine estimates in ten are more accurate than
# A prompt no plain instance holds any of goes in turn, as round-robin's, unless its turn's score
# is this many times the cheapest: placed by the queue of the moment, new conversations' homes
# left consecutive ones on one engine, to meet at every turn (docs/benchmarks/router.md).
NEW_BAND = 2.0


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


class Chooser(Ledger):
    """The estimates and the choice; the books and the learning are :class:`Ledger`'s."""

    def __init__(self, policy: str, bytes_per_token: float, cfg: PolicyConfig | None = None,
                 direct_to_prefill: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        super().__init__(bytes_per_token, cfg)
        self.policy = policy
        self.direct_to_prefill = direct_to_prefill  # kv may serve a request whole on a prefill instance
        # The honesty check: the kv policy's fallback only while it calibrates (frozen priors
        # are a request for decisions that depend on the inputs alone).
        self.honesty.enabled = policy == "kv" and self.cfg.calibrate
        self._rr = itertools.count()
        self._turn, self._new = itertools.count(), itertools.count()  # _new: prompts held nowhere (NEW_BAND)

    def floor_s(self) -> float:
        return WAIT_FLOOR_S

    # -- estimates -----------------------------------------------------------------------

    def pd_estimate(self, prompt: Prompt, prefill: Candidate, decode: Candidate, now: float,
                    wait: bool = True) -> Plan:
        """The cheapest handoff plan through ``prefill`` to ``decode`` (the module's formulas;
        ``parts`` adds ``queue_s``, ``own_s``, ``ttft_s`` (unweighted), ``prefill_s`` (the
        prefill request's time), ``fixed_s`` (its loads), ``tail_s`` (the decode instance's
        part after the transfer) and ``compute_from``/``compute_to`` (the prefill instance's
        compute)), or, when ``decode`` already holds all but the last token,
        :meth:`direct_estimate` on it. ``wait=False`` leaves the waits out."""
        n, s = prompt.tokens, prompt.store
        p, c_p, d, l_d = prefill.instance, prefill.cached, decode.instance, decode.cached
        mp = self.model(p)
        # The prefill instance's own part, as its chooser sees it (CostModel.remote_own_s).
        mine = mp.choose(Inputs(prompt_tokens=n, local_tokens=min(c_p, n - 1), tiers=self._store_tiers(s),
                                bytes_per_token=self.bytes_per_token))[0]
        own, start = mine.parts["compute_s"], n - mine.tokens("recompute")
        own_w = self.fit(p).anchor_compute_s(n - start, start)  # the wait's feature (multi.router.fits)
        q = self.wait_s(p, now, own_w) if wait else 0.0
        tiers = self._store_tiers(s) + [TierReach("p2p", n - 1, remote_prefill=True, prior=P2P_PRIOR,
                                                  remote_cached=c_p, remote_queue_s=q)]
        plans = [x for x in mp.plans(Inputs(prompt_tokens=n, local_tokens=l_d, tiers=tiers,
                                            bytes_per_token=self.bytes_per_token, busy=d.outstanding))
                 if x.tokens("p2p") > 0]
        if not plans:  # the decode instance already holds all but the last token: nothing to hand off
            return self.direct_estimate(prompt, decode, now, wait)
        best = min(plans, key=lambda x: x.seconds)
        ready = best.seconds - best.parts["recompute_s"]  # the KV is on the decode instance
        extra = max(0.0, d.queue_s(now) - ready) if wait else 0.0
        ttft = ready + best.parts["compute_s"] + extra
        loads = mine.seconds - mine.parts["recompute_s"]
        best.seconds += extra
        best.parts.update(queue_s=q, own_s=own_w, ttft_s=ttft, prefill_s=q + loads + own, fixed_s=loads,
                          tail_s=best.parts["compute_s"] + extra, compute_from=start, compute_to=n)
        return best

    def direct_estimate(self, prompt: Prompt, target: Candidate, now: float, wait: bool = True) -> Plan:
        """The cheapest plan of the whole request on ``target`` (a decode or plain instance,
        no handoff) plus its wait (``parts`` as :meth:`pd_estimate`'s, without ``prefill_s``)."""
        n, s, e, l_e = prompt.tokens, prompt.store, target.instance, target.cached
        x = Inputs(prompt_tokens=n, local_tokens=min(l_e, n - 1), tiers=self._store_tiers(s),
                   bytes_per_token=self.bytes_per_token, busy=e.outstanding)
        best = min(self.model(e).plans(x), key=lambda p: p.seconds)
        own, start = best.parts["compute_s"], n - best.tokens("recompute")
        own_w = self.fit(e).anchor_compute_s(n - start, start)
        q = self.wait_s(e, now, own_w) if wait else 0.0
        loads = best.seconds - best.parts["recompute_s"]
        return Plan(best.name, best.segments, best.seconds + q,
                    {**best.parts, "queue_s": q, "own_s": own_w, "ttft_s": loads + own + q, "tail_s": 0.0,
                     "fixed_s": loads, "compute_from": start, "compute_to": n})

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
        self.honesty.disaggregated = pool.disaggregated
        policy = self.policy if self.policy != "kv" else (self.honesty.fallback or "kv")
        if pool.disaggregated:
            route = self._choose_pd(pool, prompt, match, now, policy)
        else:
            route = self._choose_plain(pool, prompt, match, now, policy)
        if route is None:
            return None
        route.mode = policy if policy == self.policy else f"fallback {policy}"
        waiter = route.prefill or route.target
        route.wait_features = self.wait_features(waiter, now, route.own_s)
        wait = self.wait_s(waiter, now, route.own_s)
        route.base_s = route.seconds - wait
        route.slo = slo
        # The probe timed each instance alone: its estimates hold unmeasured on an idle pool only.
        busy = any(i.inflight or i.decoding for i in pool.all)
        m = route.margin = self.honesty.margin(route.kind, PRIOR_MARGIN if busy else 1.0)
        est = estimate_s(route.predicted, m)
        rejected = rejection(est, slo)
        if rejected is not None and slo is not None and route.predicted <= slo and self.late.allows():
            rejected, route.risky = None, True  # meets it as estimated: a risk the budget can take
        if rejected is None and slo is not None:  # the requests its prefill would be batched with
            # their predicted starts err as the estimates do
            queued = [waiter.deadlines[r] for r, (start, end) in waiter.times(now).items()
                      if r in waiter.deadlines and ((t := waiter.inflight[r][1]) + m * (start - t) > now or end <= now)]
            rejected = pushed_late(queued, now + est)
        if rejected is not None:
            reason, retry_after = rejected
            return Route("reject", route.prefill, route.target, route.seconds, route.plan, reason,
                         retry_after=retry_after, store=store, candidates=route.candidates,
                         predicted=route.predicted, mode=route.mode, base_s=route.base_s, margin=m)
        return route

    @staticmethod
    def _route(kind: str, p: Instance | None, target: Instance, plan: Plan, reason: str, **kw) -> Route:
        start, end = int(plan.parts["compute_from"]), int(plan.parts["compute_to"])
        return Route(kind, p, target, plan.seconds, plan.name, reason, own_s=plan.parts["own_s"],
                     predicted=plan.parts["ttft_s"], tail_s=plan.parts["tail_s"], fixed_s=plan.parts["fixed_s"],
                     compute=(end - start, start), **kw)

    def _choose_pd(self, pool: Pool, prompt: Prompt, match, now: float, policy: str) -> Route | None:
        store = prompt.store
        prefills, decodes = pool.role("prefill"), pool.role("decode")
        if not decodes:
            return None
        p = None
        if policy == "round-robin":
            k = next(self._rr)
            d = decodes[k % len(decodes)]
            p = prefills[k % len(prefills)] if prefills else None
        elif policy == "least-outstanding":
            d = min(decodes, key=lambda i: i.outstanding)
            p = min(prefills, key=lambda i: i.outstanding) if prefills else None
        else:
            d = min(decodes, key=lambda i: (i.outstanding + i.waiting, round(i.kv_usage, 2), -match(i)))
            if policy == "handoff" and prefills:
                turn = next(self._turn)
                order = [prefills[(turn + j) % len(prefills)] for j in range(len(prefills))]
                p = min(order, key=lambda i: (i.outstanding, -match(i)))
        l_d = match(d)
        if policy in ("round-robin", "least-outstanding", "handoff"):
            if p is None:
                return None
            plan = self.pd_estimate(prompt, Candidate(p, match(p)), Candidate(d, l_d), now)
            route = self._route("pd", p, d, plan, policy, cached_prefill=match(p), cached_target=l_d, store=store)
            if self.policy == "kv":  # a fallback: what kv would have weighed, for the honesty window
                route.alternatives = self._weigh_pd(prompt, prefills, d, l_d, match, now)[1]
            return route
        if policy == "direct":
            target = d
            if self.policy == "kv" and self.direct_to_prefill and prefills:
                # kv's fallback serves whole requests where kv itself may: the least loaded of the
                # decode and the prefill instances (ties to the longest cached prefix).
                target = min([d, *prefills], key=lambda i: (i.outstanding, -match(i)))
            cached = l_d if target is d else match(target)
            plan = self.direct_estimate(prompt, Candidate(target, cached), now)
            route = self._route("direct", None, target, plan, "direct", cached_target=cached, store=store)
            if self.policy == "kv":
                route.alternatives = self._weigh_pd(prompt, prefills, d, l_d, match, now)[1]
            return route
        cands, alternatives = self._weigh_pd(prompt, prefills, d, l_d, match, now)
        best = min(cands, key=lambda c: c[:3])[3]
        best.candidates = {f"{c[3].kind} {(c[3].prefill or c[3].target).url}": c[0] for c in cands}
        best.alternatives = alternatives
        return best

    def _weigh_pd(self, prompt: Prompt, prefills: list[Instance], d: Instance, l_d: int, match,
                  now: float) -> tuple[list, dict[str, float]]:
        """Every route the kv policy weighs in a P/D pool, as ``(score, requests in flight,
        turn, Route)`` (equal scores go to the less busy, then in turn), and the best
        predicted TTFT of each kind."""
        n, store = prompt.tokens, prompt.store
        direct = self.direct_estimate(prompt, Candidate(d, l_d), now)
        reason = "decode instance and store cover the prompt" if max(l_d, store) >= n - 1 else "handoff does not pay"
        cands = [(direct.seconds, d.outstanding, 0,
                  self._route("direct", None, d, direct, reason, cached_target=l_d, store=store))]
        alternatives = {"direct": direct.parts["ttft_s"]}
        turn = next(self._turn)
        for j in range(len(prefills)):
            p = prefills[(turn + j) % len(prefills)]
            c_p = match(p)
            plan = self.pd_estimate(prompt, Candidate(p, c_p), Candidate(d, l_d), now)
            if plan.tokens("p2p") > 0:
                why = "prefill instance's cache" if c_p > max(store, l_d) else "least queued prefill"
                cands.append((plan.seconds, p.outstanding, j + 1,
                              self._route("pd", p, d, plan, why, cached_prefill=c_p, cached_target=l_d, store=store)))
                alternatives["pd"] = min(alternatives.get("pd", float("inf")), plan.parts["ttft_s"])
            if self.direct_to_prefill:  # the whole request on the prefill instance, as on a plain one
                whole = self.direct_estimate(prompt, Candidate(p, c_p), now)
                cands.append((whole.seconds, p.outstanding, len(prefills) + j + 1,
                              self._route("direct", None, p, whole, "prefill instance serves it whole",
                                          cached_target=c_p, store=store)))
                alternatives["direct"] = min(alternatives["direct"], whole.parts["ttft_s"])
        return cands, alternatives

    def near(self) -> float:
        """The tie band among plain instances: ``exp`` of the direct estimates' spread at
        :data:`NEAR_Q` once the honesty window has measured it, within [1, :data:`NEAR`];
        :data:`NEAR` before."""
        spread = self.honesty.spread("direct", NEAR_Q)
        return NEAR if spread is None else min(NEAR, math.exp(spread))

    def plain_score(self, prompt: Prompt, e: Candidate, now: float) -> float:
        """``score_e`` (module docstring): the direct estimate on ``e`` plus its compute once
        for each request there still waiting for its first token."""
        plan = self.direct_estimate(prompt, e, now)
        return plan.seconds + plan.parts["compute_s"] * len(e.instance.pending(now))

    @staticmethod
    def _near_best(order: list[Instance], est: dict[str, float], match, near: float = NEAR) -> Instance:
        """The kv policy's plain instance: among those whose score is within ``near`` of the
        best, the one holding the longest prefix of the prompt, then the one with fewer
        requests still without their first token (``inflight``), then the first in ``order``
        (the turn). A prompt that lands beside one still prefilling shares its steps; beside
        one decoding it waits for a token's step only."""
        best = min(est.values())
        tied = [i for i in order if est[i.url] <= best * near]
        return min(tied, key=lambda i: (-match(i), len(i.inflight)))

    def _choose_plain(self, pool: Pool, prompt: Prompt, match, now: float, policy: str) -> Route | None:
        store = prompt.store
        plain = pool.role("plain")
        if not plain:
            return None
        est, cached = {}, {}  # kv: each instance's score and the prefix it holds (tokens), by URL
        if policy == "round-robin":
            e = plain[next(self._rr) % len(plain)]
        elif policy == "least-outstanding":
            e = min(plain, key=lambda i: i.outstanding)
        else:
            turn = next(self._turn)
            order = [plain[(turn + j) % len(plain)] for j in range(len(plain))]
            if policy == "kv":
                cached = {i.url: match(i) for i in order}  # one index walk per instance
                est = {i.url: self.plain_score(prompt, Candidate(i, cached[i.url]), now) for i in order}
                if any(cached.values()):
                    e = self._near_best(order, est, lambda i: cached[i.url], self.near())
                else:  # held nowhere: where it lands becomes its home (NEW_BAND)
                    best, k = min(est.values()), next(self._new) % len(plain)
                    e = next(i for i in plain[k:] + plain[:k] if est[i.url] <= best * NEW_BAND)
            else:  # direct (and handoff, which a plain pool cannot do)
                e = min(order, key=lambda i: (i.outstanding, -match(i)))
        l_e = cached[e.url] if cached else match(e)
        plan = self.direct_estimate(prompt, Candidate(e, l_e), now)
        reason = policy if policy != "kv" else \
            "instance's cache" if l_e > 0 else "least queued" if any(cached.values()) else "in turn"
        route = self._route("direct", None, e, plan, reason, cached_target=l_e, store=store)
        if est:
            route.candidates = {f"direct {u}": s for u, s in est.items()}
        return route
