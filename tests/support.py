"""Test support shared by the test modules: polling, requests on threads, stalls of real
processes, engines' counters, and the fault-injection deployment of ``tests/test_faults_*.py``.

Engines themselves (``Engine``, prompts, reference tokens) are in ``tests/harness.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager

import psutil
import requests

from kvcore.platform import engine_dtype
from kvcore.procs import free_port
from tests.harness import LOGS, Engine, model_dir, prompt_ids, start_engines, start_proxy

# -- polling, requests on threads, process stalls -------------------------------------------


def wait_metric(fn, pred, timeout: float) -> float:
    """Poll ``fn()`` (a metric, say) every 0.2 s until ``pred`` holds for its value or
    ``timeout`` seconds passed; its last value (metrics reach /metrics a step or two late)."""
    deadline = time.monotonic() + timeout
    v = fn()
    while not pred(v) and time.monotonic() < deadline:
        time.sleep(0.2)
        v = fn()
    return v


def wait_for(pred, timeout: float = 15.0, step: float = 0.1, what: str | None = None):
    """Poll ``pred`` until it returns something truthy or ``timeout`` seconds passed; return its
    last value. With ``what``, a timeout raises ``AssertionError`` naming it instead."""
    deadline = time.monotonic() + timeout
    v = pred()
    while not v and time.monotonic() < deadline:
        time.sleep(step)
        v = pred()
    if not v and what is not None:
        raise AssertionError(f"timed out waiting for {what}")
    return v


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


def raw_post(e: Engine, body: dict) -> socket.socket:
    """A streaming completion on a raw socket; closing the socket is a client disconnect."""
    data = json.dumps({"model": "m", "temperature": 0, "ignore_eos": True, "stream": True, **body})
    s = socket.create_connection(("127.0.0.1", e.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


# -- engines' answers and counters ----------------------------------------------------------


def usage(e: Engine) -> float:
    return e.metric("vllm:kv_cache_usage_perc")


def counter(e: Engine, name: str, **labels) -> float:
    return e.metric(f"vllm:mctier_{name}_total", **labels)


def toks(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def plan_sources(resp: dict) -> list[str]:
    return [s["source"] for s in (resp.get("kv_transfer_params") or {}).get("kv_plan", [])]


# -- the fault-injection deployment ----------------------------------------------------------
#
# One per fault module (``fault_cluster`` and ``fault_deployment`` back its module-scoped
# fixtures): a real mooncake_master + store server, a prefill (P, core 0) and a decode (D,
# core 1) engine with ``TieredConnector`` on the tiny model, ``mctier proxy`` in front. The
# session's no-connector ``baseline`` gives the expected tokens.

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
    """The deployment (processes named ``{name}-P``, ``{name}-D``, ``{name}-proxy``)."""

    def __init__(self, cluster, baseline, name: str = "faults", dtype: str | None = None):
        from mcstore.tools.engine import derive_meta

        self.cluster = cluster
        self.model = str(model_dir("tiny"))
        self.dtype = engine_dtype(explicit=dtype)
        self.boot_port = free_port()
        self.boot = f"http://127.0.0.1:{self.boot_port}"
        self.p_kv = tiered("kv_producer", cluster.master_addr, self.boot_port, abort_timeout_s=ABORT_TIMEOUT)
        self.P = Engine(f"{name}-P", 0, kv_config=self.p_kv, dtype=self.dtype)
        self.D = Engine(f"{name}-D", 1, kv_config=tiered("kv_consumer", cluster.master_addr, free_port(),
                                                         transfer_timeout_s=TRANSFER_TIMEOUT), dtype=self.dtype)
        self.proxy = None
        try:
            baseline.start()  # the baseline engine (if not up yet) boots beside P and D
            self.meta = derive_meta(self.model, self.p_kv, block_size=32, dtype=self.dtype)  # while the engines boot
            baseline.tokens(prompt_ids(40, 0), 1)
            start_engines(self.P, self.D)
            self.proxy, self.url = start_proxy(f"{name}-proxy", f"{self.P.url}@{self.boot}", self.D.url, 60)
        except BaseException:
            self.stop()
            raise
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


def fault_cluster():
    """The deployment's store (a generator, for a module-scoped fixture)."""
    from mcstore.server import StoreCluster

    # 64 MiB pool: small enough to fill (store-full case), ~250 tiny-model chunks otherwise.
    # A generous client TTL: a store server frozen for a few seconds must keep its segment.
    c = StoreCluster(LOGS, segment_size=64 << 20,
                     extra_flags=["--default_kv_lease_ttl=500", "--client_ttl=20"]).start()
    yield c
    c.stop()


def fault_deployment(cluster, baseline, name: str):
    """The deployment, warmed up, its idle KV usage recorded (a generator, for a module-scoped fixture)."""
    d = Dep(cluster, baseline, name)
    try:
        # Warm both engines (first-request compilation), then record the idle usage.
        check_serving(d, baseline, 1)
        time.sleep(1.0)
        d.idle = {n: usage(e) for n, e in d.engines()}
        yield d
    finally:
        d.stop()


def assert_no_leak(dep: Dep) -> None:
    """Every engine's KV usage back to its idle value, nothing running or waiting."""
    for name, e in dep.engines():
        idle = dep.idle[name]
        ok = wait_for(lambda: usage(e) <= idle + 1e-9 and
                      e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") == 0, SETTLE, 0.25)
        assert ok, (f"{name} leaked blocks: kv_cache_usage {usage(e):.6f} (idle {idle:.6f}), running "
                    f"{e.metric('vllm:num_requests_running')}, waiting {e.metric('vllm:num_requests_waiting')}")


def check_serving(dep: Dep, baseline, seed: int) -> None:
    """A fresh prompt through the proxy (handed off, or recomputed on D when its composite finds
    that cheaper) and one straight to D match the baseline."""
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


# -- the deployment's store: saves, lookups, loads forced from the store ---------------------


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


_probe_seq = [0]


def saves_work(dep: Dep, seed: int) -> bool:
    """A fresh one-chunk prompt on P reaches the store within 3 s."""
    _probe_seq[0] += 1
    p = prompt_ids(CHUNK + 10, seed * 100 + _probe_seq[0])
    saved = counter(dep.P, "store_saved_tokens")
    dep.P.complete(p, 1)
    return bool(wait_for(lambda: counter(dep.P, "store_saved_tokens") > saved, 3))


class Inspect:
    def __init__(self, dep: Dep):
        from mcstore.tools.inspect import Inspector

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
