"""Child processes with deadlines: start, wait until a port answers, stop by PID."""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kvcore.errors import TransferTimeout

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


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Proc:
    """A started child process with its own process group and log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cpus: set[int] | None = None,
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
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
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
