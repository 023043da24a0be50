"""Every socket a peer or a client reaches, tried as an attacker would (issue 49), on the real
listeners without engines: the prefill side channel (ZMQ ROUTER), the bootstrap server and its
client, the router's HTTP server (a real ``mctier proxy`` process), the router's KV-event
subscriber; floods, bogus registrations, a slow-drip and a ``file://`` bootstrap, undecodable
and oversized messages (a short property-based fuzz), and the process tree of ``mctier master``
and ``mctier store-server`` SIGKILLed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest
import requests
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcore.metrics import TierStats
from kvcore.procs import Proc, free_port
from p2p import bootstrap, holds
from p2p.protocol import (
    PullDone,
    PullReply,
    PullRequest,
    RegisterPayload,
    Status,
    decode_to_decode,
    encode,
    sign,
)
from tests.harness import LOGS, ROOT
from tests.hostile import Hostile

pytestmark = pytest.mark.integration

FP = "fp-of-this-engine"
SECRET = b"k" * 32
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Peer:
    """A decode worker's DEALER on a side channel."""

    def __init__(self, addr: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, msg, secret=None) -> None:
        self.sock.send(encode(sign(msg, secret)))

    def reply(self, timeout: float = 5.0, skip_wait: bool = True) -> PullReply:
        deadline = time.monotonic() + timeout
        while self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000) + 1):
            msg = decode_to_decode(self.sock.recv())
            if not (skip_wait and isinstance(msg, PullReply) and msg.status == Status.WAIT):
                return msg
        raise TimeoutError("no reply")

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def side():
    stats, lock = TierStats(), threading.Lock()
    s = holds.SideChannel([], "127.0.0.1:1", stats, lock, abort_timeout_s=30.0, fingerprint=FP)
    s.stats = stats
    yield s
    s.close()


def _counters(s) -> dict:
    with s._stats_lock:
        return dict(s.stats.data["counters"])


def _served(s, tid: str, blocks=(5, 6)) -> PullReply:
    """A legitimate pull still gets READY."""
    s.add_hold(f"req-{tid}", tid, list(blocks))
    peer = Peer(s.addr)
    try:
        peer.send(PullRequest(tid, "d", 0, 1, 0, len(blocks), 5.0, FP), s.secret)
        return peer.reply()
    finally:
        peer.close()


# ------------------------------------------------------------------ the side channel


def test_a_flood_of_pulls_with_infinite_waits_and_releases_keeps_every_table_bounded(side, monkeypatch):
    """10^5 messages, half pulls of unknown transfers with wait_s=inf, half releases of unknown
    transfers: the waiting pulls stay at MAX_WAITING (the rest are answered ERROR at once), the
    remembered releases at MAX_REMEMBERED, and a real pull is still served."""
    monkeypatch.setattr(holds, "MAX_REMEMBERED", 2000)
    peer = Peer(side.addr)
    n = 100_000
    for i in range(n):
        num = 1 if i % 2 else 0
        peer.send(PullRequest(f"flood-{i}", "d", 0, 1, 0, num, float("inf"), FP))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = _counters(side)
        if c.get("rejected:overload", 0) + holds.MAX_WAITING >= n // 2 and side.table_sizes()["early_release"] >= 2000:
            break
        time.sleep(0.2)
    sizes = side.table_sizes()
    assert sizes["waiting"] == holds.MAX_WAITING and sizes["early_release"] == 2000, sizes
    assert _counters(side)["rejected:overload"] == n // 2 - holds.MAX_WAITING
    assert all(w.until - time.monotonic() <= holds.MAX_WAIT_S for w in side._waiting)  # inf capped
    peer.close()
    assert _served(side, "legit").status == Status.READY


def test_a_repeated_transfer_id_never_orphans_a_hold(side):
    side.add_hold("first", "xfer-dup", [1, 2])
    side.add_hold("second", "xfer-dup", [3, 4])
    got = set()
    deadline = time.monotonic() + 5
    while "second" not in got and time.monotonic() < deadline:
        got |= side.take_finished()
        time.sleep(0.05)
    assert got == {"second"} and side.held() == 1  # the second is not held at all
    peer = Peer(side.addr)
    peer.send(PullRequest("xfer-dup", "d", 0, 1, 0, 2, 5.0, FP))
    assert peer.reply().block_ids == [1, 2]  # the first keeps its consumer
    peer.send(PullDone("xfer-dup", "d", True))
    deadline = time.monotonic() + 5
    while side.held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert side.held() == 0 and side.take_finished() == {"first"}
    c = _counters(side)
    assert (c["holds:opened"], c["holds:duplicate"], c["holds:released"]) == (2, 1, 1)
    peer.close()


