"""Store hits past the last whole chunk, end to end: real mooncake_master + store server, real
vLLM engines on the tiny model, 256-token chunks of 8 blocks.

A writer W (``StoreConnector``, core 0) serves prompts; a reader R (``StoreConnector``, core 1,
its loads synchronous: the CPU default) and a reader T (``TieredConnector`` with the store tier
alone, core 1) send prompts that share a prefix with W's and end, or diverge, inside a chunk.
Each reader loads the whole chunks, then the leading blocks of W's next stored object that are
its own (W's chunk, or the tail W saved past its last whole chunk): up to within a block of
where the prefix ends, as vLLM's own prefix cache would. Every reuse is checked against the
no-connector baseline with the same split, and a negative control shows the loaded blocks
are really used.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from mcstore.keys import EngineMeta
from tests.harness import Engine, cached_tokens, prompt_ids, start_engines
from tests.store_util import all_keys, store_kv
from tests.support import Call, engine_worker, frozen, wait_for

pytestmark = pytest.mark.e2e

BS, CHUNK = 32, 256


def _kv(master: str, role: str = "kv_both") -> dict:
    return store_kv(master, role, chunk_tokens=CHUNK)


def _tiered(master: str) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK}}}


@pytest.fixture(scope="module")
def engines(store_cluster):
    w = Engine("partial-W", 0, _kv(store_cluster.master_addr))
    r = Engine("partial-R", 1, _kv(store_cluster.master_addr, "kv_consumer"))
    t = Engine("partial-T", 1, _tiered(store_cluster.master_addr))
    start_engines(w, r, t)
    yield w, r, t
    for e in (w, r, t):
        e.stop()


def _ks(raw, store_cluster):
    """The key space W published (every engine here has the same one)."""
    import msgspec

    metas = [msgspec.json.decode(raw.get(k), type=EngineMeta) for k in all_keys(store_cluster)
             if k.endswith("/meta")]
    (meta,) = {m.fingerprint: m for m in metas}.values()
    return meta.key_space()


def _write(w: Engine, prompt: list[int], raw, store_cluster) -> None:
    """W serves ``prompt``; wait until its whole chunks and its tail are stored."""
    from mcstore.lookup import Probe

    w.complete(prompt, 1)
    ks = _ks(raw, store_cluster)
    hs = ks.hashes(prompt)
    probe = Probe(ks, hs, len(prompt))
    tail = len(hs) % ks.chunk_blocks
    keys = probe.chunk_keys + [ks.dir_key(hs[i]) for i in range(0, len(hs), ks.chunk_blocks)]
    if tail:
        keys += ks.all_rank_keys([ks.part_link(hs[-1], tail)])
    assert wait_for(lambda: all(rc == 1 for rc in raw.batch_is_exist(keys)), 20), "W's saves did not land"


def _counters(e: Engine) -> tuple[float, float, float]:
    return (e.metric("vllm:mctier_store_loaded_tokens_total"), e.metric("vllm:mctier_store_partial_hit_tokens_total"),
            e.metric("vllm:mctier_store_failures_total"))


def _moved(e: Engine, before: tuple[float, float, float]) -> tuple[float, float, float]:
    wait_for(lambda: _counters(e) != before, 10)
    time.sleep(0.3)  # a second counter of the same load may come a step later
    return tuple(a - b for a, b in zip(_counters(e), before))


def test_reader_diverging_mid_chunk_loads_to_within_a_block(engines, baseline, store_cluster, raw):
    w, r, _ = engines
    p = prompt_ids(900, 1)
    _write(w, p, raw, store_cluster)
    d = CHUNK + 3 * BS + 17  # the prefix ends inside block 3 of chunk 1
    q = p[:d] + prompt_ids(150, 2)
    before = _counters(r)
    resp = r.complete(q, 8)
    hit = CHUNK + 3 * BS  # the whole chunk 0, then 3 of W's chunk 1's blocks: 17 tokens short of the prefix
    assert cached_tokens(resp) == hit
    loaded, partial, failed = _moved(r, before)
    assert (loaded, partial, failed) == (hit, 3 * BS, 0)
    # W's prefix cache would reuse the same: the reference replays W's pass over p.
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=hit, writers=[p])


def test_next_turn_extending_the_writers_prompt_hits_its_saved_tail(engines, baseline, store_cluster, raw):
    w, r, _ = engines
    p = prompt_ids(2 * CHUNK + 5 * BS + 28, 3)  # 2 whole chunks, 5 more full blocks, 28 tokens
    _write(w, p, raw, store_cluster)
    q = p + prompt_ids(120, 4)
    before = _counters(r)
    resp = r.complete(q, 8)
    hit = 2 * CHUNK + 5 * BS
    assert cached_tokens(resp) == hit
    assert _moved(r, before) == (hit, 5 * BS, 0)
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=hit, writers=[p])


def test_composite_store_plan_loads_synchronously_and_mid_chunk(engines, baseline, store_cluster, raw):
    """TieredConnector with the store tier alone: the same reach as the tier, and its store
    plan loads inside the step that schedules the request (as StoreConnector's does)."""
    w, _, t = engines
    p = prompt_ids(800, 5)
    _write(w, p, raw, store_cluster)
    q = p[:2 * CHUNK + 2 * BS + 30] + prompt_ids(100, 6)
    sync0 = t.metric("vllm:mctier_store_loads_total", kind="sync")
    before = _counters(t)
    resp = t.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    hit = 2 * CHUNK + 2 * BS
    assert cached_tokens(resp) == hit
    assert _moved(t, before) == (hit, 2 * BS, 0)
    assert t.metric("vllm:mctier_store_loads_total", kind="sync") == sync0 + 1
    assert [s["source"] for s in resp["kv_transfer_params"]["kv_plan"]][:1] == ["store"]
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=hit, writers=[p])


