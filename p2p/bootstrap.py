"""The prefill-side bootstrap server and its client calls.

``POST /register`` ``{engine_id, dp_rank, tp_rank, pp_rank, addr}`` and ``GET /query`` ->
``{"<dp>": {"engine_id": .., "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}``: the
same JSON as vLLM's ``MooncakeBootstrapServer``, so vLLM's Mooncake proxy and our
proxy can read it. A conflicting registration (another engine id for a dp rank, or
another address for a (dp, tp, pp) slot) is a 400 with ``{"detail": ...}``; an
identical retry is ok. Runs an aiohttp app on its own thread and event loop; binds
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import msgspec
from aiohttp import web

from kvcore.errors import TransferTimeout
from kvcore.log import get_logger
from p2p.protocol import EngineEntry, RegisterPayload, parse_query, query_json

logger = get_logger("p2p.bootstrap")


class BootstrapError(RuntimeError):
    """A bootstrap server could not be reached or refused a call."""

    timed_out = False


class BootstrapTimeout(BootstrapError):
    """No answer within the call's timeout: a busy server (on a TP > 1 prefill instance it
    shares a process with a rank that holds the GIL through a long forward pass) or a
    host that drops packets, unlike a refused connection or an HTTP error."""

    timed_out = True


class BootstrapServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port
        self.workers: dict[int, EngineEntry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- handlers (run on the server loop: no lock needed) --
    async def _register(self, request: web.Request) -> web.Response:
        try:
            p = msgspec.convert(await request.json(), RegisterPayload, strict=False)
        except (ValueError, msgspec.ValidationError) as e:
            return web.json_response({"detail": f"bad registration: {e}"}, status=400)
        entry = self.workers.setdefault(p.dp_rank, EngineEntry(p.engine_id, {}))
        if entry.engine_id != p.engine_id:
            return web.json_response(
                {"detail": f"Engine ID mismatch for dp_rank={p.dp_rank}: expected {entry.engine_id}, "
                           f"got {p.engine_id}"},
                status=400,
            )
        slot = entry.worker_addr.setdefault(p.tp_rank, {})
        existing = slot.get(p.pp_rank)
        if existing is not None and existing != p.addr:
            return web.json_response(
                {"detail": f"Worker with dp_rank={p.dp_rank}, tp_rank={p.tp_rank}, pp_rank={p.pp_rank} "
                           f"is already registered at {existing}, but still want to register at {p.addr}"},
                status=400,
            )
        slot[p.pp_rank] = p.addr
        logger.debug("registered %s dp=%d tp=%d pp=%d at %s", p.engine_id, p.dp_rank, p.tp_rank, p.pp_rank, p.addr)
        return web.json_response({"status": "ok"})

    async def _query(self, request: web.Request) -> web.Response:
        return web.json_response(query_json(self.workers))

    # -- lifecycle --
    def start(self, timeout: float = 10.0) -> BootstrapServer:
        ready = threading.Event()
        err: list[BaseException] = []

        def run():
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_post("/register", self._register)
            app.router.add_get("/query", self._query)
            self._runner = web.AppRunner(app, access_log=None)
            try:
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                err.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="p2p-bootstrap", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TransferTimeout(f"bootstrap server did not start on {self.host}:{self.port} in {timeout}s")
        if err:
            raise BootstrapError(f"bootstrap server cannot listen on {self.host}:{self.port}: {err[0]}")
        logger.info("P2P bootstrap server on http://%s:%d", self.host, self.port)
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._thread = None


def _http(url: str, timeout: float, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise BootstrapError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        cls = BootstrapTimeout if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError) else BootstrapError
        raise cls(f"{url}: unreachable: {reason}") from None


def query(url: str, timeout: float) -> dict[int, EngineEntry]:
    return parse_query(_http(url.rstrip("/") + "/query", timeout))


# How long a worker keeps trying to register at startup. Rank 0 of the prefill instance
# starts the server while the other ranks, in their own processes, reach this call at the
# same time; on a loaded 2-core machine rank 0 was seen more than 1.5 s behind (a refused
# connection). An engine's own startup takes tens of seconds, so a minute of retrying
# costs nothing when the server is merely late and still ends a startup that cannot work.
REGISTER_WAIT_S = 60.0


def register(url: str, payload: RegisterPayload, timeout: float, wait_s: float = REGISTER_WAIT_S) -> None:
    """Register a worker. A refused connection or a timeout is retried (backing off to 2 s)
    until ``wait_s`` has passed since the first call, then raised; an HTTP 400 (a real
    conflict: another engine id or address for this slot) is raised at once."""
    give_up = time.monotonic() + wait_s
    delay, tries = 0.25, 0
    while True:
        tries += 1
        try:
            _http(url.rstrip("/") + "/register", timeout, msgspec.to_builtins(payload))
            if tries > 1:
                logger.info("registered at %s on try %d", url, tries)
            return
        except BootstrapError as e:
            if "HTTP 400" in str(e) or time.monotonic() + delay > give_up:
                raise
            if tries == 1:
                logger.info("bootstrap server %s not reachable yet (%s); retrying for up to %.0fs", url, e, wait_s)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def find_engine(workers: dict[int, EngineEntry], engine_id: str) -> EngineEntry | None:
    for entry in workers.values():
        if entry.engine_id == engine_id:
            return entry
    return None
