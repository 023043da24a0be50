"""Thin wrapper over Mooncake's ``TransferEngine``.

Only synchronous batch calls are used: ``get_batch_transfer_status`` on an already
finished batch id segfaults in 0.3.13, so async batches are never polled here.
Memory is registered with the platform's location string (``cpu:0`` on CPU,
``cuda:N`` with GPUDirect on CUDA, N the GPU the KV tensors are on).

Naming (what a peer passes to read from this engine, :attr:`TransferEngineHandle.addr`, sent in
the side channel's READY reply):

* ``P2PHANDSHAKE`` (default, no metadata server): the engine's own RPC address
  ``HOST:RPC_PORT`` (Mooncake picks the port); the peer asks it directly.
* an http or etcd metadata server: Mooncake registers the engine's segment under the name
  it was initialised with and peers look that name up in the metadata server, so both sides
  must use the same server. The name is ``HOST:PORT`` with PORT a port this handle holds
  bound (never listening) while it lives: unique among the engines of the host, and new at
  every start (a peer's Transfer Engine caches a segment's descriptor by name and never
  re-reads it, so a restarted prefill under its old name would stay unreachable). The
  address peers connect to is ``MC_TCP_BIND_ADDRESS``, set to HOST unless already set
  (Mooncake otherwise advertises the host's first LAN address).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from kvcore import platform
from kvcore.errors import ConfigError, check, error_for
from kvcore.geometry import MemRange
from kvcore.log import get_logger
from kvcore.mooncake_json import P2PHANDSHAKE, metadata_conn_string

logger = get_logger("p2p.transfer")


def _wrap(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _reserve_port(host: str) -> socket.socket:
    """A socket bound (not listening) to a fresh port on ``host`` (on loopback when ``host``
    is not an address of this machine)."""
    bare = host.strip("[]")
    for family, addr in ((socket.AF_INET6 if ":" in bare else socket.AF_INET, bare), (socket.AF_INET, "127.0.0.1")):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((addr, 0))
            return sock
        except OSError:
            sock.close()
    raise ConfigError(f"p2p: no port to name this Transfer Engine on {host!r}")


# Descriptors per synchronous batch call. Measured with Mooncake 0.3.13 on loopback TCP: one
# call of 3,072 descriptors failed (-1, the peer reset the connection) in 4 of 5 tries, also
# right after a call of 2,048 passed; the store client's batch calls fail likewise past about
# 2,048 ranges (mcstore.loads.ranged_batches). A pull of scattered blocks needs one descriptor
# per block run per KV region (a 32K-token handoff of a 12-region model: up to 12,288), so
# pulls go in calls of this many.
MAX_DESCRIPTORS_PER_CALL = 1024


class TransferEngineHandle:
    """One Mooncake ``TransferEngine`` of this process: its name for peers (:attr:`addr`)
    and the KV memory it registered; peers read (or write) that memory through it."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 metadata_server: str = P2PHANDSHAKE):
        metadata_server = metadata_conn_string(metadata_server)  # never a string Mooncake aborts on
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError(f"P2P tier needs the Mooncake Transfer Engine: {e}") from None
        self.te = TransferEngine()
        self.hostname = hostname
        self.protocol = protocol
        self.metadata_server = metadata_server
        self._name_sock: socket.socket | None = None
        name = hostname
        if metadata_server != P2PHANDSHAKE:
            self._name_sock = _reserve_port(hostname)
            name = f"{_wrap(hostname)}:{self._name_sock.getsockname()[1]}"
            bind = os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname.strip("[]"))
            if bind != hostname.strip("[]"):
                logger.warning("MC_TCP_BIND_ADDRESS=%s: peers reach this Transfer Engine there, not at "
                               "te_hostname %s", bind, hostname)
        rc = self.te.initialize(name, metadata_server, protocol, device_name)
        if rc != 0:
            self._release_name()
            hint = "" if metadata_server == P2PHANDSHAKE else "; is the metadata server up and reachable?"
            raise ConfigError(
                f"TransferEngine.initialize({name!r}, {metadata_server!r}, {protocol!r}, {device_name!r}) "
                f"returned {rc}{hint}"
            )
        self.addr = f"{_wrap(hostname)}:{self.te.get_rpc_port()}" if self._name_sock is None else name
        self._registered: list[int] = []

    def _release_name(self) -> None:
        if self._name_sock is not None:
            self._name_sock.close()
            self._name_sock = None

    def register(self, buffers: Sequence[MemRange], device=None) -> None:
        """Register ``buffers``, memory on ``device`` (the KV tensors' ``torch.device``; None:
        this process's current device)."""
        loc = platform.current().memory_location(device)
        for b in buffers:
            check(self.te.register_memory(b.addr, b.size, loc), "register_memory", f"{b.size} bytes at {b.addr:#x}")
            self._registered.append(b.addr)

    def read(self, peer: str, local: list[int], remote: list[int], lens: list[int]) -> None:
        """Copy ``remote[i]`` (peer memory) into ``local[i]``, all or error."""
        self._batched(self.te.batch_transfer_sync_read, "batch_transfer_sync_read", f"from {peer}",
                      peer, local, remote, lens)

    def write(self, peer: str, local: list[int], remote: list[int], lens: list[int]) -> None:
        self._batched(self.te.batch_transfer_sync_write, "batch_transfer_sync_write", f"to {peer}",
                      peer, local, remote, lens)

    @staticmethod
    def _batched(call, name: str, where: str, peer: str, local: list[int], remote: list[int],
                 lens: list[int]) -> None:
        """``call`` in synchronous batches of at most ``MAX_DESCRIPTORS_PER_CALL``; raise at the first failure."""
        for lo in range(0, len(lens), MAX_DESCRIPTORS_PER_CALL):
            hi = lo + MAX_DESCRIPTORS_PER_CALL
            rc = call(peer, local[lo:hi], remote[lo:hi], lens[lo:hi])
            if rc != 0:  # 0 or a negative code (the engine's own -1 for a refused or failed batch)
                raise error_for(rc, name, f"{where}, {len(lens)} descriptors")

    def close(self) -> None:
        for addr in self._registered:
            self.te.unregister_memory(addr)
        self._registered.clear()
        # The name stays reserved while the engine (registered under it) lives.
