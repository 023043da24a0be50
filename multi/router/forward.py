"""Executing a chosen route, and its bookkeeping: :class:`Forwarder`, the half of the
router (:class:`multi.router.app.Router`) that runs what :mod:`multi.router.choose` picked.

A handoff (``pd``) runs the P2P tier's proxy contract (:meth:`p2p.proxy.Proxy._run`), a
``direct`` route the whole request on one instance (:meth:`p2p.proxy.Proxy._direct`).
Around each run (:meth:`Forwarder._run_tracked`) the chooser counts the request on its
instances (outstanding, queued work) until it ends, and an answered request teaches
(:meth:`Forwarder._learn`): the index (the instance now holds the prompt's blocks; a
handoff's decode instance too; the store when a prefill or plain instance saved it, in
``--store approx`` mode), the chooser's fits, and the predicted-against-actual TTFT metrics.

A prefill instance that fails before the decode produced output is retried once on the
least queued other prefill instance; if it answered 502 (unreachable or broken) it is out
of rotation until its health check passes. ``--decision-log`` gets one JSON line per
routed request (:meth:`Forwarder._log_decision`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from multi.router.choose import Chooser, Route
from multi.router.index import STORE, BlockIndex
from multi.router.instances import Instance, Pool
from multi.router.metrics import RouterMetrics
from p2p.proxy import Proxy, ProxyError

logger = logging.getLogger("mctier.router")


@dataclass(frozen=True)
class Dispatch:
    """One routed request's run on one instance: what :meth:`Forwarder._run_tracked` keeps
    the books of and :meth:`Forwarder._learn` learns from."""

    instance: Instance  # where its prefill runs: a handoff's prefill instance, else the target
    route: Route
    tokens: int  # prompt tokens
    cached: int  # of them already there at the start: the instance's cache or the store, the longer
    hashes: list[int]  # the prompt's block hashes (multi.router.index.chain)
    t0: float  # arrival at the router (time.monotonic())
    handoff: bool  # P/D: the decode runs on route.target
    stream: bool  # the client asked for a streamed answer (only then is a first token seen)


@dataclass
class Reservation:
    """A route's first run booked at choice time (:meth:`Forwarder.reserve`)."""

    job: Dispatch
    rid: str
    alone: bool
    taken: bool = False


