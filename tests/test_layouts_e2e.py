"""Sliding-window models in real engines under each connector. Why each case goes the way it
does (and the layouts vLLM computes for these models, checked without an engine):
``tests/test_layouts_hybrid.py`` and ``kvcore.vllm_glue.require_full_attention``.

* ``tiny-swa-all`` (every layer slides, Mistral style): vLLM keeps one ``SlidingWindowSpec``
  group even with its hybrid allocator off and frees the pages behind the window. An engine
  with ``StoreConnector``, ``P2PConnector`` or ``TieredConnector`` does not start; its log
  names the refusal (the connector, the model, the group kind, the way out).
* ``tiny-swa`` (sliding and full layers interleaved, Gemma-2 style): our connectors lack
  ``SupportsHMA``, so vLLM turns its hybrid allocator off and keeps a page for every token of
  every layer. Both tiers serve it: a store hit on a second engine and a P2P handoff give
  the greedy ids of a no-connector engine (hybrid allocator off too: the same KV layout and
  kernels) that computed the same split.
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
    model_dir,
    prompt_ids,
    reference_tokens,
    start_engines,
    start_proxy,
)
from tests.store_util import all_keys, store_kv, wait_saved

pytestmark = pytest.mark.e2e

CHUNK = 64  # store_kv's chunk_tokens
PREFIX = 512  # 8 chunks, far beyond the 64-token window
MAX_TOKENS = 8
WHO = {"store": "mcstore StoreConnector", "p2p": "p2p P2PConnector", "tiered": "multi TieredConnector"}


def _kv(connector: str, master: str) -> dict:
    if connector == "store":
        return store_kv(master)
    if connector == "p2p":
        return {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"bootstrap_port": free_port()}}
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": "kv_producer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK},
                                          "p2p": {"bootstrap_port": free_port()}}}


# One engine suffices: the three connectors share the check (tests/test_layouts_hybrid.py
# constructs each of them, in both roles, against the real layout).
@pytest.mark.parametrize("connector", ["tiered"])
def test_every_layer_sliding_model_is_refused_at_startup(store_cluster, connector):
    model = str(model_dir("tiny-swa-all"))
    e = Engine(f"swa-all-{connector}", 0, kv_config=_kv(connector, store_cluster.master_addr), model=model)
    try:
        # The worker's connector refuses while the engine core initializes its KV cache; the
        # server then exits (a hang would time out here and still has to show the refusal).
        with pytest.raises((RuntimeError, TimeoutError)):
            e.wait_ready()
        log = e.proc.log_path.read_text(errors="replace")
    finally:
        e.stop()
    assert f"{WHO[connector]}: model '{model}' has a KV cache layout this connector cannot save or load whole" \
        in log, e.proc.tail(80)
    assert "SlidingWindowSpec (window 64 tokens)" in log and "--disable-sliding-window" in log


@pytest.fixture(scope="module")
def swa_ref():
    """No connector, hybrid allocator off: the KV layout the connector engines get. Its
    process starts here; each test waits for it after its own engines, which start beside it."""
    e = Engine("swa-ref", 0, model=model_dir("tiny-swa"), dev_mode=True,
               extra_args=["--disable-hybrid-kv-cache-manager"])
    yield e
    e.stop()


def test_interleaved_model_store_hit_matches_reference(store_cluster, swa_ref):
    model = model_dir("tiny-swa")
    a = Engine("swa-store-A", 0, kv_config=store_kv(store_cluster.master_addr), model=model)
    b = Engine("swa-store-B", 1, kv_config=store_kv(store_cluster.master_addr), model=model)
    try:
        start_engines(a, b)
        swa_ref.wait_ready()
        p = prompt_ids(PREFIX + 88, 41)
        q = p[:PREFIX] + prompt_ids(100, 42)
        before = all_keys(store_cluster)
        a.complete(p, 4)
        wait_saved(store_cluster, before, len(p) // CHUNK)
        r = b.complete(q, MAX_TOKENS)
        assert cached_tokens(r) == PREFIX
        # The stored prefix KV came from A's pass over p: the reference replays it.
        want = reference_tokens(swa_ref, q, MAX_TOKENS, cached_prefix=PREFIX, writers=[p])
        assert r["choices"][0]["token_ids"] == want
        deadline = time.monotonic() + 10  # the counters reach /metrics a step or two later
        while b.metric("vllm:mctier_store_loaded_tokens_total") < PREFIX and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b.metric("vllm:mctier_store_loaded_tokens_total") >= PREFIX
    finally:
        a.stop()
        b.stop()


def test_interleaved_model_p2p_handoff_matches_reference(swa_ref):
    model = model_dir("tiny-swa")
    boot_port = free_port()
    p = Engine("swa-p2p-P", 0, model=model, kv_config={
        "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_port": boot_port, "abort_timeout_s": 300}})
    d = Engine("swa-p2p-D", 1, model=model, kv_config={
        "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"transfer_timeout_s": 30}})
    proxy = None
    try:
        start_engines(p, d)
        swa_ref.wait_ready()
        proxy, url = start_proxy("swa-proxy", f"{p.url}@http://127.0.0.1:{boot_port}", d.url, 120, wait_s=90)
        # The P2P tier pulls the whole prompt's KV (the partial last block too), computed in
        # the prefill's one pass: the reference is that one pass (as in tests/test_p2p_e2e.py).
        prompt = prompt_ids(PREFIX + 1, 43)
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert cached_tokens(body) >= PREFIX == (len(prompt) - 1) // BLOCK * BLOCK
        want = reference_tokens(swa_ref, prompt, MAX_TOKENS)
        assert body["choices"][0]["token_ids"] == want
        deadline = time.monotonic() + 10  # the counters reach /metrics a step or two later
        while d.metric("vllm:mctier_p2p_pulls_total", kind="ok") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.metric("vllm:mctier_p2p_pulls_total", kind="ok") >= 1
    finally:
        if proxy is not None:
            proxy.stop(grace=5)
        p.stop()
        d.stop()
