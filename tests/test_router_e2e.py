"""The KV-aware router (``mctier proxy --policy kv``) on real engines.

A real mooncake_master and store server; two prefill instances and a decode instance
with ``TieredConnector`` (the tiny model, store chunks of 256 tokens, whole chunks only), each publishing
vLLM's KV events over ZMQ; the router with the exact store view (``--store``) and
the events (``--kv-events``), its cost model on its priors (``calibrate: false``, so
the routes do not depend on this machine's speed) with the decode instance's compute
always weighed (``idle_compute_s: 0``) and prefill instances only prefilling
(``--no-direct-to-prefill``: the routes under test are the handoff and the decode
instance); and the session's no-connector reference engine (``conftest.baseline``). Every
answer's greedy ids equal the reference's for the same computation (``reference_tokens``:
the passes that produced the KV it reused, then the prompt).

One more router, ``test_start_up_probe_seeds_estimates_that_match_this_machine``, learns
(the default ``PolicyConfig``) and starts with its probe (``multi.router.probe``).

Prompts have ``N - 1`` a multiple of the block size: a handed-off request's decode
instance computes exactly the last token, which the reference repeats.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time

import pytest
import requests

from kvcore.procs import Proc, free_port
from tests.harness import LOGS, ROOT, Engine, prompt_ids, reference_tokens, start_engines, start_proxy
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 256
# On its priors; and every compute on the decode instance weighed 1.5x, idle or not
# (``idle_compute_s: 0``; the connector's ``local_compute_weight``, named because the router's
# own default is 1), as on a decode instance serving a batch: otherwise the idle decode
# instance here would take these short prompts itself and no handoff route would be tested.
POLICY_FIELDS = {"calibrate": False, "idle_compute_s": 0.0, "local_compute_weight": 1.5}
POLICY = json.dumps(POLICY_FIELDS)
IPC_DIR = tempfile.mkdtemp(prefix="mct-ipc-")


def tiered(role: str, master: str, bootstrap_port: int) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            # Whole chunks only (no partial hits): a prefix shorter than a chunk stays out of the
            # store, so a prefill's own cache is the only place these tests' prefixes are.
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK, "load_timeout_s": 20,
                                                    "partial_hits": False},
                                          "p2p": {"bootstrap_port": bootstrap_port, "transfer_timeout_s": 30.0},
                                          "policy": POLICY_FIELDS}}


def events_args(name: str) -> list[str]:
    """vLLM's ZMQ KV event publisher on an ``ipc://`` socket the engine binds (no network
    listener; the router finds it through ``/kv_event_sources``) and a loopback replay port."""
    path = os.path.join(IPC_DIR, f"{name}.events")  # short: a unix socket path has ~107 bytes
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}",
           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return ["--kv-events-config", json.dumps(cfg)]


class Routed:
    def __init__(self, cluster, base: Engine):
        self.master = cluster.master_addr
        self.boot = {"p1": free_port(), "p2": free_port()}
        ev = {k: events_args(f"router-{k}") for k in ("p1", "p2", "d")}
        self.p1 = Engine("router-P1", core=0, kv_config=tiered("kv_producer", self.master, self.boot["p1"]),
                         extra_args=ev["p1"], dev_mode=True)
        self.p2 = Engine("router-P2", core=1, kv_config=tiered("kv_producer", self.master, self.boot["p2"]),
                         extra_args=ev["p2"], dev_mode=True)
        self.d = Engine("router-D", core=1, kv_config=tiered("kv_consumer", self.master, free_port()),
                        extra_args=ev["d"])
        start_engines(self.p1, self.p2, self.d)
        self.base = base  # the session's no-connector engine (tiny, core 0): not started or stopped here
        self.decision_log = os.path.join(IPC_DIR, "decisions.jsonl")
        self.proxy, self.url = self.router("router", extra=["--decision-log", self.decision_log])
        self.idle = {e.name: e.metric("vllm:kv_cache_usage_perc") for e in self.engines()}

    def engines(self) -> list[Engine]:
        return [self.p1, self.p2, self.d]

    def prefill_specs(self) -> list[str]:
        return [f"{self.p1.url}@http://127.0.0.1:{self.boot['p1']}", f"{self.p2.url}@http://127.0.0.1:{self.boot['p2']}"]

    def router(self, name: str, health_interval: float = 1.0, extra: list[str] | None = None):
        return start_proxy(name, self.prefill_specs(), self.d.url, 120, policy="kv", wait_s=60,
                           extra=["--store", self.master, "--policy-config", POLICY, "--no-direct-to-prefill",
                                  "--health-interval", str(health_interval), *(extra or [])])

    def complete(self, prompt, max_tokens=8, url=None, headers=None, **body) -> requests.Response:
        payload = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "return_token_ids": True, **body}
        return requests.post((url or self.url) + "/v1/completions", json=payload, headers=headers, timeout=120)

    def router_metric(self, name: str, url=None, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get((url or self.url) + "/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def decisions(self) -> list[dict]:
        with open(self.decision_log) as f:
            return [json.loads(x) for x in f]

    def decision(self, n: int, after: int, timeout: float = 10) -> dict:
        """The first record past the ``after`` earlier ones for a prompt of ``n`` tokens. The
        router writes it when the answer ends, which for a stream is just after the client
        has read ``[DONE]``: a reader polls for it."""
        found: list[dict] = []

        def newest() -> bool:
            found[:] = [d for d in self.decisions()[after:] if d["n"] == n][:1]
            return bool(found)
        assert wait_for(newest, timeout), f"no decision record for a {n}-token prompt within {timeout}s"
        return found[0]

    def served(self) -> dict[str, float]:
        """Prompt tokens each engine has been asked to process so far."""
        return {e.name: e.metric("vllm:prompt_tokens_total") for e in self.engines()}

    def assert_idle(self) -> None:
        for e in self.engines():
            ok = wait_for(lambda: e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") == 0
                          and e.metric("vllm:kv_cache_usage_perc") <= self.idle[e.name] + 1e-9, 15, 0.25)
            assert ok, f"{e.name} not idle: usage {e.metric('vllm:kv_cache_usage_perc')} (idle {self.idle[e.name]})"

    def stop(self) -> None:
        self.proxy.stop()
        for e in self.engines():
            e.stop()


@pytest.fixture(scope="module")
def rt(store_cluster, baseline):
    r = Routed(store_cluster, baseline.engine())
    yield r
    r.stop()


def plan(resp: dict) -> list[tuple[int, int, str]]:
    return [(s["start"], s["end"], s["source"]) for s in (resp.get("kv_transfer_params") or {}).get("kv_plan", [])]


def assert_fresh_prompt_tokens(rt: Routed, prompt: list[int], resp: dict) -> None:
    """A prompt nothing had cached, answered either through a handoff (``[0, N-1)`` from the
    prefill instance, the last token on D) or whole on D: the reference's ids for that split."""
    n, got = len(prompt), plan(resp)
    assert got in ([(0, n - 1, "p2p"), (n - 1, n, "recompute")], [(0, n, "recompute")]), got
    cached = n - 1 if got[0][2] == "p2p" else 0
    assert resp["choices"][0]["token_ids"] == reference_tokens(rt.base, prompt, 8, cached_prefix=cached,
                                                               writers=[prompt] if cached else None)


