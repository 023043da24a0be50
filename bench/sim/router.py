"""The simulated router: the product's :class:`multi.router.choose.Chooser` over simulated
instances, and each request's path through them (see :mod:`bench.sim.cluster`)."""

from __future__ import annotations

import itertools

from bench.sim.cluster import POLICIES, Cluster, Engine, Job, Result, Seq, Sim, Store
from bench.sim.speeds import Speeds
from bench.trace import Request
from multi.policy import PolicyConfig
from multi.router.choose import Candidate, Chooser, Prompt, Route
from multi.router.instances import Pool, make

ROLES = ("prefill", "decode", "plain")


class Runner:
    def __init__(self, sim: Sim):
        c = sim.cluster
        self.sim, self.sp, self.bs = sim, sim.speeds, c.block
        self.engines: dict[str, Engine] = {}
        insts = []
        for role, count in zip(ROLES, (c.prefill, c.decode, c.plain)):
            for j in range(count):
                # Names only: nothing is ever contacted.
                inst = make(role, f"http://sim-{role}-{j}")
                insts.append(inst)
                self.engines[inst.url] = Engine(sim, inst, c.cache_blocks)
        self.pool = Pool(insts)
        self.pool.validate()
        product = sim.policy if sim.policy != "prefix-affinity" else "kv"
        self.chooser = Chooser(product, self.sp.bytes_per_token, sim.policy_cfg)
        self.store = Store(c.store_dram_blocks, c.store_ssd_blocks, c.store_chunk_blocks)
        self.nic_free: dict[str, float] = {}
        self._rid = itertools.count()
        self._turn = itertools.count()

    # -- routing -------------------------------------------------------------------------

    def _refresh(self) -> None:
        """What the router's health poll reads from /metrics, here exact and current."""
        cap = self.sim.cluster.cache_blocks * self.bs
        for e in self.engines.values():
            e.inst.waiting = len(e.queue) + len(e.joining)
            e.inst.running = e.seqs
            e.inst.kv_usage = min(1.0, e.ctx / cap) if cap else 0.0

    def _route(self, n: int, match, store: int) -> Route | None:
        now = self.sim.now
        if self.sim.policy != "prefix-affinity":
            return self.chooser.choose(self.pool, n, match, store, self.sim.slo, now=now)
        # Baseline: the longest cached prefix wins, ties in turn; load is not looked at.
        pd = self.pool.disaggregated
        cands = self.pool.role("prefill" if pd else "plain")
        t = next(self._turn)
        order = [cands[(t + j) % len(cands)] for j in range(len(cands))]
        best = max(order, key=match)
        if not pd:
            plan = self.chooser.direct_estimate(Prompt(n, store), Candidate(best, match(best)), now)
            return Route("direct", None, best, plan.seconds, plan.name, "prefix-affinity",
                         cached_target=match(best), store=store, own_s=plan.parts["own_s"])
        d = min(self.pool.role("decode"), key=lambda i: i.outstanding)
        plan = self.chooser.pd_estimate(Prompt(n, store), Candidate(best, match(best)), Candidate(d, match(d)), now)
        if plan.tokens("p2p") == 0:  # the decode instance holds all but the last token
            return Route("direct", None, d, plan.seconds, plan.name, "prefix-affinity", cached_target=match(d),
                         store=store, own_s=plan.parts.get("own_s", 0.0))
        return Route("pd", best, d, plan.seconds, plan.name, "prefix-affinity", cached_prefill=match(best),
                     cached_target=match(d), store=store, own_s=plan.parts.get("own_s", 0.0))

    def arrive(self, r: Request, res: Result) -> None:
        bs, n = self.bs, r.input_length
        usable = r.hash_ids[:(n - 1) // bs]  # blocks that may count as cached (not the last token)
        store = self.store.reach(usable)[0] * bs if self.store.enabled else 0

        def match(inst) -> int:
            return self.engines[inst.url].cache.match(usable) * bs

        self._refresh()
        route = self._route(n, match, store)
        res.kind, res.plan, res.predicted = route.kind, route.plan, route.seconds
        res.cached_prefill, res.cached_target, res.store_view = route.cached_prefill, route.cached_target, route.store
        res.candidates = route.candidates
        if route.kind == "reject":
            return
        res.instances = tuple(i.url for i in (route.prefill, route.target) if i is not None)
        pd = route.kind == "pd"
        inst = route.prefill if pd else route.target
        cached = max(route.cached_prefill if pd else route.cached_target, route.store)
        rid = str(next(self._rid))
        alone = self.chooser.begin(route, inst, n, cached, rid, self.sim.now)
        # As multi.router.forward does: a handoff's prefill instance is done with it when its prefill
        # ends (prefill_done), its prefill when its first token is out (first_token), the request when
        # its last token is out (end, then learning).
        timing = {"t0": self.sim.now, "prefill_s": None, "rid": rid, "alone_after": None}

        def finish(t: float) -> None:
            res.done = t
            self.chooser.end(route, inst, rid, t)
            after = timing["alone_after"] if pd else not inst.inflight
            self.chooser.learn_request(route, inst, n, cached, alone and after, res.first - timing["t0"],
                                       timing["prefill_s"])

        (self._pd if pd else self._direct)(r, res, route, usable, finish, timing)

    # -- paths ---------------------------------------------------------------------------

    def _load(self, eng: Engine, usable, want_store: bool, res: Result) -> tuple[int, float]:
        """The instance's cache hit and store load for one prompt: (tokens it starts its
        prefill from, seconds of loading before it can)."""
        bs = self.bs
        hit = eng.cache.match(usable)
        eng.cache.touch(usable[:hit])
        res.local = hit * bs
        reach = self.store.reach(usable)[0] if want_store and self.store.enabled else 0
        if reach <= hit:
            return hit * bs, 0.0
        ssd_part = sum(1 for h in usable[hit:reach] if h in self.store.ssd.d)
        dram_part = reach - hit - ssd_part
        self.store.read(usable[hit:reach])
        res.store, res.store_ssd = (reach - hit) * bs, ssd_part * bs
        bpt = self.sp.bytes_per_token
        seconds = max(self.sp.store.seconds(dram_part * bs * bpt), self.sp.ssd.seconds(ssd_part * bs * bpt))
        return reach * bs, seconds

    @staticmethod
    def _decode_rest(eng: Engine, r: Request, finish, t: float) -> None:
        """The first token is out at ``t``: the request decodes its other tokens on ``eng``."""
        if r.output_length > 1:
            eng.decode(Seq(r.input_length, r.output_length - 1, lambda _t: None, finish))
        else:
            finish(t)

    def _direct(self, r: Request, res: Result, route: Route, usable, finish, timing) -> None:
        eng = self.engines[route.target.url]
        n = r.input_length
        start, load_s = self._load(eng, usable, "store" in route.plan, res)
        res.computed = n - start
        full = r.hash_ids[:n // self.bs]
        saves = eng.inst.role == "plain" and self.store.enabled

        def prefilled(t: float) -> None:
            eng.cache.insert(full)
            if saves:
                self.store.save(full)
            res.first = t
            self.chooser.first_token(route, route.target, timing["rid"], t)
            self._decode_rest(eng, r, finish, t)

        self.sim.at(self.sim.now + load_s, lambda: eng.prefill(Job(start, n, prefilled)))

    def _pd(self, r: Request, res: Result, route: Route, usable, finish, timing) -> None:
        pe, de = self.engines[route.prefill.url], self.engines[route.target.url]
        n, bs, bpt = r.input_length, self.bs, self.sp.bytes_per_token
        # The prefill instance's own connector loads what the store has beyond its cache.
        start, load_s = self._load(pe, usable, True, res)
        res.computed = n - start
        full = r.hash_ids[:n // bs]
        t0 = timing["t0"]

        def prefilled(t: float) -> None:
            pe.cache.insert(full)
            if self.store.enabled:
                self.store.save(full)
            timing["prefill_s"] = t - t0
            res.prefilled = t
            timing["alone_after"] = self.chooser.prefill_done(route.prefill, timing["rid"], t)
            if self.sp.handoff_waits_step:
                # After the prefill instance has begun its next step (events at one time run
                # in order): the transfer starts when that step ends, if there is one.
                self.sim.at(t, lambda: transfer(pe.step_end if pe.busy else t, t))
            else:
                transfer(t, t)

        def transfer(start: float, t: float) -> None:
            """The pull from the prefill instance from ``start``; a store part from ``t``."""
            have = de.cache.match(usable)
            de.cache.touch(usable[:have])
            s_reach = self.store.reach(usable)[0] if "store" in route.plan and self.store.enabled else 0
            from_store = max(0, s_reach - have)
            if from_store:
                self.store.read(usable[have:s_reach])
            base = max(have, s_reach) * bs
            res.p2p = max(0, n - 1 - base)
            res.d_local, res.d_store = have * bs, from_store * bs
            nic = max(start, self.nic_free.get(de.inst.url, 0.0))
            done = nic + self.sp.p2p.seconds(res.p2p * bpt)
            self.nic_free[de.inst.url] = done
            ready = max(done, t + self.sp.store.seconds(from_store * bs * bpt))

            def join() -> None:
                # vLLM schedules the received request as a prefill of its last token.
                res.ready = self.sim.now
                de.cache.insert(full)
                de.prefill(Job(n - 1, n, decoded))

            def decoded(t2: float) -> None:
                res.first = t2
                self.chooser.first_token(route, route.prefill, timing["rid"], t2)
                self._decode_rest(de, r, finish, t2)

            self.sim.at(ready, join)

        self.sim.at(t0 + load_s, lambda: pe.prefill(Job(start, n, prefilled)))


def simulate(reqs: list[Request], speeds: Speeds, cluster: Cluster, policy: str = "kv",
             slo: float | None = None, policy_cfg: PolicyConfig | None = None) -> list[Result]:
    """Replay ``reqs`` (arrival times in ms, as in the trace) through ``cluster``; one
    :class:`Result` per request, in trace order."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    sim = Sim(speeds, cluster, policy, slo, policy_cfg)
    runner = Runner(sim)
    t0 = reqs[0].timestamp_ms if reqs else 0.0
    out = []
    for i, r in enumerate(reqs):
        res = Result(i, (r.timestamp_ms - t0) / 1e3, r.input_length, r.output_length)
        out.append(res)
        sim.at(res.arrival + speeds.overhead_s, lambda r=r, res=res: runner.arrive(r, res))
    sim.run()
    return out