def test_a_pull_from_an_engine_with_another_kv_fingerprint_is_refused_and_the_hold_let_go(side):
    side.add_hold("p", "xfer-fp", [1, 2])
    peer = Peer(side.addr)
    peer.send(PullRequest("xfer-fp", "d", 0, 1, 0, 2, 5.0, "another-model"))
    r = peer.reply()
    assert r.status == Status.ERROR and "fingerprint" in r.error and r.fingerprint == FP
    deadline = time.monotonic() + 5
    while side.held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert side.held() == 0 and _counters(side)["rejected:fingerprint"] == 1
    peer.close()


def test_with_the_secret_unsigned_or_forged_messages_are_refused_and_counted():
    stats, lock = TierStats(), threading.Lock()
    s = holds.SideChannel([], "127.0.0.1:1", stats, lock, secret=SECRET, fingerprint=FP)
    s.stats = stats
    try:
        s.add_hold("p", "xfer-s", [1])
        peer = Peer(s.addr)
        peer.send(PullRequest("xfer-s", "d", 0, 1, 0, 1, 5.0, FP))  # unsigned
        r = peer.reply()
        assert r.status == Status.ERROR and "unsigned" in r.error
        peer.send(PullDone("xfer-s", "d", True), b"other-secret-16bytes")
        time.sleep(0.3)
        assert s.held() == 1  # neither released it
        c = _counters(s)
        assert (c["rejected:unsigned"], c["rejected:bad_signature"]) == (1, 1)
        peer.send(PullRequest("xfer-s", "d", 0, 1, 0, 1, 5.0, FP), SECRET)
        assert peer.reply().status == Status.READY
        peer.close()
    finally:
        s.close()


def test_a_pull_for_another_prompt_is_refused_and_the_hold_waits_for_its_own(side):
    """Transfer parameters replayed onto another prompt: the pull names the hold's transfer id
    but its prompt digest is another; it gets nothing, and the hold still serves its own pull."""
    from p2p.protocol import prompt_digest

    mine, other = prompt_digest([1, 2, 3]), prompt_digest([1, 2, 4])
    side.add_hold("p", "xfer-prompt", [1, 2], prompt=mine)
    peer = Peer(side.addr)
    peer.send(PullRequest("xfer-prompt", "d", 0, 1, 0, 2, 5.0, FP, other))
    r = peer.reply()
    assert r.status == Status.ERROR and r.error.startswith("prompt mismatch") and side.held() == 1
    peer.send(PullRequest("xfer-prompt", "d", 0, 1, 0, 2, 5.0, FP, mine))
    assert peer.reply().status == Status.READY
    assert _counters(side)["rejected:prompt_mismatch"] == 1
    peer.close()


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
def test_fuzz_undecodable_messages_to_the_side_channel_are_dropped(side, frames):
    peer = Peer(side.addr)
    try:
        for f in frames:
            peer.sock.send(f)
    finally:
        peer.close()
    assert side._thread.is_alive()


def test_oversized_and_undecodable_side_channel_messages_leave_it_serving(side):
    peer = Peer(side.addr)
    peer.sock.send(b"\x00" * (holds.MAX_TO_PREFILL + 1))  # ZMQ drops the connection, not the server
    peer.sock.send(msgspec.msgpack.encode({"type": "pull", "transfer_id": "x" * 10_000}))
    peer.sock.send(b"\xc1")
    time.sleep(0.5)
    peer.close()
    assert _counters(side).get("rejected:undecodable", 0) >= 1
    assert _served(side, "after-junk").status == Status.READY


# ------------------------------------------------------------------ the bootstrap server and client


@pytest.fixture
def boot():
    refused = []
    s = bootstrap.BootstrapServer(engine_id="eng-P", dp_size=1, tp_size=2, pp_size=1,
                                  on_refused=lambda: refused.append(1)).start()
    s.refused = refused
    for tp in (0, 1):
        bootstrap.register(s.url, RegisterPayload("eng-P", 0, tp, 0, f"tcp://127.0.0.1:{5000 + tp}"), 2)
    yield s
    s.stop()


