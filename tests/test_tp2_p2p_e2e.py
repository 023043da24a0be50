"""Tensor parallel 2 with the P2P tier, on real engines: a TP 2 prefill instance and a TP 2
decode instance behind ``mctier proxy``, ranks pinned one per core (both instances share
cores 0 and 1, so this also shows a waiting instance leaves the cores to its neighbour:
``kvcore.shmspin``, ``p2p.connector.IDLE_STEP_S``).

Decode rank r pulls its half of the KV heads from prefill rank r. Each answer is compared
with a no-connector TP 2 engine that computed the same split (the prefill's pass, then the
last prompt token against cached KV), and the bytes pulled are counted. Negative control:
the decode side's received KV corrupted on purpose changes the tokens. A TP 1 decode
instance refuses a TP 2 prefill (heterogeneous TP is not built), recomputes and releases.
"""

from __future__ import annotations

import time

import pytest
import requests

from kvcore.procs import free_port
from tests.harness import (
    BLOCK,
    Engine,
    cached_tokens,
    kv_bytes_per_token,
    prompt_ids,
    reference_tokens,
    start_engines,
    start_proxy,
)
from tests.support import wait_metric

pytestmark = pytest.mark.e2e

N = 18 * BLOCK + 1  # the decode instance computes exactly the last prompt token, after 18 whole blocks
BLOCKS = -(-N // BLOCK)  # the prefill holds, and the decode pulls, every block of the prompt
MAX_TOKENS = 8


class PD2:
    def __init__(self, tmp, ref: Engine):
        self.boot_port = free_port()
        self.corrupt_flag = tmp / "corrupt-now"
        self.P = Engine("tp2-p2p-P", 0, tp=2, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"bootstrap_port": self.boot_port, "abort_timeout_s": 120}})
        self.D = Engine("tp2-p2p-D", 0, tp=2, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"transfer_timeout_s": 60,
                                          "debug_corrupt_received_kv": str(self.corrupt_flag)}})
        self.ref = ref  # the session's TP 2 reference (conftest): not stopped here
        self.proxy = None
        self.url = ""


@pytest.fixture(scope="module")
def pd2(tmp_path_factory, tp2_ref):
    env = PD2(tmp_path_factory.mktemp("tp2p2p"), tp2_ref)
    try:
        start_engines(env.P, env.D, env.ref)
        # A TP > 1 engine compiles a small vocabulary-masking kernel at its first forward
        # (vLLM's CPU backend, with --enforce-eager too): pay it here, not in a handoff.
        for i, e in enumerate((env.P, env.D, env.ref)):
            e.tokens(prompt_ids(40, 800 + i), 1)
        env.proxy, env.url = start_proxy("tp2-p2p-proxy", f"{env.P.url}@http://127.0.0.1:{env.boot_port}",
                                         env.D.url, 120, wait_s=90)
        yield env
    finally:
        if env.proxy is not None:
            env.proxy.stop(grace=5)
        for e in (env.P, env.D):
            e.stop()


def _through_proxy(url: str, prompt: list[int]) -> dict:
    r = requests.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=150)
    r.raise_for_status()
    return r.json()


def _why_recomputed(pd2) -> str:
    """What a handoff that fell back to recomputation left behind: the decode side's
    failure counts by cause and both sides' P2P log lines."""
    from prometheus_client.parser import text_string_to_metric_families

    causes = {s.labels.get("kind", ""): s.value
              for fam in text_string_to_metric_families(pd2.D.metrics_text()) for s in fam.samples
              if s.name == "vllm:mctier_p2p_failures_total" and s.value}
    lines = [ln for e in (pd2.P, pd2.D) for ln in e.proc.tail(400).splitlines()
             if any(k in ln for k in ("P2P", "p2p", "hold", "bootstrap", "release", "Session"))]
    return f"decode-side failures by cause: {causes}; P2P log lines:\n" + "\n".join(lines[-30:])


