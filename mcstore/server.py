"""``mctier master``: a mooncake_master plus the store server that owns the pool.

The master keeps only metadata; bytes live in the segments that clients mount,
and a client's segment disappears with it. Engines are therefore pure clients by
default and a separate store-server process contributes the DRAM segment (and
the SSD offload directory), so stored KV outlives any engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec

from kvcore.config import parse_size
from kvcore.errors import check
from kvcore.log import get_logger
from kvcore.procs import Proc, free_port
from mcstore.client import replicate_config
from mcstore.keys import MASTER_INFO_KEY, MasterInfo

logger = get_logger("mcstore.server")

# Quiet Mooncake clients, fail fast on a missing master (setup retries 20x4s by default),
# and advertise loopback addresses.
CLIENT_ENV = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
}


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
    rpc: str
    metrics: str
    http_metadata: str | None
    store_server: str | None


def master_binary() -> str:
    exe = shutil.which("mooncake_master", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise RuntimeError("mooncake_master not found: install the 'cpu' (or 'cuda') extra")
    return exe


class StoreCluster:
    """A master and (optionally) one store server, started and stopped together."""

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
    ):
        self.log_dir = Path(log_dir)
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.http_port = http_port
        self.segment_size = segment_size
        self.ssd_dir = ssd_dir
        self.with_store_server = store_server
        self.extra_flags = list(extra_flags or [])
        self.start_timeout = start_timeout
        self.master: Proc | None = None
        self.server: Proc | None = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def master_argv(self) -> list[str]:
        argv = [
            master_binary(),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
            "--minloglevel=1",
        ]
        if self.http_port:
            # Mooncake binds this one on 0.0.0.0 whatever host is given; off unless asked.
            argv += [
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]
        if self.ssd_dir:
            argv.append("--enable_offload=true")
        return argv + self.extra_flags

    def start(self) -> StoreCluster:
        self.master = Proc("mooncake_master", self.master_argv(), self.log_dir / f"master-{self.port}.log")
        try:
            self.master.wait_port(self.port, self.start_timeout)
            if self.with_store_server:
                self.start_store_server()
        except BaseException:
            # A half-started cluster must not outlive the caller that never got it back.
            self.stop()
            raise
        return self

    def start_store_server(self) -> None:
        argv = [sys.executable, "-m", "mcstore.server", "--master", self.master_addr,
                "--segment-size", str(self.segment_size)]
        env = dict(CLIENT_ENV)
        if self.ssd_dir:
            Path(self.ssd_dir).mkdir(parents=True, exist_ok=True)
            argv += ["--ssd", self.ssd_dir]
            env.update(offload_env(self.ssd_dir))
        ready = self.log_dir / f"store-server-{self.port}.ready"
        ready.unlink(missing_ok=True)
        argv += ["--ready-file", str(ready), "--admin", f"http://127.0.0.1:{self.metrics_port}"]
        self.server = Proc("store-server", argv, self.log_dir / f"store-server-{self.port}.log", env=env)
        deadline = time.monotonic() + self.start_timeout
        while not ready.exists():
            if not self.server.alive():
                raise RuntimeError(f"store server exited; log tail:\n{self.server.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"store server not ready in {self.start_timeout}s; log:\n{self.server.tail()}")
            time.sleep(0.1)

    def addrs(self) -> MasterAddrs:
        return MasterAddrs(
            rpc=self.master_addr,
            metrics=f"http://127.0.0.1:{self.metrics_port}/metrics",
            http_metadata=f"http://127.0.0.1:{self.http_port}/metadata" if self.http_port else None,
            store_server=f"pid {self.server.pid}" if self.server else None,
        )

    def stop_master(self, sig: int = signal.SIGTERM) -> None:
        if self.master is not None:
            self.master.stop(grace=5, sig=sig)

    def restart_master(self) -> None:
        self.stop_master()
        self.master = Proc("mooncake_master", self.master_argv(), self.log_dir / f"master-{self.port}.log")
        self.master.wait_port(self.port, self.start_timeout)

    def stop(self) -> None:
        # Clients first: a client whose master is gone hangs ~10s unmounting.
        if self.server is not None:
            self.server.stop(grace=15)
            self.server = None
        self.stop_master()
        self.master = None

    def __enter__(self) -> StoreCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_segment(master: str, segment_size: int, ssd: str | None, ready_file: str | None,
                  admin: str | None = None) -> int:
    """Body of the store-server process: mount a segment, hold it until SIGTERM. With
    ``admin``, keep the master's admin URL published for the tools (again after a master
    restart)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", "P2PHANDSHAKE", segment_size, 16 << 20, "tcp", "", master,
        None, bool(ssd), ssd or "",
    )
    check(rc, f"store server setup against master {master}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    info = msgspec.json.encode(MasterInfo(admin=admin)) if admin else None
    if info is not None:
        store.upsert(MASTER_INFO_KEY, info, replicate_config(hard_pin=True))
    if ready_file:
        Path(ready_file).write_text(store.get_hostname())
    print(f"store server {store.get_hostname()} serving {segment_size} bytes for {master}", flush=True)
    checked = time.monotonic()
    while not stop.wait(1.0):
        if info is not None and time.monotonic() - checked > 5.0:
            checked = time.monotonic()
            if store.is_exist(MASTER_INFO_KEY) == 0:  # gone with a restarted master
                store.upsert(MASTER_INFO_KEY, info, replicate_config(hard_pin=True))
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcstore.server", description="Mooncake store server (segment owner)")
    p.add_argument("--master", required=True)
    p.add_argument("--segment-size", default="1GB")
    p.add_argument("--ssd")
    p.add_argument("--ready-file")
    p.add_argument("--admin", help="the master's HTTP admin URL, published for the tools")
    a = p.parse_args(argv)
    return serve_segment(a.master, parse_size(a.segment_size), a.ssd, a.ready_file, a.admin)


if __name__ == "__main__":
    sys.exit(main())