def test_prefix_only_in_one_prefill_cache_goes_to_that_instance(rt):
    prefix = prompt_ids(6 * 32, 9101)  # less than one store chunk: never in the store
    warm = prefix + prompt_ids(40, 9102)
    rt.p2.complete(warm, 1)  # straight to P2: the router learns it from P2's KV events
    assert wait_for(lambda: rt.router_metric("mctier_router_index_blocks", view=rt.p2.url, kind="exact") >= 6, 10)
    prompt = prefix + prompt_ids(97, 9103)  # N - 1 = 288
    n = len(prompt)
    before, hits2 = rt.served(), rt.p2.metric("vllm:prefix_cache_hits_total")
    r = rt.complete(prompt)
    assert r.status_code == 200, r.text
    after = rt.served()
    assert after[rt.p2.name] - before[rt.p2.name] == n and after[rt.p1.name] == before[rt.p1.name]
    assert rt.p2.metric("vllm:prefix_cache_hits_total") - hits2 == 6 * 32
    assert rt.router_metric("mctier_router_decisions_total", route="pd", reason="prefill instance's cache") >= 1
    # The decision log says what the router knew and weighed: P2's 192 tokens, both prefill
    # instances and the decode instance alone as candidates, the handoff through P2 the cheapest.
    d = rt.decisions()[-1]
    assert (d["n"], d["kind"], d["prefill"], d["target"], d["cached_prefill"], d["status"]) == \
        (n, "pd", rt.p2.url, rt.d.url, 192, 200)
    assert set(d["candidates"]) == {f"direct {rt.d.url}", f"pd {rt.p1.url}", f"pd {rt.p2.url}"}
    assert d["predicted_s"] == min(d["candidates"].values()) == d["candidates"][f"pd {rt.p2.url}"]
    assert d["ttft_s"] is None  # not streamed: no first token seen
    assert d["prefill_s"] > 0  # the handoff's prefill request, sent to answered
    resp = r.json()
    assert plan(resp) == [(0, n - 1, "p2p"), (n - 1, n, "recompute")]
    # P2 computed warm, then the prompt after its 192 cached tokens; D computed the last token.
    want = reference_tokens(rt.base, prompt, 8, cached_prefix=n - 1, writers=[warm, prompt])
    assert resp["choices"][0]["token_ids"] == want
    rt.assert_idle()


