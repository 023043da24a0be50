"""Trust at the boundaries: the deployment's shared secret, and what it signs.

Trust model in full: docs/deploy.md, "Trust model". In short, an engine acts on transfer
parameters (``kv_transfer_params``: pull KV from an address, hold blocks for a transfer id)
only when they come from the deployment's router, and on a bootstrap registration or a side
channel message only when it comes from one of the deployment's engines. Proof is an
HMAC-SHA256 with a secret every party of the deployment shares.

**The secret** is optional. It is read, in this order, from a file named by the caller (the
P2P tier's ``secret_file``, ``mctier proxy --secret-file``), from the file named by
``MCTIER_SECRET_FILE``, or from ``MCTIER_SECRET`` itself (as vLLM takes ``--api-key`` or
``VLLM_API_KEY``). Surrounding whitespace is stripped; at least 16 bytes; it is never logged.
Without a secret nothing is signed or checked: behaviour is as before it existed (what that
exposes: docs/deploy.md).

**Transfer parameters** (router -> engine). Every ``kv_transfer_params`` key except the ones
a client may set (:data:`CLIENT_KEYS`) is a transfer field. The router signs the transfer
fields it sets with :func:`sign_params`, which adds :data:`TS_KEY` (wall-clock seconds),
:data:`BODY_KEY` (:func:`body_digest` of the request body as forwarded, without its
``kv_transfer_params``: the prompt and everything else) and :data:`SIG_KEY`::

    SIG = hex HMAC-SHA256(secret, b"mctier/params/v1\\n" + canonical JSON of
                          {"body": BODY, "fields": {transfer fields}, "ts": TS})

canonical JSON being ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)``. :func:`verify_params` checks the MAC, the age (at most ``max_age_s``
either way: hosts' clocks must agree within it) and, when the caller has the body (the API
server's middleware, :mod:`p2p.guard`), the body digest: signed parameters replayed onto
another request body are refused.

**Messages** (engine <-> engine: bootstrap registrations, side channel): :func:`mac` over a
domain string and the message's canonical bytes with its MAC field empty; the message carries
its own timestamp.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger("mctier.trust")

SECRET_FILE_ENV = "MCTIER_SECRET_FILE"
SECRET_ENV = "MCTIER_SECRET"
MIN_SECRET_BYTES = 16

# The kv_transfer_params keys a client may set; the router forwards these and sets the rest.
CLIENT_KEYS = frozenset({"kv_source", "ttft_slo_s"})
SIG_KEY, TS_KEY, BODY_KEY = "mctier_sig", "mctier_ts", "mctier_body"
_SIGNATURE_KEYS = frozenset({SIG_KEY, TS_KEY, BODY_KEY})
# Signatures older (or further in the future) than this are refused: a signed request is
# forwarded at once, and deployments keep their clocks within a few seconds (NTP).
MAX_AGE_S = 60.0

DEPLOY_DOC = "docs/deploy.md, section \"Trust model\""


class SecretError(ValueError):
    """The configured secret cannot be read or is too short."""


class Refused(Exception):
    """Parameters or a message refused; ``kind`` is the metric label (``unsigned``,
    ``bad_signature``, ``expired``, ``body_mismatch``, ``malformed``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def load_secret(path: str | None = None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's secret (see the module docstring), or None when none is configured."""
    env = os.environ if env is None else env
    path = path or env.get(SECRET_FILE_ENV) or None
    if path:
        try:
            raw = Path(path).expanduser().read_bytes().strip()
        except OSError as e:
            raise SecretError(f"secret file {path}: {e.strerror or e}") from None
        where = f"secret file {path}"
    elif env.get(SECRET_ENV):
        raw, where = env[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        return None
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def mac(secret: bytes, domain: bytes, data: bytes) -> bytes:
    return hmac.new(secret, domain + b"\n" + data, hashlib.sha256).digest()


def fresh(ts, max_age_s: float, now: float | None = None) -> bool:
    """True when ``ts`` (wall-clock seconds) is a number within ``max_age_s`` of now."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return False
    return abs((time.time() if now is None else now) - ts) <= max_age_s


# -- transfer parameters ----------------------------------------------------------------------


def transfer_fields(params: Mapping) -> dict:
    """The keys of ``params`` only the router may set (everything but :data:`CLIENT_KEYS` and
    the signature's own keys)."""
    return {k: v for k, v in params.items() if k not in CLIENT_KEYS and k not in _SIGNATURE_KEYS}


def client_fields(params) -> dict:
    """What a router forwards of a client's ``kv_transfer_params`` (:data:`CLIENT_KEYS`)."""
    if not isinstance(params, Mapping):
        return {}
    return {k: v for k, v in params.items() if k in CLIENT_KEYS}


def body_digest(body: Mapping) -> str:
    """Hex SHA-256 of the canonical JSON of a request body without its ``kv_transfer_params``."""
    return hashlib.sha256(canonical({k: v for k, v in body.items() if k != "kv_transfer_params"})).hexdigest()


def _params_mac(secret: bytes, fields: dict, ts, body: str) -> str:
    return mac(secret, b"mctier/params/v1", canonical({"body": body, "fields": fields, "ts": ts})).hex()


def sign_params(secret: bytes, params: dict, body: str, now: float | None = None) -> dict:
    """``params`` with a signature of its transfer fields bound to ``body`` (:func:`body_digest`)."""
    ts = round(time.time() if now is None else now, 3)
    out = {k: v for k, v in params.items() if k not in _SIGNATURE_KEYS}
    out.update({TS_KEY: ts, BODY_KEY: body, SIG_KEY: _params_mac(secret, transfer_fields(out), ts, body)})
    return out


def verify_params(secret: bytes, params: Mapping, body: str | None = None, max_age_s: float = MAX_AGE_S,
                  now: float | None = None) -> None:
    """Raise :class:`Refused` unless ``params`` carry no transfer field, or a valid signature of
    them no older than ``max_age_s``, bound to ``body`` when given."""
    fields = transfer_fields(params)
    if not fields:
        return
    sig, ts, signed_body = params.get(SIG_KEY), params.get(TS_KEY), params.get(BODY_KEY)
    if sig is None:
        raise Refused("unsigned", f"transfer parameters {sorted(fields)} are not signed by the deployment's "
                                  f"router ({DEPLOY_DOC})")
    if not isinstance(sig, str) or not isinstance(signed_body, str):
        raise Refused("malformed", f"{SIG_KEY} and {BODY_KEY} must be strings")
    try:
        want = _params_mac(secret, fields, ts, signed_body)
    except (TypeError, ValueError) as e:  # a value canonical JSON cannot encode
        raise Refused("malformed", f"transfer parameters cannot be encoded: {e}") from None
    if not hmac.compare_digest(want, sig):
        raise Refused("bad_signature", "the signature of the transfer parameters does not match")
    if not fresh(ts, max_age_s, now):
        raise Refused("expired", f"the transfer parameters were signed at {ts!r}, more than {max_age_s:g}s "
                                 f"from this host's clock")
    if body is not None and not hmac.compare_digest(body, signed_body):
        raise Refused("body_mismatch", "the transfer parameters were signed for another request body")


# -- one warning per process -------------------------------------------------------------------

_warned: set[str] = set()
_warned_lock = threading.Lock()

def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    return h in ("localhost", "::1") or h.startswith("127.")


def warn_exposed_transfer_engine(host: str, protocol: str, who: str, log: logging.Logger | None = None) -> bool:
    """Once per process: a Transfer Engine named on a non-loopback address over TCP serves
    reads and writes of its registered memory to whoever reaches it. True when it warned."""
    if protocol.lower() != "tcp" or is_loopback(host):
        return False
    with _warned_lock:
        if "te" in _warned:
            return False
        _warned.add("te")
    (log or logger).warning(
        "%s: Mooncake's Transfer Engine serves %s over tcp without authentication, on every interface: "
        "whoever reaches its ports can read and write this process's registered KV memory. Fence its ports "
        "(%s).", who, host, DEPLOY_DOC)
    return True
