"""The P2P tier's proxy contract: vLLM's Mooncake P/D exchange, for a router to drive.

:func:`prefill_body` and :func:`decode_body` build the two requests of one client
request, tied by one ``transfer_id``: the prefill request (``max_tokens=1``, not
streamed, ``do_remote_decode``) and the decode request (``do_remote_prefill``,
``remote_bootstrap_addr``, ``remote_engine_id``, ``transfer_id``). :class:`Proxy` runs them:
the prefill instance's engine id comes from its bootstrap server's ``/query`` (vLLM's route),
both requests go out concurrently, and the decode response (its ``kv_transfer_params``
included) is passed through, streamed or whole. :meth:`Proxy._direct` sends a whole
request to one instance instead.

Of a client's ``kv_transfer_params`` only the keys a client may set pass
(``kv_source``; ``kv_transfer_params.ttft_slo_s`` is the router's own, ``kvcore.trust.CLIENT_KEYS``),
on both routes: every transfer field is the proxy's own. With the deployment's secret the
proxy signs the transfer fields it sets, bound to the body it forwards
(``kvcore.trust.sign_params``), and its hold releases (:mod:`p2p.release`).

Failures: a prefill that fails before the decode produced output, or an unreachable
instance, is a :class:`ProxyError` with status 502 (``prefill_failed`` tells a router it
may retry elsewhere); a decode that fails after its prefill succeeded has the prefill's
hold released at once (:mod:`p2p.release`) instead of at its abort timeout; a client
that disconnects cancels both upstream requests (vLLM then aborts them and the prefill
blocks are released). ``mctier proxy`` is :mod:`multi.router`, which picks the instances.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

from kvcore import trust
from p2p.release import release_hold

# A standalone process: a plain logger (kvcore.log would import all of vLLM just for this).
logger = logging.getLogger("mctier.proxy")


@dataclass
class Backend:
    url: str
    bootstrap: str | None = None
    outstanding: int = 0
    engine_id: str | None = None
    engine_checked: float = field(default=0.0)


class ProxyError(Exception):
    """A request that cannot be answered: ``status`` is the HTTP status to return;
    ``prefill_failed`` says the prefill instance failed before the decode instance
    produced any output (a router may retry the request on another prefill instance)."""

    def __init__(self, status: int, message: str, prefill_failed: bool = False):
        super().__init__(message)
        self.status, self.message, self.prefill_failed = status, message, prefill_failed


def error_response(status: int, message: str) -> web.Response:
    """An OpenAI-style JSON error answer with HTTP ``status`` (what a router returns)."""
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


def default_bootstrap(url: str) -> str:
    """A prefill instance's bootstrap server when none is given: its host, port
    ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (8998, vLLM's default)."""
    host = urlparse(url).hostname or "127.0.0.1"
    return f"http://{host}:{os.environ.get('VLLM_MOONCAKE_BOOTSTRAP_PORT', '8998')}"


def prefill_body(body: dict, transfer_id: str) -> dict:
    """The prefill request of vLLM's Mooncake proxy contract: one token, not streamed,
    ``do_remote_decode`` with the request's ``transfer_id`` (nothing of the client's
    ``kv_transfer_params``)."""
    pbody = {k: v for k, v in body.items() if k not in ("stream_options",)}
    pbody.update(max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id})
    if "max_completion_tokens" in body:
        pbody["max_completion_tokens"] = 1
    return pbody


def decode_body(body: dict, client_params: dict, bootstrap: str, engine_id: str, transfer_id: str) -> dict:
    """The decode request: the client's, with ``do_remote_prefill`` and where to pull from; of
    the client's ``kv_transfer_params`` only the keys a client may set are kept."""
    dbody = dict(body)
    dbody["kv_transfer_params"] = {**trust.client_fields(client_params), "do_remote_decode": False,
                                   "do_remote_prefill": True, "remote_bootstrap_addr": bootstrap,
                                   "remote_engine_id": engine_id, "transfer_id": transfer_id}
    return dbody


