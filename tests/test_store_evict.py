"""Store pressure: a DRAM pool too small for the workload evicts, and requests
whose chunks went get correct tokens anyway; with SSD offload on, chunks evicted
from DRAM come back from disk. Engines run without a local prefix cache, so any
reuse is the store's."""

from __future__ import annotations

import time

import pytest

from mcstore.server import StoreCluster
from tests.harness import LOGS, Engine, cached_tokens, prompt_ids, start_engines
from tests.store_util import all_keys, raw_client, store_kv

pytestmark = pytest.mark.e2e

SEGMENT = 16 << 20  # Mooncake's minimum: 256 chunks of 64 KiB (tiny model, 64-token chunks)
CHUNKS = 24  # per prompt: 1.5 MiB
PROMPTS = [prompt_ids(CHUNKS * 64 + 40, 100 + i) for i in range(12)]  # 18 MiB in all
SSD_PROMPTS = [prompt_ids(CHUNKS * 64 + 40, 200 + i) for i in range(12)]
FULL_HIT = CHUNKS * 64
FLAGS = ["--default_kv_lease_ttl=500", "--client_ttl=2"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    ssd = str(tmp_path_factory.mktemp("ssd"))
    dram = StoreCluster(LOGS, segment_size=SEGMENT, extra_flags=FLAGS).start()
    try:
        disk = StoreCluster(LOGS, segment_size=SEGMENT, ssd_dir=ssd, extra_flags=FLAGS).start()
    except BaseException:
        dram.stop()
        raise
    yield dram, disk
    disk.stop()
    dram.stop()


@pytest.fixture(scope="module")
def engines(clusters):
    dram, disk = clusters
    no_local = ["--no-enable-prefix-caching"]
    e_dram = Engine("store-dram", 0, store_kv(dram.master_addr, save_retry_s=5.0), extra_args=no_local)
    e_disk = Engine("store-ssd", 1, store_kv(disk.master_addr, save_retry_s=5.0), extra_args=no_local)
    start_engines(e_dram, e_disk)
    yield e_dram, e_disk
    e_dram.stop()
    e_disk.stop()


def _fill(engine, cluster, prompts) -> list[set[str]]:
    """Serve every prompt's chunk-aligned head once (one prefill pass, as the reference
    computes it); the keys each one added."""
    added = []
    for p in prompts:
        before = all_keys(cluster)
        engine.complete(p[:FULL_HIT], 1)
        time.sleep(1.0)  # saves run after the response, in the background
        added.append(all_keys(cluster) - before)
    return added


def test_dram_eviction_keeps_tokens_correct(engines, clusters, baseline):
    e_dram, _ = engines
    dram, _ = clusters
    _fill(e_dram, dram, PROMPTS)
    stored = len(all_keys(dram))
    assert stored < len(PROMPTS) * CHUNKS, f"nothing was evicted ({stored} chunks stored)"
    hits, wrong, unchecked = {}, [], []
    # Newest first: a cyclic scan over a too-small LRU pool would miss on every prompt.
    for i in reversed(range(len(PROMPTS))):
        fails0 = e_dram.metric("vllm:mctier_store_failures_total")
        r = e_dram.complete(PROMPTS[i], 8)
        hits[i] = cached_tokens(r)
        if e_dram.metric("vllm:mctier_store_failures_total") != fails0:
            # A chunk vanished between lookup and load: part of the hit was recomputed,
            # so the split the reference needs is unknown (recovery is covered in test_store_e2e).
            unchecked.append(i)
        elif r["choices"][0]["token_ids"] != baseline.tokens(PROMPTS[i], 8, cached_prefix=hits[i]):
            wrong.append(i)
    assert not wrong, f"wrong tokens for prompts {wrong}; hits {hits}"
    assert len(unchecked) <= 2, f"too many failed loads to check tokens: {unchecked}"
    # The newest prompt is still (mostly) stored; the oldest lost (part of) its chunks.
    assert hits[len(PROMPTS) - 1] > 0, hits
    assert hits[0] < FULL_HIT, hits


def test_ssd_offload_brings_evicted_chunks_back(engines, clusters, baseline):
    _, e_disk = engines
    _, disk = clusters
    added = _fill(e_disk, disk, SSD_PROMPTS)
    raw = raw_client(disk.master_addr)
    try:
        first = sorted(added[0])
        assert len(first) == CHUNKS, f"first prompt saved {len(first)} of {CHUNKS} chunks"
        deadline = time.monotonic() + 30
        while True:
            descs = raw.batch_get_replica_desc(first)
            on_disk_only = [k for k in first
                            if descs.get(k) and not any(d.is_memory_replica() for d in descs[k])]
            if on_disk_only:
                break
            assert time.monotonic() < deadline, "no chunk of the first prompt left DRAM"
            time.sleep(0.5)
    finally:
        raw.close()
    r = e_disk.complete(SSD_PROMPTS[0], 8)
    assert cached_tokens(r) == FULL_HIT
    assert r["choices"][0]["token_ids"] == baseline.tokens(SSD_PROMPTS[0], 8, cached_prefix=FULL_HIT)
    assert e_disk.metric("vllm:mctier_store_loaded_tokens_total") >= FULL_HIT
