"""Several "hosts" on one machine: a real etcd on a loopback address of its own, and what is
listening where (read from ``/proc/net/tcp``).

Hosts are loopback addresses (127.0.0.2, 127.0.0.3, ...): the whole 127.0.0.0/8 range is local
to this machine, so nothing here ever addresses anything outside it.
"""

from __future__ import annotations

import shutil
import socket
import struct
from pathlib import Path

import psutil

from kvcore.procs import Proc, free_port
from tests.harness import LOGS


def etcd_binary() -> str:
    exe = shutil.which("etcd")
    if exe is None:
        raise RuntimeError("etcd not found: `make test` installs Debian's etcd-server "
                           "(or: apt-get install -y etcd-server)")
    return exe


class Etcd:
    """One real etcd member (Debian's ``etcd-server``) on ``host``, data under ``data_dir``."""

    def __init__(self, host: str = "127.0.0.1", data_dir: str | Path | None = None, start_timeout: float = 30):
        self.host = host
        self.port = free_port(host)
        self.peer_port = free_port(host)
        self.data_dir = Path(data_dir or LOGS / f"etcd-{host}-{self.port}")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        name = f"mct{self.port}"
        peer = f"http://{host}:{self.peer_port}"
        self.proc = Proc("etcd", [
            etcd_binary(), "--name", name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}", "--log-level", "warn",
        ], LOGS / f"etcd-{host}-{self.port}.log", die_with_parent=True)
        try:
            self.proc.wait_port(self.port, start_timeout, host=host)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        """``HOST:PORT``, the form Mooncake's ``--etcd_endpoints`` and ``etcd://`` entries take."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.proc.stop(grace=5)
        shutil.rmtree(self.data_dir, ignore_errors=True)


# -- what listens where ---------------------------------------------------------------------------

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _addr(hex_addr: str, v6: bool) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if v6:
        # Four host-order 32-bit words.
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, raw)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[7:]
    else:
        ip = socket.inet_ntoa(struct.pack("<I", int(ip_hex, 16)))
    return ip, int(port_hex, 16)


def listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket on the machine
    (``/proc/net/tcp`` and ``tcp6``; IPv4-mapped v6 addresses are shown as IPv4, "::" as is)."""
    out: dict[int, tuple[str, int]] = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == _LISTEN:
                out[int(f[9])] = _addr(f[1], v6)
    return out


def listeners_by_process(pid: int) -> dict[str, list[tuple[str, int]]]:
    """Where the process ``pid`` and each of its descendants listen: ``"PID NAME"`` -> sorted
    (address, port) pairs, for processes that listen at all."""
    socks = listening()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, list[tuple[str, int]]] = {}
    for p in procs:
        found: set[tuple[str, int]] = set()
        try:
            for fd in Path(f"/proc/{p.pid}/fd").iterdir():
                try:
                    target = fd.readlink().as_posix()
                except OSError:
                    continue
                if target.startswith("socket:[") and int(target[8:-1]) in socks:
                    found.add(socks[int(target[8:-1])])
            name = p.name()
        except (OSError, psutil.Error):
            continue
        if found:
            out[f"{p.pid} {name}"] = sorted(found)
    return out


def listeners_of(pid: int) -> list[tuple[str, int]]:
    """Where the process ``pid`` and its descendants listen (address, port), sorted."""
    return sorted({s for socks in listeners_by_process(pid).values() for s in socks})
