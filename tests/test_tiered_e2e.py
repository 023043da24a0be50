"""The composite on real engines: a master, a prefill and a decode instance with
``TieredConnector`` (the ``small`` model, where loading vs recomputing is a real
choice), ``mctier proxy`` in front, and a no-connector baseline."""

from __future__ import annotations

import time

import pytest
import requests

from kvcore.procs import free_port
from tests.harness import (
    Engine,
    cached_tokens,
    kv_bytes_per_token,
    model_dir,
    prompt_ids,
    reference_tokens,
    start_engines,
    start_proxy,
)
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 256
# Bounds that catch a hang, not a speed: the slowest case here is a few 2K-token prefills
# of the small model (1 to 3 s each on any CPU class, kvcore/platform.py and multi/cli/models.py).
HANG_S = 180.0


def tiered(role: str, master: str, bootstrap_port: int | None, **policy) -> dict:
    p2p = {"bootstrap_port": bootstrap_port, "transfer_timeout_s": 30.0} if bootstrap_port else {}
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK, "load_timeout_s": 20},
                                          "p2p": p2p, "policy": policy}}


class Deployment:
    def __init__(self, cluster):
        small = model_dir("small")
        self.bootstrap = free_port()
        self.p = Engine("tiered-P", core=0, model=small, max_model_len=8192,
                        kv_config=tiered("kv_producer", cluster.master_addr, self.bootstrap))
        # All of D's own compute weighed 1.5x, idle or not (idle_compute_s 0), as on a decode
        # instance serving a batch: the idle D here would otherwise compute the prompts of
        # up to ~1K tokens these tests hand off (multi.policy, tests/test_policy.py).
        self.d = Engine("tiered-D", core=1, model=small, max_model_len=8192,
                        kv_config=tiered("kv_consumer", cluster.master_addr, free_port(), idle_compute_s=0.0))
        self.base = Engine("baseline-small", core=0, model=small, max_model_len=8192, dev_mode=True,
                           pinned=False)
        start_engines(self.p, self.d, self.base)
        self.proxy, self.url = start_proxy("proxy", f"{self.p.url}@http://127.0.0.1:{self.bootstrap}", self.d.url,
                                           600, connect_timeout=None, wait_s=30)

    def complete(self, prompt, max_tokens=8, **kv) -> dict:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        if kv:
            body["kv_transfer_params"] = kv
        r = requests.post(self.url + "/v1/completions", json=body, timeout=180)
        r.raise_for_status()
        return r.json()

    def p_reused_tokens(self) -> float:
        """Prompt tokens the prefill instance did not compute (its prefix cache or the store), so far."""
        return sum(self.p.metric("vllm:mctier_tiered_planned_tokens_total", kind=k) for k in ("local", "store"))

    def reference(self, prompt, max_tokens, cached_prefix=0, writers=None) -> list[int]:
        return reference_tokens(self.base, prompt, max_tokens, cached_prefix, writers)

    def moved(self) -> dict[str, float]:
        """Decode-side counters: tokens from the store, bytes pulled from the prefill instance."""
        return {"store_tokens": self.d.metric("vllm:mctier_store_loaded_tokens_total"),
                "p2p_bytes": self.d.metric("vllm:mctier_p2p_bytes_total", kind="pulled")}

    def stop(self):
        self.proxy.stop()
        for e in (self.p, self.d, self.base):
            e.stop()


@pytest.fixture(scope="module")
def dep(store_cluster):
    d = Deployment(store_cluster)
    yield d
    d.stop()


def plan_of(resp) -> list[tuple[int, int, str]]:
    params = resp.get("kv_transfer_params") or {}
    return [(r["start"], r["end"], r["source"]) for r in params.get("kv_plan", [])]


def test_store_prefix_and_p2p_tail_in_one_request(dep):
    prefix = prompt_ids(4 * CHUNK, 501)
    # Store the prefix: a prefill-only request on P saves its chunks.
    dep.p.complete(prefix + prompt_ids(40, 502), 1)
    assert wait_for(lambda: dep.p.metric("vllm:mctier_store_saved_tokens_total") >= 4 * CHUNK)
    # N - 1 a whole number of blocks: the decode instance computes only the last token, and
    # the reference can repeat exactly that split.
    prompt = prefix + prompt_ids(993, 503)
    before, p_store = dep.moved(), dep.p_reused_tokens()
    resp = dep.complete(prompt, 8)
    after = dep.moved()
    n = len(prompt)
    # The prefill instance reused the same prefix (its own cache or the store), computed the rest.
    assert dep.p_reused_tokens() - p_store == 4 * CHUNK
    assert plan_of(resp) == [(0, 4 * CHUNK, "store"), (4 * CHUNK, n - 1, "p2p"), (n - 1, n, "recompute")]
    assert after["store_tokens"] - before["store_tokens"] == 4 * CHUNK
    tail_blocks = (n - 1) // 32 - 4 * CHUNK // 32  # P2P fills the blocks of [S, N-1)
    bytes_per_block = 32 * kv_bytes_per_token(dep.p.model)
    assert after["p2p_bytes"] - before["p2p_bytes"] == tail_blocks * bytes_per_block
    # The reference replays what computed this KV: P's save pass over the prefix (the store's
    # [0, S)), P's prefill of the prompt after its local hit ([S, N-1)), then D's last token.
    assert resp["choices"][0]["token_ids"] == dep.reference(prompt, 8, cached_prefix=n - 1,
                                                            writers=[prefix + prompt_ids(40, 502), prompt])
    assert cached_tokens(resp) >= n - 32


