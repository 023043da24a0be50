"""Real Mooncake: put/get through a real master and store server, a Transfer Engine pair,
and ``mctier master`` as a user starts it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvcore.errors import ObjectNotFound, check, first_error
from kvcore.geometry import KVGeometry
from kvcore.procs import free_port, port_open
from mcstore.server import CLIENT_ENV

pytestmark = pytest.mark.integration

os.environ.update(CLIENT_ENV)


def kv_like(num_blocks=16, layers=2):
    """Per-layer views into one buffer, the CPU engine's shape ([B, H, bs, 2*D])."""
    buf = torch.zeros(layers * num_blocks * 2 * 32 * 128, dtype=torch.int16)
    buf.random_()
    per = buf.view(layers, num_blocks, 2, 32, 128)
    return {f"model.layers.{i}.self_attn.attn": per[i] for i in range(layers)}


@pytest.fixture
def client(store_cluster):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    check(s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", store_cluster.master_addr), "setup")
    yield s
    s.close()


def test_put_get_pages_through_master(client):
    kv = kv_like()
    geo = KVGeometry.from_kv_caches(kv, 16)
    for b in geo.buffers:
        check(client.register_buffer(b.addr, b.size), "register_buffer")
    src, dst = [2, 3, 4], [9, 11, 12]
    keys = [f"itest/{time.time_ns()}"]
    sr = geo.ranges(src)
    rcs = client.batch_put_from_multi_buffers(keys, [[a for a, _ in sr]], [[n for _, n in sr]])
    assert first_error(rcs, "put") is None, rcs
    assert client.batch_is_exist(keys) == [1]
    dr = geo.ranges(dst)
    got = client.batch_get_into_multi_buffers(keys, [[a for a, _ in dr]], [[n for _, n in dr]])
    assert got == [geo.nbytes(3)]
    for t in kv.values():
        assert torch.equal(t[dst], t[src])
    missing = client.batch_get_into_multi_buffers([keys[0] + "-absent"], [[a for a, _ in dr]], [[n for _, n in dr]])
    with pytest.raises(ObjectNotFound):
        check(missing[0], "get")
    for b in geo.buffers:
        client.unregister_buffer(b.addr)


TARGET = r"""
import sys, torch
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = torch.zeros(1 << 20, dtype=torch.uint8)
assert te.register_memory(buf.data_ptr(), buf.numel()) == 0
print(te.get_rpc_port(), buf.data_ptr(), flush=True)
sys.stdin.readline()
print(int(buf.to(torch.int64).sum()), bytes(buf[:8].tolist()).hex(), flush=True)
"""


def test_transfer_engine_pair_moves_bytes():
    from mooncake.engine import TransferEngine

    target = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **CLIENT_ENV})
    try:
        port, remote_base = map(int, target.stdout.readline().split())
        te = TransferEngine()
        check(te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), "te init")
        src = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
        check(te.register_memory(src.data_ptr(), src.numel()), "register")
        peer = f"127.0.0.1:{port}"
        rc = te.batch_transfer_sync_write(peer, [src.data_ptr(), src.data_ptr() + 4096],
                                          [remote_base, remote_base + 8192], [4096, 4096])
        check(rc, "batch_transfer_sync_write")
        # Outside the peer's registered memory: refused, not written.
        assert te.transfer_sync_write(peer, src.data_ptr(), remote_base + (1 << 21), 4096) < 0
        target.stdin.write("\n")
        target.stdin.flush()
        total, head = target.stdout.readline().split()
        assert int(total) == 2 * int(src[:4096].to(torch.int64).sum())
        assert head == bytes(src[:8].tolist()).hex()
    finally:
        target.kill()
        target.wait(timeout=10)


PATTERN_TARGET = r"""
import sys, torch
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = (torch.arange(SIZE, dtype=torch.int64) * 7 % 251).to(torch.uint8)
assert te.register_memory(buf.data_ptr(), buf.numel()) == 0
print(te.get_rpc_port(), buf.data_ptr(), flush=True)
sys.stdin.readline()
"""


def _pattern(size: int) -> torch.Tensor:
    """The bytes :data:`PATTERN_TARGET` registers."""
    return (torch.arange(size, dtype=torch.int64) * 7 % 251).to(torch.uint8)


@contextlib.contextmanager
def _pattern_peer(size: int):
    """A peer process holding :func:`_pattern` of ``size`` bytes in a registered buffer, and
    this process's ``TransferEngineHandle`` with a zeroed buffer of the same size:
    yields ``(handle, dst, peer, remote_base)``; stops both (the peer by PID)."""
    from kvcore.geometry import MemRange
    from p2p.transfer import TransferEngineHandle

    target = subprocess.Popen([sys.executable, "-c", PATTERN_TARGET.replace("SIZE", str(size))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **CLIENT_ENV})
    h = None
    try:
        port, remote_base = map(int, target.stdout.readline().split())
        h = TransferEngineHandle()
        dst = torch.zeros(size, dtype=torch.uint8)
        h.register([MemRange(dst.data_ptr(), dst.numel())])
        yield h, dst, f"127.0.0.1:{port}", remote_base
    finally:
        if h is not None:
            h.close()
        target.kill()
        target.wait(timeout=10)