def test_prefix_only_in_the_store_is_loaded_by_the_decode_instance(rt):
    prefix = prompt_ids(2 * CHUNK, 9201)
    warm = prefix + prompt_ids(40, 9202)
    saved = rt.p1.metric("vllm:mctier_store_saved_tokens_total")
    rt.p1.complete(warm, 1)  # P1 saves the two chunks
    assert wait_for(lambda: rt.p1.metric("vllm:mctier_store_saved_tokens_total") - saved >= 2 * CHUNK, 20)
    rt.p1.reset_prefix_cache()  # ... and forgets them: only the store holds the prefix now
    rt.p1.complete(prompt_ids(10, 9204), 1)  # vLLM publishes the AllBlocksCleared with its next step
    assert wait_for(lambda: rt.router_metric("mctier_router_index_blocks", view=rt.p1.url, kind="exact") == 0, 10)
    prompt = prefix + prompt_ids(33, 9203)  # N - 1 = 544
    before, loaded = rt.served(), rt.d.metric("vllm:mctier_store_loaded_tokens_total")
    r = rt.complete(prompt)
    assert r.status_code == 200, r.text
    after = rt.served()
    # No prefill instance worked on it: the decode instance (the only one, so the least
    # loaded) loaded the prefix from the store and computed the 33 tokens after it.
    assert after[rt.p1.name] == before[rt.p1.name] and after[rt.p2.name] == before[rt.p2.name]
    assert rt.d.metric("vllm:mctier_store_loaded_tokens_total") - loaded == 2 * CHUNK
    assert rt.router_metric("mctier_router_decisions_total", route="direct") >= 1
    resp = r.json()
    assert plan(resp) == [(0, 2 * CHUNK, "store"), (2 * CHUNK, len(prompt), "recompute")]
    want = reference_tokens(rt.base, prompt, 8, cached_prefix=2 * CHUNK, writers=[warm])
    assert resp["choices"][0]["token_ids"] == want
    rt.assert_idle()


def test_request_that_cannot_meet_its_target_gets_429_before_any_engine(rt):
    before, rejected = rt.served(), rt.router_metric("mctier_router_rejections_total")
    prompt = prompt_ids(32 * 40 + 1, 9301)
    r = rt.complete(prompt, headers={"X-TTFT-SLO": "0.0005"})
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1 and "target cannot be met" in r.json()["error"]["message"]
    r2 = rt.complete(prompt, kv_transfer_params={"ttft_slo_s": 0.0005})
    assert r2.status_code == 429
    time.sleep(0.5)
    assert rt.served() == before  # no engine saw either request
    assert rt.router_metric("mctier_router_rejections_total") - rejected == 2
    assert [(d["kind"], d["status"]) for d in rt.decisions()[-2:]] == [("reject", 429)] * 2
    bad = rt.complete(prompt, headers={"X-TTFT-SLO": "soon"})
    assert bad.status_code == 400 and "seconds" in bad.json()["error"]["message"]
    # A target the estimate meets: served, with the right tokens.
    ok = rt.complete(prompt, headers={"X-TTFT-SLO": "60"})
    assert ok.status_code == 200, ok.text
    assert_fresh_prompt_tokens(rt, prompt, ok.json())


