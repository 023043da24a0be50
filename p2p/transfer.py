"""Thin wrapper over Mooncake's ``TransferEngine`` (P2PHANDSHAKE metadata, no etcd).

Only synchronous batch calls are used: ``get_batch_transfer_status`` on an already
finished batch id segfaults in 0.3.13, so async batches are never polled here.
Memory is registered with the platform's location string (``cpu:0`` on CPU,
``cuda:N`` with GPUDirect on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore import platform
from kvcore.errors import ConfigError, check, error_for
from kvcore.geometry import MemRange


class TransferEngineHandle:
    """One Mooncake ``TransferEngine`` of this process: its address (``host:rpc_port``) and
    the KV memory it registered; peers read (or write) that memory through it."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError(f"P2P tier needs the Mooncake Transfer Engine: {e}") from None
        self.te = TransferEngine()
        self.hostname = hostname
        self.protocol = protocol
        rc = self.te.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise ConfigError(
                f"TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, {device_name!r}) returned {rc}"
            )
        self.addr = f"{hostname}:{self.te.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, buffers: Sequence[MemRange], device_index: int = 0) -> None:
        loc = platform.current().memory_location(device_index)
        for b in buffers:
            check(self.te.register_memory(b.addr, b.size, loc), "register_memory", f"{b.size} bytes at {b.addr:#x}")
            self._registered.append(b.addr)

    def read(self, peer: str, local: list[int], remote: list[int], lens: list[int]) -> None:
        """Copy ``remote[i]`` (peer memory) into ``local[i]``, all or error."""
        if not lens:
            return
        rc = self.te.batch_transfer_sync_read(peer, local, remote, lens)
        if rc != 0:  # 0 or a negative code (the engine's own -1 for a refused or failed batch)
            raise error_for(rc, "batch_transfer_sync_read", f"from {peer}, {len(lens)} descriptors")

    def write(self, peer: str, local: list[int], remote: list[int], lens: list[int]) -> None:
        if not lens:
            return
        rc = self.te.batch_transfer_sync_write(peer, local, remote, lens)
        if rc != 0:
            raise error_for(rc, "batch_transfer_sync_write", f"to {peer}, {len(lens)} descriptors")

    def close(self) -> None:
        for addr in self._registered:
            self.te.unregister_memory(addr)
        self._registered.clear()