def test_partial_object_evicted_between_lookup_and_load(engines, baseline, store_cluster, raw):
    """R looks the prompt up (chunk 0, then 4 blocks of W's chunk 1), then W's chunk 1 goes
    before R's worker loads it: R's worker is frozen, so the step that carries the load waits
    in it while the scheduler has decided. Chunk 0 loads; the 4 blocks are that step's load
    errors and vLLM recomputes from there: tokens of the split at chunk 0."""
    w, r, _ = engines
    p = prompt_ids(700, 7)
    # W computes chunk 0 in a pass of its own first, so that a reference engine can hold
    # exactly that KV and no more of q (it replays that pass alone).
    first = p[:CHUNK + 10]
    _write(w, first, raw, store_cluster)
    _write(w, p, raw, store_cluster)
    ks = _ks(raw, store_cluster)
    q = p[:CHUNK + 4 * BS + 5] + prompt_ids(90, 8)
    before = _counters(r)
    with frozen(engine_worker(r).pid):
        c = Call(r.complete, q, 8)
        c.start()
        time.sleep(1.0)  # looked up (the master answered); the load sits in the frozen worker's step
        assert raw.remove(f"{ks.links(p)[1]}/tp0", True) == 0
    resp = c.get(60)
    loaded, partial, failed = _moved(r, before)
    assert (loaded, partial, failed) == (CHUNK, 4 * BS, 1)
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=CHUNK, writers=[first])


def test_negative_control_noise_in_the_partial_objects_changes_tokens(engines, baseline, store_cluster, raw):
    """W's chunk 1 (the source of a mid-chunk hit) and W's saved tail, replaced by noise of
    their own size: the readers load the noise and serve other tokens than the reference."""
    w, r, t = engines
    ks = _ks(raw, store_cluster)
    rng = np.random.default_rng(0)

    def noise(key):
        size = raw.get_size(key)
        assert size > 0
        assert raw.upsert(key, (rng.standard_normal(size // 4) * 3).astype(np.float32).tobytes()) == 0

    p = prompt_ids(900, 9)
    _write(w, p, raw, store_cluster)
    noise(f"{ks.links(p)[1]}/tp0")
    q = p[:CHUNK + 5 * BS + 3] + prompt_ids(100, 10)
    resp = r.complete(q, 8)
    assert cached_tokens(resp) == CHUNK + 5 * BS
    assert resp["choices"][0]["token_ids"] != baseline.tokens(q, 8, cached_prefix=CHUNK + 5 * BS, writers=[p])

    p2 = prompt_ids(CHUNK + 6 * BS + 10, 11)
    _write(w, p2, raw, store_cluster)
    hs = ks.hashes(p2)
    noise(f"{ks.part_link(hs[-1], 6)}/tp0")
    q2 = p2 + prompt_ids(80, 12)
    resp = t.complete(q2, 8, kv_transfer_params={"kv_source": "store"})
    assert cached_tokens(resp) == CHUNK + 6 * BS
    assert resp["choices"][0]["token_ids"] != baseline.tokens(q2, 8, cached_prefix=CHUNK + 6 * BS, writers=[p2])
