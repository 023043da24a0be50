"""Thin wrapper over Mooncake's ``TransferEngine``.

Reads and writes are submitted asynchronously, one descriptor per Mooncake batch, and
waited for here with short pauses (:data:`POLL_MAX_S`), not with Mooncake's synchronous
batch calls: those wait by checking the batch's status in a loop without any pause, which
keeps one core fully busy for the whole transfer. On a CPU host where a prefill and a
decode instance share cores, that loop starved the prefill process whose Transfer Engine
had to send the bytes, until Mooncake's client dropped the stalled reads
(docs/benchmarks/p2p.md). ``transfer_check_status`` reports only a batch's first task, hence one
descriptor per batch; it frees the batch once it is terminal, so a finished batch is never
asked again (asking again reads freed memory).
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
import time
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


# Descriptors in flight at once (submitted and not yet terminal). Measured with Mooncake
# 0.3.13 on loopback TCP: one synchronous call of 3,072 descriptors failed (-1, the peer reset
# the connection) in 4 of 5 tries, also right after a call of 2,048 passed; the store client's
# batch calls fail likewise past about 2,048 ranges (mcstore.loads.ranged_batches). A pull of
# scattered blocks needs one descriptor per block run per KV region (a 32K-token handoff of a
# 12-region model: up to 12,288), so its descriptors go in windows of this many.
MAX_DESCRIPTORS_PER_CALL = 1024

# Pause between two status checks of the copies in flight: the first check follows the
# submit at once, each later pause doubles up to POLL_MAX_S. A read is noticed done at most
# POLL_MAX_S late; in between, this thread leaves the core to the Transfer Engines.
POLL_MIN_S = 0.0001
POLL_MAX_S = 0.002


def _sync_timeout_s() -> float:
    """Mooncake's own bound on a synchronous transfer, without its per-byte part (seconds)."""
    try:
        return float(max(5, int(os.environ["MC_TRANSFER_TIMEOUT"])))
    except (KeyError, ValueError):
        return 30.0


# Past its bound, a transfer still in flight is asked about this often (seconds), and logged.
OVERDUE_POLL_S = 0.05
OVERDUE_LOG_S = 60.0


def _wait_terminal(check, batch_ids: list[int], bound_at: float, clock=time.monotonic,
                   sleep=time.sleep) -> tuple[int, float]:
    """Wait with pauses until every batch is terminal: ``(failed, seconds past bound_at)``.
    ``check`` is ``transfer_check_status``: 1 completed, -1 failed (both free the batch: never
    asked again), 0 pending, -2 a slice timed out (Mooncake keeps the batch: asked again until
    it ends).

    There is no giving up: until Mooncake ends a batch it may still write into the local
    memory (KV blocks vLLM would otherwise hand to another request and cache). Mooncake ends a
    stalled TCP transfer itself (``MC_TCP_PROGRESS_TIMEOUT_SEC``, 30 s); past ``bound_at``
    (monotonic s) the wait goes on with longer pauses and an error in the log every
    :data:`OVERDUE_LOG_S`, and the request whose blocks these are keeps them meanwhile (vLLM
    frees a request waiting for remote KV, aborted or not, only once the connector reported it)."""
    failed = 0
    pause = POLL_MIN_S
    logged = None
    while batch_ids:
        still = []
        for bid in batch_ids:
            rc = check(bid)
            if rc == -1:
                failed += 1
            elif rc != 1:
                still.append(bid)
        batch_ids = still
        if not batch_ids:
            break
        now = clock()
        if now >= bound_at:
            if logged is None or now - logged >= OVERDUE_LOG_S:
                logged = now
                logger.error("%d Mooncake transfers still in flight %.0fs past their bound; their memory may still "
                             "change, so it stays with its request until they end", len(batch_ids), now - bound_at)
            pause = max(pause, OVERDUE_POLL_S)
        sleep(pause)
        pause = min(2 * pause, POLL_MAX_S) if pause < OVERDUE_POLL_S else pause
    return failed, max(0.0, clock() - bound_at)


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
        """Copy ``remote[i]`` (peer memory) into ``local[i]``, all or error (a typed
        :class:`~kvcore.errors.MooncakeError`). Returns only when no copy is in flight any more
        (:meth:`_transfer`)."""
        self._transfer(self.te.batch_transfer_async_read, "read", f"from {peer}", peer, local, remote, lens)

    def write(self, peer: str, local: list[int], remote: list[int], lens: list[int]) -> None:
        """Copy ``local[i]`` into ``remote[i]`` (peer memory), all or error, as :meth:`read`."""
        self._transfer(self.te.batch_transfer_async_write, "write", f"to {peer}", peer, local, remote, lens)

    def _transfer(self, submit, op: str, where: str, peer: str, local: list[int], remote: list[int],
                  lens: list[int]) -> None:
        """Submit one batch per descriptor, then wait until every submitted batch is terminal.

        Failures are reported only after that wait, so the caller may reuse its memory at
        once. A transfer should end within the bound Mooncake puts on its own synchronous call
        (30 s, or ``MC_TRANSFER_TIMEOUT``, plus 1 ns per byte), and one that moves no bytes for
        ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (30 s) is failed by Mooncake before that; one that has
        not ended by then is still waited for (:func:`_wait_terminal`): the caller's deadline
        decides whether a late result is still of use."""
        name = f"batch_transfer_async_{op}"
        bound_s = _sync_timeout_s() + sum(lens) / 1e9
        bound_at = time.monotonic() + bound_s
        refused = failed = 0
        for lo in range(0, len(lens), MAX_DESCRIPTORS_PER_CALL):
            pending: list[int] = []
            for i in range(lo, min(lo + MAX_DESCRIPTORS_PER_CALL, len(lens))):
                bid = submit(peer, [local[i]], [remote[i]], [lens[i]])
                if bid == 0:  # Mooncake's failure value (no segment for the peer, or a refused submit)
                    refused = len(lens) - i
                    break
                pending.append(bid)
            f, late = _wait_terminal(self.te.transfer_check_status, pending, bound_at)
            failed += f
            if late > 0:
                logger.warning("%s %s: %d descriptors ended %.1fs past the %.0fs bound", name, where, len(pending),
                               late, bound_s)
            if refused or failed:
                break
        if refused or failed:
            parts = [f"{k} {what}" for k, what in ((refused, "not submitted"), (failed, "failed")) if k]
            raise error_for(-1, name, f"{where}, {len(lens)} descriptors: " + ", ".join(parts))

    def close(self) -> None:
        """Unregister the memory and destroy the engine now. Mooncake's engine takes about 1 s
        to stop its threads and holds the GIL meanwhile: left to the garbage collector, that
        second froze every thread of the process at a random later moment (a test process's
        side-channel heartbeats and timed waits). Idempotent; the handle is
        unusable afterwards."""
        if self.te is None:
            return
        for addr in self._registered:
            self.te.unregister_memory(addr)
        self._registered.clear()
        self.te = None
        # The name was reserved while the engine registered under it lived.
        self._release_name()
