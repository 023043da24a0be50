"""``kv_connector_extra_config`` of the P2P tier.

Keys (all optional)::

    protocol / mooncake_protocol   Transfer Engine protocol: "tcp" (default), "rdma", ...
    device_name                    NIC whitelist passed to TransferEngine.initialize
    te_hostname                    address peers use for this engine's TE (127.0.0.1)
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
"""

from __future__ import annotations

import os

import msgspec

from kvcore.config import load
from kvcore.errors import ConfigError


class P2PConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    protocol: str = "tcp"
    mooncake_protocol: str | None = None
    device_name: str = ""
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


def load_config(extra: dict | None) -> P2PConfig:
    try:
        return load(P2PConfig, dict(extra or {}), "kv_connector_extra_config (P2PConnector)")
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"kv_connector_extra_config (P2PConnector): {e}") from None
