"""Store tier configuration: ``kv_connector_extra_config`` as a typed struct.

Keys (all optional except the master address, which may also come from
``MOONCAKE_CONFIG_PATH``)::

    master               the mooncake_master: "HOST:PORT", or Mooncake's HA entry
                         "etcd://HOST:PORT[;HOST:PORT...]" (the etcd that elects the leading master)
                         (alias: master_server_address)
    protocol             transfer protocol, "tcp" (default) or "rdma"
    device_name          RDMA device(s), "" for TCP
    metadata_server      Transfer Engine metadata: "P2PHANDSHAKE" (default), "http://HOST:PORT/metadata"
                         or "etcd://HOST:PORT[,HOST:PORT...]" (kvcore.mooncake_json.metadata_conn_string)
    local_hostname       address peers use to reach this client (default VLLM_HOST_IP or 127.0.0.1)
    global_segment_size  DRAM this engine contributes to the pool; 0 = pure client (default)
    local_buffer_size    client staging buffer (default 16MB)
    chunk_tokens         tokens per stored object; a multiple of the block size (default 256)
    model_id             model identity for the key fingerprint (default: the served model path)
    replicas / soft_pin / soft_pin_ttl_ms / hard_pin / preferred_segment   ReplicateConfig knobs
    enable_ssd_offload / ssd_offload_path   for an engine-contributed segment
    load_timeout_s       deadline of one request's load (default 20)
    save_retry_s         how long a save retries store pressure (-200) before dropping (default 2)
    save_queue_chunks    bound on chunks waiting to be saved (default 4096)
    probe_interval_s     master health probe period (default 1)
    slow_rpc_s           a lookup slower than this opens the breaker (default 1)
    connect_timeout_s    start-up TCP probe deadline for the master (default 5)
    key_prefix           namespace of our objects in the store (default "mct")
    verify_checksums     store an xxh3 checksum trailer with each chunk and check it on load (default false;
                         host-resident KV only: it reads the pages with the CPU)
    stage_above_ranges_per_region
                         a whole chunk whose blocks make more buffer ranges than this many per KV
                         region (a range per run of consecutive blocks per region: 1 per region while
                         the engine's blocks are contiguous, up to the chunk's blocks once they
                         scatter) is loaded as one range into a host staging buffer, then copied into
                         its pages (default 4; 0 = never: always straight into the pages)
    load_staging_size    that host staging buffer: as many whole chunks as it holds are fetched per
                         Mooncake get, then copied (default 64MB; at least one chunk is held, whatever
                         the size; registered with Mooncake at the first staged load)
    idle_step_ms         pause the engine's scheduler takes at a step that computes nothing (a request
                         waiting for its load, nothing else to run), so the engine's step loop leaves
                         the core and the GIL to the load; never at the step that starts a load
                         (default: 20 on a CPU engine with TP/PP > 1, see kvcore.shmspin; 2 otherwise;
                         0 = never pause)
    load_thread_nice     nice value of the worker's load thread, which waits for each Mooncake get by
                         polling it without pause, so that the poll leaves the core to the transfer
                         (default: 10 on a CPU engine, where 19 starved background loads while the
                         engine decoded; 0 elsewhere, where it was not measured; 0 = as the engine's
                         other threads)
    sync_load_max        a load of at most this many bytes (per rank; all such loads of one engine step
                         together) runs inside the step that schedules its request, before the forward
                         (vLLM's synchronous load), instead of in the background while the request
                         waits for a later step; never while a background load is under way (default:
                         32MB on a CPU engine; 0, always in the background, elsewhere, where it was not
                         measured). The step, and every request in it, waits for the load.

``MOONCAKE_CONFIG_PATH`` (Mooncake's own ``mooncake.json``, :mod:`kvcore.mooncake_json`) supplies
defaults; keys in ``kv_connector_extra_config`` win. The store tier takes master_server_address,
metadata_server (with vLLM V0's metadata_backend), protocol, device_name, global_segment_size,
local_buffer_size, local_hostname, enable_ssd_offload and ssd_offload_path. It ignores
prefill_url and decode_url (the P2P tier's, :mod:`p2p.config`), tenant_id,
enable_client_http_server and client_http_port, so one file serves both tiers.

With an http or etcd metadata server, a Mooncake store client registers its Transfer Engine
segment under its local hostname; without a port Mooncake appends a free one, so several
clients on one host do not collide. Peers then reach it at ``MC_TCP_BIND_ADDRESS``, else at
the host's first LAN address (not at local_hostname, as under P2PHANDSHAKE).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from kvcore import mooncake_json, shmspin
from kvcore.config import load, parse_size
from kvcore.errors import ConfigError
from kvcore.mooncake_json import P2PHANDSHAKE, metadata_conn_string, split_host_port
from kvcore.tier import LoadPrior

# A one-rank engine waiting for a load steps with nothing to compute, on the core the load
# runs on. Pausing each such step 2 ms made the load 0.78 to 0.83x as long and the store hit's
# TTFT 0.90 to 0.92x at 2K and 8K tokens (bench.store_phases --ab idle_step_ms=2, 2026-12-02);
# 5 ms was 0.91x at 8K but 1.09x at 2K against 2 (each pause delays noticing the load's end).
IDLE_STEP_MS_ONE_RANK = 2.0

# A background load parks its request until a later step notices the load ended; on a one-core
# CPU engine the step loop also takes the core from the transfer meanwhile. Loaded inside the
# step instead, a store hit's TTFT was 0.75x, 0.70x and 1.00x the background path's at 2K, 4K
# and 8K tokens, the loads 0.50x, 0.53x and 0.83x as long (bench.store_phases --prefixes
# 2048,4096,7936 --reps 4 --ab sync_load_max=0, AMD EPYC AVX2 host, 2026-12-05). An earlier
# try of the same code (a size option under another name) gave 0.86x at 16K tokens (32 MiB)
# and 1.16x at 32K (64 MiB). The limit also bounds how long one step stalls the engine's
# running requests: about 30 ms at the 1 GB/s one core moves over loopback TCP.
SYNC_LOAD_MAX_CPU = 32 << 20

# Nice value of the load thread on a CPU engine (mcstore.worker._io_thread says why it is not 0).
# 19 (the default from 2026-12-02 to 2026-12-05) was measured on idle engines only. With decode
# streams running, the engine's forward passes keep its core busy and a nice-19 thread gets
# about 1.5% of it (CFS weights 15 against 1,024): a background store hit took 317, 393 and
# 604 ms at 2K, 8K and 16K tokens, against 152, 221 and 358 at nice 10 and 110, 209 and 392 at
# nice 0. Idle, nice 10 kept nice 19's gain over 0: 0.88x, 1.01x and 0.98x nice 19's TTFT,
# nice 0 0.83x, 1.06x and 1.24x (bench.store_streams --prefixes 2048,7936,15872 --reps 4, with
# --streams 4 and with --streams 0, background loads, AMD EPYC AVX2 host, 2026-12-05).
LOAD_THREAD_NICE_CPU = 10

# Where the composite's (and the router's) load-time fit for this tier starts.
LOAD_PRIOR = LoadPrior(latency_s=0.02, bandwidth_gbps=1.0)

# mooncake.json keys the store tier takes -> ours (metadata_server: with metadata_backend).
_MOONCAKE_JSON_KEYS = {
    "master_server_address": "master",
    "protocol": "protocol",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
    "device_name": "device_name",
    "local_hostname": "local_hostname",
    "enable_ssd_offload": "enable_ssd_offload",
    "ssd_offload_path": "ssd_offload_path",
}
# ... and the ones it leaves to others (the P2P tier's, or nobody's).
_MOONCAKE_JSON_IGNORED = {"prefill_url", "decode_url", "tenant_id", "enable_client_http_server",
                          "client_http_port"}


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    master: str | None = None
    protocol: str = "tcp"
    device_name: str = ""
    metadata_server: str = P2PHANDSHAKE
    local_hostname: str | None = None
    global_segment_size: int | str = 0
    local_buffer_size: int | str = "16MB"
    chunk_tokens: int = 256
    model_id: str | None = None
    replicas: int = 1
    soft_pin: bool = False
    soft_pin_ttl_ms: int | None = None
    hard_pin: bool = False
    preferred_segment: str = ""
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    load_timeout_s: float = 20.0
    save_retry_s: float = 2.0
    save_queue_chunks: int = 4096
    probe_interval_s: float = 1.0
    slow_rpc_s: float = 1.0
    connect_timeout_s: float = 5.0
    key_prefix: str = "mct"
    verify_checksums: bool = False
    stage_above_ranges_per_region: float = 4.0
    load_staging_size: int | str = "64MB"
    idle_step_ms: float | None = None  # None: idle_step_s() picks by the engine's ranks
    load_thread_nice: int | None = None  # None: load_nice() picks by the platform
    sync_load_max: int | str | None = None  # None: sync_load_bytes() picks by the platform

    def __post_init__(self):
        if not self.master:
            raise ConfigError(
                "mcstore: no master address: set kv_connector_extra_config.master "
                "(\"HOST:PORT\") or MOONCAKE_CONFIG_PATH with master_server_address"
            )
        self.master = self.master.strip()
        _ha_endpoints(self.master)
        try:
            self.metadata_server = metadata_conn_string(self.metadata_server)
        except ConfigError as e:
            raise ConfigError(f"mcstore: {e}") from None
        for name in ("global_segment_size", "local_buffer_size", "load_staging_size", "sync_load_max"):
            if getattr(self, name) is None:
                continue
            try:
                setattr(self, name, parse_size(getattr(self, name)))
            except ConfigError as e:
                raise ConfigError(f"mcstore: {name}: {e}") from None
        if self.chunk_tokens <= 0:
            raise ConfigError(f"mcstore: chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.replicas < 1:
            raise ConfigError(f"mcstore: replicas must be >= 1, got {self.replicas}")
        for name in ("load_timeout_s", "probe_interval_s", "slow_rpc_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"mcstore: {name} must be positive")
        if self.stage_above_ranges_per_region < 0:
            raise ConfigError("mcstore: stage_above_ranges_per_region must be >= 0 (0 = never), "
                              f"got {self.stage_above_ranges_per_region}")
        if self.load_thread_nice is not None and not 0 <= self.load_thread_nice <= 19:
            raise ConfigError(f"mcstore: load_thread_nice must be within [0, 19], got {self.load_thread_nice}")
        if self.idle_step_ms is not None and not 0 <= self.idle_step_ms <= 1000:
            raise ConfigError(f"mcstore: idle_step_ms must be within [0, 1000], got {self.idle_step_ms}")
        if self.save_retry_s < 0 or self.save_queue_chunks < 1:
            raise ConfigError("mcstore: save_retry_s must be >= 0 and save_queue_chunks >= 1")
        if self.enable_ssd_offload and not self.ssd_offload_path:
            raise ConfigError("mcstore: enable_ssd_offload needs ssd_offload_path")
        if "/" in self.key_prefix or not self.key_prefix:
            raise ConfigError("mcstore: key_prefix must be a non-empty string without '/'")
        self.protocol = self.protocol.strip().lower()

    def idle_step_s(self, multi_rank_cpu: bool) -> float:
        """Seconds a step that computes nothing pauses: ``idle_step_ms`` if set, else
        kvcore.shmspin.IDLE_STEP_S on a CPU engine with TP/PP > 1, else IDLE_STEP_MS_ONE_RANK."""
        if self.idle_step_ms is not None:
            return self.idle_step_ms / 1e3
        return shmspin.IDLE_STEP_S if multi_rank_cpu else IDLE_STEP_MS_ONE_RANK / 1e3

    def load_nice(self, device_type: str) -> int:
        """Nice value of the load thread: ``load_thread_nice`` if set, else LOAD_THREAD_NICE_CPU
        on a CPU engine (measured there) and 0 on others."""
        if self.load_thread_nice is not None:
            return self.load_thread_nice
        return LOAD_THREAD_NICE_CPU if device_type == "cpu" else 0

    def sync_load_bytes(self, device_type: str) -> int:
        """Bytes per step that load synchronously: ``sync_load_max`` if set, else
        SYNC_LOAD_MAX_CPU on a CPU engine and 0 (never) on others."""
        if self.sync_load_max is not None:
            return self.sync_load_max
        return SYNC_LOAD_MAX_CPU if device_type == "cpu" else 0

    @property
    def master_host_port(self) -> tuple[str, int]:
        """``(host, port)`` of a plain ``HOST:PORT`` master (ConfigError for an HA entry)."""
        if self.ha_etcd_endpoints is not None:
            raise ConfigError(f"mcstore: master {self.master!r} is an HA entry: no fixed HOST:PORT")
        host, _, port = self.master.rpartition(":")
        return host, int(port)

    @property
    def ha_etcd_endpoints(self) -> list[str] | None:
        """The etcd endpoints (``"HOST:PORT"``) of an ``etcd://`` HA master entry, None for a
        plain ``HOST:PORT`` master."""
        return _ha_endpoints(self.master)

    def hostname(self) -> str:
        return self.local_hostname or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_tokens % block_size:
            raise ConfigError(
                f"mcstore: chunk_tokens={self.chunk_tokens} is not a multiple of the "
                f"vLLM block size {block_size}"
            )


def _ha_endpoints(master: str) -> list[str] | None:
    """Check ``master`` ("HOST:PORT" or "etcd://HOST:PORT[;HOST:PORT...]"); the etcd endpoints of
    the HA form, None for the plain one."""
    form = 'master must be HOST:PORT or etcd://HOST:PORT[;HOST:PORT...]'
    scheme, sep, rest = master.partition("://")
    if not sep:
        try:
            split_host_port(master, "master")
        except ConfigError:
            raise ConfigError(f"mcstore: {form}, got {master!r}") from None
        return None
    if scheme != "etcd":
        raise ConfigError(f"mcstore: {form}, got {master!r}")
    if "," in rest:
        raise ConfigError(f"mcstore: separate the etcd endpoints of master {master!r} with ';' (Mooncake's form)")
    eps = [e.strip() for e in rest.split(";")]
    if not all(eps):
        raise ConfigError(f"mcstore: {form}, got {master!r} (an empty etcd endpoint)")
    for e in eps:
        try:
            split_host_port(e)
        except ConfigError:
            raise ConfigError(f"mcstore: etcd endpoint {e!r} of master {master!r} is not HOST:PORT") from None
    return eps


def _from_mooncake_json(mj: mooncake_json.MooncakeJson) -> dict[str, Any]:
    """The store tier's keys of a ``mooncake.json``, renamed to ours."""
    given = mj.given()
    out = {ours: given[k] for k, ours in _MOONCAKE_JSON_KEYS.items() if k in given}
    if mj.metadata() is not None:
        out["metadata_server"] = mj.metadata()
    return out


def load_config(extra: dict[str, Any] | None, env: dict[str, str] | None = None) -> StoreConfig:
    """The store config from ``kv_connector_extra_config`` over ``MOONCAKE_CONFIG_PATH``."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    mj = mooncake_json.from_env(env)
    if mj is not None:
        data.update(_from_mooncake_json(mj))
    extra = dict(extra or {})
    if "master_server_address" in extra:
        if "master" in extra:
            raise ConfigError("mcstore: give either master or master_server_address, not both")
        extra["master"] = extra.pop("master_server_address")
    data.update(extra)
    return load(StoreConfig, data, "mcstore kv_connector_extra_config")


def composite_role(kv_role: str, write_back: bool) -> str:
    """The store's ``kv_role`` inside a composite of role ``kv_role``: prefill (and
    kv_both) instances load prefixes and save; decode instances only load unless
    ``write_back``."""
    if kv_role == "kv_consumer" and not write_back:
        return "kv_consumer"
    return "kv_both"
