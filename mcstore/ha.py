"""Mooncake master high availability: which master leads, read from etcd.

With ``mooncake_master --enable_ha --etcd_endpoints=...`` several masters run on several hosts;
they elect one leader through etcd and the leader writes its RPC address (``HOST:PORT``) under
:data:`MASTER_VIEW_KEY` with a lease, so the key disappears when the leader dies and the next
leader rewrites it. Standbys do not listen on their RPC port at all. Clients name the pool as
``etcd://HOST:PORT[;HOST:PORT...]`` and Mooncake's client follows the leader itself; what this
module adds is the leader's address for our own health probe (``mcstore.client.Breaker``) and
for start-up errors that say which master leads.

Measured on Mooncake 0.3.13 (one host, loopback addresses): a newly elected leader serves about
5 s after it wins (its warm-up), a client's calls fail for about 9.5 s after the leader is
killed, and store servers remount their segments on the new leader by themselves. Objects stored
before the failover survive it only with ``--enable_oplog`` (the leader's metadata replicated
through etcd), which ``mctier master --ha`` turns on; without it the new leader starts empty.

etcd is read through its v3 JSON gateway (``POST /v3/kv/range``, keys base64-encoded), which
etcd 3.4 and later serve on the client URL: no etcd client library is needed.
"""

from __future__ import annotations

import base64

import requests

from kvcore.errors import ConfigError

CLUSTER_ID = "mooncake_cluster"  # mooncake_master --cluster_id default; clients use the same


def master_view_key(cluster_id: str = CLUSTER_ID) -> str:
    return f"mooncake-store/{cluster_id}/master_view"


MASTER_VIEW_KEY = master_view_key()


def parse_entry(entry: str) -> list[str] | None:
    """The etcd endpoints (``HOST:PORT``) of an ``etcd://`` master entry; None for a plain
    ``HOST:PORT`` master. Raises :class:`ConfigError` on an ``etcd://`` entry without endpoints."""
    if not entry.startswith("etcd://"):
        return None
    eps = [e.strip() for e in entry[len("etcd://"):].split(";") if e.strip()]
    for e in eps:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"mcstore: etcd endpoint must be HOST:PORT, got {e!r} in {entry!r}")
    if not eps:
        raise ConfigError(f"mcstore: no etcd endpoint in master entry {entry!r}")
    return eps


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def leader(endpoints: list[str], timeout: float = 1.0, key: str = MASTER_VIEW_KEY) -> str | None:
    """The leading master's RPC address (``HOST:PORT``), or None while no master leads (an
    election in progress) or no etcd endpoint answers within ``timeout`` seconds each."""
    for ep in endpoints:
        try:
            r = requests.post(f"http://{ep}/v3/kv/range", json={"key": _b64(key)}, timeout=timeout)
            r.raise_for_status()
        except (requests.RequestException, ValueError):
            continue
        kvs = r.json().get("kvs") or []
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None
    return None


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)
