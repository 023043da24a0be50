"""Sliding-window models in real engines under each connector. Why each case goes the way it
does (and the layouts vLLM computes for these models, checked without an engine):
``tests/test_layouts_hybrid.py``, ``kvcore.kvgroups`` and ``kvcore.vllm_glue.require_full_attention``.

* Store tier (``StoreConnector`` declares ``SupportsHMA``: vLLM keeps its hybrid allocator on):
  ``tiny-swa`` (sliding and full layers interleaved, Gemma-2 style: a sliding group and a full
  group) and ``tiny-swa-all`` (every layer slides, Mistral style: one sliding group). A store hit
  of a prompt far longer than the window gives the greedy ids of a no-connector engine with the
  hybrid allocator on too, each group saved and loaded at its own block ids under keys that name
  it, a sliding group's window only; noise in a sliding group's objects changes the tokens.
* ``TieredConnector`` lacks ``SupportsHMA``: vLLM turns its hybrid allocator off.
  ``tiny-swa-all`` keeps one ``SlidingWindowSpec`` group even so, whose pages behind the
  window vLLM frees: such an engine does not start, its log names the refusal (the connector,
  the model, the group kind, the way out).
* ``P2PConnector`` and ``TieredHMAConnector`` declare ``SupportsHMA``: the P2P handoff of both
  models with the hybrid allocator on, and with that composite as the decode, is
  ``tests/test_p2p_hma_e2e.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvcore.procs import free_port
from tests.harness import (
    BLOCK,
    Engine,
    cached_tokens,
    model_dir,
    page_bytes,
    prompt_ids,
    reference_tokens,
    start_engines,
)
from tests.store_util import all_keys, store_kv, wait_saved

pytestmark = pytest.mark.e2e

CHUNK = 64  # store_kv's chunk_tokens
PREFIX = 512  # 8 chunks, far beyond the 64-token window
MAX_TOKENS = 8
WHO = {"tiered": "multi TieredConnector"}


def _kv(connector: str, master: str) -> dict:
    if connector == "p2p":
        return {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"bootstrap_port": free_port()}}
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": "kv_producer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK},
                                          "p2p": {"bootstrap_port": free_port()}}}


# One engine suffices: the connectors without SupportsHMA share the check
# (tests/test_layouts_hybrid.py constructs each of them, in both roles, against the real layout).
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


HMA_CHUNK = 128  # 4 blocks: a sliding group's object holds the last 2, its 64-token window's
HMA_PROMPT = PREFIX + 88  # 4 whole chunks, the 600-token prompt far longer than the window


@pytest.fixture(scope="module")
def hma(store_cluster):
    """Per sliding-window model, a store engine (dev mode: its prefix cache is emptied between a
    save and the hit, so the hit comes from the store) and a no-connector reference, both with
    vLLM's hybrid allocator on (the store tier declares SupportsHMA; without a connector it is
    vLLM's default). The reference keeps a sliding-window checkpoint every chunk
    (``--prefix-cache-retention-interval``; vLLM's default 0 keeps them only where a prompt ends),
    so that its own prefix cache hits where the store does. All four start at once, two per core."""
    out = {}
    for core, preset in enumerate(("tiny-swa", "tiny-swa-all")):
        out[preset] = (Engine(f"hma-store-{preset}", core, kv_config=store_kv(store_cluster.master_addr,
                                                                               chunk_tokens=HMA_CHUNK),
                              model=model_dir(preset), dev_mode=True),
                       Engine(f"hma-ref-{preset}", core, model=model_dir(preset), dev_mode=True,
                              extra_args=["--prefix-cache-retention-interval", str(HMA_CHUNK)]))
    try:
        start_engines(*(e for pair in out.values() for e in pair))
        yield out
    finally:
        for pair in out.values():
            for e in pair:
                e.stop()


def _save(engine: Engine, prompt: list[int], cluster, groups: int) -> dict[int, list[str]]:
    """Serve ``prompt`` and wait for its chunks' objects: group -> their keys."""
    before = all_keys(cluster)
    engine.complete(prompt, 4)
    new = wait_saved(cluster, before, groups * (len(prompt) // HMA_CHUNK))
    by_group: dict[int, list[str]] = {}
    for k in new:
        suffix = k.rsplit("/", 1)[1]
        assert suffix.startswith("g") and suffix.endswith("tp0"), k  # the keys name the group
        by_group.setdefault(int(suffix[1:-3]), []).append(k)
    return by_group


# (sliding groups, layers per group) of each model's layout with the hybrid allocator on:
# tiny-swa has a sliding group (0) and a full one (1) of one layer each, tiny-swa-all one
# sliding group of both layers.
LAYOUT = {"tiny-swa": ({0}, {0: 1, 1: 1}), "tiny-swa-all": ({0}, {0: 2})}


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-swa-all"])
def test_hybrid_store_hit_matches_reference_window_only(hma, store_cluster, raw, preset):
    """A store hit of a prompt far longer than the window, with the hybrid allocator on, gives the
    reference's tokens; each group is stored and loaded at its own block ids, a sliding group's
    window only (its objects are 2 of a chunk's 4 blocks; the load moves 2 of its 16 blocks)."""
    s, ref = hma[preset]
    sliding, layers = LAYOUT[preset]
    seed = 50 if preset == "tiny-swa" else 60
    p = prompt_ids(HMA_PROMPT, seed)
    q = p[:PREFIX] + prompt_ids(100, seed + 1)
    by_group = _save(s, p, store_cluster, len(layers))
    page = page_bytes(s)
    assert sorted(by_group) == sorted(layers)
    for g, keys in by_group.items():
        blocks = 2 if g in sliding else HMA_CHUNK // BLOCK
        assert {raw.get_size(k) for k in keys} == {blocks * layers[g] * page}, (g, keys)
    s.reset_prefix_cache()  # the hit must come from the store
    tokens0 = s.metric("vllm:mctier_store_loaded_tokens_total")
    bytes0 = s.metric("vllm:mctier_store_loaded_bytes_total")
    r = s.complete(q, MAX_TOKENS)
    assert cached_tokens(r) == PREFIX
    # The stored prefix KV came from the pass over p: the reference replays it.
    want = reference_tokens(ref, q, MAX_TOKENS, cached_prefix=PREFIX, writers=[p])
    assert r["choices"][0]["token_ids"] == want
    moved = sum((2 if g in sliding else PREFIX // BLOCK) * n * page for g, n in layers.items())
    deadline = time.monotonic() + 10  # the counters reach /metrics a step or two later
    while s.metric("vllm:mctier_store_loaded_tokens_total") < tokens0 + PREFIX and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s.metric("vllm:mctier_store_loaded_tokens_total") == tokens0 + PREFIX
    assert s.metric("vllm:mctier_store_loaded_bytes_total") == bytes0 + moved


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-swa-all"])
def test_hybrid_negative_control_corrupted_sliding_group_changes_tokens(hma, store_cluster, raw, preset):
    """The sliding group's stored bytes replaced by noise (the full group's left intact): the hit
    uses them, and the tokens are no longer the reference's."""
    s, ref = hma[preset]
    sliding, layers = LAYOUT[preset]
    seed = 70 if preset == "tiny-swa" else 80
    p = prompt_ids(HMA_PROMPT, seed)
    q = p[:PREFIX] + prompt_ids(100, seed + 1)
    by_group = _save(s, p, store_cluster, len(layers))
    rng = np.random.default_rng(seed)
    for g in sliding:
        for k in by_group[g]:
            size = raw.get_size(k)
            noise = (rng.standard_normal(size // 2) * 3).astype(np.float16).tobytes()
            assert len(noise) == size and raw.upsert(k, noise) == 0
    s.reset_prefix_cache()
    r = s.complete(q, MAX_TOKENS)
    assert cached_tokens(r) == PREFIX
    want = reference_tokens(ref, q, MAX_TOKENS, cached_prefix=PREFIX, writers=[p])
    assert r["choices"][0]["token_ids"] != want
