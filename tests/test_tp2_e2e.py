"""Tensor parallel 2 with the store tier, on real engines: one rank per core (cores 0 and 1).

* A TP 2 engine saves a prefix; another TP 2 engine loads it (every chunk is one object per
  rank) and gives the greedy ids of a no-connector TP 2 engine that computed the same split.
* Negative control: noise written over rank 1's objects only changes the tokens, so the
  second rank's half of the heads really comes from the store.
* The next turn of a TP 2 writer's prompt loads its saved tail (a part object per rank).
* A TP 1 engine on the same store misses the TP 2 prefix (its fingerprint holds the TP
  size, so its keys differ) and computes it, with the TP 1 reference's ids.

The P2P handoff between two TP 2 instances is not here: tests/test_tp2_p2p_e2e.py and docs/layouts.md.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.harness import Engine, cached_tokens, prompt_ids, reference_tokens, start_engines
from tests.store_util import all_keys, dir_keys, raw_client, store_kv, wait_saved
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 64  # store_kv's chunk_tokens
PREFIX = 512
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster():
    """A master plus store server with Mooncake's default 5 s read lease: the shared
    ``store_cluster``'s 0.5 s lease can expire inside a TP rank's read when four ranks share
    two cores (the load then fails cleanly and is recomputed, which is not what this tests)."""
    from mcstore.server import StoreCluster
    from tests.harness import LOGS

    c = StoreCluster(log_dir=LOGS, segment_size=256 << 20).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tp2(cluster, tp2_ref):
    # Two TP 2 engines, the reference and the master share 2 cores: a master call took 2.0 s in
    # two full runs, so the lookup timed out and the breaker opened (a miss, computed: the hit
    # under test lost). What is tested here is what each rank saves and loads, not the lookup's
    # deadline (tests/test_store_events_e2e.py and tests/test_store_lookup.py test that).
    starved = {"lookup_timeout_ms": 15000, "slow_rpc_s": 15.0}
    a = Engine("tp2-store-A", 0, kv_config=store_kv(cluster.master_addr, **starved), tp=2)
    b = Engine("tp2-store-B", 0, kv_config=store_kv(cluster.master_addr, **starved), tp=2)
    ref = tp2_ref  # the session's (conftest): not stopped here
    start_engines(a, b, ref)
    try:
        # A TP > 1 engine compiles a small vocabulary-masking kernel at its first forward
        # (vLLM's CPU backend, with --enforce-eager too): pay it here, not in a timed step.
        for i, e in enumerate((a, b, ref)):
            e.tokens(prompt_ids(40, 900 + i), 1)
        yield a, b, ref
    finally:
        for e in (a, b):
            e.stop()


@pytest.fixture(scope="module")
def raw(cluster):
    s = raw_client(cluster.master_addr)
    yield s
    s.close()


def _save(engine: Engine, prompt: list[int], cluster) -> set[str]:
    """Serve ``prompt`` on ``engine`` and wait until both ranks' objects of every whole chunk
    are in the store; the new keys."""
    before = all_keys(cluster)
    engine.complete(prompt, 4)
    return wait_saved(cluster, before, 2 * (len(prompt) // CHUNK), timeout=30)


@pytest.fixture(scope="module")
def stored(tp2, cluster):
    """A prefix A saved (both ranks' objects of every chunk): ``(p, q)``, where ``q`` shares
    ``p``'s first PREFIX tokens."""
    a, _, _ = tp2
    p = prompt_ids(PREFIX + 88, 51)
    new = _save(a, p, cluster)
    assert {k.rsplit("/", 1)[1] for k in new} == {"tp0", "tp1"}, sorted(new)[:4]
    return p, p[:PREFIX] + prompt_ids(100, 52)


def test_tp2_store_hit_across_instances_matches_tp2_reference(tp2, stored):
    _, b, ref = tp2
    p, q = stored
    loaded0 = b.metric("vllm:mctier_store_loaded_tokens_total")
    r = b.complete(q, MAX_TOKENS)
    assert cached_tokens(r) == PREFIX
    want = reference_tokens(ref, q, MAX_TOKENS, cached_prefix=PREFIX, writers=[p])
    assert r["choices"][0]["token_ids"] == want
    deadline = time.monotonic() + 10  # the counters reach /metrics a step or two later
    while b.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 < PREFIX and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 >= PREFIX


def test_tp2_negative_control_noise_in_rank1_objects_changes_tokens(tp2, cluster, raw):
    a, b, ref = tp2
    p = prompt_ids(PREFIX + 88, 61)
    q = p[:PREFIX] + prompt_ids(100, 62)
    new = _save(a, p, cluster)
    rank1 = [k for k in new if k.endswith("/tp1")]
    assert len(rank1) == len(p) // CHUNK
    rng = np.random.default_rng(0)
    for k in rank1:
        noise = (rng.standard_normal(raw.get_size(k) // 2) * 3).astype(np.float16).tobytes()
        assert raw.upsert(k, noise) == 0
        # Read it back before the engine does: in two runs the first reads after these
        # upserts took 10 to 13 s, past the engine's read lease, and the load was recomputed.
        assert raw.get(k) == noise
    r = b.complete(q, MAX_TOKENS)
    assert cached_tokens(r) == PREFIX
    want = reference_tokens(ref, q, MAX_TOKENS, cached_prefix=PREFIX, writers=[p])
    assert r["choices"][0]["token_ids"] != want


def test_tp2_next_turn_loads_the_writers_tail_from_both_ranks(tp2, cluster, raw):
    """A saves a prompt of 8 whole chunks and one more full block: each rank writes its part of
    the tail (a one-block part object), and B, whose prompt extends A's, loads the chunks and
    the tail from both ranks: the ids of the TP 2 reference with that split."""
    a, b, ref = tp2
    p = prompt_ids(PREFIX + 40, 71)
    before, before_dirs = all_keys(cluster), dir_keys(cluster)
    a.complete(p, 4)
    new = wait_saved(cluster, before, 2 * (len(p) // CHUNK) + 2, timeout=30)
    assert sorted(k.rsplit("/", 1)[1] for k in new if k.split("/")[2].endswith("-b1")) == ["tp0", "tp1"]
    # The master lists an object once its put starts; a lookup counts it once the put ended.
    assert wait_for(lambda: all(rc == 1 for rc in raw.batch_is_exist(sorted(new))), 30)
    # Rank 0 writes the directory entries (one per chunk and one for the tail) after its
    # objects; B finds the tail through its entry (mcstore.saves: _save_dirs).
    assert wait_for(lambda: len(dir_keys(cluster) - before_dirs) >= len(p) // CHUNK + 1, 30)
    q = p + prompt_ids(60, 72)
    r = b.complete(q, MAX_TOKENS)
    assert cached_tokens(r) == PREFIX + 32
    want = reference_tokens(ref, q, MAX_TOKENS, cached_prefix=PREFIX + 32, writers=[p])
    assert r["choices"][0]["token_ids"] == want


def test_tp1_engine_never_reads_tp2_objects(stored, cluster, baseline):
    _, q = stored
    c = Engine("tp1-store-C", 1, kv_config=store_kv(cluster.master_addr))
    try:
        start_engines(c)
        r = c.complete(q, MAX_TOKENS)
        assert cached_tokens(r) == 0
        assert c.metric("vllm:mctier_store_loaded_tokens_total") == 0
        assert r["choices"][0]["token_ids"] == baseline.tokens(q, MAX_TOKENS)
    finally:
        c.stop()
