"""``TransferGuard``: an ASGI middleware for vLLM's API server that refuses, with a clear 4xx,
a request carrying transfer parameters the deployment's router did not sign.

A KV connector cannot answer HTTP: refused parameters there only make the engine compute the
request itself (``p2p.scheduler``). The middleware answers the client before vLLM sees the
request::

    MCTIER_SECRET_FILE=/etc/mctier/secret vllm serve MODEL --middleware p2p.guard.TransferGuard ...

``mctier serve`` installs it by itself whenever a secret is configured (the P2P tier's
``secret_file``, ``MCTIER_SECRET_FILE`` or ``MCTIER_SECRET``). For every POST whose JSON body
carries ``kv_transfer_params`` with a transfer field (any key but ``kv_source`` and
``ttft_slo_s``, :data:`kvcore.trust.CLIENT_KEYS`), the signature must be valid, no older than
``kvcore.trust.MAX_AGE_S``, and made for this very body (``kvcore.trust.verify_params``):

- 403 ``unsigned``, ``bad_signature``, ``expired``, ``body_mismatch`` (signed parameters
  replayed onto another request);
- 400 ``malformed`` (signature fields of the wrong type), ``xargs``
  (``vllm_xargs.kv_transfer_params``: vLLM would take it for ``kv_transfer_params``).

Each refusal is counted in ``vllm:mctier_api_refused_total{kind}`` on the server's
``/metrics``. Bodies without transfer fields pass untouched (one substring search decides for
most); a body is parsed off the event loop when it is large. Without a secret it passes
everything and says so once at start.
"""

from __future__ import annotations

import asyncio
import json
import logging

from kvcore import trust

logger = logging.getLogger("vllm.mctier.p2p.guard")

_PARSE_INLINE = 256 << 10  # bytes of JSON parsed on the event loop; larger bodies in a thread
# A body without any of these cannot carry kv_transfer_params (JSON names a key only by its
# characters or their \u escapes; a NUL byte means UTF-16 or UTF-32, which json.loads decodes).
_MARKERS = (b"kv_transfer_params", b"vllm_xargs", b"\\u", b"\x00")

_counter = None


def _count(kind: str) -> None:
    global _counter
    if _counter is None:
        from prometheus_client import Counter

        _counter = Counter("vllm:mctier_api_refused", "Requests the API server's TransferGuard refused, by reason",
                           ["kind"])
    _counter.labels(kind).inc()


class TransferGuard:
    def __init__(self, app, secret: bytes | None = None, max_age_s: float = trust.MAX_AGE_S):
        self.app = app
        self.secret = trust.load_secret() if secret is None else secret
        self.max_age_s = max_age_s
        if self.secret is None:
            logger.warning("TransferGuard: no secret configured (%s or %s): it checks nothing",
                           trust.SECRET_FILE_ENV, trust.SECRET_ENV)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or self.secret is None:
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay(bytes(body), msg, receive), send)
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        data = bytes(body)
        refused = await self._check(data) if any(m in data for m in _MARKERS) else None
        if refused is None:
            return await self.app(scope, _replay(data, None, receive), send)
        status, kind, message = refused
        _count(kind)
        logger.warning("refused %s %s (%d %s): %s", scope.get("method"), scope.get("path"), status, kind, message)
        payload = json.dumps({"error": {"message": message, "type": "mctier_transfer_refused", "param": kind,
                                        "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _check(self, data: bytes) -> tuple[int, str, str] | None:
        try:
            obj = json.loads(data) if len(data) <= _PARSE_INLINE else await asyncio.to_thread(json.loads, data)
        except (ValueError, RecursionError):
            return None  # not JSON: vLLM refuses it itself
        if not isinstance(obj, dict):
            return None
        xargs = obj.get("vllm_xargs")
        if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
            return 400, "xargs", "transfer parameters refused: kv_transfer_params inside vllm_xargs is not accepted"
        params = obj.get("kv_transfer_params")
        if not isinstance(params, dict) or not trust.transfer_fields(params):
            return None
        try:
            digest = trust.body_digest(obj) if len(data) <= _PARSE_INLINE else \
                await asyncio.to_thread(trust.body_digest, obj)
            trust.verify_params(self.secret, params, digest, self.max_age_s)
        except trust.Refused as e:
            return (400 if e.kind == "malformed" else 403), e.kind, f"transfer parameters refused: {e}"
        except (TypeError, ValueError) as e:
            return 400, "malformed", f"transfer parameters refused: the body cannot be digested: {e}"
        return None


def _replay(body: bytes, last, receive):
    """A ``receive`` that hands the app the body already read (then ``last``, then the client's)."""
    queue = [{"type": "http.request", "body": body, "more_body": False}] + ([last] if last is not None else [])

    async def again():
        if queue:
            return queue.pop(0)
        return await receive()

    return again


GUARD = "p2p.guard.TransferGuard"


def _secret_file(extra) -> str | None:
    """The first ``secret_file`` in a connector's extra config (a composite's tier, a
    MultiConnector's child)."""
    if isinstance(extra, dict):
        if isinstance(extra.get("secret_file"), str):
            return extra["secret_file"]
        for v in extra.values():
            if (found := _secret_file(v)) is not None:
                return found
    elif isinstance(extra, list):
        for v in extra:
            if (found := _secret_file(v)) is not None:
                return found
    return None


def serve_args(argv: list[str], environ) -> list[str]:
    """``vllm serve`` arguments with :class:`TransferGuard` added when a secret is configured:
    the connector's ``secret_file`` (exported as ``MCTIER_SECRET_FILE`` for the API server,
    whose middleware has no other way to learn it, and for the engine's processes), else the
    environment. ``SystemExit`` for a secret that cannot be read."""
    ktc = None
    for i, a in enumerate(argv):
        if a in ("--kv-transfer-config", "--kv_transfer_config") and i + 1 < len(argv):
            ktc = argv[i + 1]
        elif a.startswith(("--kv-transfer-config=", "--kv_transfer_config=")):
            ktc = a.split("=", 1)[1]
    try:
        cfg = json.loads(ktc) if ktc else {}
    except ValueError:
        cfg = {}  # vLLM reports it
    path = _secret_file(cfg.get("kv_connector_extra_config") if isinstance(cfg, dict) else None)
    if path is not None:
        environ[trust.SECRET_FILE_ENV] = path
    try:
        secret = trust.load_secret(env=environ)
    except trust.SecretError as e:
        raise SystemExit(f"mctier serve: {e}") from None
    if secret is None or GUARD in argv:
        return argv
    return [*argv, "--middleware", GUARD]
