"""``mctier store-server``: contribute a DRAM segment (and an SSD offload directory) to a
Mooncake Store pool, from any host.

Usage::

    # host A: the master (and, by default, a first store server)
    mctier master --host 10.0.0.1
    # hosts B, C, ...: more DRAM for the same pool
    mctier store-server --master 10.0.0.1:50051 --host 10.0.0.2 --segment-size 64GB --ssd /nvme/mooncake
    # with masters in HA mode (`mctier master --ha --etcd ...`), name the pool by its etcd:
    mctier store-server --master etcd://10.0.0.9:2379 --host 10.0.0.2

The process mounts the segment, holds it until SIGTERM or SIGINT, then unmounts it (its objects
leave the pool with it, unless they have replicas elsewhere). It follows a master failover by
itself: Mooncake's client remounts the segment on the new leader. ``--host`` is the address other
hosts reach this segment at (the Transfer Engine's advertised address).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec

from kvcore.config import parse_size
from kvcore.errors import check
from kvcore.log import get_logger
from kvcore.trust import warn_exposed_transfer_engine
from mcstore.client import replicate_config
from mcstore.keys import MASTER_INFO_KEY, MasterInfo

logger = get_logger("mcstore.segment")


def serve_segment(master: str, segment_size: int, ssd: str | None, ready_file: str | None,
                  admin: str | None = None, host: str = "127.0.0.1", protocol: str = "tcp",
                  device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                  local_buffer_size: int = 16 << 20) -> int:
    """Mount a segment, hold it until SIGTERM. With ``admin``, keep the master's admin URL
    published for the tools (again after a master restart, whose pool starts empty)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata_server, segment_size, local_buffer_size, protocol, device_name, master,
                     None, bool(ssd), ssd or "")
    check(rc, f"store server setup against master {master}")
    warn_exposed_transfer_engine(host, protocol, "store server", logger)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", required=True, help="HOST:PORT of mooncake_master, or etcd://HOST:PORT[;HOST:PORT] "
                                                   "for masters in HA mode")
    p.add_argument("--host", default="127.0.0.1", help="the address other hosts reach this segment at")
    p.add_argument("--segment-size", default="4GB", help="DRAM contributed to the pool")
    p.add_argument("--local-buffer-size", default="16MB")
    p.add_argument("--ssd", help="directory for SSD offload (enables it)")
    p.add_argument("--protocol", default="tcp", help="Transfer Engine protocol: tcp or rdma")
    p.add_argument("--device-name", default="", help="RDMA device(s), e.g. mlx5_0 (empty for TCP)")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE",
                   help="Transfer Engine metadata: P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://HOST:PORT")
    p.add_argument("--admin", help="the master's HTTP admin URL, published for the tools")
    p.add_argument("--ready-file", help="written with the segment's name once it is mounted")


def run(a: argparse.Namespace) -> int:
    import os

    from mcstore.server import client_env, offload_env

    # The environment Mooncake reads at set-up: quiet, fail fast, advertise --host.
    os.environ.update({k: v for k, v in client_env(a.host).items()
                       if k not in os.environ or k == "MC_TCP_BIND_ADDRESS"})
    if a.ssd:
        Path(a.ssd).mkdir(parents=True, exist_ok=True)
        for k, v in offload_env(a.ssd).items():
            os.environ.setdefault(k, v)
    return serve_segment(a.master, parse_size(a.segment_size), a.ssd, a.ready_file, a.admin, a.host,
                         a.protocol.strip().lower(), a.device_name, a.metadata_server,
                         parse_size(a.local_buffer_size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mctier store-server", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
