"""Mooncake's own ``mooncake.json`` (the file ``MOONCAKE_CONFIG_PATH`` names), for every tier.

Two generations of the file are in use and both are accepted, also mixed in one file:

* vLLM V0's ``MooncakeConnector`` (Mooncake's vllm-integration v0.2), one file on both sides::

      prefill_url       "HOST:PORT" of the prefill (kv_producer) instance
      decode_url        "HOST:PORT" of the decode (kv_consumer) instance
      metadata_server   metadata server of the Transfer Engine (see below)
      metadata_backend  "etcd" / "http" / "redis" when metadata_server has no scheme
      protocol          "tcp" / "rdma"
      device_name       RDMA device(s), comma-separated without spaces; "" for TCP

* Mooncake Store's ``MooncakeConfig.from_file``: ``local_hostname``, ``metadata_server``,
  ``master_server_address``, ``global_segment_size``, ``local_buffer_size`` (sizes as bytes or
  strings like "4GB", :func:`kvcore.config.parse_size`), ``protocol``, ``device_name``,
  ``enable_ssd_offload``, ``ssd_offload_path``, ``tenant_id``, ``enable_client_http_server``,
  ``client_http_port``.

:func:`read` checks every key and value (an unknown key is an error naming it, the file and
the known keys); each tier then takes the keys that apply to it (``mcstore.config``,
``p2p.config``) and lets its ``kv_connector_extra_config`` win over the file.

Metadata (:func:`metadata_conn_string`): Mooncake's Transfer Engine takes one connection
string, ``P2PHANDSHAKE`` (no metadata server: a peer is named ``HOST:RPC_PORT`` and asked
directly; the default), ``http://HOST:PORT/PATH`` or ``etcd://HOST:PORT[,HOST:PORT...]``.
A ``metadata_server`` without a scheme gets ``metadata_backend``'s, and etcd when there is
none, as Mooncake's ``TransferEngine.initialize`` does. An http URL without a path gets
``/metadata``, where mooncake_master's embedded server and mooncake_http_metadata_server answer
(Mooncake would query ``/`` and get 404). ``redis`` is refused here: the
Mooncake wheels this project installs (0.3.13) have no redis plugin and their Transfer
Engine aborts the whole process on a ``redis://`` string ("Unable to find metadata storage
plugin redis").
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvcore.config import parse_size
from kvcore.errors import ConfigError

P2PHANDSHAKE = "P2PHANDSHAKE"
METADATA_BACKENDS = ("etcd", "http")
# Where mooncake_master's embedded server and mooncake_http_metadata_server answer.
HTTP_METADATA_PATH = "/metadata"


class MooncakeJson(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The file's keys (:func:`read` fills and checks it); None = absent, the tier's own
    default applies."""

    # vLLM V0 MooncakeConnector: the P2P tier's
    prefill_url: str | None = None
    decode_url: str | None = None
    metadata_backend: str | None = None
    # both generations
    metadata_server: str | None = None
    protocol: str | None = None
    device_name: str | None = None
    local_hostname: str | None = None
    # Mooncake Store: the store tier's
    master_server_address: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None
    enable_ssd_offload: bool | None = None
    ssd_offload_path: str | None = None
    # read and checked, used by no tier
    tenant_id: str | None = None
    enable_client_http_server: bool | None = None
    client_http_port: int | None = None

    def check(self) -> MooncakeJson:
        """Normalise (lower-case protocol and backend, sizes in bytes) and check the values
        and the metadata combination; raises :class:`ConfigError`. Returns self."""
        for name in ("prefill_url", "decode_url"):
            value = getattr(self, name)
            if value is not None:
                split_host_port(value, name)
        if self.protocol is not None:
            self.protocol = self.protocol.strip().lower()
        if self.metadata_backend is not None:
            self.metadata_backend = self.metadata_backend.strip().lower()
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, parse_size(getattr(self, name)))
                except ConfigError as e:
                    raise ConfigError(f"{name}: {e}") from None
        self.metadata()  # combination errors at load time, not at the first transfer
        return self

    def metadata(self) -> str | None:
        """The metadata connection string of ``metadata_server`` + ``metadata_backend``, or None
        when the file names no metadata server."""
        if self.metadata_server is None:
            if self.metadata_backend is not None:
                raise ConfigError(f"metadata_backend {self.metadata_backend!r} without metadata_server")
            return None
        return metadata_conn_string(self.metadata_server, self.metadata_backend)

    def given(self) -> dict[str, Any]:
        """The keys present in the file, with their checked values."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


KNOWN_KEYS = tuple(sorted(MooncakeJson.__struct_fields__))


def read(path: str) -> MooncakeJson:
    """The file at ``path``; any problem raises :class:`ConfigError` naming the file."""
    where = f"MOONCAKE_CONFIG_PATH={path}"
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a JSON object")
    for k in raw:
        if k not in MooncakeJson.__struct_fields__:
            raise ConfigError(f"{where}: unknown key {k!r} (known keys: {', '.join(KNOWN_KEYS)})")
    try:
        mj = msgspec.convert(raw, MooncakeJson, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e}") from None
    try:
        return mj.check()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def from_env(env) -> MooncakeJson | None:
    """The file ``env["MOONCAKE_CONFIG_PATH"]`` names, or None when it is unset or empty."""
    path = env.get("MOONCAKE_CONFIG_PATH")
    return read(path) if path else None


def split_host_port(addr: str, what: str = "address") -> tuple[str, int]:
    """``("HOST", PORT)`` of ``"HOST:PORT"`` (``"[V6]:PORT"`` too); ConfigError otherwise."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {addr!r}")
    return host, int(port)


