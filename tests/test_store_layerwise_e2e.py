"""Layer-wise store loads end to end (``layerwise_load``, mcstore.layerwise): real
mooncake_master and store server, real vLLM engines on the tiny model (2 layers: one ranged
get per layer).

Two store engines in dev mode (their prefix cache is emptied between a save and the hit, so the
hit comes from the store, synchronously, inside the step that schedules the request): V with
checksums, N without. Every hit is checked against the no-connector baseline: V's and N's
layer-wise hits give its greedy ids; one layer's bytes of every stored chunk replaced by noise
is caught by V's checksum and recomputed (the ids stay right), while N, which cannot tell, uses
the noise and its ids change (the negative control: the tokens follow the bytes loaded).
"""

from __future__ import annotations

import numpy as np
import pytest

from mcstore.objects import TRAILER
from tests.harness import Engine, cached_tokens, page_bytes, prompt_ids, start_engines
from tests.store_util import all_keys, store_kv, wait_saved
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 64  # store_kv's chunk_tokens: 2 blocks
PREFIX = 512  # 8 chunks
LAYERS = 2  # the tiny model (multi/cli/models.py)
DTYPES = {"float32": np.float32, "bfloat16": np.float16, "float16": np.float16}


@pytest.fixture(scope="module")
def engines(store_cluster):
    v = Engine("layerwise-V", 0, store_kv(store_cluster.master_addr, verify_checksums=True, layerwise_load=True),
               dev_mode=True)
    n = Engine("layerwise-N", 1, store_kv(store_cluster.master_addr, layerwise_load=True), dev_mode=True)
    start_engines(v, n)
    yield {"V": v, "N": n}
    v.stop()
    n.stop()


def _save(engine: Engine, prompt: list[int], cluster) -> list[str]:
    """Serve ``prompt`` (whole chunks and a tail shorter than a block: no part object) and wait
    for its chunk objects' keys."""
    before = all_keys(cluster)
    engine.complete(prompt, 1)
    new = wait_saved(cluster, before, len(prompt) // CHUNK)
    keys = sorted(k for k in new if not k.endswith("/meta"))
    assert len(keys) == len(prompt) // CHUNK, keys
    return keys


def _hit(engine: Engine, q: list[int]) -> tuple[dict, float]:
    """Serve ``q`` from the store (prefix cache emptied first); the response and how many
    layer-wise loads the engine ran for it."""
    def layered() -> float:
        return engine.metric("vllm:mctier_store_phase_seconds_count", phase="load_layer_first")

    engine.reset_prefix_cache()
    layered0 = layered()
    r = engine.complete(q, 8)
    wait_for(lambda: layered() > layered0, timeout=10)  # the counters reach /metrics a step or two later
    return r, layered() - layered0


def _noise_layer(raw, keys: list[str], layer: int, page: int, dtype, rng) -> None:
    """Replace layer ``layer``'s pages (2 blocks) of each object by noise in the KV's dtype,
    everything else (the other layer, a trailer) left as it was."""
    for k in keys:
        data = bytearray(raw.get(k))
        at = layer * 2 * page
        noise = (rng.standard_normal(2 * page // np.dtype(dtype).itemsize) * 3).astype(dtype).tobytes()
        data[at:at + 2 * page] = noise
        assert raw.upsert(k, bytes(data)) == 0


@pytest.mark.parametrize("who,seed", [("V", 1), ("N", 3)])
def test_layerwise_hit_matches_the_baseline(engines, baseline, store_cluster, who, seed):
    e = engines[who]
    p = prompt_ids(PREFIX + 20, seed)
    q = p[:PREFIX] + prompt_ids(100, seed + 1)
    _save(e, p, store_cluster)
    sync0 = e.metric("vllm:mctier_store_loads_total", kind="sync")
    fails0 = e.metric("vllm:mctier_store_failures_total")
    r, layered = _hit(e, q)
    assert cached_tokens(r) == PREFIX
    assert layered == 1  # the load went layer by layer
    assert e.metric("vllm:mctier_store_loads_total", kind="sync") == sync0 + 1
    assert e.metric("vllm:mctier_store_failures_total") == fails0
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=PREFIX, writers=[p])


def test_corrupted_layer_is_caught_and_recomputed(engines, baseline, store_cluster, raw):
    """Layer 1's bytes of every stored chunk replaced (the trailer kept): V's incremental digest
    fails the first chunk, the step reports every loaded block as a load error, vLLM recomputes
    the prompt, and the ids are those of a pass over all of it."""
    v = engines["V"]
    p = prompt_ids(PREFIX + 20, 5)
    q = p[:PREFIX] + prompt_ids(100, 6)
    keys = _save(v, p, store_cluster)
    page = page_bytes(v)
    assert {raw.get_size(k) for k in keys} == {LAYERS * 2 * page + TRAILER.size}
    _noise_layer(raw, keys, 1, page, DTYPES[v.dtype], np.random.default_rng(5))
    fails0 = v.metric("vllm:mctier_store_failures_total", kind="load_checksum")
    r, layered = _hit(v, q)
    assert layered == 1
    assert v.metric("vllm:mctier_store_failures_total", kind="load_checksum") == fails0 + 1
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8)


def test_negative_control_corrupted_layer_changes_tokens(engines, baseline, store_cluster, raw):
    """The same noise in layer 1 without checksums: N loads it layer by layer, uses it, and its
    ids differ from the baseline's (with the hit test above, N's ids follow the bytes it loads)."""
    n = engines["N"]
    p = prompt_ids(PREFIX + 20, 7)
    q = p[:PREFIX] + prompt_ids(100, 8)
    keys = _save(n, p, store_cluster)
    page = page_bytes(n)
    assert {raw.get_size(k) for k in keys} == {LAYERS * 2 * page}
    _noise_layer(raw, keys, 1, page, DTYPES[n.dtype], np.random.default_rng(7))
    r, layered = _hit(n, q)
    assert cached_tokens(r) == PREFIX and layered == 1
    assert r["choices"][0]["token_ids"] != baseline.tokens(q, 8, cached_prefix=PREFIX, writers=[p])
