"""Child processes with deadlines: start, wait until a port answers, stop by PID.

A child started with ``die_with_parent`` gets SIGTERM when the process that started it dies,
however it dies (``PR_SET_PDEATHSIG``; a SIGKILLed parent runs no handler, so nothing else
could stop it): a killed ``mctier master`` leaves no ``mooncake_master`` behind to be found
leading by the next one. :func:`refuse_taken` turns a port an earlier process still holds
into a clear error naming it and its holder.
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kvcore.errors import ConfigError, TransferTimeout

# Ports picked for listeners come from below the kernel's ephemeral range: a port the kernel
# handed out (bind to port 0) is free only until the next outgoing connection or ephemeral
# bind takes it, and one did: a prefill's bootstrap port, picked that way, was taken before
# the engine bound it (Errno 98 in tests/test_router_e2e.py). Below 20000 are
# well-known services and the range Mooncake's Transfer Engine draws its RPC ports from
# (rpc_min_port to rpc_max_port, 15000 to 17000 by default).
_PICK_FROM = 20000
_handed: set[int] = set()  # this process's picks, never handed out twice


@functools.cache  # a host setting: read once per process, not per port
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def name_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) in /proc, as top -H, perf and
    ``/proc/<pid>/task/<tid>/comm`` show it: Python's thread names stay inside Python. Linux only;
    elsewhere, or if the call fails, nothing happens."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a listener that a child process will bind: drawn at
    random below the kernel's ephemeral range (from 20000 up) and checked by binding it; the
    kernel's own pick (port 0) only when that range is too small or 64 draws found none free."""
    low = _ephemeral_low()
    if low - _PICK_FROM >= 1000:
        for _ in range(64):
            port = random.randrange(_PICK_FROM, low)
            if port in _handed:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def holder(port: int) -> str | None:
    """``pid N (name)`` of the process listening on TCP ``port``, when it can be found."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
    except Exception:  # noqa: BLE001 - no permission, no psutil: the port alone is named
        return None
    return None


def refuse_taken(port: int, host: str, what: str) -> None:
    """``ConfigError`` when something already listens on ``host:port`` (a port this start
    needs), naming the process when it can be found."""
    if not port_open(port, host):
        return
    who = holder(port)
    raise ConfigError(f"{what}: port {port} on {host} is already in use" + (f" by {who}" if who else "") +
                      "; an orphan of an earlier start? Stop it first" + (f" (kill {who.split()[1]})" if who else ""))


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _die_with(parent: int, cpus: set[int] | None):
    """preexec_fn: SIGTERM when ``parent`` dies (and now, if it already has); pin to ``cpus``."""
    def setup():
        if cpus:
            os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the caller's own stop() still applies
            return
        if os.getppid() != parent:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)
    return setup


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Proc:
    """A started child process with its own process group and log file. ``die_with_parent``:
    it gets SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``: start such
    children from the main thread, or from one that lives as long as they should)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cpus: set[int] | None = None,
        die_with_parent: bool = False,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,  # own group: stop() reaches its children too
            # Children inherit the affinity: an engine's API server and scheduler
            # process stay on its core instead of taking cycles from its neighbour's.
            preexec_fn=_die_with(os.getpid(), cpus) if die_with_parent else
            (lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_port(self, port: int, timeout: float, host: str = "127.0.0.1") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; log tail:\n{self.tail()}")
            if port_open(port, host):
                return
            time.sleep(0.2)
        raise TransferTimeout(f"{self.name} did not listen on {host}:{port} within {timeout:.0f}s; "
                              f"log tail:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal the process group, wait ``grace`` seconds, then SIGKILL it."""
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _reap_group(self) -> None:
        # Children that outlived the leader (engine workers) still carry its group id.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