def test_short_prompt_recomputes_long_prompt_loads(dep):
    short = prompt_ids(40, 510)
    before = dep.moved()
    r = dep.complete(short, 6)
    assert plan_of(r)[-1] == (0, 40, "recompute") and len(plan_of(r)) == 1
    assert dep.moved() == before  # nothing moved
    assert r["choices"][0]["token_ids"] == dep.reference(short, 6)
    long = prompt_ids(2000, 511)
    r = dep.complete(long, 6)
    sources = {s for _, _, s in plan_of(r)}
    assert "p2p" in sources or "store" in sources
    assert r["choices"][0]["token_ids"] == dep.reference(long, 6)


@pytest.mark.parametrize("force", ["recompute", "p2p", "store"])
def test_forced_sources_are_obeyed(dep, force):
    # A prefix of its own per case: D's prefix cache must not already hold it.
    seed = {"recompute": 600, "p2p": 610, "store": 620}[force]
    saved = dep.p.metric("vllm:mctier_store_saved_tokens_total")
    prefix = prompt_ids(2 * CHUNK, seed)
    dep.p.complete(prefix + [7, 8, 9], 1)
    assert wait_for(lambda: dep.p.metric("vllm:mctier_store_saved_tokens_total") >= saved + 2 * CHUNK)
    prompt = prefix + prompt_ids(300, seed + 1)
    p_store = dep.p_reused_tokens()
    r = dep.complete(prompt, 6, kv_source=force)
    p_split = int(dep.p_reused_tokens() - p_store)  # how the prefill instance computed it
    sources = [s for _, _, s in plan_of(r)]
    assert r["kv_transfer_params"]["kv_plan_estimates"]["reason"].startswith(f"forced {force}")
    expected = {"recompute": ["recompute"], "p2p": ["p2p", "recompute"], "store": ["store", "recompute"]}[force]
    assert sources == expected
    split = {"recompute": 0, "p2p": p_split, "store": 2 * CHUNK}[force]
    assert r["choices"][0]["token_ids"] == dep.reference(prompt, 6, cached_prefix=split)


def test_calibration_converges(dep):
    """After a warm-up, forward-time estimates are within a factor of 2 of the measured times
    (mean relative error below 1.0 over the samples taken after the warm-up)."""
    for seed in range(4):
        dep.complete(prompt_ids(300 + 200 * seed, 530 + seed), 4)
    n0 = dep.d.metric("vllm:mctier_tiered_estimate_samples_total", kind="forward")
    e0 = dep.d.metric("vllm:mctier_tiered_estimate_error_total", kind="forward")
    for seed in range(4):
        dep.complete(prompt_ids(400 + 150 * seed, 540 + seed), 4, kv_source="recompute")
    n1 = dep.d.metric("vllm:mctier_tiered_estimate_samples_total", kind="forward")
    e1 = dep.d.metric("vllm:mctier_tiered_estimate_error_total", kind="forward")
    assert n1 - n0 >= 8
    assert (e1 - e0) / (n1 - n0) < 1.0


def test_store_master_down_everything_from_prefill(dep, store_cluster):
    prompt = prompt_ids(1500, 560)
    store_cluster.stop_master()
    try:
        t0 = time.monotonic()
        r = dep.complete(prompt, 6)
        assert time.monotonic() - t0 < HANG_S
        assert [s for _, _, s in plan_of(r)] == ["p2p", "recompute"]
        assert r["choices"][0]["token_ids"] == dep.reference(prompt, 6)
    finally:
        store_cluster.restart_master()


def test_prefill_dead_store_plus_recompute(dep):
    prefix = prompt_ids(4 * CHUNK, 570)
    # The master was restarted empty by the previous test; wait until D's store client is
    # back (its breaker closes on the next probe). Each probe uses a fresh prefix: one that
    # D computed itself would come from its local cache, not the store.
    probes = iter(range(5000, 5100))

    def store_back() -> bool:
        probe = prompt_ids(CHUNK, next(probes))
        before = dep.p.metric("vllm:mctier_store_saved_tokens_total")
        dep.p.complete(probe + [1], 1)
        if not wait_for(lambda: dep.p.metric("vllm:mctier_store_saved_tokens_total") > before, timeout=10):
            return False
        r = dep.d.complete(probe + [2, 3], 1, kv_transfer_params={"kv_source": "store"})
        return "store" in {s for _, _, s in plan_of(r)}

    assert wait_for(store_back, timeout=HANG_S)
    saved = dep.p.metric("vllm:mctier_store_saved_tokens_total")
    assert wait_for(lambda: dep.p.complete(prefix + [11, 12], 1) and
                    dep.p.metric("vllm:mctier_store_saved_tokens_total") >= saved + 4 * CHUNK, timeout=HANG_S)
    query = requests.get(f"http://127.0.0.1:{dep.bootstrap}/query", timeout=5).json()
    engine_id = next(iter(query.values()))["engine_id"]
    dep.p.proc.kill()
    prompt = prefix + prompt_ids(1200, 571)
    before = dep.moved()
    t0 = time.monotonic()
    r = dep.d.complete(prompt, 6, kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-dead-prefill",
        "remote_bootstrap_addr": f"http://127.0.0.1:{dep.bootstrap}", "remote_engine_id": engine_id})
    assert time.monotonic() - t0 < HANG_S
    assert [s for _, _, s in plan_of(r)] == ["store", "p2p", "recompute"], plan_of(r)
    assert dep.moved()["store_tokens"] - before["store_tokens"] == 4 * CHUNK
    assert r["choices"][0]["token_ids"] == dep.reference(prompt, 6, cached_prefix=4 * CHUNK)
    assert dep.d.tokens(prompt_ids(50, 572), 4) == dep.reference(prompt_ids(50, 572), 4)  # D still serves
