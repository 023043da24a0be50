"""Fault injection across both tiers: "loads never hang and never lie".

One deployment for the module: a real mooncake_master + store server, a prefill (P, core 0)
and a decode (D, core 1) engine with ``TieredConnector`` on the tiny model, ``mctier proxy``
in front, and the session's no-connector ``baseline``. Every case checks, afterwards:

* every request ended within its deadline, with the greedy token ids of the no-connector
  run with the same split (``baseline.tokens(prompt, n, cached_prefix=S)``) or a clear error;
* no block leaked: both engines' ``vllm:kv_cache_usage_perc`` is back to its idle value
  within a few seconds (prefix-cached blocks count as free);
* both engines still serve (a fresh request through the proxy matches the baseline).

Timing windows are made deterministic with real stalls, not fakes: a process frozen with
SIGSTOP is a real component that stopped making progress (the store server whose segment
a load reads; P's EngineCore, so its prefill stalls while its worker's side channel still
answers WAIT; D's EngineCore before it saw a request; D's Worker after its scheduler
looked a request up). Cases that kill a process come last (the master is restarted; P
is not). Runtime ~3 min on 2 cores (engine start ~75 s of it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import msgspec
import psutil
import pytest
import requests
import zmq

from kvcore.procs import Proc, free_port
from tests.harness import LOGS, ROOT, Engine, model_dir, prompt_ids, start_engines
from tests.store_util import raw_client

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

CHUNK = 256
TRANSFER_TIMEOUT = 4.0  # D: deadline of one handoff (P's prefill wait included)
ABORT_TIMEOUT = 300.0  # P: a leak would last this long; no test may depend on reaching it
LOAD_TIMEOUT = 15.0  # store load deadline
SAVE_RETRY = 1.0  # how long a save retries a full store
SETTLE = 10.0  # "a few seconds": blocks must be free again within this
MAX_TOKENS = 6


def tiered(role: str, master: str, bootstrap_port: int, **p2p) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store": {"master": master, "chunk_tokens": CHUNK, "load_timeout_s": LOAD_TIMEOUT,
                          "save_retry_s": SAVE_RETRY},
                "p2p": {"bootstrap_port": bootstrap_port, **p2p}}}


class Dep:
    def __init__(self, cluster, baseline):
        from mcstore.toolkeys import derive_meta

        self.cluster = cluster
        self.model = str(model_dir("tiny"))
        self.boot_port = free_port()
        self.boot = f"http://127.0.0.1:{self.boot_port}"
        self.p_kv = tiered("kv_producer", cluster.master_addr, self.boot_port, abort_timeout_s=ABORT_TIMEOUT)
        self.P = Engine("faults-P", 0, kv_config=self.p_kv)
        self.D = Engine("faults-D", 1, kv_config=tiered("kv_consumer", cluster.master_addr, free_port(),
                                                        transfer_timeout_s=TRANSFER_TIMEOUT))
        self.proxy = None
        try:
            self.meta = derive_meta(self.model, self.p_kv, block_size=32)  # while the engines boot
            baseline.tokens(prompt_ids(40, 0), 1)  # the baseline engine boots meanwhile too
            start_engines(self.P, self.D)
            port = free_port()
            self.proxy = Proc("faults-proxy", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port),
                                               "--prefill", f"{self.P.url}@{self.boot}", "--decode", self.D.url,
                                               "--timeout", "60", "--connect-timeout", "2"],
                              LOGS / f"faults-proxy-{port}.log", cwd=str(ROOT))
            self.proxy.wait_port(port, 60)
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{cluster.metrics_port}"
        self.idle = {"P": 0.0, "D": 0.0}

    def engines(self):
        return [("P", self.P), ("D", self.D)] if self.P.proc.alive() else [("D", self.D)]

    def complete(self, prompt, max_tokens=MAX_TOKENS, timeout=60, **kv) -> dict:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        if kv:
            body["kv_transfer_params"] = kv
        r = requests.post(self.url + "/v1/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def engine_id(self) -> str:
        return requests.get(self.boot + "/query", timeout=5).json()["0"]["engine_id"]

    def side_channel(self) -> str:
        return requests.get(self.boot + "/query", timeout=5).json()["0"]["worker_addr"]["0"]["0"]

    def keys(self, prompt, cache_salt=None) -> list[str]:
        ks = self.meta.key_space()
        return [ks.key(link, 0) for link in ks.links(prompt, cache_salt=cache_salt)]

    def stop(self):
        if self.proxy is not None:
            self.proxy.stop()
        for e in (self.P, self.D):
            e.stop()


@pytest.fixture(scope="module")
def cluster():
    from mcstore.server import StoreCluster

    # 64 MiB pool: small enough to fill (store-full case), ~250 tiny-model chunks otherwise.
    # A generous client TTL: a store server frozen for a few seconds must keep its segment.
    c = StoreCluster(LOGS, segment_size=64 << 20,
                     extra_flags=["--default_kv_lease_ttl=500", "--client_ttl=20"]).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def dep(cluster, baseline):
    d = Dep(cluster, baseline)
    try:
        # Warm both engines (first-request compilation), then record the idle usage.
        check_serving(d, baseline, 1)
        time.sleep(1.0)
        d.idle = {n: usage(e) for n, e in d.engines()}
        yield d
    finally:
        d.stop()


@pytest.fixture
def raw(dep):
    s = raw_client(dep.cluster.master_addr)
    yield s
    s.close()


# -- helpers -----------------------------------------------------------------------------


def usage(e: Engine) -> float:
    return e.metric("vllm:kv_cache_usage_perc")


def wait_for(pred, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    v = pred()
    while not v and time.monotonic() < deadline:
        time.sleep(step)
        v = pred()
    return v


def counter(e: Engine, name: str, **labels) -> float:
    return e.metric(f"vllm:mctier_{name}_total", **labels)


def toks(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def plan_sources(resp: dict) -> list[str]:
    return [s["source"] for s in (resp.get("kv_transfer_params") or {}).get("kv_plan", [])]


def assert_no_leak(dep: Dep) -> None:
    """Every engine's KV usage back to its idle value, nothing running or waiting."""
    for name, e in dep.engines():
        idle = dep.idle[name]
        ok = wait_for(lambda: usage(e) <= idle + 1e-9 and
                      e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") == 0, SETTLE, 0.25)
        assert ok, (f"{name} leaked blocks: kv_cache_usage {usage(e):.6f} (idle {idle:.6f}), running "
                    f"{e.metric('vllm:num_requests_running')}, waiting {e.metric('vllm:num_requests_waiting')}")


def check_serving(dep: Dep, baseline, seed: int) -> None:
    """A fresh prompt through the proxy (P -> D handoff) and one straight to D match the baseline."""
    p = prompt_ids(300, 90_000 + seed)
    r = dep.complete(p)
    assert toks(r) == baseline.tokens(p, MAX_TOKENS), "proxied request after the fault"
    q = prompt_ids(120, 91_000 + seed)
    assert dep.D.tokens(q, MAX_TOKENS) == baseline.tokens(q, MAX_TOKENS), "D after the fault"


def recovered(dep: Dep, baseline, seed: int) -> None:
    assert_no_leak(dep)
    if dep.P.proc.alive():
        check_serving(dep, baseline, seed)
    else:
        q = prompt_ids(120, 92_000 + seed)
        assert dep.D.tokens(q, MAX_TOKENS) == baseline.tokens(q, MAX_TOKENS), "D after the fault"
    assert_no_leak(dep)


def engine_core(e: Engine) -> psutil.Process:
    """The engine's EngineCore process (the scheduler; the worker is its own process)."""
    for c in psutil.Process(e.proc.pid).children(recursive=True):
        try:
            if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()):
                return c
        except psutil.Error:
            continue
    raise RuntimeError(f"no EngineCore process under {e.name} (pid {e.proc.pid})")


