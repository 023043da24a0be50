"""``mctier proxy``: OpenAI-compatible P/D proxy speaking vLLM's Mooncake contract.

    mctier proxy --prefill http://127.0.0.1:8100@http://127.0.0.1:8998 \\
                 --decode http://127.0.0.1:8200 --port 8000

Each ``--prefill`` is ``URL`` or ``URL@BOOTSTRAP_URL`` (the prefill engine's bootstrap
server; default: the prefill host with port ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` or 8998);
``--bootstrap`` gives them as a separate list instead. Per client request: one
``transfer_id``; the prefill request (``max_tokens=1``, not streamed,
``do_remote_decode``) and the decode request (``do_remote_prefill``,
``remote_bootstrap_addr``, ``remote_engine_id``, ``transfer_id``, plus any
``kv_transfer_params`` keys the client sent) go out concurrently; instances are picked
by fewest outstanding requests; the decode response (its ``kv_transfer_params``
included) is passed through. A prefill that fails before the decode produced output,
or an unreachable instance, is a 502; the overall deadline is a 504; a client that
disconnects cancels both upstream requests (vLLM then aborts them and the prefill
blocks are released).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

import logging

from p2p.config import normalize_url

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
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


def _default_bootstrap(url: str) -> str:
    host = urlparse(url).hostname or "127.0.0.1"
    return f"http://{host}:{os.environ.get('VLLM_MOONCAKE_BOOTSTRAP_PORT', '8998')}"


class Proxy:
    def __init__(self, prefills: list[Backend], decodes: list[Backend], timeout: float, connect_timeout: float):
        self.prefills, self.decodes = prefills, decodes
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app):
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout))

    async def stop(self, app):
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def _pick(backends: list[Backend]) -> Backend:
        return min(backends, key=lambda b: b.outstanding)

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
    async def health(self, request: web.Request) -> web.Response:
        async def ok(b: Backend) -> bool:
            try:
                async with self.session.get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        states = await asyncio.gather(*(ok(b) for b in self.prefills + self.decodes))
        body = {b.url: s for b, s in zip(self.prefills + self.decodes, states)}
        healthy = any(states[: len(self.prefills)]) and any(states[len(self.prefills):])
        return web.json_response({"healthy": healthy, "instances": body}, status=200 if healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        d = self._pick(self.decodes)
        try:
            async with self.session.get(d.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode instance {d.url} unreachable: {e!r}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except (ValueError, json.JSONDecodeError) as e:
            return _error(400, f"invalid JSON body: {e}")
        p, d = self._pick(self.prefills), self._pick(self.decodes)
        p.outstanding += 1
        d.outstanding += 1
        try:
            return await asyncio.wait_for(self._run(request, path, body, p, d), self.timeout)
        except ProxyError as e:
            logger.warning("%s: %s", path, e.message)
            return _error(e.status, e.message)
        except asyncio.TimeoutError:
            return _error(504, f"no complete answer within the proxy deadline ({self.timeout:.0f}s)")
        finally:
            p.outstanding -= 1
            d.outstanding -= 1

    async def _run(self, request: web.Request, path: str, body: dict, p: Backend, d: Backend):
        rid = str(uuid.uuid4())
        tid = f"xfer-{rid}"
        client_params = body.get("kv_transfer_params") or {}
        if not isinstance(client_params, dict):
            raise ProxyError(400, "kv_transfer_params must be an object")
        try:
            engine_id = await self._engine_id(p)
        except ProxyError:
            p.engine_id = None
            raise
        headers = {"X-Request-Id": rid}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth

        pbody = {k: v for k, v in body.items() if k not in ("stream_options",)}
        pbody.update(max_tokens=1, stream=False,
                     kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid})
        if "max_completion_tokens" in body:
            pbody["max_completion_tokens"] = 1
        dbody = dict(body)
        dbody["kv_transfer_params"] = {**client_params, "do_remote_decode": False, "do_remote_prefill": True,
                                       "remote_bootstrap_addr": p.bootstrap, "remote_engine_id": engine_id,
                                       "transfer_id": tid}

        prefill = asyncio.create_task(self._prefill(p, path, pbody, headers))
        stream = bool(body.get("stream"))
        first = asyncio.create_task(self._decode_first(d, path, dbody, headers, stream))
        resp = None
        try:
            # Until the decode instance produced something, a failed prefill fails the request.
            await self._race(first, prefill)
            resp, data = first.result()
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

    async def _prefill(self, p: Backend, path: str, body: dict, headers: dict) -> None:
        t0 = time.monotonic()
        try:
            async with self.session.post(p.url + path, json=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    status = r.status if 400 <= r.status < 500 else 502
                    raise ProxyError(status, f"prefill instance {p.url}: HTTP {r.status}: {data[:300].decode(errors='replace')}")
        except (aiohttp.ClientError, ConnectionError) as e:
            p.engine_id = None  # it may come back with another engine id
            raise ProxyError(502, f"prefill instance {p.url} failed: {e!r}") from None
        logger.debug("prefill on %s took %.3fs", p.url, time.monotonic() - t0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mctier proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", nargs="+", required=True, metavar="URL[@BOOTSTRAP_URL]")
    ap.add_argument("--decode", nargs="+", required=True, metavar="URL")
    ap.add_argument("--bootstrap", nargs="+", metavar="URL", help="bootstrap URLs, one per --prefill")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline of one client request (504 after)")
    ap.add_argument("--connect-timeout", type=float, default=5.0, help="connect / bootstrap query timeout (502 after)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap.parse_args(argv)


def build_app(args: argparse.Namespace) -> web.Application:
    prefills = []
    if args.bootstrap and len(args.bootstrap) != len(args.prefill):
        raise SystemExit("--bootstrap needs exactly one URL per --prefill")
    for i, spec in enumerate(args.prefill):
        url, _, boot = spec.partition("@")
        if args.bootstrap:
            boot = args.bootstrap[i]
        url = normalize_url(url)
        prefills.append(Backend(url, normalize_url(boot) if boot else _default_bootstrap(url)))
    decodes = [Backend(normalize_url(u)) for u in args.decode]
    proxy = Proxy(prefills, decodes, args.timeout, args.connect_timeout)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app["proxy"] = proxy
    return app


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    for p in app["proxy"].prefills:
        print(f"prefill {p.url} (bootstrap {p.bootstrap})", flush=True)
    for d in app["proxy"].decodes:
        print(f"decode  {d.url}", flush=True)
    # handler_cancellation: a client disconnect cancels the handler, which closes the
    # upstream connections, which makes vLLM abort both requests.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None,
                print=lambda s: print(s, flush=True))
    return 0