def test_bogus_registrations_are_refused_and_the_engine_stays_as_registered(boot):
    before = requests.get(boot.url + "/query", timeout=5).json()
    bogus = [RegisterPayload("eng-P", -1, 0, 0, "tcp://127.0.0.1:1"),  # would win the router's pick
             RegisterPayload("eng-P", 0, 2, 0, "tcp://127.0.0.1:1"),  # an extra TP rank
             RegisterPayload("eng-P", 0, 0, 1, "tcp://127.0.0.1:1"),
             RegisterPayload("eng-X", 1, 0, 0, "tcp://127.0.0.1:1"),  # another engine
             RegisterPayload("eng-P", 0, 0, 0, "tcp://127.0.0.1:9"),  # another address for a slot
             RegisterPayload("eng-P", 0, 1, 0, "http://evil/"), RegisterPayload("eng-P", 0, 1, 0, "tcp://0.0.0.0:1")]
    for p in bogus:
        with pytest.raises(bootstrap.BootstrapError, match="HTTP 400"):
            bootstrap.register(boot.url, p, 2, wait_s=0)
    r = requests.post(boot.url + "/register", data=json.dumps({"engine_id": "eng-P"}),
                      headers={"Content-Type": "text/plain"}, timeout=5)
    assert r.status_code == 415
    r = requests.post(boot.url + "/register", data=b"{" * (bootstrap.MAX_BODY + 1),
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 413
    assert requests.get(boot.url + "/query", timeout=5).json() == before
    assert len(boot.refused) >= len(bogus) + 1


def test_with_the_secret_only_signed_registrations_are_believed():
    s = bootstrap.BootstrapServer(engine_id="e", dp_size=1, tp_size=1, pp_size=1, secret=SECRET).start()
    try:
        p = RegisterPayload("e", 0, 0, 0, "tcp://127.0.0.1:7")
        with pytest.raises(bootstrap.BootstrapError, match="HTTP 403.*unsigned"):
            bootstrap.register(s.url, p, 2, wait_s=0)
        with pytest.raises(bootstrap.BootstrapError, match="HTTP 403.*bad_signature"):
            bootstrap.register(s.url, p, 2, wait_s=0, secret=b"z" * 32)
        assert bootstrap.query(s.url, 2) == {}
        bootstrap.register(s.url, p, 2, secret=SECRET)
        assert bootstrap.query(s.url, 2)[0].worker_addr == {0: {0: "tcp://127.0.0.1:7"}}
    finally:
        s.stop()


@FUZZ
@given(st.binary(max_size=2000))
def test_fuzz_registrations_never_break_the_bootstrap_server(boot, body):
    r = requests.post(boot.url + "/register", data=body, headers={"Content-Type": "application/json"}, timeout=5)
    assert 400 <= r.status_code < 500
    assert len(bootstrap.query(boot.url, 2)[0].worker_addr) == 2


def test_a_slow_drip_a_file_url_and_a_huge_answer_fail_the_bootstrap_query_within_its_deadline():
    drip = Hostile("drip", every=0.2)  # ~80 bytes: 16 s at that pace
    big = Hostile("huge", size=bootstrap.MAX_REPLY + 10)
    try:
        t0 = time.monotonic()
        with pytest.raises(bootstrap.BootstrapTimeout, match="timed out"):
            bootstrap.query(drip.url, 1.0)
        assert time.monotonic() - t0 < 2.0  # one deadline for the whole answer, not per read
        with pytest.raises(bootstrap.BootstrapError, match="longer than"):
            bootstrap.query(big.url, 5.0)
        for url in ("file:///etc/passwd", "ftp://127.0.0.1/", "gopher://x", "http://", "http://h:99999"):
            t0 = time.monotonic()
            with pytest.raises(bootstrap.BootstrapError):
                bootstrap.query(url, 5.0)
            assert time.monotonic() - t0 < 0.5
    finally:
        drip.close()
        big.close()


# ------------------------------------------------------------------ the router's HTTP server


@pytest.fixture(scope="module")
def router():
    """A real `mctier proxy` in front of instances nobody serves: what it refuses, it refuses
    before routing (no instance is ever reached)."""
    port, dead = free_port(), free_port()
    proc = Proc("sec-router", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port), "--plain",
                               f"http://127.0.0.1:{dead}", "--max-body-mb", "1", "--kv-bytes-per-token", "1",
                               "--connect-timeout", "0.5", "--health-interval", "60"],
                LOGS / f"sec-router-{port}.log", cwd=str(ROOT))
    try:
        proc.wait_port(port, 60)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop(grace=5)