def engine_worker(e: Engine) -> psutil.Process:
    """The engine's Worker process (model runner and the connectors' worker side)."""
    for c in psutil.Process(e.proc.pid).children(recursive=True):
        try:
            title = c.name() + " " + " ".join(c.cmdline())
        except psutil.Error:
            continue
        if "Worker" in title and "EngineCore" not in title:
            return c
    raise RuntimeError(f"no Worker process under {e.name} (pid {e.proc.pid})")


@contextmanager
def frozen(pid: int):
    """SIGSTOP a process (a real peer that stops answering); SIGCONT on exit, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class Call(threading.Thread):
    """A request on a thread: result or exception, and how long it took."""

    def __init__(self, fn, *args, **kw):
        super().__init__(daemon=True)
        self.fn, self.args, self.kw = fn, args, kw
        self.result = self.error = None
        self.took = None

    def run(self):
        t0 = time.monotonic()
        try:
            self.result = self.fn(*self.args, **self.kw)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        self.took = time.monotonic() - t0

    def get(self, timeout: float):
        self.join(timeout)
        assert not self.is_alive(), f"request still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def raw_post(e: Engine, body: dict) -> socket.socket:
    """A streaming completion on a raw socket; closing the socket is a client disconnect."""
    data = json.dumps({"model": "m", "temperature": 0, "ignore_eos": True, "stream": True, **body})
    s = socket.create_connection(("127.0.0.1", e.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


def save_prefix(dep: Dep, prefix: list[int], tail_seed: int, timeout: float = 20) -> None:
    """P serves ``prefix`` + a tail (prefill only) and its full chunks reach the store."""
    from tests.store_util import all_keys

    saved = counter(dep.P, "store_saved_tokens")
    keys0 = all_keys(dep.cluster)
    dep.P.complete(prefix + prompt_ids(20, tail_seed), 1)
    n = len(prefix) // CHUNK * CHUNK
    assert wait_for(lambda: counter(dep.P, "store_saved_tokens") >= saved + n, timeout), "prefix not saved"
    new = all_keys(dep.cluster) - keys0
    assert set(dep.keys(prefix)) <= new | keys0, f"tool keys {dep.keys(prefix)} are not the engine's {sorted(new)}"
    assert wait_for(lambda: Inspect(dep).hit(prefix) == n, 10), "saved chunks not visible in the store"


class Inspect:
    def __init__(self, dep: Dep):
        from mcstore.inspect import Inspector

        self.insp = Inspector(dep.cluster.master_addr, dep.admin, dep.meta)

    def hit(self, tokens, cache_salt=None) -> int:
        return self.insp.lookup(tokens, cache_salt=cache_salt).hit_tokens


def d_store(dep: Dep, prompt, **body) -> dict:
    """Straight to D, forcing the store as the source of the prefix."""
    return dep.D.complete(prompt, MAX_TOKENS, timeout=LOAD_TIMEOUT + 30,
                          kv_transfer_params={"kv_source": "store"}, **body)


def load_outcome(dep: Dep, before: tuple[float, float], timeout: float = 10) -> tuple[float, float]:
    """(tokens loaded from the store, store load failures) on D since ``before``."""
    wait_for(lambda: d_load_counters(dep) != before, timeout)
    time.sleep(0.3)  # a second counter of the same load may arrive one step later
    a = d_load_counters(dep)
    return a[0] - before[0], a[1] - before[1]


def d_load_counters(dep: Dep) -> tuple[float, float]:
    return counter(dep.D, "store_loaded_tokens"), counter(dep.D, "store_failures")


def assert_interrupted_load_ended(dep: Dep, baseline, call, before: tuple[float, float], prompt) -> None:
    """A store load cut by a fault: the request ended within its deadline, either every chunk
    arrived or the load failed (whole chunks only), and the tokens are those of that split."""
    r = call.get(LOAD_TIMEOUT + 30)
    assert call.took < LOAD_TIMEOUT + 10
    loaded, failed = load_outcome(dep, before)
    assert loaded in (0, CHUNK, 2 * CHUNK) and (loaded == 2 * CHUNK or failed == 1), (loaded, failed)
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS, cached_prefix=int(loaded))


# -- 6. bad input: kv_transfer_params, side channel, bootstrap ------------------------------


def test_malformed_kv_transfer_params(dep, baseline):
    eid = dep.engine_id()
    bad_d = [
        {"do_remote_prefill": True, "transfer_id": 5, "remote_engine_id": eid, "remote_bootstrap_addr": dep.boot},
        {"do_remote_prefill": True, "remote_engine_id": eid, "remote_bootstrap_addr": dep.boot},  # no transfer_id
        {"do_remote_prefill": "yes", "transfer_id": ["x"], "remote_engine_id": None, "remote_bootstrap_addr": 7},
        {"do_remote_prefill": True, "transfer_id": "faults-unknown-engine", "remote_engine_id": "no-such-engine",
         "remote_bootstrap_addr": dep.boot},
        {"do_remote_prefill": True, "transfer_id": "faults-no-hold", "remote_engine_id": eid,
         "remote_bootstrap_addr": dep.boot},  # valid shape, but P never prefilled it
        {"kv_source": 42},
        {"kv_source": "bogus"},
        {"kv_source": "p2p"},  # forced, but nothing to pull
    ]
    bad_p = [{"do_remote_decode": True, "transfer_id": 12}, {"do_remote_decode": True},
             {"do_remote_decode": "no", "transfer_id": {"a": 1}}]
    invalid0 = counter(dep.D, "p2p_failures", kind="invalid_params")
    boot0 = counter(dep.D, "p2p_failures", kind="bootstrap")
    opened0 = counter(dep.P, "p2p_holds", kind="opened")
    for i, params in enumerate(bad_d + bad_p):
        e = dep.D if i < len(bad_d) else dep.P
        p = prompt_ids(200 + 10 * i, 1000 + i)
        t0 = time.monotonic()
        r = requests.post(e.url + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": params})
        took = time.monotonic() - t0
        assert took < TRANSFER_TIMEOUT + 10, (params, took)
        if r.status_code == 200:
            assert toks(r.json()) == baseline.tokens(p, MAX_TOKENS), params
        else:
            assert r.status_code == 400 and r.json()["error"]["message"], (params, r.status_code, r.text)
    # A non-object kv_transfer_params is refused by the server, or ignored; never a crash.
    p = prompt_ids(64, 1100)
    r = requests.post(dep.D.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": "garbage"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert toks(r.json()) == baseline.tokens(p, MAX_TOKENS)
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="invalid_params") >= invalid0 + 2, 10)
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="bootstrap") >= boot0 + 1, 10)
    assert counter(dep.P, "p2p_holds", kind="opened") == opened0  # P held nothing for malformed params
    recovered(dep, baseline, 6)


def test_side_channel_garbage_is_rejected_and_counted(dep, baseline):
    from p2p.protocol import PullDone, PullReply, PullRequest, Status, decode_to_decode, encode

    rej = lambda k: counter(dep.P, "p2p_rejected", kind=k)  # noqa: E731
    before = {k: rej(k) for k in ("undecodable", "unknown_transfer", "tp_mismatch")}
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(dep.side_channel())
    try:
        for junk in (b"", b"\x00\xffgarbage", msgspec.msgpack.encode({"foo": 1}),
                     msgspec.msgpack.encode({"type": "pull", "transfer_id": 7})):
            s.send(junk)
        s.send_multipart([b"two", b"frames"])
        s.send(encode(PullDone("faults-nope", "r", True)))
        s.send(encode(PullRequest("faults-nope", "r", 0, 1, 0, 4, wait_s=0.0)))
        s.send(encode(PullRequest("faults-nope-tp", "r", 0, 8, 0, 4, wait_s=0.0)))
        replies = []
        deadline = time.monotonic() + 5
        while len(replies) < 3 and time.monotonic() < deadline:
            if s.poll(200):
                replies.append(decode_to_decode(s.recv()))
    finally:
        s.close(0)
    errors = sorted(r.transfer_id for r in replies if isinstance(r, PullReply) and r.status == Status.ERROR)
    assert errors == ["faults-nope", "faults-nope-tp"], replies  # answered, at once, not held open
    # Counters reach /metrics with P's next step: a handoff, which must still work.
    p = prompt_ids(400, 1200)
    r = dep.complete(p)
    assert "p2p" in plan_sources(r) and toks(r) == baseline.tokens(p, MAX_TOKENS)
    assert wait_for(lambda: rej("undecodable") >= before["undecodable"] + 4, 10), rej("undecodable")
    assert wait_for(lambda: rej("unknown_transfer") >= before["unknown_transfer"] + 2, 10), rej("unknown_transfer")
    assert rej("tp_mismatch") >= before["tp_mismatch"] + 1
    recovered(dep, baseline, 61)


def test_bootstrap_register_conflict_is_refused(dep, baseline):
    q0 = requests.get(dep.boot + "/query", timeout=5).json()
    eid, addr = q0["0"]["engine_id"], q0["0"]["worker_addr"]["0"]["0"]
    cases = [
        {"engine_id": "intruder", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:1"},
        {"engine_id": eid, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:2"},
        {"engine_id": eid},
        {"engine_id": eid, "dp_rank": "zero", "tp_rank": 0, "pp_rank": 0, "addr": addr},
    ]
    for body in cases:
        r = requests.post(dep.boot + "/register", json=body, timeout=5)
        assert r.status_code == 400 and r.json()["detail"], (body, r.status_code, r.text)
    r = requests.post(dep.boot + "/register", data=b"{not json", timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    # An identical retry of the real registration is fine; the table is unchanged.
    assert requests.post(dep.boot + "/register", timeout=5, json={
        "engine_id": eid, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr}).status_code == 200
    assert requests.get(dep.boot + "/query", timeout=5).json() == q0
    p = prompt_ids(350, 1300)
    r = dep.complete(p)
    assert "p2p" in plan_sources(r) and toks(r) == baseline.tokens(p, MAX_TOKENS)
    recovered(dep, baseline, 62)


# -- isolation ------------------------------------------------------------------------------


def test_cache_salt_isolates_tenants(dep, baseline):
    prefix = prompt_ids(2 * CHUNK, 1400)
    saved = counter(dep.P, "store_saved_tokens")
    dep.P.complete(prefix + [5, 6, 7], 1, cache_salt="tenant-a")
    assert wait_for(lambda: counter(dep.P, "store_saved_tokens") >= saved + 2 * CHUNK, 20)
    insp = Inspect(dep)
    assert insp.hit(prefix, cache_salt="tenant-a") == 2 * CHUNK
    assert insp.hit(prefix, cache_salt="tenant-b") == 0
    assert insp.hit(prefix) == 0
    miss, hit = prefix + prompt_ids(100, 1401), prefix + prompt_ids(100, 1402)
    for salt, expect, prompt in (("tenant-b", 0, miss), (None, 0, miss), ("tenant-a", 2 * CHUNK, hit)):
        before = d_load_counters(dep)
        body = {"cache_salt": salt} if salt else {}
        r = d_store(dep, prompt, **body)
        loaded, failed = load_outcome(dep, before, timeout=3 if expect == 0 else 10)
        assert (loaded, failed) == (expect, 0), (salt, loaded, failed)
        assert toks(r) == baseline.tokens(prompt, MAX_TOKENS, cached_prefix=expect), salt
    # The inspection server binds loopback unless told otherwise (its refusal of destructive
    # calls without the token is tests/test_tools.py::test_http_refuses_and_rejects).
    import argparse

    from mcstore.inspect_cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["inspect", "serve", "--master", dep.cluster.master_addr])
    assert args.host == "127.0.0.1" and args.token is None


# -- 5. a foreign object of the wrong size under the engine's key -----------------------------


def test_wrong_size_object_under_engine_key(dep, baseline, raw):
    prefix = prompt_ids(3 * CHUNK, 1500)
    save_prefix(dep, prefix, 1501)
    keys = dep.keys(prefix)
    assert raw.batch_is_exist(keys) == [1, 1, 1]
    assert raw.remove(keys[1], True) == 0
    assert raw.put(keys[1], b"\x07" * 1000) == 0  # a foreign writer, wrong size
    assert Inspect(dep).hit(prefix) == 3 * CHUNK  # the store still "has" all three chunks
    prompt = prefix + prompt_ids(150, 1502)
    before = d_load_counters(dep)
    t0 = time.monotonic()
    r = d_store(dep, prompt)
    assert time.monotonic() - t0 < LOAD_TIMEOUT + 10
    loaded, failed = load_outcome(dep, before)
    assert (loaded, failed) == (CHUNK, 1), (loaded, failed)  # chunk 0 used, 1-2 recomputed
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS, cached_prefix=CHUNK)
    raw.remove(keys[1], True)
    recovered(dep, baseline, 5)


# -- 4. chunks gone between lookup and load ------------------------------------------------


def test_chunks_removed_between_lookup_and_load(dep, baseline, raw):
    """D's scheduler looks the prompt up (both chunks present), then the objects disappear
    before D's worker loads them: chunk 0 by an ordinary remove (the master refuses it while
    a read lease is live; the lookup takes none and the lease TTL is 0.5 s), chunk 1 by a
    forced remove. The window is held open deterministically: D's worker process is frozen,
    so the step that carries the load waits in it while the scheduler has already decided."""
    prefix = prompt_ids(2 * CHUNK, 1610)
    save_prefix(dep, prefix, 1611)
    keys = dep.keys(prefix)
    prompt = prefix + prompt_ids(90, 1612)
    before = d_load_counters(dep)
    hits0 = counter(dep.D, "store_lookups", kind="hit")
    with frozen(engine_worker(dep.D).pid):
        c = Call(d_store, dep, prompt)
        c.start()
        time.sleep(1.0)  # looked up (the master answered); the load sits in the frozen worker's step
        time.sleep(0.6)  # past any read lease
        assert raw.remove(keys[0], False) == 0
        assert raw.remove(keys[1], True) == 0
    r = c.get(LOAD_TIMEOUT + 30)
    assert c.took < LOAD_TIMEOUT + 10
    loaded, failed = load_outcome(dep, before)
    assert wait_for(lambda: counter(dep.D, "store_lookups", kind="hit") >= hits0 + 1, 5), "not a hit at lookup"
    assert (loaded, failed) == (0, 1), f"loaded {loaded} tokens, {failed} failed loads"
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)  # recomputed from scratch
    recovered(dep, baseline, 4)


def test_read_lease_expires_during_a_slow_load(dep, baseline):
    """The store server that owns the bytes stalls mid-read for longer than the master's read
    lease (0.5 s): the read cannot be trusted (the object may have been evicted and its memory
    reused), so the load fails and the tokens are recomputed; nothing waits past the deadline."""
    prefix = prompt_ids(2 * CHUNK, 1620)
    save_prefix(dep, prefix, 1621)
    prompt = prefix + prompt_ids(90, 1622)
    before = d_load_counters(dep)
    with frozen(dep.cluster.server.pid):
        c = Call(d_store, dep, prompt)
        c.start()
        time.sleep(2.0)
    assert_interrupted_load_ended(dep, baseline, c, before, prompt)
    recovered(dep, baseline, 41)


# -- 3. store full ---------------------------------------------------------------------------


def test_store_full_for_a_sustained_period(dep, baseline, raw):
    from mooncake.store import ReplicateConfig

    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    fill, codes = [], []
    # Rounds until a round adds nothing: the master evicts unpinned (engine) objects when
    # full, so space comes back for a while after the first -200.
    for rnd in range(8):
        added = 0
        for size in (4 << 20, 1 << 20, 256 << 10, 64 << 10):
            data = b"\x5a" * size
            for i in range(200):
                key = f"faults-fill/{rnd}/{size}/{i}"
                rc = raw.put(key, data, cfg)
                if rc != 0:
                    codes.append(rc)
                    break
                fill.append(key)
                added += 1
        if added == 0:
            break
        time.sleep(1.5)
    assert fill and -200 in codes, f"could not fill the pool: {len(fill)} objects, codes {codes}"
    nospace0 = counter(dep.P, "store_failures", kind="save_no_space")
    saved0 = counter(dep.P, "store_saved_tokens")
    try:
        t_end = time.monotonic() + 4.0  # sustained: several saves, each retrying for SAVE_RETRY
        i = 0
        while time.monotonic() < t_end or i < 3:
            p = prompt_ids(2 * CHUNK + 40, 1700 + i)
            if i % 2:
                r = dep.complete(p)
                assert toks(r) == baseline.tokens(p, MAX_TOKENS)
            else:
                assert dep.P.tokens(p, MAX_TOKENS) == baseline.tokens(p, MAX_TOKENS)
            i += 1
        assert wait_for(lambda: counter(dep.P, "store_failures", kind="save_no_space") >= nospace0 + 2, 15)
        assert counter(dep.P, "store_saved_tokens") == saved0  # nothing got in while full
        assert_no_leak(dep)  # dropped saves released their blocks
    finally:
        rcs = raw.batch_remove(fill, True)
    assert all(rc == 0 for rc in rcs), rcs
    # Room again: saves and hits resume.
    prefix = prompt_ids(2 * CHUNK, 1750)
    save_prefix(dep, prefix, 1751)
    prompt = prefix + prompt_ids(80, 1752)
    before = d_load_counters(dep)
    r = d_store(dep, prompt)
    assert load_outcome(dep, before) == (2 * CHUNK, 0)
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS, cached_prefix=2 * CHUNK)
    recovered(dep, baseline, 3)


# -- 7. a peer slower than the transfer deadline ---------------------------------------------


def test_prefill_slower_than_transfer_deadline(dep, baseline):
    """P stalls (its engine core frozen: neither prefill nor side channel make progress) for
    longer than D's transfer_timeout_s. D gives up at its deadline and recomputes; when P
    resumes and finishes the prefill, it must not hold the blocks for ABORT_TIMEOUT."""
    eid = dep.engine_id()
    prompt = prompt_ids(700, 1800)
    tid = "faults-slow-1"
    timeouts0 = counter(dep.D, "p2p_failures", kind="timeout") + counter(dep.D, "p2p_failures", kind="peer")
    expired0 = counter(dep.P, "p2p_holds", kind="expired")
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = dep.D.complete(prompt, MAX_TOKENS, timeout=60, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"})
        took = time.monotonic() - t0
        time.sleep(1.0)  # P stays stalled a little past D's deadline
    assert TRANSFER_TIMEOUT - 0.5 < took < TRANSFER_TIMEOUT + 8, took
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)
    assert plan_sources(r)[0] == "p2p"  # it was planned as a pull, and fell back
    cp.get(60)  # P's own request ends once it resumes
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="timeout") + counter(dep.D, "p2p_failures", kind="peer")
                    >= timeouts0 + 1, 10)
    recovered(dep, baseline, 7)  # P's blocks free within SETTLE, not at ABORT_TIMEOUT
    assert counter(dep.P, "p2p_holds", kind="expired") == expired0


# -- 2b. decode request aborted by its client -----------------------------------------------


def test_decode_aborted_before_its_pull_was_scheduled(dep, baseline):
    """P finished and holds the blocks; the client of the decode request disconnects before D's
    scheduler ever saw the request (D's engine core frozen meanwhile): D must tell P to let go."""
    eid = dep.engine_id()
    prompt = prompt_ids(600, 1900)
    tid = "faults-abort-before"
    freed = lambda: (counter(dep.P, "p2p_holds", kind="released")  # noqa: E731
                     + counter(dep.P, "p2p_holds", kind="early_release"))
    freed0 = freed()
    dep.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    assert wait_for(lambda: usage(dep.P) > dep.idle["P"], 10), "P does not hold the prefill's blocks"
    with frozen(engine_core(dep.D).pid):
        s = raw_post(dep.D, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"}})
        time.sleep(0.5)
        s.close()
        time.sleep(0.5)
    assert wait_for(lambda: freed() >= freed0 + 1, SETTLE), "P still holds the aborted request's blocks"
    recovered(dep, baseline, 21)


def test_decode_aborted_after_its_pull_was_scheduled(dep, baseline):
    """D scheduled the pull and waits for P (stalled mid-prefill) when the client disconnects;
    P then finishes. Neither side may keep the blocks."""
    eid = dep.engine_id()
    prompt = prompt_ids(800, 1950)
    tid = "faults-abort-after"
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        s = raw_post(dep.D, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"}})
        assert wait_for(lambda: usage(dep.D) > dep.idle["D"], 5), "D did not allocate blocks for the pull"
        time.sleep(0.3)
        s.close()
        time.sleep(0.7)
    cp.get(60)
    recovered(dep, baseline, 22)


# -- 1. the master dies during a load and during a save; restarted later ----------------------


def test_master_killed_during_load_and_save_then_restarted(dep, baseline, cluster, raw):
    prefix = prompt_ids(2 * CHUNK, 2000)
    save_prefix(dep, prefix, 2001)
    raw.close()  # the raw client goes with the master

    # During a load: D looked the prefix up and is reading it (from the frozen store server)
    # when the master is SIGKILLed.
    prompt = prefix + prompt_ids(100, 2002)
    before = d_load_counters(dep)
    with frozen(cluster.server.pid):
        c = Call(d_store, dep, prompt)
        c.start()
        time.sleep(0.8)
        cluster.stop_master(sig=signal.SIGKILL)
    assert_interrupted_load_ended(dep, baseline, c, before, prompt)
    recovered(dep, baseline, 11)

    # During a save: P's put session started (the master allocated space) and its bytes are
    # being written to the frozen store server when the master is SIGKILLed again.
    cluster.restart_master()
    assert wait_for(lambda: _saves_work(dep, 2010), 60, 2.0), "saves did not resume after the master restart"
    prompt = prompt_ids(3 * CHUNK + 50, 2020)
    with frozen(cluster.server.pid):
        c = Call(dep.P.complete, prompt, MAX_TOKENS)
        c.start()
        time.sleep(0.8)
        cluster.stop_master(sig=signal.SIGKILL)
    r = c.get(60)
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)
    recovered(dep, baseline, 12)  # the failed save released P's blocks

    # Master back: saves and hits resume, eventually. (The first RPC of each Mooncake client
    # after a restart fails with -900 and the store server's segment comes back a little
    # later: those saves are skipped and those loads recomputed, so allow attempts for 90 s.)
    cluster.restart_master()
    assert wait_for(lambda: _saves_work(dep, 2030), 60, 2.0), "saves did not resume after the master restart"
    outcomes = []
    deadline = time.monotonic() + 90
    for attempt in range(20):
        if time.monotonic() > deadline:
            break
        prefix = prompt_ids(2 * CHUNK, 2040 + 10 * attempt)
        try:
            save_prefix(dep, prefix, 2041 + 10 * attempt, timeout=10)
        except AssertionError as e:  # the store server's segment may not be back yet
            outcomes.append(("not saved", str(e).splitlines()[0]))
            time.sleep(2)
            continue
        prompt = prefix + prompt_ids(60, 2042 + 10 * attempt)
        before = d_load_counters(dep)
        r = d_store(dep, prompt)
        loaded, failed = load_outcome(dep, before)
        outcomes.append((loaded, failed))
        assert toks(r) == baseline.tokens(prompt, MAX_TOKENS, cached_prefix=int(loaded))
        if (loaded, failed) == (2 * CHUNK, 0):
            break
    assert outcomes[-1] == (2 * CHUNK, 0), f"store hits did not resume: {outcomes}"
    recovered(dep, baseline, 13)


_probe_seq = [0]


def _saves_work(dep: Dep, seed: int) -> bool:
    _probe_seq[0] += 1
    p = prompt_ids(CHUNK + 10, seed * 100 + _probe_seq[0])
    saved = counter(dep.P, "store_saved_tokens")
    dep.P.complete(p, 1)
    return bool(wait_for(lambda: counter(dep.P, "store_saved_tokens") > saved, 3))


# -- 2a. the prefill instance dies mid-handoff (last: P is not restarted) ---------------------


def test_prefill_killed_mid_handoff(dep, baseline):
    eid = dep.engine_id()
    prompt = prompt_ids(900, 2100)
    tid = "faults-kill-p"
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        cd = Call(dep.D.complete, prompt, MAX_TOKENS, timeout=60, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"})
        cd.start()
        assert wait_for(lambda: usage(dep.D) > dep.idle["D"], 5), "D did not start its pull"
        dep.P.proc.kill()  # SIGKILL the whole prefill process group, mid-handoff
    r = cd.get(TRANSFER_TIMEOUT + 30)
    assert cd.took < TRANSFER_TIMEOUT + 10, cd.took
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)
    cp.join(30)
    assert cp.error is not None  # P's own client sees the failure, it does not hang
    assert dep.D.proc.alive()
    recovered(dep, baseline, 2)