def test_decision_log_times_a_streamed_answer_to_its_first_token(rt):
    prompt = prompt_ids(64 + 1, 9351)
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    logged = len(rt.decisions())
    t0 = time.monotonic()
    with requests.post(rt.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith(b"data:"))
        client_ttft = time.monotonic() - t0
        rest = [x for x in lines if x]
    assert b'"text"' in first and rest[-1] == b"data: [DONE]"
    d = rt.decision(len(prompt), after=logged)
    assert d["status"] == 200
    # From the router's arrival to its first streamed chunk: inside the client's own TTFT;
    # a handoff's prefill answered before it.
    assert 0 < d["ttft_s"] <= client_ttft
    assert d["prefill_s"] is None if d["kind"] == "direct" else 0 < d["prefill_s"] < d["ttft_s"]
    # The streamed ids are the reference's for the route taken: a handoff reused the prefill
    # instance's KV for all but the last prompt token.
    chunks = [json.loads(x.removeprefix(b"data: ")) for x in [first, *rest[:-1]]]
    got = [t for c in chunks for t in (c["choices"] or [{}])[0].get("token_ids") or []]
    cached = len(prompt) - 1 if d["kind"] == "pd" else 0
    assert got == reference_tokens(rt.base, prompt, 4, cached_prefix=cached, writers=[prompt] if cached else None)


def test_client_disconnect_cancels_both_sides_and_frees_blocks(rt):
    prompt = prompt_ids(32 * 40 + 1, 9401)
    body = {"model": "m", "prompt": prompt, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    host, port = rt.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    generated = rt.d.metric("vllm:generation_tokens_total")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"data:" not in got:  # the first streamed token: the decode instance is generating
            chunk = s.recv(4096)
            assert chunk, "router closed the stream"
            got += chunk
        assert wait_for(lambda: rt.d.metric("vllm:num_requests_running") >= 1, 10)
    # The client is gone: the decode request is aborted long before its 3000 tokens, and
    # every block (the decode's, any prefill hold) is free again.
    rt.assert_idle()
    # vLLM does not count aborted requests in request_success; the tokens it generated show
    # the decode request was stopped (it would have produced 3000).
    assert 0 < rt.d.metric("vllm:generation_tokens_total") - generated < 3000


def test_health_reads_each_engines_load_and_cache_size_from_its_metrics(rt):
    """The router's health read keeps only the lines of the families it uses from each
    engine's whole /metrics: its index takes each engine's cache size in blocks from them."""
    from multi.router.instances import MAX_METRICS_BYTES

    for e in rt.engines():
        text = requests.get(e.url + "/metrics", timeout=10).text
        assert len(text) < MAX_METRICS_BYTES
        info = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
        assert len(info) == 1, info
        blocks = int(info[0].split('num_gpu_blocks="')[1].split('"')[0])
        assert blocks > 0
        assert wait_for(lambda: rt.router_metric("mctier_router_index_capacity_blocks", view=e.url) == blocks, 10), \
            (rt.router_metric("mctier_router_index_capacity_blocks", view=e.url), blocks)


def test_instances_file_is_reloaded_on_sighup_and_health_readmits(rt, tmp_path):
    f = tmp_path / "instances.toml"
    f.write_text(f'[[prefill]]\nurl = "{rt.p1.url}"\nbootstrap = "http://127.0.0.1:{rt.boot["p1"]}"\n'
                 f'[[decode]]\nurl = "{rt.d.url}"\n')
    port = free_port()
    proc = Proc("router-file", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port), "--instances", str(f),
                                "--health-interval", "0.5", "--connect-timeout", "1", "--policy-config", POLICY],
                LOGS / f"router-file-{port}.log", cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_port(port, 60)
        assert set(requests.get(url + "/health", timeout=10).json()["instances"]) == {rt.p1.url, rt.d.url}
        f.write_text(f.read_text() + f'[[prefill]]\nurl = "{rt.p2.url}"\nbootstrap = "http://127.0.0.1:{rt.boot["p2"]}"\n')
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: rt.p2.url in requests.get(url + "/health", timeout=10).json()["instances"], 10)
        # A stalled instance (SIGSTOP: alive, not answering) leaves the rotation, and comes
        # back once it answers its health check again.
        os.killpg(rt.p2.proc.pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: not requests.get(url + "/health", timeout=10).json()["instances"][rt.p2.url]["healthy"], 10)
            prompt = prompt_ids(32 * 30 + 1, 9501)
            r = rt.complete(prompt, url=url)  # served by P1 or the decode instance meanwhile
            assert r.status_code == 200, r.text
            assert_fresh_prompt_tokens(rt, prompt, r.json())
        finally:
            os.killpg(rt.p2.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: requests.get(url + "/health", timeout=10).json()["instances"][rt.p2.url]["healthy"], 15)
    finally:
        proc.stop()


