"""The prefill-side bootstrap server and its client calls.

``POST /register`` ``{engine_id, dp_rank, tp_rank, pp_rank, addr}`` and ``GET /query`` ->
``{"<dp>": {"engine_id": .., "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}``: the
same JSON as vLLM's ``MooncakeBootstrapServer``, so vLLM's Mooncake proxy and our
proxy can read it. A conflicting registration (another engine id for a dp rank, or
another address for a (dp, tp, pp) slot) is a 400 with ``{"detail": ...}``; an
identical retry is ok. Runs an aiohttp app on its own thread and event loop; binds
127.0.0.1 unless told otherwise.

A registration is believed only when it could come from its own engine's workers: a JSON
body (else 415) of at most :data:`MAX_BODY` bytes (else 413), the engine id of the engine
that runs the server, ranks within its own sizes, an address ``tcp://HOST:PORT`` (not a
wildcard), and with the deployment's secret a valid signature
(``p2p.protocol.registration_refusal``; else 403). Anything else is a 400 naming why, and
counted (``rejected:register``).

The client calls (:func:`query`, :func:`register`) accept only ``http`` and ``https`` URLs,
have one deadline for the whole exchange (a server that answers a byte at a time does not
stretch it) and read at most :data:`MAX_REPLY` bytes of an answer.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from kvcore.errors import TransferTimeout
from kvcore.log import Throttle, get_logger
from p2p.protocol import (
    EngineEntry,
    RegisterPayload,
    parse_query,
    query_json,
    registration_refusal,
    sign_registration,
)

logger = get_logger("p2p.bootstrap")

MAX_BODY = 16 << 10  # a registration is ~200 bytes
MAX_REPLY = 1 << 20  # a /query answer lists every worker's address: ~100 bytes each
MAX_WORKERS = 4096  # registrations a server without known sizes keeps


class BootstrapError(RuntimeError):
    """A bootstrap server could not be reached or refused a call."""

    timed_out = False


class BootstrapTimeout(BootstrapError):
    """No answer within the call's timeout: a busy server (on a TP > 1 prefill instance it
    shares a process with a rank that holds the GIL through a long forward pass) or a
    host that drops packets, unlike a refused connection or an HTTP error."""

    timed_out = True


def check_worker_addr(addr: str) -> str | None:
    """Why ``addr`` is not a side channel address ``tcp://HOST:PORT`` a decode may dial, or None."""
    u = urlsplit(addr) if isinstance(addr, str) and len(addr) <= 300 else None
    try:
        port = u.port if u is not None else None
    except ValueError:
        port = None
    if u is None or u.scheme != "tcp" or not u.hostname or not port or u.path or u.query:
        return f"address {addr!r} is not tcp://HOST:PORT"
    try:
        if ipaddress.ip_address(u.hostname).is_unspecified:
            return f"address {addr!r} names no host (a wildcard)"
    except ValueError:
        if not all(c.isalnum() or c in "-." for c in u.hostname):
            return f"address {addr!r}: {u.hostname!r} is neither an IP address nor a host name"
    return None


class BootstrapServer:
    """``engine_id`` and the sizes: the engine that runs the server (registrations from another
    engine, or with ranks outside these sizes, are refused); None: not checked (a server apart
    from any engine). ``secret``: the deployment's, registrations must be signed with it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, engine_id: str | None = None,
                 dp_size: int | None = None, tp_size: int | None = None, pp_size: int | None = None,
                 secret: bytes | None = None, on_refused=None):
        self.host = host
        self.port = port
        self.engine_id, self.secret = engine_id, secret
        self.sizes = {"dp_rank": dp_size, "tp_rank": tp_size, "pp_rank": pp_size}
        self.on_refused = on_refused  # called with no argument for every refused registration
        self.workers: dict[int, EngineEntry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._throttle = Throttle()

    # -- handlers (run on the server loop: no lock needed) --
    def _refuse(self, status: int, detail: str) -> web.Response:
        if self.on_refused is not None:
            self.on_refused()
        if (held := self._throttle.ready("refused")) is not None:
            logger.warning("bootstrap: registration refused (%d): %s (%d more since the last such line)", status,
                           detail, held)
        return web.json_response({"detail": detail}, status=status)

    def _why_not(self, p: RegisterPayload) -> str | None:
        if self.engine_id is not None and p.engine_id != self.engine_id:
            return f"engine id {p.engine_id[:100]!r} is not this server's engine ({self.engine_id})"
        for name, size in self.sizes.items():
            rank = getattr(p, name)
            if rank < 0 or (size is not None and rank >= size):
                return f"{name}={rank} is outside this engine's [0, {size if size is not None else 'inf'})"
        if (why := check_worker_addr(p.addr)) is not None:
            return why
        if None in self.sizes.values() and sum(len(s) for e in self.workers.values()
                                               for s in e.worker_addr.values()) >= MAX_WORKERS:
            return f"more than {MAX_WORKERS} workers registered"
        return None

    async def _register(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return self._refuse(415, f"a registration is JSON (Content-Type: application/json), got "
                                     f"{request.content_type[:100]!r}")
        try:
            p = msgspec.json.decode(await request.read(), type=RegisterPayload)
        except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
            return self._refuse(400, f"bad registration: {str(e)[:300]}")
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, f"a registration is at most {MAX_BODY} bytes")
        if (why := registration_refusal(p, self.secret)) is not None:
            return self._refuse(403, f"registration refused: {why} (not signed with the deployment's secret)"
                                if why == "unsigned" else f"registration refused: {why}")
        if (why := self._why_not(p)) is not None:
            return self._refuse(400, f"bad registration: {why}")
        entry = self.workers.setdefault(p.dp_rank, EngineEntry(p.engine_id, {}))
        if entry.engine_id != p.engine_id:
            return self._refuse(400, f"Engine ID mismatch for dp_rank={p.dp_rank}: expected {entry.engine_id}, "
                                     f"got {p.engine_id}")
        slot = entry.worker_addr.setdefault(p.tp_rank, {})
        existing = slot.get(p.pp_rank)
        if existing is not None and existing != p.addr:
            return self._refuse(400, f"Worker with dp_rank={p.dp_rank}, tp_rank={p.tp_rank}, pp_rank={p.pp_rank} "
                                     f"is already registered at {existing}, but still want to register at {p.addr}")
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
            app = web.Application(client_max_size=MAX_BODY)
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


def check_url(url: str) -> str | None:
    """Why ``url`` is not a bootstrap server's URL (``http`` or ``https`` with a host), or None."""
    if not isinstance(url, str) or len(url) > 2048:
        return "not a URL string of at most 2048 characters"
    u = urlsplit(url)
    try:
        u.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError:
        return f"{url!r} has a bad port"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"{url!r} is not an http(s) URL (a bootstrap server is reached over http or https only)"
    return None