def test_the_router_refuses_text_plain_oversized_and_malformed_bodies(router):
    url, _ = router
    good = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
    r = requests.post(url + "/v1/completions", data=json.dumps(good), headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    big = {"model": "m", "prompt": "x" * (1 << 20)}
    r = requests.post(url + "/v1/completions", json=big, timeout=10)
    assert r.status_code == 413
    for bad in (b"[1, 2]", b"{", b'{"prompt": [' + b"9" * 40 + b"]}", b'{"prompt": [1], "cache_salt": 5}'):
        r = requests.post(url + "/v1/chat/completions" if b"salt" in bad else url + "/v1/completions", data=bad,
                          headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code in (400, 503), (bad, r.status_code, r.text)
    assert requests.post(url + "/v1/completions", json=good, timeout=10).status_code == 503  # routed: nobody up


@FUZZ
@given(st.one_of(st.binary(max_size=500), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(
        ["prompt", "messages", "kv_transfer_params", "cache_salt", "stream", "ttft_slo_s", "x"]), c, max_size=4),
    max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_fuzz_the_router_answers_every_body_with_a_client_or_routing_error(router, body):
    url, proc = router
    r = requests.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code in (400, 413, 429, 502, 503, 504), (body[:200], r.status_code, r.text[:300])
    assert proc.alive()


# ------------------------------------------------------------------ the router's KV-event subscriber


def test_fuzz_and_oversized_kv_event_messages_leave_the_subscriber_working(tmp_path, monkeypatch):
    from multi.router import events
    from multi.router.eventwire import BlockStored, KVEventBatch
    from multi.router.index import BlockIndex, chain

    monkeypatch.setattr(events, "MAX_MSG_BYTES", 1 << 20)
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/ev"
    pub.bind(ep)
    index = BlockIndex(4)
    sub = events.EventSubscriber("inst", ep, index)
    sub.start()
    time.sleep(0.5)
    try:
        rng = random.Random(49)
        junk = [[rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 5))] for _ in range(40)]
        for frames in junk + [[b"", (1).to_bytes(8, "big"), b"\xc1\xc1"]]:
            pub.send_multipart(frames)
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\x00" * (2 << 20)])  # over MAXMSGSIZE: dropped
        time.sleep(1.0)  # the SUB reconnects after a dropped connection
        toks = [1, 2, 3, 4]
        ok = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[msgspec.Raw(msgspec.msgpack.encode(
            BlockStored(block_hashes=[b"h1"], parent_block_hash=None, token_ids=toks, block_size=4, lora_id=None,
                        medium="GPU")))]))
        deadline = time.monotonic() + 10
        seq = 3
        while index.match("inst", chain(toks, 4)) == 0 and time.monotonic() < deadline:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), ok])
            seq += 1
            time.sleep(0.2)
        assert index.match("inst", chain(toks, 4)) == 1 and sub._thread.is_alive(), str(sub.stats())
        st_ = sub.stats()
        assert st_["malformed"] + st_["decode_errors"] >= 1
    finally:
        sub.stop()
        pub.close(0)


# ------------------------------------------------------------------ processes


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_sigkilled_mctier_master_leaves_no_process_and_a_held_port_is_named():
    """`mctier master` (master + store server) SIGKILLed: its children die with it. A start on
    a port something still holds fails at once naming the holder."""
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "multi.cli", "master", "--port", str(port), "--metrics-port", str(metrics),
            "--segment-size", "32MB", "--log-dir", str(LOGS)]
    wrapper = Proc("sec-master", argv, LOGS / f"sec-master-{port}.log", cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C stops everything" not in wrapper.tail() and time.monotonic() < deadline:
            assert wrapper.alive(), wrapper.tail()
            time.sleep(0.2)
        kids = _tree(wrapper.pid)
        names = sorted(p.name() for p in kids)
        assert any("mooncake_master" in n for n in names) and len(kids) >= 2, names
        # Another start while it runs: refused, naming the holder of the port.
        r = subprocess.run(argv + ["--no-store-server"], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        assert r.returncode == 2 and f"port {port}" in r.stderr and "mooncake_master" in r.stderr, r.stderr
        os.kill(wrapper.pid, signal.SIGKILL)
        assert _gone(kids, 30) == []
    finally:
        wrapper.stop(grace=2)


def test_a_sigkilled_store_server_leaves_no_process(store_cluster):
    argv = [sys.executable, "-m", "multi.cli", "store-server", "--master", store_cluster.master_addr,
            "--segment-size", "32MB"]
    proc = Proc("sec-store-server", argv, LOGS / f"sec-store-server-{time.monotonic_ns()}.log", cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 60
        while "serving" not in proc.tail() and time.monotonic() < deadline:
            assert proc.alive(), proc.tail()
            time.sleep(0.2)
        group = [p for p in psutil.process_iter() if _pgid(p) == proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        assert _gone(group, 30) == []
    finally:
        proc.stop(grace=2)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


def test_a_child_started_to_die_with_its_parent_does_even_after_sigkill():
    code = ("import sys, time; from kvcore.procs import Proc; "
            "p = Proc('sleeper', [sys.executable, '-c', 'import time; time.sleep(300)'], sys.argv[1], "
            "die_with_parent=True); print(p.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(LOGS / "sec-sleeper.log")], stdout=subprocess.PIPE,
                              text=True, cwd=str(ROOT), start_new_session=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _gone([child], 10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
