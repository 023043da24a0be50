"""The KV-aware router behind ``mctier proxy``: routes each request to where its KV lives,
weighed against load, and rejects early what cannot meet its time-to-first-token target.

    mctier proxy --prefill http://127.0.0.1:8100@http://127.0.0.1:8998 http://127.0.0.1:8101@... \\
                 --decode http://127.0.0.1:8200 --store 127.0.0.1:50051 --ttft-slo 2.0

Per request: the prompt's token ids (the served model's tokenizer, else the instance's
``/tokenize``) give the router's block hashes (:func:`multi.kvindex.chain`); the index
(:mod:`multi.kvindex`) says how much of the prefix each instance holds, the store view
how much the store holds (``--store MASTER``: the store tier's lookup,
:mod:`multi.storeview`, falling back to what prefills stored when the lookup is late;
``--store approx``: what prefills stored; no ``--store``: nothing); :mod:`multi.route` picks the route (P/D through the cheapest prefill
instance, or the whole request on the decode / a plain instance) and applies
admission. The P/D exchange itself is the P2P tier's proxy contract (:mod:`p2p.proxy`).

Failures: a prefill instance that fails before the decode produced output is retried
once on another prefill instance (and, if it could not be reached, taken out of
rotation until its health check passes); a decode that fails after its prefill
succeeded has the prefill's blocks released at once (:mod:`p2p.release`); a client that
disconnects cancels both upstream requests. Answers: 400 bad input, 429 admission
(``Retry-After``), 502 an instance failed, 503 no healthy instance, 504 the deadline.

The index learns what the router sent where (the approximate view, aged by each
instance's cache size) and, for instances that publish vLLM's KV events (found through
their ``/kv_event_sources``, or given), from those events (exact: stored and evicted
blocks, :mod:`multi.kvevents`), which it uses while the event stream is trustworthy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

from multi import instances as inst_mod
from multi.instances import Instance, Pool
from multi.kvevents import EventSubscriber
from multi.kvindex import BlockIndex, chain
from multi.prompts import Prompts
from multi.route import Chooser, Route
from multi.router_metrics import RouterMetrics
from multi.vllm_events import replay_address, subscriber_address
from p2p.proxy import Proxy, ProxyError, _error

logger = logging.getLogger("mctier.router")

STORE = "store"  # the index view of the shared store
SLO_HEADER = "X-TTFT-SLO"  # seconds; per-request TTFT target
SLO_PARAM = "ttft_slo_s"  # the same, as a kv_transfer_params key (removed before forwarding)


class Router(Proxy):
    def __init__(self, pool: Pool, chooser: Chooser, index: BlockIndex, prompts: Prompts, *, timeout: float,
                 connect_timeout: float, slo: float | None = None, store_view=None, store_approx: bool = False,
                 health_interval: float = 2.0, instances_file: str | None = None, store_timeout: float = 0.5,
                 decision_log: str | None = None):
        super().__init__(timeout, connect_timeout)
        self.pool, self.chooser, self.index, self.prompts = pool, chooser, index, prompts
        # The exact view (KV events) lives apart from the router's own record: a stale
        # subscriber clears its view, and removals must not delete what the router recorded.
        self.exact = BlockIndex(index.block_size, index.default_capacity)
        self.slo, self.store_view, self.store_approx = slo, store_view, store_approx
        self.store_timeout = store_timeout
        self.health_interval, self.instances_file = health_interval, instances_file
        self.metrics = RouterMetrics()
        self.subscribers: dict[str, EventSubscriber] = {}
        self._first: dict[str, float] = {}
        self._prefill_s: dict[str, float] = {}
        self._alone_after: dict[str, bool] = {}  # a handoff: nothing else in flight on P when its prefill ended
        self._tasks: list[asyncio.Task] = []
        # Store lookups get threads of their own: a slow master must not hold up the
        # default executor (tokenization, hold releases).
        self._store_pool = ThreadPoolExecutor(2, thread_name_prefix="store-view")
        # One JSON line per routed request (see _log_decision); line-buffered, so a reader
        # (bench/trace_replay) sees every answered request without a flush.
        self.decision_log = open(decision_log, "a", buffering=1) if decision_log else None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, app) -> None:
        await super().start(app)
        await asyncio.gather(*(self._discover_events(i) for i in self.pool.all))
        self._sync_subscribers()
        await asyncio.gather(*(inst_mod.check(self.session, i, self.connect_timeout) for i in self.pool.all))
        self._tasks.append(asyncio.create_task(self._health_loop()))
        # Load the tokenizer and connect to the store now, not on the first request.
        self._tasks.append(asyncio.create_task(self.prompts.load(self.session, self.pool)))
        if self.store_view is not None:
            asyncio.get_running_loop().run_in_executor(self._store_pool, self.store_view.reach, [0], None)
        if self.instances_file:
            try:
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests in-process)
                pass

    async def stop(self, app) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self.subscribers.values():
            await asyncio.to_thread(s.stop)
        if self.store_view is not None:
            await asyncio.get_running_loop().run_in_executor(self._store_pool, self.store_view.close)
        self._store_pool.shutdown(wait=False, cancel_futures=True)
        if self.decision_log is not None:
            self.decision_log.close()
        await super().stop(app)

    async def _discover_events(self, inst: Instance) -> None:
        """An instance's KV event publisher from its ``/kv_event_sources`` (vLLM's route),
        unless given; none when the engine publishes no events."""
        if inst.events:
            return
        try:
            async with self.session.get(inst.url + "/kv_event_sources",
                                        timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as r:
                body = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return
        cfg = (body or {}).get("0") or {}
        if cfg.get("enable_kv_cache_events") and cfg.get("publisher") == "zmq" and cfg.get("endpoint"):
            inst.events, inst.replay = cfg["endpoint"], cfg.get("replay_endpoint")
            logger.info("%s publishes KV events at %s (replay %s)", inst.url, inst.events, inst.replay)

    def _sync_subscribers(self) -> None:
        want = {i.url: i for i in self.pool.all if i.events}
        for url in [u for u in self.subscribers if u not in want]:
            self.subscribers.pop(url).stop()
            self.exact.drop(url)
        for url, i in want.items():
            if url not in self.subscribers:
                host = urlparse(url).hostname or "127.0.0.1"
                addr, bind = subscriber_address(i.events, host)
                sub = EventSubscriber(url, addr, self.exact, replay_address(i.replay, host), bind=bind)
                self.subscribers[url] = sub
                sub.start()

    def match(self, inst: Instance, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that ``inst`` holds: from its KV events while they are
        trustworthy, else from what the router sent it."""
        sub = self.subscribers.get(inst.url)
        if sub is not None and not sub.stale:
            return self.exact.match(inst.url, hashes)
        return self.index.match(inst.url, hashes)

    def reload(self) -> None:
        """SIGHUP: re-read the instances file; on an error keep the current instances.
        (An added instance's KV events are followed when the file names them.)"""
        try:
            added, removed = self.pool.replace_file(inst_mod.load_file(self.instances_file))
        except ValueError as e:
            logger.error("reload of %s failed, instances unchanged: %s", self.instances_file, e)
            return
        for i in removed:
            self.index.drop(i.url)
            self.exact.drop(i.url)
            try:
                self.metrics.healthy.remove(i.url, i.role)
            except KeyError:  # never exported (removed before the first health round)
                pass
        self._sync_subscribers()
        logger.warning("reloaded %s: added %s, removed %s", self.instances_file,
                       [i.url for i in added] or "none", [i.url for i in removed] or "none")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await asyncio.gather(*(inst_mod.check(self.session, i, self.connect_timeout) for i in self.pool.all))
                self._refresh_gauges()
            except Exception:  # noqa: BLE001 - the loop must survive anything one round throws
                logger.exception("health round failed")

    def _refresh_gauges(self) -> None:
        m, now = self.metrics, time.monotonic()
        for i in self.pool.all:
            if i.cache_blocks:
                self.index.set_capacity(i.url, i.cache_blocks)
                self.exact.set_capacity(i.url, i.cache_blocks)
            m.healthy.labels(i.url, i.role).set(1 if i.healthy else 0)
            m.queue.labels(i.url).set(i.queue_s(now))
            m.outstanding.labels(i.url).set(i.outstanding)
        for view in [i.url for i in self.pool.all] + [STORE]:
            m.index_blocks.labels(view, "approx").set(self.index.blocks(view))
            m.index_capacity.labels(view).set(self.index.capacity(view))
        for url in self.subscribers:
            m.index_blocks.labels(url, "exact").set(self.exact.blocks(url))
        for url, s in self.subscribers.items():
            st = s.stats()
            m.event_lag.labels(url).set(st.get("lag_s") or 0.0)
            for k in ("events", "batches", "gaps", "replays", "replay_failures", "unknown_parent"):
                m.events.labels(url, k).set(st.get(k, 0))
            m.events.labels(url, "stale").set(1 if st.get("stale") else 0)

    # -- handlers --------------------------------------------------------------------------

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self._refresh_gauges()
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        body = {i.url: {"role": i.role, "healthy": i.healthy} for i in self.pool.all}
        if self.pool.disaggregated:
            # The kv policy serves on a decode instance alone when no prefill instance is up.
            ok = bool(self.pool.role("decode")) and (bool(self.pool.role("prefill")) or self.chooser.policy == "kv")
        else:
            ok = bool(self.pool.role("plain"))
        # "tokenizer" (multi.prompts.Prompts.state): a router still loading it routes token-id
        # prompts as usual, but holds string prompts until it is loaded, and spends CPU on it.
        return web.json_response({"healthy": ok, "tokenizer": self.prompts.state, "instances": body},
                                 status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        up = self.pool.role("decode") or self.pool.role("plain")
        if not up:
            return _error(503, "no healthy instance")
        try:
            async with self.session.get(up[0].url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"instance {up[0].url} unreachable: {e!r}")

    def _slo(self, request: web.Request, body: dict) -> float | None:
        params = body.get("kv_transfer_params")
        raw = request.headers.get(SLO_HEADER)
        if isinstance(params, dict) and SLO_PARAM in params:
            raw = params.pop(SLO_PARAM)
        if raw is None:
            return self.slo
        try:
            v = float(raw)
        except (TypeError, ValueError):
            raise ProxyError(400, f"TTFT target must be seconds (a number), got {raw!r}") from None
        if not v > 0:
            raise ProxyError(400, f"TTFT target must be > 0 seconds, got {raw!r}")
        return v

    async def _store_reach(self, tokens: list[int], hashes: list[int], salt) -> int:
        approx = self.index.match(STORE, hashes) * self.index.block_size if self.store_approx else 0
        if self.store_view is None or not tokens:
            return approx
        try:
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(loop.run_in_executor(self._store_pool, self.store_view.reach, tokens, salt),
                                          self.store_timeout)
        except Exception as e:  # noqa: BLE001 - late or failed lookups fall back to the approximate view
            logger.debug("store lookup failed (%r): approximate view", e)
            return approx

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except (ValueError, json.JSONDecodeError) as e:
            return self._answer(_error(400, f"invalid JSON body: {e}"))
        try:
            slo = self._slo(request, body)
            tokens = await self.prompts.token_ids(self.session, self.pool, path, body)
        except ProxyError as e:
            return self._answer(_error(e.status, e.message))
        salt = body.get("cache_salt")
        hashes = chain(tokens, self.index.block_size, salt) if tokens else []
        store = await self._store_reach(tokens, hashes, salt)
        bs = self.index.block_size

        def match(i: Instance) -> int:
            return self.match(i, hashes) * bs

        route = self.chooser.choose(self.pool, len(tokens), match, store, slo)
        if route is None:
            return self._answer(_error(503, "no healthy instance to route to"))
        self.metrics.decisions.labels(route.kind, route.reason).inc()
        if route.kind == "reject":
            self.metrics.rejections.inc()
            resp = _error(429, f"time-to-first-token target cannot be met: {route.reason}")
            resp.headers["Retry-After"] = str(route.retry_after)
            self._log_decision(t0, len(tokens), route, resp.status, None)
            return self._answer(resp)
        ttft: dict[str, float] = {}
        try:
            resp = await asyncio.wait_for(self._execute(request, path, body, route, tokens, hashes, t0, ttft),
                                          self.timeout)
        except ProxyError as e:
            logger.warning("%s: %s", path, e.message)
            resp = _error(e.status, e.message)
        except asyncio.TimeoutError:
            resp = _error(504, f"no complete answer within the router's deadline ({self.timeout:.0f}s)")
        except asyncio.CancelledError:  # the client went away: logged with nginx's 499
            self._log_decision(t0, len(tokens), route, 499, ttft.get("s"), ttft.get("prefill_s"))
            raise
        self._log_decision(t0, len(tokens), route, resp.status, ttft.get("s"), ttft.get("prefill_s"))
        return self._answer(resp)

    def _log_decision(self, t0: float, n: int, route: Route, status: int, ttft_s: float | None,
                      prefill_s: float | None = None) -> None:
        """``--decision-log``: what the router knew, chose and weighed for one request, and
        how it came out (``ttft_s``: from arrival to the first streamed token, None when the
        answer was not streamed or failed; ``prefill_s``: a handoff's prefill request from
        sent to answered). Times in seconds, ``t`` on the monotonic clock."""
        if self.decision_log is None:
            return
        rec = {"t": round(t0, 6), "n": n, "kind": route.kind, "plan": route.plan, "reason": route.reason,
               "prefill": route.prefill.url if route.prefill else None,
               "target": route.target.url if route.target else None,
               "cached_prefill": route.cached_prefill, "cached_target": route.cached_target, "store": route.store,
               "predicted_s": round(route.seconds, 6), "wait_s": round(route.seconds - route.base_s, 6),
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

    async def _execute(self, request, path, body, route: Route, tokens, hashes, t0, ttft: dict) -> web.StreamResponse:
        n, stream = len(tokens), bool(body.get("stream"))
        if route.kind == "direct":
            return await self._on(route.target, route, n, max(route.cached_target, route.store), hashes, t0,
                                  lambda rid: self._direct(request, path, body, route.target, rid), stream=stream,
                                  ttft=ttft)
        tried: set[str] = set()
        p = route.prefill
        while True:
            tried.add(p.url)
            try:
                return await self._on(p, route, n, max(route.cached_prefill, route.store), hashes, t0,
                                      lambda rid: self._run(request, path, body, p, route.target, rid), pd=True,
                                      stream=stream, ttft=ttft)
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
                route.prefill, route.wait_x = p, []

    async def _on(self, inst: Instance, route: Route, n: int, cached: int, hashes, t0: float, call,
                  pd: bool = False, stream: bool = False, ttft: dict | None = None) -> web.StreamResponse:
        """Run ``call(rid)`` with ``inst``'s bookkeeping: outstanding counts, queued work,
        then what it teaches the index and the cost model; a streamed answer's time to first
        token goes into ``ttft["s"]``."""
        rid = str(uuid.uuid4())
        alone = self.chooser.begin(route, inst, n, cached, rid, time.monotonic())
        try:
            resp = await call(rid)
        finally:
            self.chooser.end(route, inst, rid)
            first, prefill_s = self._first.pop(rid, None), self._prefill_s.pop(rid, None)
            alone_after = self._alone_after.pop(rid, not inst.inflight)
        if resp.status == 200:
            # Only a streamed answer's first chunk is a first token; a whole answer is not.
            first = first if stream else None
            if ttft is not None:
                if first is not None:
                    ttft["s"] = first - t0
                if pd and prefill_s is not None:
                    ttft["prefill_s"] = prefill_s
            self._learn(inst, route, n, cached, hashes, t0, first, prefill_s, alone and alone_after, pd)
        return resp

    def _learn(self, inst, route, n, cached, hashes, t0, first, prefill_s, alone, pd) -> None:
        self.index.record(inst.url, hashes)
        if pd:
            self.index.record(route.target.url, hashes)  # the decode's prefix cache keeps what it pulled
        if self.store_approx and (pd or inst.role == "plain"):
            # A prefill instance's (or a plain engine's) store tier saved the prompt; a decode
            # instance saves only with write_back, which the router cannot see.
            self.index.record(STORE, hashes)
        self.chooser.learn_request(route, inst, n, cached, alone, None if first is None else first - t0,
                                   prefill_s if pd else None)
        if first is not None:
            actual = first - t0
            self.metrics.ttft.labels("predicted").observe(route.seconds)
            self.metrics.ttft.labels("actual").observe(actual)
            if route.seconds > 0:
                self.metrics.ttft_ratio.observe(actual / route.seconds)

    def _release_later(self, p, engine_id: str, tid: str) -> None:
        self.metrics.released.inc()
        super()._release_later(p, engine_id, tid)

    def _first_output(self, rid: str) -> None:
        self._first[rid] = time.monotonic()

    def _prefill_done(self, p, rid: str, seconds: float) -> None:
        self._prefill_s[rid] = seconds
        self._alone_after[rid] = self.chooser.prefill_done(p, rid)

