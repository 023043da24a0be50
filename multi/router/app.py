"""The KV-aware router behind ``mctier proxy``: routes each request to where its KV lives,
weighed against load, and rejects early what cannot meet its time-to-first-token target.

    mctier proxy --prefill http://127.0.0.1:8100@http://127.0.0.1:8998 http://127.0.0.1:8101@... \\
                 --decode http://127.0.0.1:8200 --store 127.0.0.1:50051 --ttft-slo 2.0

Per request: the prompt's token ids (:mod:`multi.router.prompts`: the served model's
tokenizer, else the instance's ``/tokenize``) give the router's block hashes
(:func:`multi.router.index.chain`); the index (:mod:`multi.router.index`) says how much of
the prefix each instance holds, the store view how much the store holds (``--store
MASTER``: what the store tier's KV events say it holds, confirmed by the store tier's lookup,
:mod:`multi.router.storeview`, falling back to what prefills stored when the lookup is late;
``--store approx``: what prefills stored; no ``--store``: nothing); :mod:`multi.router.choose` picks the route (P/D through the
cheapest prefill instance, or the whole request on the decode / a plain instance) and
applies admission (:mod:`multi.router.admission`); :mod:`multi.router.forward` runs it.
The P/D exchange itself is the P2P tier's proxy contract (:mod:`p2p.proxy`).

Failures: a prefill instance that fails before the decode produced output is retried
once on another prefill instance (and, if it could not be reached, taken out of
rotation until its health check passes); a decode that fails after its prefill
succeeded has the prefill's blocks released at once (:mod:`p2p.release`); a client that
disconnects cancels both upstream requests. Answers: 400 bad input, 429 admission
(``Retry-After``), 502 an instance failed, 503 no healthy instance, 504 the deadline.

The index learns what the router sent where (the approximate view, aged by each
instance's cache size) and, for instances that publish vLLM's KV events (found through
their ``/kv_event_sources``, or given), from those events (exact: stored and evicted
blocks, :mod:`multi.router.events`), which it uses while the event stream is trustworthy.
This module holds :class:`Router`: its lifecycle (event subscribers, health checks, the
tokenizer, SIGHUP reloads), the index and store views, and the HTTP handlers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

from multi.router.admission import ttft_target
from multi.router.choose import Chooser
from multi.router.events import EventSubscriber
from multi.router.eventwire import replay_address, subscriber_address
from multi.router.forward import Forwarder
from multi.router.index import STORE, BlockIndex
from multi.router.instances import Instance, Pool, check_health, load_file
from multi.router.intake import block_hashes, check_prompt, max_model_len, read_json
from multi.router.prompts import Prompts
from multi.router.storeview import StoreIndex
from p2p.proxy import ProxyError, error_response

logger = logging.getLogger("mctier.router")


class Router(Forwarder):
    """The KV-aware router: see the module docstring. Routes run in :class:`Forwarder`."""

    def __init__(self, pool: Pool, chooser: Chooser, index: BlockIndex, prompts: Prompts, *, timeout: float,
                 connect_timeout: float, slo: float | None = None, store_view=None, store_approx: bool = False,
                 health_interval: float = 2.0, instances_file: str | None = None, store_timeout: float = 0.5,
                 decision_log: str | None = None, secret: bytes | None = None, probe_timeout: float = 60.0,
                 store_index: StoreIndex | None = None):
        super().__init__(pool, chooser, index, timeout=timeout, connect_timeout=connect_timeout,
                         store_approx=store_approx, decision_log=decision_log, secret=secret)
        self.prompts = prompts
        self.max_model_len: int | None = None  # the served model's (intake.max_model_len), once known
        # The exact view (KV events) lives apart from the router's own record: a stale
        # subscriber clears its view, and removals must not delete what the router recorded.
        self.exact = BlockIndex(index.block_size, index.default_capacity)
        self.slo, self.store_view = slo, store_view
        # What the store tier's KV events say the store holds (all instances' events, one view):
        # the first filter of the store check, with a store view only (multi.router.storeview).
        self.store_index = store_index if store_view is not None else None
        self.store_timeout = store_timeout
        self.health_interval, self.instances_file = health_interval, instances_file
        self.subscribers: dict[str, EventSubscriber] = {}
        self._tasks: list[asyncio.Task] = []
        # The start-up probe (multi.router.probe): off with a 0 deadline or frozen priors.
        self.probe_timeout = probe_timeout if chooser.cfg.calibrate else 0.0
        self._probed: set[str] = set()  # instances probed since they (re)joined the rotation
        self._probing: asyncio.Task | None = None
        # Store lookups get threads of their own: a slow master must not hold up the
        # default executor (tokenization, hold releases).
        self._store_pool = ThreadPoolExecutor(2, thread_name_prefix="store-view")

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, app) -> None:
        await super().start(app)
        await asyncio.gather(*(self._discover_events(i) for i in self.pool.all))
        self._sync_subscribers()
        await asyncio.gather(*(check_health(self.session, i, self.connect_timeout) for i in self.pool.all))
        self.max_model_len = await max_model_len(self.session, self.pool, self.connect_timeout)
        # The probe runs while the router already listens; /health answers 503 until it is done.
        self._probing = asyncio.create_task(self._probe([i for i in self.pool.all if i.healthy]))
        self._tasks += [self._probing, asyncio.create_task(self._health_loop())]
        # Load the tokenizer and connect to the store now, not on the first request.
        self._tasks.append(asyncio.create_task(self._load_tokenizer()))
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
                sub = EventSubscriber(url, addr, self.exact, replay_address(i.replay, host), bind=bind,
                                      store=self.store_index.index if self.store_index is not None else None)
                self.subscribers[url] = sub
                sub.start()

    def match(self, inst: Instance, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` that ``inst`` holds: from its KV events while they are
        trustworthy, else from what the router sent it."""
        sub = self.subscribers.get(inst.url)
        if sub is not None and not sub.stale:
            return self.exact.match(inst.url, hashes)
        return self.index.match(inst.url, hashes)

    def cached_most(self, hashes: list[int]) -> int:
        """The most leading prompt tokens any healthy instance holds (:meth:`match`)."""
        return max((self.match(i, hashes) for i in self.pool.all if i.healthy), default=0) * self.index.block_size

    def reload(self) -> None:
        """SIGHUP: re-read the instances file; on an error keep the current instances.
        (An added instance's KV events are followed when the file names them.)"""
        try:
            added, removed = self.pool.replace_file(load_file(self.instances_file))
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

    async def _probe(self, instances: list[Instance]) -> None:
        """Probe ``instances`` (:mod:`multi.router.probe`) and remember which were done."""
        if self.probe_timeout <= 0 or not instances:
            return
        from multi.router.probe import probe

        got = await probe(self, instances, self.probe_timeout)
        for url, m in got.items():
            self._probed.add(url)  # a failed probe is not retried until the instance rejoins
            for what in ("step", "token", "handoff"):
                if what in m:
                    self.metrics.probe.labels(url, what).set(m[what])

    def _probe_joined(self) -> None:
        """An instance that joined or came back into rotation, idle: probe it in the background."""
        for i in self.pool.all:
            if not i.healthy:
                self._probed.discard(i.url)
        todo = [i for i in self.pool.all if i.healthy and i.url not in self._probed and not (i.inflight or i.decoding)]
        if todo and self.probe_timeout > 0 and (self._probing is None or self._probing.done()):
            self._probing = asyncio.create_task(self._probe(todo))
            self._tasks.append(self._probing)

    async def _load_tokenizer(self) -> None:
        await self.prompts.load(self.session, self.pool)
        await self.prompts.verify(self.session, self.pool)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await asyncio.gather(*(check_health(self.session, i, self.connect_timeout) for i in self.pool.all))
                # A prefill that restarted between two rounds has another engine id: ask again.
                await asyncio.gather(*(self.check_engine_id(i) for i in self.pool.role("prefill")))
                self._refresh_gauges()
                self._probe_joined()
                await self.prompts.verify(self.session, self.pool)
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
        if self.store_index is not None:
            m.index_blocks.labels(STORE, "exact").set(self.store_index.blocks())
        for url, s in self.subscribers.items():
            st = s.stats()
            m.event_lag.labels(url).set(st.get("lag_s") or 0.0)
            for k in ("events", "batches", "gaps", "replays", "replay_failures", "unknown_parent",
                      "store_stored", "store_removed", "store_unmapped"):
                m.events.labels(url, k).set(st.get(k, 0))
            m.events.labels(url, "stale").set(1 if st.get("stale") else 0)

    # -- handlers --------------------------------------------------------------------------

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self._refresh_gauges()
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        body = {i.url: {"role": i.role, "healthy": i.healthy} for i in self.pool.all}
        if self.pool.disaggregated:
            # The kv and direct policies serve on a decode instance alone when no prefill instance is up.
            ok = bool(self.pool.role("decode")) and (bool(self.pool.role("prefill"))
                                                     or self.chooser.policy in ("kv", "direct"))
        else:
            ok = bool(self.pool.role("plain"))
        # "tokenizer" (multi.router.prompts.Prompts.state): a router still loading it routes token-id
        # prompts as usual, but holds string prompts until it is loaded, and spends CPU on it. "probe":
        # the start-up probe's state (multi.router.probe); unhealthy while it runs (its requests share
        # the engines with any routed meanwhile, which go on the priors).
        running = self._probing is not None and not self._probing.done()
        probe = "off" if self.probe_timeout <= 0 else "running" if running else "done"
        ok = ok and not running
        # "prompts": "token ids" when string completion prompts go to the engines as the router's
        # token ids (multi.router.prompts.Prompts.forwarding), else "text".
        prompts = "token ids" if self.prompts.forwarding(self.pool) else "text"
        return web.json_response({"healthy": ok, "tokenizer": self.prompts.state, "prompts": prompts, "probe": probe,
                                  "instances": body},
                                 status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        up = self.pool.role("decode") or self.pool.role("plain")
        if not up:
            return error_response(503, "no healthy instance")
        try:
            async with self.session.get(up[0].url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(502, f"instance {up[0].url} unreachable: {e!r}")

    def store_events_trusted(self) -> bool:
        """Whether the store tier's events may filter the store check: every instance's event
        stream is followed and none is stale (lost events may include a stored chunk)."""
        if self.store_index is None or not self.pool.all:
            return False
        return all((sub := self.subscribers.get(i.url)) is not None and not sub.stale for i in self.pool.all)

    async def _store_reach(self, tokens: list[int], hashes: list[int], salt) -> tuple[int, str | None, int | None]:
        """The store's reach ``S`` in tokens, how it was settled (``short``, ``skipped``, ``confirmed``,
        ``stale``, ``unfiltered``, ``unanswered``; None without a store view) and what the store
        tier's events said (tokens; None when they were not used): :mod:`multi.router.storeview`."""
        approx = self.index.match(STORE, hashes) * self.index.block_size if self.store_approx else 0
        if self.store_view is None or not tokens:
            return approx, None, None
        chunk = self.store_view.chunk_tokens
        if chunk and len(tokens) - self.cached_most(hashes) < chunk:
            # An instance's own cache leaves less than a chunk: what the store could add is worth
            # less than the lookup's round trip, and the engine's store tier would not wait for
            # it either (mcstore's lookup_defer_min_tokens).
            return self._store_checked(approx, "short", None)
        events = self.store_index if self.store_events_trusted() else None
        probable = events.probable(hashes) if events is not None else None
        if probable == 0:
            return self._store_checked(0, "skipped", 0)
        said = None if probable is None else probable * self.index.block_size
        try:
            loop = asyncio.get_running_loop()
            found = await asyncio.wait_for(loop.run_in_executor(self._store_pool, self.store_view.check, tokens, salt),
                                           self.store_timeout)
        except Exception as e:  # noqa: BLE001 - late or failed lookups fall back to the approximate view
            logger.debug("store lookup failed (%r): approximate view", e)
            found = None
        if found is None or chunk is None:
            return self._store_checked(approx, "unanswered", said)
        if events is None:
            return self._store_checked(found, "unfiltered", said)
        return self._store_checked(found, events.settle(hashes, probable, found, chunk), said)

    def _store_checked(self, store: int, outcome: str, said: int | None) -> tuple[int, str, int | None]:
        self.metrics.store_checks.labels(outcome).inc()
        return store, outcome, said

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.monotonic()
        salt = None
        try:
            # JSON only, bounded, parsed and hashed off the event loop when large (intake).
            body = await read_json(request)
            slo = ttft_target(request.headers, body, self.slo)
            tokens = await self.prompts.token_ids(self.session, self.pool, path, body)
            if self.max_model_len is None and tokens:
                self.max_model_len = await max_model_len(self.session, self.pool, self.connect_timeout)
            check_prompt(tokens, self.max_model_len)
            salt = body.get("cache_salt")
            t1 = time.monotonic()
            hashes = await block_hashes(tokens, self.index.block_size, salt)
        except ProxyError as e:
            return self._answer(error_response(e.status, e.message))
        t2 = time.monotonic()
        store, store_check, store_events = await self._store_reach(tokens, hashes, salt)
        t3 = time.monotonic()
        bs = self.index.block_size

        def match(i: Instance) -> int:
            return self.match(i, hashes) * bs

        route = self.chooser.choose(self.pool, len(tokens), match, store, slo)
        if route is None:
            return self._answer(error_response(503, "no healthy instance to route to"))
        route.store_check, route.store_events = store_check, store_events
        self.metrics.decisions.labels(route.kind, route.reason).inc()
        if route.kind == "reject":
            self.metrics.rejections.inc()
            resp = error_response(429, f"time-to-first-token target cannot be met: {route.reason}")
            resp.headers["Retry-After"] = str(route.retry_after)
            self._log_decision(t0, len(tokens), route, resp.status, None)
            return self._answer(resp)
        ttft: dict[str, float] = {}
        body = self.prompts.as_ids(path, body, tokens, self.pool)  # tokenized once (multi.router.prompts)
        booked = self.reserve(route, tokens, hashes, t0, body)
        for phase, dt in (("tokenize", t1 - t0), ("hash", t2 - t1), ("store", t3 - t2), ("choose", time.monotonic() - t3)):
            self.metrics.intake.labels(phase).observe(dt)
        try:
            resp = await asyncio.wait_for(self._execute(request, path, body, route, tokens, hashes, t0, ttft, booked),
                                          self.timeout)
        except ProxyError as e:
            logger.warning("%s: %s", path, e.message)
            resp = error_response(e.status, e.message)
        except asyncio.TimeoutError:
            resp = error_response(504, f"no complete answer within the router's deadline ({self.timeout:.0f}s)")
        except asyncio.CancelledError:  # the client went away: logged with nginx's 499
            self._log_decision(t0, len(tokens), route, 499, ttft.get("s"), ttft.get("prefill_s"))
            raise
        finally:
            self.release(booked)  # a request cancelled before its run started
        self._log_decision(t0, len(tokens), route, resp.status, ttft.get("s"), ttft.get("prefill_s"))
        return self._answer(resp)