def test_decode_failing_after_its_prefill_releases_the_prefill_blocks_at_once(rt):
    # The decode instance stalls (SIGSTOP: alive, never answers) while the prefill finishes
    # and holds its blocks for a pull that will not come. The router's deadline ends the
    # request; the hold must be released then, not at the prefill's 480 s abort timeout.
    proc, url = start_proxy("router-release", rt.prefill_specs(), rt.d.url, 4, policy="least-outstanding",
                            extra=["--health-interval", "3600"])
    d_pgid = rt.d.proc.pid
    try:
        prompt = prompt_ids(32 * 40 + 1, 9701)

        def released():
            return sum(p.metric("vllm:mctier_p2p_holds_total", kind=k) for p in (rt.p1, rt.p2)
                       for k in ("released", "early_release"))

        before = released()
        os.killpg(d_pgid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = rt.complete(prompt, url=url)
            assert r.status_code == 504, r.text
            for p in (rt.p1, rt.p2):
                assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") <= rt.idle[p.name] + 1e-9
                                and p.metric("vllm:num_requests_running") == 0, 5, 0.1), \
                    f"{p.name} still holds blocks {time.monotonic() - t0:.1f}s after the request started"
            prom = requests.get(url + "/metrics", timeout=10).text
            assert "mctier_router_released_holds_total 1.0" in prom
            assert wait_for(lambda: released() - before == 1, 5)  # a release, not the abort timeout
        finally:
            os.killpg(d_pgid, signal.SIGCONT)
        rt.assert_idle()
    finally:
        proc.stop()


def test_prefill_instance_killed_mid_run_is_dropped_and_requests_succeed(rt):
    # A router that would not notice the kill by itself for an hour: the request's own
    # failure must take P2 out and retry on P1.
    proc, url = rt.router("router-kill", health_interval=3600)
    try:
        prefix = prompt_ids(6 * 32, 9601)
        rt.p2.complete(prefix + prompt_ids(40, 9602), 1)  # P2 is where this prefix lives
        assert wait_for(lambda: rt.router_metric("mctier_router_index_blocks", url=url, view=rt.p2.url, kind="exact") >= 6, 10)
        rt.p2.proc.kill()
        prompt = prefix + prompt_ids(4 * 32 + 1, 9603)  # N - 1 = 320
        n = len(prompt)
        r = rt.complete(prompt, url=url)
        assert r.status_code == 200, r.text
        assert rt.router_metric("mctier_router_retries_total", url=url) == 1
        health = requests.get(url + "/health", timeout=10).json()["instances"]
        assert health[rt.p2.url]["healthy"] is False and health[rt.p1.url]["healthy"] is True
        resp = r.json()
        assert plan(resp) == [(0, n - 1, "p2p"), (n - 1, n, "recompute")]
        assert resp["choices"][0]["token_ids"] == reference_tokens(rt.base, prompt, 8, cached_prefix=n - 1,
                                                                   writers=[prompt])
        for i in range(4):  # and the ones after it go to P1 (or the decode instance), all answered
            p = prompt_ids(32 * 20 + 1, 9610 + i)
            r = rt.complete(p, url=url)
            assert r.status_code == 200, r.text
            assert_fresh_prompt_tokens(rt, p, r.json())
        for e in (rt.p1, rt.d):
            assert wait_for(lambda: e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") == 0
                            and e.metric("vllm:kv_cache_usage_perc") <= rt.idle[e.name] + 1e-9, 15, 0.25)
    finally:
        proc.stop()