def direct_body(body: dict) -> dict:
    """A whole request for one instance: the client's, without any transfer field."""
    params = trust.client_fields(body.get("kv_transfer_params"))
    dbody = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        dbody["kv_transfer_params"] = params
    return dbody


_SIGN_INLINE = 64 << 10  # request bytes whose body is digested on the event loop; larger in a thread


class Proxy:
    def __init__(self, timeout: float, connect_timeout: float, secret: bytes | None = None):
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.secret = secret  # the deployment's (kvcore.trust): transfer parameters are signed with it
        self.session: aiohttp.ClientSession | None = None
        self.releases = 0  # prefill holds released after their decode failed

    async def _signed(self, body: dict, size: int | None) -> dict:
        """``body`` with its transfer parameters signed (unchanged without a secret)."""
        if self.secret is None:
            return body
        if size is None or size > _SIGN_INLINE:
            digest = await asyncio.to_thread(trust.body_digest, body)
        else:
            digest = trust.body_digest(body)
        body["kv_transfer_params"] = trust.sign_params(self.secret, body["kv_transfer_params"], digest)
        return body

    async def check_engine_id(self, p: Backend) -> None:
        """Health round: forget ``p``'s cached engine id when its bootstrap server no longer
        lists it first (the prefill restarted) or does not answer; the next request asks again."""
        if p.engine_id is None or p.bootstrap is None:
            return
        url = p.bootstrap.rstrip("/") + "/query"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as r:
                body = await r.json() if r.status == 200 else None
            now = body[min(body, key=int)]["engine_id"] if body else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            now = None
        if now != p.engine_id:
            logger.warning("prefill %s: engine id %s is gone from %s (now %s); asking again at its next request",
                           p.url, p.engine_id, url, now)
            p.engine_id = None

    async def start(self, app):
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout))

    async def stop(self, app):
        if self.session is not None:
            await self.session.close()

    async def _engine_id(self, p: Backend) -> str:
        if p.engine_id is not None:
            return p.engine_id
        url = p.bootstrap.rstrip("/") + "/query"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as r:
                if r.status != 200:
                    raise ProxyError(502, f"prefill bootstrap {url}: HTTP {r.status}")
                body = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ProxyError(502, f"prefill bootstrap {url} unreachable: {e!r}") from None
        if not body:
            raise ProxyError(502, f"prefill bootstrap {url}: no engine registered yet")
        p.engine_id = body[min(body, key=int)]["engine_id"]
        logger.info("prefill %s: engine id %s (from %s)", p.url, p.engine_id, url)
        return p.engine_id

    # ---------------- handlers ----------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        """Pick the instances and run :meth:`_run` or :meth:`_direct`: the router's part
        (:class:`multi.router.app.Router`)."""
        raise NotImplementedError

    # Hooks for a router that measures (no-ops here): the first output of request ``rid``
    # reached the proxy; the prefill of ``rid`` on ``p`` succeeded after ``seconds``.
    def _first_output(self, rid: str) -> None:
        pass

    def _prefill_done(self, p: Backend, rid: str, seconds: float) -> None:
        pass

    async def _run(self, request: web.Request, path: str, body: dict, p: Backend, d: Backend,
                   rid: str | None = None):
        rid = rid or str(uuid.uuid4())
        tid = f"xfer-{rid}"
        client_params = body.get("kv_transfer_params") or {}
        if not isinstance(client_params, dict):
            raise ProxyError(400, "kv_transfer_params must be an object")
        try:
            engine_id = await self._engine_id(p)
        except ProxyError as e:
            p.engine_id = None
            e.prefill_failed = True
            raise
        headers = {"X-Request-Id": rid}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth

        pbody = await self._signed(prefill_body(body, tid), request.content_length)
        dbody = await self._signed(decode_body(body, client_params, p.bootstrap, engine_id, tid),
                                   request.content_length)
        prefill = asyncio.create_task(self._prefill(p, path, pbody, headers, rid))
        stream = bool(body.get("stream"))
        first = asyncio.create_task(self._decode_first(d, path, dbody, headers, stream))
        resp, answered = None, False
        try:
            # Until the decode instance produced something, a failed prefill fails the request.
            await self._race(first, prefill)
            resp, data = first.result()
            self._first_output(rid)
            out = await self._relay(request, resp, data, stream)
            answered = resp.status == 200
            return out
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ProxyError(502, f"decode instance {d.url} failed: {e!r}") from None
        finally:
            if not first.done():
                first.cancel()
            if resp is not None:
                resp.release()
            if not prefill.done():
                # Client gone or decode finished first: the prefill request is useless now.
                prefill.cancel()
            elif not prefill.cancelled() and prefill.exception() is not None:
                logger.info("prefill failed after the decode answered: %s", prefill.exception())
            elif not answered and not prefill.cancelled():
                # The prefill holds its blocks for a decode that will not pull them: free
                # them now rather than at the prefill's abort timeout.
                self._release_later(p, engine_id, tid)

    def _release_later(self, p: Backend, engine_id: str, tid: str) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: release_hold(p.bootstrap, engine_id, tid, self.connect_timeout,
                                                              secret=self.secret))
        self.releases += 1
        fut.add_done_callback(lambda f: f.exception() or logger.info(
            "released the prefill hold of %s on %s (%d workers confirmed)", tid, p.url, f.result()))

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, data: bytes,
                     stream: bool) -> web.StreamResponse:
        """Pass an upstream response on: whole (``data``) or streamed from its first chunk."""
        if resp.status != 200 or not stream:
            return web.Response(body=data, status=resp.status, content_type=resp.content_type)
        out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
        await out.prepare(request)
        chunk = data
        while chunk:
            await out.write(chunk)
            chunk = await resp.content.readany()
        await out.write_eof()
        return out

    async def _direct(self, request: web.Request, path: str, body: dict, d: Backend,
                      rid: str | None = None) -> web.StreamResponse:
        """The whole request on one instance (no handoff): a plain engine, or a decode instance
        whose connector loads what the store holds and recomputes the rest."""
        rid = rid or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        stream = bool(body.get("stream"))
        resp = None
        try:
            resp, data = await self._decode_first(d, path, direct_body(body), headers, stream)
            self._first_output(rid)
            return await self._relay(request, resp, data, stream)
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ProxyError(502, f"instance {d.url} failed: {e!r}") from None
        finally:
            if resp is not None:
                resp.release()

    async def _decode_first(self, d: Backend, path: str, body: dict, headers: dict, stream: bool):
        """The decode response and its whole body (non-streamed or error) or first chunk."""
        resp = await self._open(d, path, body, headers)
        try:
            if resp.status != 200 or not stream:
                return resp, await resp.read()
            return resp, await resp.content.readany()
        except BaseException:
            resp.release()
            raise

    async def _race(self, decode_task: asyncio.Task, prefill: asyncio.Task) -> None:
        """Wait for ``decode_task``; a prefill failure before it completes is raised (502)."""
        try:
            done, _ = await asyncio.wait({decode_task, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if decode_task not in done:
                err = None if prefill.cancelled() else prefill.exception()
                if err is not None:
                    decode_task.cancel()
                    raise err
                await asyncio.wait({decode_task})
        except asyncio.CancelledError:
            decode_task.cancel()
            raise

    async def _open(self, b: Backend, path: str, body: dict, headers: dict) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(b.url + path, json=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ProxyError(502, f"decode instance {b.url} unreachable: {e!r}") from None

    async def _prefill(self, p: Backend, path: str, body: dict, headers: dict, rid: str = "") -> None:
        t0 = time.monotonic()
        try:
            async with self.session.post(p.url + path, json=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    status = r.status if 400 <= r.status < 500 else 502
                    raise ProxyError(status, f"prefill instance {p.url}: HTTP {r.status}: "
                                             f"{data[:300].decode(errors='replace')}", prefill_failed=status >= 500)
        except (aiohttp.ClientError, ConnectionError) as e:
            p.engine_id = None  # it may come back with another engine id
            raise ProxyError(502, f"prefill instance {p.url} failed: {e!r}", prefill_failed=True) from None
        logger.debug("prefill on %s took %.3fs", p.url, time.monotonic() - t0)
        self._prefill_done(p, rid, time.monotonic() - t0)
