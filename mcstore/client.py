"""The Mooncake store client as the tier uses it: fail-fast set-up, a health
breaker around the master, typed replicate config, zero-copy batch calls.

Mooncake's client blocks ~4 s per RPC when the master is gone and its
``health_check`` keeps answering 0, so a background thread probes the master's
TCP port; while the master is unreachable (or an RPC failed or was slow) the
breaker is open and callers skip the store instead of stalling a scheduling
step. The probe closes it again when the master answers.
"""

from __future__ import annotations

import os
import threading
import time

from kvcore.errors import ConfigError, check
from kvcore.log import get_logger
from kvcore.procs import port_open
from mcstore.config import StoreConfig

logger = get_logger("mcstore.client")

# Codes that mean "the master (or the network to it) is not answering".
_RPC_DOWN = frozenset({-900, -901, -1})


class Breaker:
    """Open while the master is unreachable; a daemon thread probes it."""

    def __init__(self, host: str, port: int, interval: float, name: str, rpc_ok=None):
        self.host, self.port, self.interval = host, port, interval
        # After a master restart its port answers before a client's RPCs do (the first
        # one fails with -900): close only once a real, cheap RPC went through.
        self.rpc_ok = rpc_ok or (lambda: True)
        self._up = threading.Event()
        self._up.set()
        self._stop = threading.Event()
        self.trips = 0
        self._thread = threading.Thread(target=self._run, name=f"mcstore-probe-{name}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """True when calls may go to the master."""
        return self._up.is_set()

    def trip(self, why: str) -> None:
        if self._up.is_set():
            self.trips += 1
            logger.warning("mcstore: master %s:%s unavailable (%s); store skipped until it answers",
                           self.host, self.port, why)
        self._up.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            ok = port_open(self.port, self.host, min(0.5, self.interval))
            if ok and not self._up.is_set() and not self.rpc_ok():
                continue
            if ok and not self._up.is_set():
                logger.warning("mcstore: master %s:%s reachable again; store resumed", self.host, self.port)
                self._up.set()
            elif not ok and self._up.is_set():
                self.trip("TCP probe failed")

    def stop(self) -> None:
        self._stop.set()


def replicate_config(cfg: StoreConfig):
    from mooncake.store import ReplicateConfig, SoftPinAction

    rc = ReplicateConfig()
    rc.replica_num = cfg.replicas
    rc.with_hard_pin = cfg.hard_pin
    if cfg.soft_pin:
        rc.soft_pin_action = SoftPinAction.ENABLE
        if cfg.soft_pin_ttl_ms is not None:
            rc.soft_pin_ttl_ms = cfg.soft_pin_ttl_ms
    if cfg.preferred_segment:
        rc.preferred_segment = cfg.preferred_segment
    return rc


class StoreClient:
    """One MooncakeDistributedStore per process role, plus its breaker."""

    def __init__(self, cfg: StoreConfig, name: str, segment: bool):
        self.cfg = cfg
        host, port = cfg.master_host_port
        # One clear error instead of Mooncake's 20 x 4 s set-up retries.
        if not port_open(port, host, cfg.connect_timeout_s):
            raise ConfigError(
                f"mcstore: Mooncake master {cfg.master} is not reachable (TCP connect failed within "
                f"{cfg.connect_timeout_s:.0f}s); start it with `mctier master` or fix "
                f"kv_connector_extra_config.master"
            )
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
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
        self.replicate = replicate_config(cfg)
        self.breaker = Breaker(host, port, cfg.probe_interval_s, name,
                               rpc_ok=lambda: self.store.is_exist(f"{cfg.key_prefix}/probe") >= 0)
        self._registered: list[int] = []
        logger.info("mcstore %s client up (%s, segment %d bytes) against %s", name,
                    self.store.get_hostname(), seg, cfg.master)

    # -- guarded calls ------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.breaker.closed

    def _after(self, rcs: list[int], t0: float, op: str) -> None:
        if any(rc in _RPC_DOWN for rc in rcs):
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

    def register(self, addr: int, size: int) -> None:
        check(self.store.register_buffer(addr, size), "register_buffer", f"{size} bytes at {addr:#x}")
        self._registered.append(addr)

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