def _cut(sock: list, fired: threading.Event) -> None:
    """The deadline passed: wake whatever read or write the exchange is blocked in (the
    response keeps reading the socket after the connection object let go of it)."""
    fired.set()
    for s in sock:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _http(url: str, timeout: float, body: dict | None = None, max_reply: int = MAX_REPLY) -> dict:
    """One exchange with a bootstrap server: the JSON answer, or BootstrapError (BootstrapTimeout
    when ``timeout`` seconds passed before the whole answer arrived)."""
    if (why := check_url(url)) is not None:
        raise BootstrapError(why)
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout
    conn = cls(u.hostname, u.port, timeout=timeout)
    sock: list = []
    fired = threading.Event()
    timer = threading.Timer(timeout, _cut, (sock, fired))
    timer.daemon = True
    data = None if body is None else json.dumps(body).encode()
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    try:
        timer.start()
        conn.connect()
        sock.append(conn.sock)
        conn.request("GET" if data is None else "POST", path, body=data,
                     headers={"Content-Type": "application/json"} if data is not None else {})
        r = conn.getresponse()
        raw = r.read(max_reply + 1)
        if fired.is_set():  # what was read before the cut is not the whole answer
            raise TimeoutError
        if len(raw) > max_reply:
            raise BootstrapError(f"{url}: answer longer than {max_reply} bytes")
        if r.status != 200:
            raise BootstrapError(f"{url}: HTTP {r.status}: {raw[:500].decode(errors='replace')}")
        return json.loads(raw or b"{}")
    except (OSError, http.client.HTTPException) as e:
        if fired.is_set() or time.monotonic() >= deadline - 0.01 or isinstance(e, TimeoutError):
            raise BootstrapTimeout(f"{url}: timed out: no complete answer within {timeout:.1f}s") from None
        raise BootstrapError(f"{url}: unreachable: {e!r}") from None
    except ValueError as e:
        raise BootstrapError(f"{url}: answer is not JSON: {str(e)[:200]}") from None
    finally:
        timer.cancel()
        conn.close()


def query(url: str, timeout: float) -> dict[int, EngineEntry]:
    body = _http(url.rstrip("/") + "/query", timeout)
    try:
        return parse_query(body)
    except (msgspec.ValidationError, TypeError, ValueError) as e:
        raise BootstrapError(f"{url}: /query answer is not vLLM's shape: {str(e)[:200]}") from None


# How long a worker keeps trying to register at startup. Rank 0 of the prefill instance
# starts the server while the other ranks, in their own processes, reach this call at the
# same time; on a loaded 2-core machine rank 0 was seen more than 1.5 s behind (a refused
# connection). An engine's own startup takes tens of seconds, so a minute of retrying
# costs nothing when the server is merely late and still ends a startup that cannot work.
REGISTER_WAIT_S = 60.0


def register(url: str, payload: RegisterPayload, timeout: float, wait_s: float = REGISTER_WAIT_S,
             secret: bytes | None = None) -> None:
    """Register a worker. A refused connection or a timeout is retried (backing off to 2 s)
    until ``wait_s`` has passed since the first call, then raised; an HTTP 4xx (a real
    conflict, another engine id or address for this slot, or a refused registration) is
    raised at once."""
    give_up = time.monotonic() + wait_s
    delay, tries = 0.25, 0
    while True:
        tries += 1
        try:
            # Signed again at every try: a signature is only good for kvcore.trust.MAX_AGE_S.
            _http(url.rstrip("/") + "/register", timeout, msgspec.to_builtins(sign_registration(payload, secret)))
            if tries > 1:
                logger.info("registered at %s on try %d", url, tries)
            return
        except BootstrapError as e:
            if ": HTTP 4" in str(e) or time.monotonic() + delay > give_up:
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