class Forwarder(Proxy):
    """Runs routes and keeps their books; :class:`multi.router.app.Router` adds the views,
    the health checks and the handlers."""

    def __init__(self, pool: Pool, chooser: Chooser, index: BlockIndex, *, timeout: float, connect_timeout: float,
                 store_approx: bool = False, decision_log: str | None = None, secret: bytes | None = None):
        super().__init__(timeout, connect_timeout, secret)
        self.pool, self.chooser, self.index = pool, chooser, index
        self.store_approx = store_approx
        self.metrics = RouterMetrics()
        # Per request id, filled by the proxy's hooks while the request runs:
        self._first_output_at: dict[str, float] = {}  # monotonic time of its first output
        self._prefill_s: dict[str, float] = {}  # a handoff's prefill request, sent to answered
        self._alone_after: dict[str, bool] = {}  # a handoff: nothing else in flight on P when its prefill ended
        self._jobs: dict[str, Dispatch] = {}  # running requests (for the first-token hook)
        # One JSON line per routed request (see _log_decision); line-buffered, so a reader
        # (bench/trace_replay) sees every answered request without a flush.
        self.decision_log = open(decision_log, "a", buffering=1) if decision_log else None

    def _dispatch(self, route: Route, p, tokens, hashes, t0, stream: bool) -> Dispatch:
        n = len(tokens)
        if route.kind == "direct":
            return Dispatch(route.target, route, n, max(route.cached_target, route.store), hashes, t0,
                            handoff=False, stream=stream)
        return Dispatch(p, route, n, max(route.cached_prefill, route.store), hashes, t0, handoff=True, stream=stream)

    def reserve(self, route: Route, tokens, hashes, t0, body: dict) -> Reservation:
        """Book the chosen route's first run on its instance at once, in the same step as the
        choice (:meth:`Chooser.begin`, and the approximate index): the next request's choice
        sees it queued, even before this one's task runs. :meth:`_execute` takes the booking over; :meth:`release` undoes
        one it never took (a request cancelled before it ran)."""
        job = self._dispatch(route, route.prefill, tokens, hashes, t0, bool(body.get("stream")))
        # The approximate index records what was sent where at once: a request with the same
        # prefix arriving while this one computes it then follows it and queues behind it (its
        # wait is modelled) rather than computing the prefix a second time elsewhere.
        self.index.record(job.instance.url, hashes)
        rid = str(uuid.uuid4())
        return Reservation(job, rid, self.chooser.begin(route, job.instance, job.tokens, job.cached, rid,
                                                        time.monotonic()))

    def release(self, res: Reservation) -> None:
        if not res.taken:
            res.taken = True
            self.chooser.end(res.job.route, res.job.instance, res.rid)

    async def _execute(self, request, path, body, route: Route, tokens, hashes, t0, ttft: dict,
                       booked: Reservation | None = None) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        if route.kind == "direct":
            job = self._dispatch(route, None, tokens, hashes, t0, stream)
            return await self._run_tracked(job, lambda rid: self._direct(request, path, body, route.target, rid),
                                           ttft=ttft, booked=booked)
        tried: set[str] = set()
        p = route.prefill
        while True:
            tried.add(p.url)
            job = self._dispatch(route, p, tokens, hashes, t0, stream)
            try:
                return await self._run_tracked(job, lambda rid: self._run(request, path, body, p, route.target, rid),
                                               ttft=ttft, booked=booked)
            except ProxyError as e:
                if not e.prefill_failed:
                    raise
                if e.status == 502:
                    p.healthy = False  # unreachable or broken: out until a health check passes
                others = [i for i in self.pool.role("prefill") if i.url not in tried]
                if not others or len(tried) > 1:
                    raise
                self.metrics.retries.inc()
                logger.warning("prefill on %s failed (%s); retrying on another prefill instance", p.url, e.message)
                p = min(others, key=lambda i: i.queue_s())
                # The estimate was made for the first instance: teach no wait fit with this one.
                route.prefill, route.wait_features = p, []
                booked = None

    async def _run_tracked(self, job: Dispatch, call, ttft: dict | None = None,
                           booked: Reservation | None = None) -> web.StreamResponse:
        """Run ``call(rid)`` with ``job.instance``'s bookkeeping: outstanding counts, queued
        work (booked by :meth:`reserve` when ``booked`` is given), then what it teaches the
        index and the cost model; a streamed answer's time to first token goes into
        ``ttft["s"]`` (a handoff's prefill time into ``ttft["prefill_s"]``)."""
        inst, route = job.instance, job.route
        if booked is not None and not booked.taken and booked.job.instance is inst:
            booked.taken = True
            rid, alone = booked.rid, booked.alone
        else:
            if booked is not None:
                self.release(booked)
            rid = str(uuid.uuid4())
            alone = self.chooser.begin(route, inst, job.tokens, job.cached, rid, time.monotonic())
        self._jobs[rid] = job
        try:
            resp = await call(rid)
        finally:
            self._jobs.pop(rid, None)
            self.chooser.end(route, inst, rid, time.monotonic())
            first, prefill_s = self._first_output_at.pop(rid, None), self._prefill_s.pop(rid, None)
            alone_after = self._alone_after.pop(rid, not inst.inflight)
        if resp.status == 200:
            # Only a streamed answer's first chunk is a first token; a whole answer is not.
            first = first if job.stream else None
            if ttft is not None:
                if first is not None:
                    ttft["s"] = first - job.t0
                if job.handoff and prefill_s is not None:
                    ttft["prefill_s"] = prefill_s
            self._learn(job, first, prefill_s, alone and alone_after)
        return resp

    def _learn(self, job: Dispatch, first: float | None, prefill_s: float | None, alone: bool) -> None:
        """What an answered request teaches. ``first``: when its first token reached the
        router (monotonic; None for an answer not streamed); ``prefill_s``: a handoff's
        prefill request time; ``alone``: nothing else was in flight on ``job.instance``."""
        inst, route, pd = job.instance, job.route, job.handoff
        self.index.record(inst.url, job.hashes)
        if pd:
            self.index.record(route.target.url, job.hashes)  # the decode's prefix cache keeps what it pulled
        if self.store_approx and (pd or inst.role in ("plain", "prefill")):
            # A prefill instance's (or a plain engine's) store tier saved the prompt, handoff or whole
            # request; a decode instance saves only with write_back, which the router cannot see.
            self.index.record(STORE, job.hashes)
        self.chooser.learn_request(route, inst, job.tokens, job.cached, alone,
                                   None if first is None else first - job.t0, prefill_s if pd else None)
        if first is not None:
            actual = first - job.t0
            self.metrics.ttft.labels("predicted").observe(route.predicted)
            self.metrics.ttft.labels("actual").observe(actual)
            if route.predicted > 0:
                self.metrics.ttft_ratio.observe(actual / route.predicted)
                self.metrics.ttft_kind_ratio.labels(route.kind).observe(actual / route.predicted)
            self.metrics.set_honesty(self.chooser.honesty.state())

    def _log_decision(self, t0: float, n: int, route: Route, status: int, ttft_s: float | None,
                      prefill_s: float | None = None) -> None:
        """``--decision-log``: what the router knew, chose and weighed for one request, and
        how it came out (``ttft_s``: from arrival to the first streamed token, None when the
        answer was not streamed or failed; ``prefill_s``: a handoff's prefill request from
        sent to answered). ``predicted_s`` is the chosen route's score (what the choice
        compared with ``candidates``), ``ttft_predicted_s`` its predicted time to first token
        (unweighted), ``mode`` the policy that chose (``kv``, or ``fallback POLICY`` while
        the honesty check falls back), ``drift`` the window's median |ln(actual/predicted)|
        per route kind, ``margin`` admission's margin on ``ttft_predicted_s`` (null without
        a choice), ``risky`` whether admission took it at risk. Times in seconds, ``t`` on the monotonic clock."""
        if self.decision_log is None:
            return
        rec = {"t": round(t0, 6), "n": n, "kind": route.kind, "plan": route.plan, "reason": route.reason,
               "prefill": route.prefill.url if route.prefill else None,
               "target": route.target.url if route.target else None,
               "cached_prefill": route.cached_prefill, "cached_target": route.cached_target, "store": route.store,
               "store_check": route.store_check, "store_events": route.store_events,
               "predicted_s": round(route.seconds, 6), "wait_s": round(route.seconds - route.base_s, 6),
               "ttft_predicted_s": round(route.predicted, 6), "mode": route.mode,
               "margin": None if route.margin is None else round(route.margin, 4), "risky": route.risky,
               "drift": {k: round(v, 4) for k, v in self.chooser.honesty.state()["drift"].items()},
               "candidates": {k: round(v, 6) for k, v in route.candidates.items()},
               "status": status, "ttft_s": None if ttft_s is None else round(ttft_s, 6),
               "prefill_s": None if prefill_s is None else round(prefill_s, 6)}
        try:
            self.decision_log.write(json.dumps(rec) + "\n")
        except OSError as e:  # a full disk must not fail requests
            logger.warning("decision log write failed: %s", e)

    def _answer(self, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(str(resp.status)).inc()
        return resp

    # -- the proxy's hooks -------------------------------------------------------------------

    def _release_later(self, p, engine_id: str, tid: str) -> None:
        self.metrics.released.inc()
        super()._release_later(p, engine_id, tid)

    def _first_output(self, rid: str) -> None:
        self._first_output_at[rid] = time.monotonic()
        job = self._jobs.get(rid)
        if job is not None:
            self.chooser.first_token(job.route, job.instance, rid, self._first_output_at[rid])

    def _prefill_done(self, p, rid: str, seconds: float) -> None:
        self._prefill_s[rid] = seconds
        self._alone_after[rid] = self.chooser.prefill_done(p, rid, time.monotonic())
