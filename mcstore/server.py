"""The store's processes: a ``mooncake_master`` (:class:`Master`), a store server that owns a
DRAM segment (:class:`StoreServer`, body in :mod:`mcstore.segment`), and the two together on
one host (:class:`StoreCluster`, what ``mctier master`` runs).

The master keeps only metadata; bytes live in the segments that clients mount, and a client's
segment disappears with it. Engines are therefore pure clients by default and store servers
contribute the DRAM (and the SSD offload directory), so stored KV outlives any engine. Any
number of store servers, on any hosts, can join one pool (``mctier store-server``).

Addresses: every listener takes the address it binds, and that address is also the one peers
are told (loopback by default, never the wildcard unless asked). With ``ha_etcd`` the master
runs Mooncake's HA mode: it joins the election in etcd and listens on its RPC port only while
it leads (:mod:`mcstore.ha`); clients then name the pool ``etcd://HOST:PORT``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import msgspec

from kvcore.errors import ConfigError
from kvcore.log import get_logger
from kvcore.procs import Proc, free_port, port_open, refuse_taken
from mcstore.ha import leader

logger = get_logger("mcstore.server")

# Quiet Mooncake clients and fail fast on a missing master (setup retries 20x4s by default).
CLIENT_ENV = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
}

WILDCARDS = ("0.0.0.0", "::", "")


def client_env(host: str) -> dict[str, str]:
    """:data:`CLIENT_ENV` for a Mooncake client that peers reach at ``host``."""
    return {**CLIENT_ENV, "MC_TCP_BIND_ADDRESS": host}


def offload_env(ssd_dir: str) -> dict[str, str]:
    return {
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": ssd_dir,
        # File-per-key: the default bucket backend only writes full buckets and
        # loses lone objects evicted before their bucket fills.
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend",
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(128 << 20),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    }


class MasterAddrs(msgspec.Struct):
    rpc: str  # what clients put in kv_connector_extra_config.master
    metrics: str
    http_metadata: str | None
    store_server: str | None


def master_binary() -> str:
    search = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    exe = shutil.which("mooncake_master", path=search)
    if exe is None:
        raise RuntimeError("mooncake_master not found: install the 'cpu' (or 'cuda') extra")
    return exe


class Master:
    """One ``mooncake_master`` process bound to ``host``.

    ``ha_etcd`` ("HOST:PORT[;HOST:PORT]"): Mooncake's HA mode, with the metadata oplog on. The
    master publishes ``host:port`` as its RPC address in etcd when it wins the election, so
    ``host`` must be an address peers reach (a wildcard is refused)."""

    def __init__(self, log_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int = 0, http_port: int = 0, ssd: bool = False,
                 ha_etcd: str | None = None, extra_flags: list[str] | None = None):
        if ha_etcd and host in WILDCARDS:
            raise ConfigError("mctier master --ha: --host must be the address other hosts reach "
                              "(it is published in etcd as the leader's address), not a wildcard")
        self.log_dir, self.host = Path(log_dir), host
        probe = "127.0.0.1" if host in WILDCARDS else host
        self.port = port or free_port(probe)
        self.metrics_port = metrics_port or free_port(probe)
        self.http_port, self.ssd, self.ha_etcd = http_port, ssd, ha_etcd
        self.extra_flags = list(extra_flags or [])
        self.proc: Proc | None = None

    @property
    def reach_host(self) -> str:
        """The address a local client dials (loopback for a wildcard bind)."""
        return "127.0.0.1" if self.host in WILDCARDS else self.host

    @property
    def rpc(self) -> str:
        return f"{self.reach_host}:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://{self.reach_host}:{self.metrics_port}"

    def argv(self) -> list[str]:
        argv = [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
            "--minloglevel=1",
        ]
        if self.http_port:
            # Mooncake binds this one on 0.0.0.0 whatever host is given; off unless asked.
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}",
            ]
        if self.ssd:
            argv.append("--enable_offload=true")
        if self.ha_etcd:
            # The oplog replicates the leader's metadata through etcd: a new leader knows the
            # objects already in the pool (without it, it starts empty and every prefix misses).
            argv += ["--enable_ha=true", f"--etcd_endpoints={self.ha_etcd}", "--enable_oplog=true"]
        return argv + self.extra_flags

    def start(self, timeout: float = 30.0, wait_leader: bool = True) -> Master:
        """Start it and wait until it serves: its RPC port answers (in HA mode, with
        ``wait_leader``, until some master leads; a standby never opens its RPC port). A port
        already taken (an orphaned master still listening, say) is a ``ConfigError`` naming its
        holder. The master gets SIGTERM when the process that started it dies."""
        for port, what in ((self.port, "RPC"), (self.metrics_port, "metrics"), (self.http_port, "HTTP metadata")):
            if port:
                refuse_taken(port, self.reach_host, f"mooncake_master {what}")
        self.proc = Proc("mooncake_master", self.argv(), self.log_dir / f"master-{self.host}-{self.port}.log",
                         die_with_parent=True)
        if not self.ha_etcd:
            self.proc.wait_port(self.port, timeout, host=self.reach_host)
            return self
        self.proc.wait_port(self.metrics_port, timeout, host=self.reach_host)
        if wait_leader:
            self.wait_leader(timeout)
        return self

    def wait_leader(self, timeout: float) -> str:
        """The RPC address of whichever master leads, once it answers (HA mode)."""
        deadline = time.monotonic() + timeout
        eps = self.ha_etcd.split(";")
        while time.monotonic() < deadline:
            if self.proc is not None and not self.proc.alive():
                raise RuntimeError(f"mooncake_master exited; log tail:\n{self.proc.tail()}")
            addr = leader(eps)
            if addr:
                host, _, port = addr.rpartition(":")
                if port_open(int(port), host):
                    return addr
            time.sleep(0.2)
        raise RuntimeError(f"no Mooncake master leads after {timeout:.0f}s (etcd {self.ha_etcd})")

    def leads(self) -> bool:
        """True when this master is the one serving (its RPC port answers)."""
        return self.alive() and port_open(self.port, self.reach_host)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.stop(grace=5, sig=sig)


class StoreServer:
    """One store-server process (:mod:`mcstore.segment`): a DRAM segment of ``segment_size``
    bytes (and an SSD offload directory) mounted into the pool of ``master`` from ``host``."""

    def __init__(self, log_dir: str | os.PathLike, master: str, host: str = "127.0.0.1",
                 segment_size: int = 1 << 30, ssd_dir: str | None = None, admin: str | None = None,
                 protocol: str = "tcp", device_name: str = "", metadata_server: str = "P2PHANDSHAKE"):
        self.log_dir, self.master, self.host = Path(log_dir), master, host
        self.segment_size, self.ssd_dir, self.admin = segment_size, ssd_dir, admin
        self.protocol, self.device_name, self.metadata_server = protocol, device_name, metadata_server
        self.proc: Proc | None = None
        self.hostname: str | None = None  # "host:port" as Mooncake names the segment, once ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def argv(self, ready: Path) -> list[str]:
        argv = [sys.executable, "-m", "mcstore.segment", "--master", self.master, "--host", self.host,
                "--segment-size", str(self.segment_size), "--protocol", self.protocol,
                "--metadata-server", self.metadata_server, "--ready-file", str(ready)]
        if self.device_name:
            argv += ["--device-name", self.device_name]
        if self.ssd_dir:
            argv += ["--ssd", self.ssd_dir]
        if self.admin:
            argv += ["--admin", self.admin]
        return argv

    def start(self, timeout: float = 30.0) -> StoreServer:
        env = client_env(self.host)
        if self.ssd_dir:
            Path(self.ssd_dir).mkdir(parents=True, exist_ok=True)
            env.update(offload_env(self.ssd_dir))
        tag = f"{self.host}-{os.getpid()}-{time.monotonic_ns()}"
        ready = self.log_dir / f"store-server-{tag}.ready"
        self.proc = Proc("store-server", self.argv(ready), self.log_dir / f"store-server-{tag}.log", env=env,
                         die_with_parent=True)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if not self.proc.alive():
                raise RuntimeError(f"store server exited; log tail:\n{self.proc.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"store server not ready in {timeout}s; log:\n{self.proc.tail()}")
            time.sleep(0.1)
        self.hostname = ready.read_text().strip()
        ready.unlink(missing_ok=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self, grace: float = 15.0, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.stop(grace=grace, sig=sig)


class StoreCluster:
    """A master and (optionally) one store server on one host, started and stopped together.

    ``host`` is where both listen. ``master``/``server`` are their :class:`~kvcore.procs.Proc`
    (None when not running)."""

    def __init__(
        self,
        log_dir: str | os.PathLike,
        port: int = 0,
        metrics_port: int = 0,
        http_port: int = 0,
        segment_size: int = 1 << 30,
        ssd_dir: str | None = None,
        store_server: bool = True,
        extra_flags: list[str] | None = None,
        start_timeout: float = 30.0,
        host: str = "127.0.0.1",
        ha_etcd: str | None = None,
    ):
        self.log_dir = Path(log_dir)
        self._master = Master(log_dir, host, port, metrics_port, http_port, bool(ssd_dir), ha_etcd, extra_flags)
        self.host, self.port, self.metrics_port = host, self._master.port, self._master.metrics_port
        self.http_port, self.segment_size, self.ssd_dir = http_port, segment_size, ssd_dir
        self.ha_etcd = ha_etcd
        self.with_store_server = store_server
        self.start_timeout = start_timeout
        self.store_server: StoreServer | None = None

    @property
    def master(self) -> Proc | None:
        return self._master.proc

    @property
    def server(self) -> Proc | None:
        return self.store_server.proc if self.store_server is not None else None

    @property
    def master_addr(self) -> str:
        """What clients give as ``master``: ``HOST:PORT``, or ``etcd://...`` in HA mode."""
        return f"etcd://{self.ha_etcd}" if self.ha_etcd else self._master.rpc

    def start(self) -> StoreCluster:
        try:
            self._master.start(self.start_timeout)
            if self.with_store_server:
                self.start_store_server()
        except BaseException:
            # A half-started cluster must not outlive the caller that never got it back.
            self.stop()
            raise
        return self

    def start_store_server(self) -> None:
        # In HA mode the published admin URL is this master's; the tools take --admin otherwise.
        self.store_server = StoreServer(self.log_dir, self.master_addr, self._master.reach_host,
                                        self.segment_size, self.ssd_dir, admin=self._master.admin
                                        ).start(self.start_timeout)

    def addrs(self) -> MasterAddrs:
        return MasterAddrs(
            rpc=self.master_addr,
            metrics=f"{self._master.admin}/metrics",
            http_metadata=f"http://{self._master.reach_host}:{self.http_port}/metadata" if self.http_port else None,
            store_server=(f"{self.store_server.hostname} (pid {self.store_server.pid})"
                          if self.store_server is not None and self.store_server.alive() else None),
        )

    def stop_master(self, sig: int = signal.SIGTERM) -> None:
        self._master.stop(sig)

    def restart_master(self) -> None:
        self.stop_master()
        self._master.start(self.start_timeout)

    def stop(self) -> None:
        # Clients first: a client whose master is gone hangs ~10s unmounting.
        if self.store_server is not None:
            self.store_server.stop()
            self.store_server = None
        self.stop_master()
        self._master.proc = None

    def __enter__(self) -> StoreCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