def test_start_up_probe_seeds_estimates_that_match_this_machine(rt):
    """A router that calibrates probes every instance before it reports healthy: each
    instance's step and per-token cost, and the handoff through each prefill instance, are
    in its /metrics; then its predicted time to first token of a short prompt is within a
    factor of 3 of the actual for the request of five that the host delayed least (the priors
    are another machine's). Not a speed assertion: the ratio of two measurements of the same
    request. Why not the median: in full runs on the bf16 class two or three of five requests to
    the prefill instance took ~0.4 s (the instance's store lookup wait peaked at 0.39 s then),
    not explained yet; a delay only lowers predicted/actual, so the largest ratio still fails
    an estimate more than 3x off in either direction."""
    log = os.path.join(IPC_DIR, "decisions-probed.jsonl")
    proc, url = start_proxy("router-probed", rt.prefill_specs(), rt.d.url, 120, policy="kv", wait_s=60,
                            extra=["--store", rt.master, "--probe-timeout", "60", "--decision-log", log])
    try:
        assert wait_for(lambda: requests.get(url + "/health", timeout=10).status_code == 200, 90, 0.5)
        health = requests.get(url + "/health", timeout=10).json()
        assert health["probe"] == "done"
        # Every instance in rotation (an earlier test of this module may have killed P2) was probed.
        up = [e for e in rt.engines() if health["instances"][e.url]["healthy"]]
        assert rt.p1 in up and rt.d in up
        for e in up:
            assert rt.router_metric("mctier_router_probe_seconds", url=url, instance=e.url, what="token") > 0
            assert rt.router_metric("mctier_router_probe_seconds", url=url, instance=e.url, what="step") >= 0
        for e in (rt.p1, rt.p2):
            if e in up:
                assert rt.router_metric("mctier_router_probe_seconds", url=url, instance=e.url, what="handoff") >= 0
        for e in up:  # the probe's requests and handoffs left nothing behind
            assert wait_for(lambda: e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting") == 0
                            and e.metric("vllm:kv_cache_usage_perc") <= rt.idle[e.name] + 1e-9, 15, 0.25), e.name
        ratios = []
        for i in range(5):
            prompt = prompt_ids(64 + 1, 9801 + i)
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
                assert r.status_code == 200
                chunks = [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines()
                          if x.startswith(b"data:") and x != b"data: [DONE]"]
            assert wait_for(lambda: os.path.exists(log) and len(open(log).read().splitlines()) > i, 10)
            with open(log) as f:
                d = [json.loads(x) for x in f][-1]
            assert d["n"] == len(prompt) and d["status"] == 200 and d["ttft_s"] > 0
            ratios.append(d["ttft_predicted_s"] / d["ttft_s"])
            got = [t for c in chunks for t in (c["choices"] or [{}])[0].get("token_ids") or []]
            cached = len(prompt) - 1 if d["kind"] == "pd" else 0
            assert got == reference_tokens(rt.base, prompt, 2, cached_prefix=cached,
                                           writers=[prompt] if cached else None)
        assert 1 / 3 <= max(ratios) <= 3, ratios
    finally:
        proc.stop()


def test_string_prompts_go_out_as_the_routers_token_ids_only_where_the_tokenizers_agree(rt, tiny_model):
    """Tokenized once (:mod:`multi.router.prompts`): the router checked every instance's
    ``/tokenize`` against its own tokenizer, and sends a string completion prompt on as its
    token ids: the ids the engine ran are the engine's own tokenization of the text, and the
    answer is the no-connector reference's for them. Against a tokenizer that is not the
    engines' (``tiny-seed1``'s), the same check on a real engine refuses to forward ids."""
    import asyncio
    import random

    import aiohttp

    from mcstore.tools.engine import Renderer
    from multi.cli.models import build
    from multi.router.instances import Pool, make
    from multi.router.prompts import Prompts
    from tests.harness import CACHE

    assert wait_for(lambda: requests.get(rt.url + "/health", timeout=10).json().get("prompts") == "token ids", 30, 0.5)
    rng = random.Random(9901)
    words = ["river", "stone", "quiet", "lamp", "orbit", "maple", "signal", "copper", "north", "paper"]
    text, local = " ".join(rng.choice(words) for _ in range(150)), Renderer(str(tiny_model))
    while len(local.text(text)) % 32 != 1:  # a handoff's prefill then computes whole blocks (the reference's)
        text += " " + rng.choice(words)
    r = rt.complete(text)
    assert r.status_code == 200, r.text
    resp = r.json()
    ids = resp["choices"][0]["prompt_token_ids"]
    own = requests.post(rt.base.url + "/tokenize", json={"model": "m", "prompt": text}, timeout=30)
    assert own.status_code == 200, own.text
    assert ids == own.json()["tokens"]
    assert_fresh_prompt_tokens(rt, ids, resp)

    async def forwards(tokenizer) -> bool:
        pool = Pool([make("plain", rt.d.url)])
        p = Prompts(tokenizer=str(tokenizer), timeout=10)
        async with aiohttp.ClientSession() as s:
            await p.load(s, pool)
            await p.verify(s, pool)
        return p.forwarding(pool, "m")

    assert asyncio.run(forwards(tiny_model))
    assert not asyncio.run(forwards(build("tiny", CACHE / "models" / "tiny-seed1", seed=1)))