def test_p2p_read_of_more_descriptors_than_one_call_takes():
    """``TransferEngineHandle.read`` of 3 x MAX_DESCRIPTORS_PER_CALL descriptors (256 bytes each,
    in reverse order so that none merge) from a fresh peer process: every byte lands where it
    should. As one call, the same read failed with INTERNAL_ERROR (p2p.transfer)."""
    from p2p.transfer import MAX_DESCRIPTORS_PER_CALL

    with _pattern_peer(1 << 20) as (h, dst, peer, remote_base):
        n, size = 3 * MAX_DESCRIPTORS_PER_CALL, 256
        local = [dst.data_ptr() + i * size for i in range(n)]
        remote = [remote_base + (n - 1 - i) * size for i in range(n)]
        h.read(peer, local, remote, [size] * n)
        want = _pattern(1 << 20)[: n * size].view(n, size).flip(0).reshape(-1)
        assert torch.equal(dst[: n * size], want)


def test_p2p_read_waits_without_spinning_where_mooncakes_sync_read_spins():
    """While ``TransferEngineHandle.read`` waits for its bytes, the calling thread leaves the
    core (under 20% of the read's wall time on that thread's CPU clock): on a CPU host the
    prefill process that sends the bytes may share that core (p2p.transfer). Control: the
    same reads through Mooncake's ``batch_transfer_sync_read`` keep the calling thread
    busy (over three times our share; on an idle host over 40%: the ratio, not the absolute
    share, because a host busy with other work gives a spinning thread less of a core), so the
    measurement can tell the two apart."""
    size = 64 << 20
    with _pattern_peer(size) as (h, dst, peer, remote_base):
        quarter = size // 4
        local = [dst.data_ptr() + i * quarter for i in range(4)]
        remote = [remote_base + i * quarter for i in range(4)]

        def busy_share(read) -> float:
            wall = cpu = 0.0
            for _ in range(4):
                w0, c0 = time.perf_counter(), time.thread_time()
                read()
                wall += time.perf_counter() - w0
                cpu += time.thread_time() - c0
            return cpu / wall

        ours = busy_share(lambda: h.read(peer, local, remote, [quarter] * 4))
        assert torch.equal(dst, _pattern(size))
        sync = busy_share(lambda: check(h.te.batch_transfer_sync_read(peer, local, remote, [quarter] * 4),
                                        "batch_transfer_sync_read"))
        print(f"calling thread's CPU over the read's wall time: ours {ours:.1%}, Mooncake's sync read {sync:.1%}")
        assert ours < 0.2 and sync > 3 * ours, (ours, sync)


def test_mctier_master_cli_serves_and_stops(tmp_path):
    from mooncake.store import MooncakeDistributedStore

    port, mport = free_port(), free_port()
    cli = subprocess.Popen([sys.executable, "-m", "multi.cli", "master", "--port", str(port), "--metrics-port",
                            str(mport), "--segment-size", "64MB", "--log-dir", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = ""
        deadline = time.monotonic() + 30
        while "Ctrl-C" not in banner and time.monotonic() < deadline:
            banner += cli.stdout.readline()
        assert f"127.0.0.1:{port}" in banner and "store server" in banner, banner
        s = MooncakeDistributedStore()
        check(s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}"), "setup")
        data = os.urandom(100_000)
        check(s.put("cli-key", data), "put")  # lands in the store server's segment (ours is 0)
        s.close()
        s2 = MooncakeDistributedStore()
        check(s2.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}"), "setup")
        assert s2.get("cli-key") == data  # outlived the writer
        s2.close()
        import requests

        assert "master_key_count" in requests.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=40) == 0
        assert not port_open(port) and not port_open(mport)
        leftovers = subprocess.run(["pgrep", "-f", f"rpc_port={port}|--master 127.0.0.1:{port}"],
                                   capture_output=True, text=True).stdout.split()
        assert leftovers == []
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait(timeout=10)


def test_p2p_io_cpus_puts_the_transfer_engines_threads_and_the_pulls_on_those_cpus():
    """A P2P worker's transfers off the compute core (kvcore.iocpus): the Transfer Engine's
    threads started inside ``threads_started_on`` and the Puller's pool threads (started
    later, from the caller's thread) run on ``io_cpus``; the caller keeps its own CPUs."""
    import threading

    from kvcore import iocpus
    from kvcore.metrics import TierStats
    from p2p.puller import Puller
    from p2p.transfer import TransferEngineHandle

    io, mine = {sorted(os.sched_getaffinity(0))[0]}, os.sched_getaffinity(0)
    before = set(map(int, os.listdir("/proc/self/task")))
    h = None
    try:
        with iocpus.threads_started_on(io, "p2p"):
            h = TransferEngineHandle()
        started = set(map(int, os.listdir("/proc/self/task"))) - before
        assert started, "the Transfer Engine started no thread of its own"
        assert all(os.sched_getaffinity(t) == io for t in started)
        assert os.sched_getaffinity(0) == mine
        puller = Puller(None, h, TierStats(), threading.Lock(), num_workers=2, io_cpus=io)
        assert puller._pool.submit(os.sched_getaffinity, 0).result(timeout=10) == io
        puller._pool.shutdown(wait=True)
    finally:
        if h is not None:
            h.close()