def metadata_conn_string(server: str | None, backend: str | None = None) -> str:
    """Mooncake's metadata connection string from a ``metadata_server`` and an optional
    ``metadata_backend`` (vLLM V0's pair): None, "" or "P2PHANDSHAKE" -> "P2PHANDSHAKE";
    "SCHEME://..." as is (a backend, if given, must agree); "HOST:PORT[,HOST:PORT...]" ->
    "BACKEND://..." (etcd without a backend). An http URL without a path gets "/metadata".
    Raises :class:`ConfigError` on anything Mooncake would refuse or abort on."""
    s = (server or "").strip()
    b = (backend or "").strip().lower() or None
    if not s or s.upper() == P2PHANDSHAKE:
        if b is not None:
            raise ConfigError(f"metadata_backend {b!r} given, but metadata_server is {server!r} "
                              f"(a {b} server's address is needed, or no metadata_backend for {P2PHANDSHAKE})")
        return P2PHANDSHAKE
    scheme, sep, rest = s.partition("://")
    if sep:
        scheme = scheme.lower()
        if b is not None and b != scheme:
            raise ConfigError(f"metadata_backend {b!r} contradicts metadata_server {s!r}")
    else:
        scheme, rest = b or "etcd", s
    if scheme in ("redis", "rediss"):
        raise ConfigError(
            f"metadata server {s!r}: the redis metadata backend is not available (Mooncake 0.3.13's "
            f"wheels have no redis plugin; their Transfer Engine aborts the process with \"Unable to "
            f"find metadata storage plugin redis\"); use {P2PHANDSHAKE}, http or etcd")
    if scheme not in METADATA_BACKENDS:
        raise ConfigError(f"metadata server {s!r}: unknown backend {scheme!r} "
                          f"(use {P2PHANDSHAKE}, http://HOST:PORT/metadata or etcd://HOST:PORT)")
    if scheme == "etcd":
        eps = [e.strip() for e in rest.replace(";", ",").split(",")]
        if not all(eps):
            raise ConfigError(f"metadata server {s!r}: an empty etcd endpoint")
        for e in eps:
            split_host_port(e, f"etcd endpoint in metadata server {s!r}")
        return "etcd://" + ",".join(eps)
    hostport, slash, path = rest.partition("/")
    split_host_port(hostport, f"http metadata server {s!r}")
    return f"http://{hostport}{slash}{path}" if path else f"http://{hostport}{HTTP_METADATA_PATH}"


def metadata_kind(conn: str) -> str:
    """``"p2p"``, ``"http"`` or ``"etcd"``: how peers find a Transfer Engine's segment."""
    return "p2p" if conn == P2PHANDSHAKE else conn.partition("://")[0]
