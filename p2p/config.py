"""``kv_connector_extra_config`` of the P2P tier.

Keys (all optional)::

    protocol / mooncake_protocol   Transfer Engine protocol: "tcp" (default), "rdma", ...
    device_name                    NIC whitelist passed to TransferEngine.initialize
    metadata_server                Transfer Engine metadata: "P2PHANDSHAKE" (default), an
                                   "http://HOST:PORT/metadata" or "etcd://HOST:PORT[,...]" server
                                   (the same one on both sides; p2p.transfer)
    te_hostname                    address (a host, no port) peers use for this engine's TE (127.0.0.1)
    bootstrap_host                 bind address of the prefill bootstrap server (127.0.0.1)
    bootstrap_port                 its port (else VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998)
    bootstrap_server_address       "host:port" of an external bootstrap server (no local one)
    side_channel_host              bind/advertise address of the ZMQ side channel (127.0.0.1)
    abort_timeout_s                prefill side: hold blocks at most this long without an
                                   acknowledgement (else VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480)
    transfer_timeout_s             decode side: deadline of one handoff, prefill wait included
    bootstrap_timeout_s            decode side: per HTTP call to a bootstrap server
    peer_silence_timeout_s         decode side: a prefill worker that sends nothing (no WAIT
                                   heartbeat, no reply) for this long is considered dead
    num_workers                    decode side: concurrent pulls
    debug_corrupt_received_kv      TEST ONLY: flip the sign of every received KV value
                                   (true), or do so while the named file exists (a path)

``MOONCAKE_CONFIG_PATH`` (Mooncake's ``mooncake.json``, :mod:`kvcore.mooncake_json`; vLLM V0's
file, the same on both sides) supplies defaults; keys in ``kv_connector_extra_config`` win.
The P2P tier takes protocol, device_name, metadata_server (with metadata_backend) and
te_hostname: the host of ``prefill_url`` on a kv_producer or kv_both instance, of
``decode_url`` on a kv_consumer, else of local_hostname. The URLs' ports are not used: the
Transfer Engine picks its own (a name unique to the process under a metadata server,
:mod:`p2p.transfer`), so V0's rule for equal URLs on one host (decode port + 100) is not
needed. The store tier's keys (master_server_address, global_segment_size,
local_buffer_size, enable_ssd_offload, ssd_offload_path) and tenant_id,
enable_client_http_server, client_http_port are ignored here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvcore import mooncake_json
from kvcore.config import load
from kvcore.errors import ConfigError
from kvcore.mooncake_json import P2PHANDSHAKE, metadata_conn_string
from kvcore.tier import LoadPrior

# Where the composite's (and the router's) load-time fit for this tier starts.
LOAD_PRIOR = LoadPrior(latency_s=0.03, bandwidth_gbps=1.0)

# mooncake.json keys the P2P tier takes (the metadata pair and the URLs are mapped below).
_MOONCAKE_JSON_KEYS = ("protocol", "device_name")
_PRODUCER_ROLES = ("kv_producer", "kv_both")


class P2PConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    protocol: str = "tcp"
    mooncake_protocol: str | None = None
    device_name: str = ""
    metadata_server: str = P2PHANDSHAKE
    te_hostname: str = "127.0.0.1"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int | None = None
    bootstrap_server_address: str | None = None
    side_channel_host: str = "127.0.0.1"
    abort_timeout_s: float | None = None
    transfer_timeout_s: float = 120.0
    bootstrap_timeout_s: float = 5.0
    peer_silence_timeout_s: float = 10.0
    num_workers: int = 4
    debug_corrupt_received_kv: bool | str = False

    def __post_init__(self):
        if self.mooncake_protocol:
            self.protocol = self.mooncake_protocol
        self.protocol = self.protocol.strip().lower()
        try:
            self.metadata_server = metadata_conn_string(self.metadata_server)
        except ConfigError as e:
            raise ConfigError(f"p2p: {e}") from None
        self.te_hostname = self.te_hostname.strip()
        if not self.te_hostname or self.te_hostname.count(":") == 1:
            raise ConfigError(f"p2p: te_hostname must be a host without a port, got {self.te_hostname!r}")
        if self.bootstrap_port is None:
            self.bootstrap_port = int(os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998"))
        if self.abort_timeout_s is None:
            self.abort_timeout_s = float(os.environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480"))
        for name in ("abort_timeout_s", "transfer_timeout_s", "bootstrap_timeout_s", "peer_silence_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"p2p: {name} must be > 0")
        if self.num_workers < 1:
            raise ConfigError("p2p: num_workers must be >= 1")

    @property
    def bootstrap_url(self) -> str:
        """Where this engine's workers register (the local server unless an external one is set)."""
        if self.bootstrap_server_address:
            return normalize_url(self.bootstrap_server_address)
        host = "127.0.0.1" if self.bootstrap_host in ("0.0.0.0", "::", "") else self.bootstrap_host
        return f"http://{host}:{self.bootstrap_port}"


def normalize_url(addr: str) -> str:
    addr = addr.strip().rstrip("/")
    return addr if "://" in addr else f"http://{addr}"


def _from_mooncake_json(mj: mooncake_json.MooncakeJson, kv_role: str | None) -> dict[str, Any]:
    """The P2P tier's keys of a ``mooncake.json`` (see the module docstring)."""
    given = mj.given()
    out = {k: given[k] for k in _MOONCAKE_JSON_KEYS if k in given}
    if mj.metadata() is not None:
        out["metadata_server"] = mj.metadata()
    url = mj.prefill_url if kv_role in _PRODUCER_ROLES else mj.decode_url if kv_role == "kv_consumer" else None
    if url is not None:
        out["te_hostname"] = _host_of(url)
    elif mj.local_hostname:
        out["te_hostname"] = _host_of(mj.local_hostname)
    return out


def _host_of(addr: str) -> str:
    """The host of "HOST", "HOST:PORT", "[V6]:PORT" or a bare IPv6 address."""
    addr = addr.strip()
    if addr.startswith("["):
        return addr[1:].partition("]")[0]
    return addr.partition(":")[0] if addr.count(":") == 1 else addr


def load_config(extra: dict | None, kv_role: str | None = None, env: Mapping[str, str] | None = None) -> P2PConfig:
    """The P2P config from ``kv_connector_extra_config`` over ``MOONCAKE_CONFIG_PATH``;
    ``kv_role`` picks the URL of the file (none without a role)."""
    env = os.environ if env is None else env
    where = "kv_connector_extra_config (P2PConnector)"
    data: dict[str, Any] = {}
    mj = mooncake_json.from_env(env)
    if mj is not None:
        data.update(_from_mooncake_json(mj, kv_role))
    data.update(extra or {})  # mooncake_protocol, when given, wins over either protocol
    try:
        return load(P2PConfig, data, where)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from None