def test_tp2_handoffs_move_the_kv_and_match_tp2_reference(pd2):
    block_bytes = BLOCK * kv_bytes_per_token(pd2.P.model)
    prompts = [prompt_ids(N, 300 + seed) for seed in (1, 2, 3)]
    # The reference computed the same split: the prefill's pass over the prompt, then the
    # last token against the first N - 1 tokens' cached KV. (All first: the reference engine
    # shares the cores, and stays idle during the handoffs.)
    wants = [reference_tokens(pd2.ref, p, MAX_TOKENS, cached_prefix=N - 1, writers=[p]) for p in prompts]
    for i, (prompt, want) in enumerate(zip(prompts, wants)):
        pulled0 = pd2.D.metric("vllm:mctier_p2p_bytes_total", kind="pulled")
        ok0 = pd2.D.metric("vllm:mctier_p2p_pulls_total", kind="ok")
        released0 = pd2.P.metric("vllm:mctier_p2p_holds_total", kind="released")
        t0 = time.monotonic()
        body = _through_proxy(pd2.url, prompt)
        took = time.monotonic() - t0
        why = _why_recomputed(pd2) if cached_tokens(body) < N - 1 else ""
        if why:  # printed whole: pytest cuts a long assertion message
            print(f"TP 2 handoff {i} recomputed after {took:.1f}s: {body.get('usage')}\n{why}")
        assert cached_tokens(body) >= N - 1, (body.get("usage"), why)
        assert body["choices"][0]["token_ids"] == want
        # Both ranks pulled (each its half of the heads), every block of the prompt in total.
        ok = lambda: pd2.D.metric("vllm:mctier_p2p_pulls_total", kind="ok") - ok0  # noqa: E731
        pulled = lambda: pd2.D.metric("vllm:mctier_p2p_bytes_total", kind="pulled") - pulled0  # noqa: E731
        released = lambda: pd2.P.metric("vllm:mctier_p2p_holds_total", kind="released") - released0  # noqa: E731
        assert wait_metric(ok, lambda v: v >= 2, 10) == 2
        assert wait_metric(pulled, lambda v: v >= BLOCKS * block_bytes, 10) == BLOCKS * block_bytes
        assert wait_metric(released, lambda v: v >= 2, 10) == 2
        print(f"TP 2 handoff {i}: {took:.2f}s, {BLOCKS * block_bytes} bytes")
    assert pd2.D.metric("vllm:mctier_p2p_pulls_total", kind="failed") == 0


def test_tp2_negative_control_corrupted_kv_changes_tokens(pd2):
    prompt = prompt_ids(N, 399)
    want = reference_tokens(pd2.ref, prompt, MAX_TOKENS, cached_prefix=N - 1, writers=[prompt])
    ok0 = pd2.D.metric("vllm:mctier_p2p_pulls_total", kind="ok")
    pd2.corrupt_flag.write_text("on")
    try:
        body = _through_proxy(pd2.url, prompt)
    finally:
        pd2.corrupt_flag.unlink()
    assert cached_tokens(body) >= N - 1  # the corrupted KV was used, not recomputed
    ok = lambda: pd2.D.metric("vllm:mctier_p2p_pulls_total", kind="ok") - ok0  # noqa: E731
    assert wait_metric(ok, lambda v: v >= 2, 10) == 2
    assert body["choices"][0]["token_ids"] != want


def test_tp2_prefill_to_tp1_decode_is_refused_recomputed_and_released(pd2, baseline):
    """Heterogeneous TP is not built: a TP 1 decode instance refuses a TP 2 prefill's KV
    (``protocol``), recomputes the prompt with the TP 1 reference's ids, and releases both
    prefill ranks' holds at once instead of leaving them to the abort timeout."""
    d1 = Engine("tp1-p2p-D", 1, kv_config={
        "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"transfer_timeout_s": 60}})
    try:
        start_engines(d1)
        boot = f"http://127.0.0.1:{pd2.boot_port}"
        eid = requests.get(boot + "/query", timeout=5).json()["0"]["engine_id"]
        prompt = prompt_ids(N, 450)
        freed = lambda: sum(pd2.P.metric("vllm:mctier_p2p_holds_total", kind=k)  # noqa: E731
                            for k in ("released", "early_release", "expired"))
        freed0, expired0 = freed(), pd2.P.metric("vllm:mctier_p2p_holds_total", kind="expired")
        # What the proxy would send: the prefill first, then the decode with its transfer id.
        pd2.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-tp2-to-tp1"})
        t0 = time.monotonic()
        body = d1.complete(prompt, MAX_TOKENS, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": "xfer-tp2-to-tp1", "remote_engine_id": eid,
            "remote_bootstrap_addr": boot})
        took = time.monotonic() - t0
        assert took < 30, took
        assert body["choices"][0]["token_ids"] == baseline.tokens(prompt, MAX_TOKENS)
        protocol = lambda: d1.metric("vllm:mctier_p2p_failures_total", kind="protocol")  # noqa: E731
        assert wait_metric(protocol, lambda v: v >= 1, 10) == 1
        assert d1.metric("vllm:mctier_p2p_bytes_total", kind="pulled") == 0
        # Both ranks' holds end within seconds (the abort timeout here is 120 s), not by expiry.
        assert wait_metric(lambda: freed() - freed0, lambda v: v >= 2, 10) == 2
        assert pd2.P.metric("vllm:mctier_p2p_holds_total", kind="expired") == expired0
        assert "prefill has 2 TP ranks, decode has 1" in d1.proc.tail(200)
    finally:
        d1.stop()
