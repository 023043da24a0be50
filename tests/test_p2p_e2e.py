"""P2P tier end to end: real vLLM prefill (core 0) and decode (core 1) engines, the real
``mctier proxy``, greedy token ids compared with the no-connector baseline.

Order matters: the prefill instance is killed in the last test.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from kvcore.procs import Proc, free_port
from tests.harness import BLOCK, Engine, cached_tokens, kv_bytes_per_token, prompt_ids, start_proxy
from tests.support import wait_metric

pytestmark = pytest.mark.e2e

ABORT_TIMEOUT = 300.0  # P side: the tests must never depend on reaching it
TRANSFER_TIMEOUT = 30.0
SILENCE = 3.0
BOOT_TIMEOUT = 2.0
MAX_TOKENS = 8


class PD:
    def __init__(self, tmp):
        self.boot_port = free_port()
        self.corrupt_flag = tmp / "corrupt-now"
        self.P = Engine("p2p-P", 0, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"bootstrap_port": self.boot_port, "abort_timeout_s": ABORT_TIMEOUT}})
        self.D = Engine("p2p-D", 1, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"transfer_timeout_s": TRANSFER_TIMEOUT, "peer_silence_timeout_s": SILENCE,
                                          "bootstrap_timeout_s": BOOT_TIMEOUT,
                                          "debug_corrupt_received_kv": str(self.corrupt_flag)}})
        self.boot = f"http://127.0.0.1:{self.boot_port}"
        self.proxy = None

    def start_proxy(self, prefill_spec: str | None = None, timeout: float = 120) -> tuple[Proc, str]:
        return start_proxy("p2p-proxy", prefill_spec or f"{self.P.url}@{self.boot}", self.D.url, timeout, wait_s=90)

    def engine_id(self) -> str:
        return requests.get(self.boot + "/query", timeout=5).json()["0"]["engine_id"]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, baseline):
    env = PD(tmp_path_factory.mktemp("p2p"))
    try:
        baseline.tokens(prompt_ids(300, 1), MAX_TOKENS)  # boots the baseline while P and D boot
        env.P.wait_ready()
        env.D.wait_ready()
        env.proxy, env.proxy_url = env.start_proxy()
        yield env
    finally:
        if env.proxy is not None:
            env.proxy.stop(grace=5)
        env.P.stop()
        env.D.stop()


def _counter(e: Engine, name: str, kind: str) -> float:
    return e.metric(f"vllm:mctier_p2p_{name}_total", kind=kind)


def _post(url: str, path: str, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout)


def _completion(url, prompt, stream=False, **extra):
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _post(url, "/v1/completions", body)


def _stream_tokens(resp: requests.Response) -> tuple[list[int], dict]:
    toks, usage = [], {}
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for ch in ev.get("choices") or []:
            toks += ch.get("token_ids") or []
        if ev.get("usage"):
            usage = ev["usage"]
    return toks, {"usage": usage}


def _raw_post(e: Engine, body: dict) -> socket.socket:
    """Send a completion request on a raw socket; closing it is a client disconnect."""
    data = json.dumps(body)
    s = socket.create_connection(("127.0.0.1", e.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


class Saturated:
    """Fill every sequence slot of an engine (--max-num-seqs 16) with long decodes, so a
    new request deterministically waits in the queue; the fillers are aborted on exit."""

    def __init__(self, e: Engine, n: int = 16):
        self.e, self.n = e, n

    def __enter__(self):
        self.socks = [_raw_post(self.e, {"model": "m", "prompt": prompt_ids(40, 100 + i), "max_tokens": 3000,
                                         "ignore_eos": True, "stream": True}) for i in range(self.n)]
        got = wait_metric(lambda: self.e.metric("vllm:num_requests_running"), lambda v: v >= self.n, 30)
        assert got >= self.n, f"only {got} fillers running"
        return self

    def __exit__(self, *exc):
        for s in self.socks:
            s.close()
        wait_metric(lambda: self.e.metric("vllm:num_requests_running"), lambda v: v == 0, 30)


def _full_block_tokens(n: int) -> int:
    return (n // BLOCK) * BLOCK


# ------------------------------------------------------------------ happy path


def _tokens_and_body(r, stream: bool) -> tuple[list[int], dict]:
    """Greedy ids and the (last) response body of a proxied completion or chat call."""
    assert r.status_code == 200, r.text
    if stream:
        return _stream_tokens(r)
    body = r.json()
    return body["choices"][0]["token_ids"], body


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_through_proxy_match_baseline(pd, baseline, stream):
    prompt = prompt_ids(300, 1 if not stream else 2)
    want = baseline.tokens(prompt, MAX_TOKENS)
    held_before = _counter(pd.P, "holds", "released")
    ok_before = _counter(pd.D, "pulls", "ok")
    r = _completion(pd.proxy_url, prompt, stream=stream)
    toks, body = _tokens_and_body(r, stream)
    assert toks == want
    # The decode instance computed only the last prompt token: its cache covers the full blocks.
    assert cached_tokens(body) >= _full_block_tokens(len(prompt)), body.get("usage")
    assert wait_metric(lambda: _counter(pd.D, "pulls", "ok"), lambda v: v >= ok_before + 1, 10) == ok_before + 1
    assert wait_metric(lambda: _counter(pd.P, "holds", "released"), lambda v: v >= held_before + 1, 10) \
        == held_before + 1
    assert pd.D.metric("vllm:mctier_p2p_bytes_total", kind="pulled") > 0


def _chat(url, text, stream=False):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _post(url, "/v1/chat/completions", body)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_through_proxy_matches_baseline(pd, baseline, stream):
    import random

    rng = random.Random(7 + stream)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "mooncake", "decode", "prefill", "block"]
    text = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(150))
    # The prompt ids come from a plain (non-proxied) chat call on the baseline's twin: the
    # decode engine without transfer params renders the same template.
    ref = _chat(pd.D.url, text).json()
    prompt = ref["prompt_token_ids"]
    assert len(prompt) > 3 * BLOCK
    want = baseline.tokens(prompt, MAX_TOKENS)
    r = _chat(pd.proxy_url, text, stream=stream)
    toks, body = _tokens_and_body(r, stream)
    assert toks == want


def test_models_and_health(pd):
    assert requests.get(pd.proxy_url + "/v1/models", timeout=10).json()["data"][0]["id"] == "m"
    h = requests.get(pd.proxy_url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["healthy"] is True


def test_client_kv_transfer_params_reach_decode_and_response_passes_through(pd, baseline):
    # A client key (e.g. the composite's kv_source) is forwarded to the decode request;
    # the decode instance's JSON (kv_transfer_params field included) comes back untouched.
    prompt = prompt_ids(200, 3)
    r = _completion(pd.proxy_url, prompt, kv_transfer_params={"kv_source": "p2p"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == baseline.tokens(prompt, MAX_TOKENS)
    assert "kv_transfer_params" in body  # vLLM's field, passed through as the decode set it


def test_decode_pulls_only_the_blocks_it_lacks(pd, baseline):
    """D's own prefix cache already holds the first 8 blocks: it asks P for the other 4
    (the matching tail of P's block list) and the tokens are still the baseline's."""
    prompt = prompt_ids(360, 15)  # 11 full blocks + 8 tokens = 12 blocks
    pd.D.complete(prompt[:256], 1)  # D computes and caches blocks 0..7 locally
    eid = pd.engine_id()
    pd.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-partial"})
    before = pd.D.metric("vllm:mctier_p2p_bytes_total", kind="pulled")
    out = pd.D.complete(prompt, MAX_TOKENS, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": "xfer-partial", "remote_engine_id": eid,
        "remote_bootstrap_addr": pd.boot})
    assert out["choices"][0]["token_ids"] == baseline.tokens(prompt, MAX_TOKENS)
    assert cached_tokens(out) >= _full_block_tokens(len(prompt))
    block_bytes = BLOCK * kv_bytes_per_token(pd.P.model)
    pulled = wait_metric(lambda: pd.D.metric("vllm:mctier_p2p_bytes_total", kind="pulled") - before,
                          lambda v: v > 0, 10)
    assert pulled == 4 * block_bytes


# ------------------------------------------------------------------ negative control


def test_negative_control_corrupted_kv_changes_tokens(pd, baseline):
    prompt = prompt_ids(300, 4)
    want = baseline.tokens(prompt, MAX_TOKENS)
    pd.corrupt_flag.write_text("on")
    try:
        r = _completion(pd.proxy_url, prompt)
    finally:
        pd.corrupt_flag.unlink()
    assert r.status_code == 200, r.text
    body = r.json()
    assert cached_tokens(body) >= _full_block_tokens(len(prompt))  # the (corrupted) KV was used
    assert body["choices"][0]["token_ids"] != want
    # and with the flag gone the same prompt is right again (fresh transfer id, fresh pull)
    r = _completion(pd.proxy_url, prompt_ids(300, 5))
    assert r.json()["choices"][0]["token_ids"] == baseline.tokens(prompt_ids(300, 5), MAX_TOKENS)


# ------------------------------------------------------------------ bad input


def test_malformed_params_compute_locally(pd, baseline):
    prompt = prompt_ids(260, 6)
    want = baseline.tokens(prompt, MAX_TOKENS)
    for params in ({"do_remote_prefill": True, "transfer_id": "xfer-bad"},  # no engine id / bootstrap
                   {"do_remote_prefill": True, "transfer_id": 5, "remote_engine_id": "e",
                    "remote_bootstrap_addr": pd.boot}):
        body = pd.D.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
        assert body["choices"][0]["token_ids"] == want
    assert "invalid kv_transfer_params" in pd.D.proc.tail(400)


def test_bootstrap_unreachable_recomputes_within_timeout(pd, baseline):
    prompt = prompt_ids(300, 7)
    want = baseline.tokens(prompt, MAX_TOKENS)
    before = _counter(pd.D, "failures", "bootstrap")
    t0 = time.monotonic()
    body = pd.D.complete(prompt, MAX_TOKENS, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": "xfer-nobody", "remote_engine_id": "nobody",
        "remote_bootstrap_addr": f"127.0.0.1:{free_port()}"})
    took = time.monotonic() - t0
    assert body["choices"][0]["token_ids"] == want
    assert took < BOOT_TIMEOUT + 10, took
    assert wait_metric(lambda: _counter(pd.D, "failures", "bootstrap"), lambda v: v > before, 10) == before + 1


def test_proxy_bootstrap_unreachable_is_502(pd):
    proc, url = pd.start_proxy(prefill_spec=f"{pd.P.url}@http://127.0.0.1:{free_port()}")
    try:
        t0 = time.monotonic()
        r = _completion(url, prompt_ids(100, 8))
        assert r.status_code == 502 and "bootstrap" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
    finally:
        proc.stop(grace=5)


# ------------------------------------------------------------------ lifecycle


def _held_now(e: Engine) -> float:
    opened = _counter(e, "holds", "opened")
    done = sum(_counter(e, "holds", k) for k in ("released", "expired", "early_release"))
    return opened - done


def test_client_abort_releases_prefill_blocks(pd, baseline):
    """The prefill finished and holds its blocks; the client gives up while the decode
    request is still queued: the decode side tells P (release message), which frees at
    once, not at the abort timeout."""
    idle_usage = pd.P.metric("vllm:kv_cache_usage_perc")
    freed = lambda: _counter(pd.P, "holds", "released") + _counter(pd.P, "holds", "early_release")  # noqa: E731
    freed_before = freed()
    releases_before = _counter(pd.D, "pulls", "release")
    eid = pd.engine_id()
    prompt = prompt_ids(600, 9)
    tid = "xfer-abort-1"
    pd.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    assert wait_metric(lambda: _held_now(pd.P), lambda v: v >= 1, 10) >= 1
    assert pd.P.metric("vllm:kv_cache_usage_perc") > idle_usage  # the blocks really are held
    with Saturated(pd.D):
        s = _raw_post(pd.D, {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": pd.boot}})
        assert wait_metric(lambda: pd.D.metric("vllm:num_requests_waiting"), lambda v: v >= 1, 10) >= 1
        s.close()  # the client is gone before the decode started
        t0 = time.monotonic()
        assert wait_metric(freed, lambda v: v > freed_before, 30) == freed_before + 1, "prefill blocks not freed"
        assert time.monotonic() - t0 < 30 < ABORT_TIMEOUT
    assert _counter(pd.D, "pulls", "release") == releases_before + 1  # told by a release, no transfer
    assert _counter(pd.P, "holds", "expired") == 0
    assert wait_metric(lambda: pd.P.metric("vllm:kv_cache_usage_perc"), lambda v: v <= idle_usage, 10) <= idle_usage


def test_aborted_prefill_fails_the_pull_promptly(pd, baseline):
    """The client disconnects while its prefill is still queued: P does not hold any blocks
    and a decode side asking for them gets an error at once, then recomputes."""
    eid = pd.engine_id()
    prompt = prompt_ids(700, 11)
    tid = "xfer-abort-2"
    aborted_before = _counter(pd.P, "holds", "aborted")
    opened_before = _counter(pd.P, "holds", "opened")
    with Saturated(pd.P):
        s = _raw_post(pd.P, {"model": "m", "prompt": prompt, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}})
        assert wait_metric(lambda: pd.P.metric("vllm:num_requests_waiting"), lambda v: v >= 1, 10) >= 1
        s.close()
        assert wait_metric(lambda: _counter(pd.P, "holds", "aborted"), lambda v: v > aborted_before, 20) \
            == aborted_before + 1
    t0 = time.monotonic()
    out = pd.D.complete(prompt, MAX_TOKENS, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid, "remote_bootstrap_addr": pd.boot})
    assert out["choices"][0]["token_ids"] == baseline.tokens(prompt, MAX_TOKENS)
    assert time.monotonic() - t0 < 5  # an immediate ERROR, not the 30 s transfer deadline
    assert _counter(pd.P, "holds", "opened") == opened_before
    assert wait_metric(lambda: _counter(pd.D, "failures", "remote"), lambda v: v >= 1, 10) >= 1


# ------------------------------------------------------------------ prefill instance dies (last)


def test_prefill_killed_during_handoff(pd, baseline):
    eid = pd.engine_id()
    dead0 = _counter(pd.D, "failures", "peer") + _counter(pd.D, "failures", "bootstrap")
    # 1) P finished and holds the blocks, then dies before D pulls: D notices the silent
    #    peer within peer_silence_timeout_s and recomputes.
    prompt = prompt_ids(400, 12)
    pd.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-kill-1"})
    # 2) a proxied request whose prefill is queued on P (all P's slots busy) when P is
    #    SIGKILLed: the client gets a clear 502 (or, had the prefill finished, the right tokens).
    long_prompt = prompt_ids(1500, 13)
    result = {}

    def client():
        t = time.monotonic()
        try:
            r = _completion(pd.proxy_url, long_prompt)
            result.update(status=r.status_code, body=r.json())
        except requests.RequestException as e:
            result.update(status=None, error=repr(e))
        result["took"] = time.monotonic() - t

    fill = Saturated(pd.P).__enter__()
    th = threading.Thread(target=client)
    th.start()
    assert wait_metric(lambda: pd.P.metric("vllm:num_requests_waiting"), lambda v: v >= 1, 15) >= 1
    pd.P.proc.kill()  # SIGKILL the whole prefill process group
    th.join(TRANSFER_TIMEOUT + 30)
    for sock in fill.socks:
        sock.close()
    assert not th.is_alive(), "client still waiting"
    print("proxied request while P was killed:", {k: v for k, v in result.items() if k != "body"},
          (result.get("body") or {}).get("error"))
    if result["status"] == 200:
        assert result["body"]["choices"][0]["token_ids"] == baseline.tokens(long_prompt, MAX_TOKENS)
    else:
        assert result["status"] in (502, 504), result
        assert "prefill" in result["body"]["error"]["message"]
    assert result["took"] < TRANSFER_TIMEOUT + 5
    # The decode side's half of that request does not linger: its pull (or release) to the
    # dead prefill ends at the silence timeout, counted as a failure.
    dead = lambda: _counter(pd.D, "failures", "peer") + _counter(pd.D, "failures", "bootstrap")  # noqa: E731
    assert wait_metric(dead, lambda v: v >= dead0 + 1, SILENCE + 15) == dead0 + 1
    assert wait_metric(lambda: pd.D.metric("vllm:num_requests_running") + pd.D.metric("vllm:num_requests_waiting"),
                        lambda v: v == 0, 10) == 0

    before = _counter(pd.D, "failures", "peer") + _counter(pd.D, "failures", "bootstrap")
    t0 = time.monotonic()
    out = pd.D.complete(prompt, MAX_TOKENS, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": "xfer-kill-1", "remote_engine_id": eid,
        "remote_bootstrap_addr": pd.boot})
    assert out["choices"][0]["token_ids"] == baseline.tokens(prompt, MAX_TOKENS)
    assert time.monotonic() - t0 < SILENCE + BOOT_TIMEOUT + 10
    assert wait_metric(lambda: _counter(pd.D, "failures", "peer") + _counter(pd.D, "failures", "bootstrap"),
                        lambda v: v > before, 10) == before + 1
    # the decode engine keeps serving
    p2 = prompt_ids(100, 14)
    assert pd.D.tokens(p2, MAX_TOKENS) == baseline.tokens(p2, MAX_TOKENS)
    assert pd.D.proc.alive()
