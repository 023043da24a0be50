"""The Mooncake store client as the tier and its tools use it: fail-fast set-up, a
health breaker around the master, typed replicate config, zero-copy batch calls,
and the master's HTTP admin API (:mod:`mcstore.admin`); what an engine publishes for the
tools is :mod:`mcstore.publish`.

Mooncake's client blocks ~4 s per RPC when the master is gone and its
``health_check`` keeps answering 0, so a background thread probes the master's
TCP port; while the master is unreachable (or an RPC failed or was slow) the
breaker is open and callers skip the store instead of stalling a scheduling
step. The probe closes it again when the master answers.
"""

from __future__ import annotations

import os
import re
import threading
import time

import msgspec

from kvcore.errors import ConfigError, check, is_rpc_down
from kvcore.log import get_logger
from kvcore.procs import port_open
from kvcore.trust import warn_exposed_transfer_engine
from mcstore.admin import DEFAULT_ADMIN_PORT, MasterAdmin, Unavailable
from mcstore.config import StoreConfig
from mcstore.ha import leader, parse_entry, split_addr
from mcstore.keys import MASTER_INFO_KEY, KeySpace, MasterInfo

logger = get_logger("mcstore.client")


class Breaker:
    """Open while the master is unreachable; a daemon thread probes it.

    ``target()`` names the master to probe, ``(host, port)``, or None while none can be named
    (an HA election in progress): then the breaker opens, as for a master that does not answer.
    """

    def __init__(self, target, interval: float, name: str, rpc_ok=None):
        self.target, self.interval = target, interval
        # After a master restart its port answers before a client's RPCs do (the first
        # one fails with -900): close only once a real, cheap RPC went through.
        self.rpc_ok = rpc_ok or (lambda: True)
        self._up = threading.Event()
        self._up.set()
        self._stop = threading.Event()
        self.last = target()
        self._thread = threading.Thread(target=self._run, name=f"mcstore-probe-{name}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """True when calls may go to the master."""
        return self._up.is_set()

    def _where(self) -> str:
        return f"{self.last[0]}:{self.last[1]}" if self.last else "(no leader)"

    def trip(self, why: str) -> None:
        if self._up.is_set():
            logger.warning("mcstore: master %s unavailable (%s); store skipped until it answers",
                           self._where(), why)
        self._up.clear()

    def _probe(self) -> bool:
        where = self.target()
        if where is None:
            return False
        self.last = where
        return port_open(where[1], where[0], min(0.5, self.interval))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            ok = self._probe()
            if ok and not self._up.is_set() and not self.rpc_ok():
                continue
            if ok and not self._up.is_set():
                logger.warning("mcstore: master %s reachable again; store resumed", self._where())
                self._up.set()
            elif not ok and self._up.is_set():
                self.trip("TCP probe failed" if self.last else "no master leads")

    def stop(self) -> None:
        self._stop.set()


def master_target(cfg: StoreConfig, timeout: float = 1.0):
    """``target()`` for :class:`Breaker`: the configured master, or with an ``etcd://`` entry
    the master that leads now (:func:`mcstore.ha.leader`)."""
    eps = parse_entry(cfg.master)
    if eps is None:
        fixed = cfg.master_host_port
        return lambda: fixed

    def current():
        addr = leader(eps, timeout)
        return split_addr(addr) if addr else None

    return current


_REPLICATE_DEFAULTS = {"replicas": 1, "hard_pin": False, "soft_pin": False, "soft_pin_ttl_ms": None,
                       "preferred_segment": None}


def replicate_config(cfg: StoreConfig | None = None, **override):
    """Mooncake's ``ReplicateConfig``: ``cfg``'s replicas and pins (Mooncake's defaults without
    it), with keyword overrides (``replicas``, ``hard_pin``, ``soft_pin``, ``soft_pin_ttl_ms``,
    ``preferred_segment``), e.g. a tool's ``--pin``/``--replicas``."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    unknown = set(override) - set(_REPLICATE_DEFAULTS)
    if unknown:
        raise TypeError(f"replicate_config: unknown settings {sorted(unknown)}")
    s = dict(_REPLICATE_DEFAULTS)
    if cfg is not None:
        s.update({k: getattr(cfg, k) for k in s})
    s.update(override)
    rc = ReplicateConfig()
    rc.replica_num = s["replicas"]
    rc.with_hard_pin = bool(s["hard_pin"])
    if s["soft_pin"]:
        rc.soft_pin_action = SoftPinAction.ENABLE
        if s["soft_pin_ttl_ms"] is not None:
            rc.soft_pin_ttl_ms = s["soft_pin_ttl_ms"]
    if s["preferred_segment"]:
        rc.preferred_segment = s["preferred_segment"]
    return rc


class StoreClient:
    """One MooncakeDistributedStore per process role, plus its breaker."""

    def __init__(self, cfg: StoreConfig, name: str, segment: bool):
        self.cfg = cfg
        target = master_target(cfg, timeout=min(1.0, cfg.connect_timeout_s))
        where = target()
        # One clear error instead of Mooncake's 20 x 4 s set-up retries.
        if where is None:
            raise ConfigError(
                f"mcstore: no Mooncake master leads in {cfg.master} (etcd unreachable or no leader "
                f"elected); start masters with `mctier master --ha --etcd ...` or fix "
                f"kv_connector_extra_config.master"
            )
        if not port_open(where[1], where[0], cfg.connect_timeout_s):
            raise ConfigError(
                f"mcstore: Mooncake master {where[0]}:{where[1]} is not reachable (TCP connect failed "
                f"within {cfg.connect_timeout_s:.0f}s); start it with `mctier master` or fix "
                f"kv_connector_extra_config.master"
            )
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        # With an http/etcd metadata server Mooncake advertises MC_TCP_BIND_ADDRESS, else the
        # host's first LAN address, whatever local_hostname says.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg.hostname())
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        seg = cfg.global_segment_size if segment else 0
        t0 = time.monotonic()
        rc = self.store.setup(
            cfg.hostname(), cfg.metadata_server, seg, cfg.local_buffer_size, cfg.protocol,
            cfg.device_name, cfg.master, None,
            bool(segment and cfg.enable_ssd_offload), cfg.ssd_offload_path if segment else "",
        )
        if rc != 0:
            raise ConfigError(
                f"mcstore: Mooncake client set-up against master {cfg.master} failed (rc {rc}, "
                f"{time.monotonic() - t0:.1f}s); check the master, protocol={cfg.protocol!r} and "
                f"metadata_server={cfg.metadata_server!r}"
            )
        warn_exposed_transfer_engine(cfg.hostname(), cfg.protocol, "mcstore", logger)
        self.replicate = replicate_config(cfg)
        self.breaker = Breaker(target, cfg.probe_interval_s, name,
                               rpc_ok=lambda: self.store.is_exist(f"{cfg.key_prefix}/probe") >= 0)
        self._registered: list[int] = []
        logger.info("mcstore %s client up (%s, segment %d bytes) against %s", name,
                    self.store.get_hostname(), seg, cfg.master)

    # -- guarded calls ------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.breaker.closed

    def _after(self, rcs: list[int], t0: float, op: str) -> None:
        if any(is_rpc_down(rc) for rc in rcs):
            self.breaker.trip(f"{op} returned {sorted(set(rc for rc in rcs if rc < 0))}")
        elif time.monotonic() - t0 > self.cfg.slow_rpc_s:
            self.breaker.trip(f"{op} took {time.monotonic() - t0:.1f}s")

    def exists(self, keys: list[str]) -> list[int]:
        """1/0 per key; raises nothing: errors read as -1 (not present)."""
        if not keys:
            return []
        t0 = time.monotonic()
        rcs = list(self.store.batch_is_exist(keys))
        self._after(rcs, t0, "batch_is_exist")
        return rcs

    def put_from(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        t0 = time.monotonic()
        rcs = list(self.store.batch_put_from_multi_buffers(keys, ptrs, sizes, self.replicate))
        self._after(rcs, t0, "batch_put_from_multi_buffers")
        return rcs

    def get_into(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        t0 = time.monotonic()
        rcs = list(self.store.batch_get_into_multi_buffers(keys, ptrs, sizes))
        self._after(rcs, t0, "batch_get_into_multi_buffers")
        return rcs

    def session_start(self, keys: list[str]) -> list[int]:
        """Mooncake's get session: the master's replica lookup of ``keys`` once, cached in this
        client for :meth:`get_ranges` (and a read lease on each found object: a remove of one is
        refused with OBJECT_HAS_LEASE meanwhile); 0 per key found, else a status code."""
        t0 = time.monotonic()
        rcs = list(self.store.batch_get_session_start(keys))
        self._after(rcs, t0, "batch_get_session_start")
        return rcs

    def session_end(self, keys: list[str]) -> None:
        """End the get session of ``keys`` (drops the cached replicas). Raises nothing."""
        try:
            self.store.batch_get_session_end(keys)
        except Exception:  # noqa: BLE001 - nothing to do about a failed clean-up
            pass

    def get_ranges(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                   offsets: list[list[int]]) -> list[int]:
        """Byte ranges of objects in a get session (:meth:`session_start`): key ``i``'s bytes
        ``[offsets[i][j], offsets[i][j] + sizes[i][j])`` into ``ptrs[i][j]`` (registered memory).
        Per key the bytes read (``sum(sizes[i])``), or a status code: INVALID_PARAMS (-600) for a
        range past the object's end or a key outside the session."""
        t0 = time.monotonic()
        rcs = list(self.store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets))
        self._after([rc for rc in rcs if rc != -600], t0, "batch_get_into_multi_buffer_ranges")
        return rcs

    def fetch(self, key: str, max_bytes: int) -> bytes | None:
        """A small object's bytes (through the client's local buffer); None when it is absent,
        larger than ``max_bytes``, the breaker is open or the call failed. Raises nothing."""
        if not self.available:
            return None
        t0 = time.monotonic()
        try:
            raw = self.store.get(key)
        except Exception:  # noqa: BLE001 - a failed read is an absent object here
            raw = None
        self._after([], t0, "get")
        return bytes(raw) if raw and len(raw) <= max_bytes else None

    def fetch_many(self, keys: list[str], max_bytes: int) -> list[bytes | None]:
        """:meth:`fetch` of several small objects in one call (Mooncake's ``get_batch``: one
        replica query to the master for all of them, the reads together, the GIL released while
        they run); per key its bytes, or None (absent, larger than ``max_bytes``, failed; all
        None while the breaker is open or when the call failed). Raises nothing."""
        if not keys:
            return []
        if not self.available:
            return [None] * len(keys)
        t0 = time.monotonic()
        try:
            raws = list(self.store.get_batch(list(keys)))
        except Exception:  # noqa: BLE001 - a failed read is an absent object here
            raws = []
        self._after([], t0, "get_batch")
        if len(raws) != len(keys):
            return [None] * len(keys)
        return [bytes(r) if r and len(r) <= max_bytes else None for r in raws]

    def upsert_small(self, keys: list[str], values: list[bytes]) -> int:
        """Small objects, each inserted or replaced (``upsert_batch``, through the local buffer,
        with the tier's replicate config): 0 when all went, else a status code. Raises nothing."""
        if not keys:
            return 0
        if not self.available:
            return -1
        t0 = time.monotonic()
        try:
            rc = int(self.store.upsert_batch(keys, values, self.replicate))
        except Exception:  # noqa: BLE001
            rc = -1
        self._after([rc], t0, "upsert_batch")
        return rc

    def register(self, addr: int, size: int) -> None:
        check(self.store.register_buffer(addr, size), "register_buffer", f"{size} bytes at {addr:#x}")
        self._registered.append(addr)

    def unregister(self, addr: int) -> None:
        if addr in self._registered:
            self._registered.remove(addr)
            self.store.unregister_buffer(addr)

    # -- tool operations: raise Unavailable while the breaker is open ----------------------

    @classmethod
    def for_tool(cls, master: str, name: str) -> StoreClient:
        """A pure client for an operator tool (small staging buffer, no slow-RPC trips:
        a tool's large batches are slow by nature)."""
        return cls(StoreConfig(master=master, local_buffer_size=4 << 20, slow_rpc_s=120.0), name, segment=False)

    def _guard(self, op: str) -> float:
        if not self.available:
            raise Unavailable(f"master {self.cfg.master} unavailable: {op} skipped")
        return time.monotonic()

    def get(self, key: str) -> bytes | None:
        """The object's bytes (through the staging buffer: small objects), None if absent."""
        t0 = self._guard("get")
        raw = self.store.get(key)
        self._after([], t0, "get")
        return bytes(raw) if raw else None

    def read(self, key: str, type_):
        """A msgspec JSON object, None when absent or not of that type."""
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=type_)
        except msgspec.DecodeError:
            return None

    def sizes(self, keys: list[str]) -> list[int]:
        """Bytes per key (a negative status code when it has none)."""
        t0 = self._guard("get_size")
        out = [self.store.get_size(k) for k in keys]
        self._after([rc for rc in out if rc < 0], t0, "get_size")
        return out

    def upsert(self, key: str, value: bytes, replicate=None) -> int:
        t0 = self._guard("upsert")
        rc = self.store.upsert(key, value, replicate if replicate is not None else self.replicate)
        self._after([rc], t0, "upsert")
        return rc

    def put_many(self, keys: list[str], ptrs: list[int], sizes: list[int], replicate=None) -> list[int]:
        """One registered buffer per key, ``replicate`` (default: the tier's) for every one."""
        t0 = self._guard("batch_put_from")
        rcs = list(self.store.batch_put_from(keys, ptrs, sizes, replicate if replicate is not None else self.replicate))
        self._after(rcs, t0, "batch_put_from")
        return rcs

    def get_many(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        t0 = self._guard("batch_get_into")
        rcs = list(self.store.batch_get_into(keys, ptrs, sizes))
        self._after([rc for rc in rcs if rc < 0], t0, "batch_get_into")
        return rcs

    def remove(self, keys: list[str], force: bool = False) -> list[int]:
        """0 per removed key, else a status code (a leased object is refused unless ``force``)."""
        if not keys:
            return []
        t0 = self._guard("batch_remove")
        rcs = list(self.store.batch_remove(keys, force))
        self._after(rcs, t0, "batch_remove")
        return rcs

    def remove_key_space(self, keys: KeySpace) -> int:
        """Remove every object of ``keys``' key space (whoever wrote it; leased ones too), not
        its published metadata: how many (Mooncake's ``remove_by_regex``). Raises Unavailable
        while the breaker is open, MooncakeError on a failed call."""
        t0 = self._guard("remove_by_regex")
        # Objects are {prefix}/{fp16}/{64 hex digits}[-b{blocks}]/{part} (chunks, part objects),
        # directory entries {prefix}/{fp16}/d/{64 hex digits} (mcstore.keys); the metadata is .../meta.
        p = re.escape(keys.prefix)
        n = self.store.remove_by_regex(f"^{p}/([0-9a-f]{{64}}(-b[0-9]+)?/|d/[0-9a-f]{{64}}$)", True)
        self._after([n], t0, "remove_by_regex")
        return check(n, "remove_by_regex", keys.prefix)

    def admin(self, url: str | None = None, timeout: float = 5.0) -> MasterAdmin:
        """The master's HTTP admin API: ``url``, else the address the store server published
        (:data:`mcstore.keys.MASTER_INFO_KEY`), else the (leading) master host's default admin port."""
        if url is None:
            try:
                info = self.read(MASTER_INFO_KEY, MasterInfo)
            except Unavailable:
                info = None
            host = self.breaker.last[0] if self.breaker.last else self.cfg.master.rpartition(":")[0]
            url = info.admin if info is not None else f"http://{host}:{DEFAULT_ADMIN_PORT}"
        return MasterAdmin(url, timeout)

    def close(self) -> None:
        self.breaker.stop()
        for addr in self._registered:
            try:
                self.store.unregister_buffer(addr)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._registered.clear()
        try:
            self.store.close()
        except Exception:  # noqa: BLE001
            pass
