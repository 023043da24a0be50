"""Store tier end to end: real mooncake_master + store server, real vLLM engines.

Engine A runs the store tier alone, its loads synchronous (inside the step that schedules
the request: the CPU default); engine B runs it as the first child of vLLM's stock
MultiConnector, its loads in the background (``sync_load_max=0``). Every reuse is checked
against the no-connector baseline.

Both engines hash blocks with ``--prefix-caching-hash-algo xxhash``, so this module runs the
store on mctier's own key chain over the token ids (``mcstore.keys``): the key space of
every engine whose vLLM does not hash with ``sha256``. The other end-to-end modules run
vLLM's default, links from its ``sha256`` block hashes.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from mcstore.worker import trailer as worker_trailer
from tests.harness import Engine, cached_tokens, prompt_ids, start_engines
from tests.store_util import all_keys, kill_mid_put, multi_kv, store_kv, wait_saved

pytestmark = pytest.mark.e2e

PREFIX = 512  # shared prefix: 8 chunks of 64 tokens
HASH_ALGO = ["--prefix-caching-hash-algo", "xxhash"]  # mctier's own key chain (module doc)


def _a_kv(master: str) -> dict:
    # Checksums on (they are opt-in): the negative control shows both what they catch and
    # that KV with a valid trailer really is used. Every whole chunk A loads goes through host
    # staging (a chunk on contiguous blocks makes one range per KV region, above the 0.5 per
    # region allowed), B's straight into its pages: both paths are checked against the baseline.
    return store_kv(master, verify_checksums=True, stage_above_ranges_per_region=0.5)


@pytest.fixture(scope="module")
def engines(store_cluster, tmp_path_factory):
    a = Engine("store-A", 0, _a_kv(store_cluster.master_addr), extra_args=HASH_ALGO)
    # A loads synchronously (the CPU default, sync_load_max), B in the background.
    b = Engine("store-B-multi", 1, multi_kv(store_cluster.master_addr, str(tmp_path_factory.mktemp("example")),
                                            verify_checksums=True, sync_load_max=0), extra_args=HASH_ALGO)
    start_engines(a, b)
    yield a, b
    a.stop()
    b.stop()


def _shared(seed: int, tail_seed: int, n_tail: int = 100) -> tuple[list[int], list[int]]:
    p = prompt_ids(PREFIX + 88, seed)
    return p, p[:PREFIX] + prompt_ids(n_tail, tail_seed)


def _serve_and_wait_saved(engine, prompt, cluster, before: set[str], **body) -> set[str]:
    engine.complete(prompt, 4, **body)
    return wait_saved(cluster, before, len(prompt) // 64)


def test_prefix_reuse_across_engines(engines, baseline, store_cluster):
    a, b = engines
    p, q = _shared(1, 2)
    _serve_and_wait_saved(a, p, store_cluster, all_keys(store_cluster))
    r = b.complete(q, 8)
    assert cached_tokens(r) == PREFIX
    # The reference replays A's pass over p: the stored prefix KV came from it.
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=PREFIX, writers=[p])
    assert b.metric("vllm:mctier_store_loaded_tokens_total") >= PREFIX
    assert b.metric("vllm:mctier_store_lookups_total", kind="hit") >= 1
    assert b.metric("vllm:mctier_store_loads_total", kind="background") >= 1
    assert b.metric("vllm:mctier_store_loads_total", kind="sync") == 0
    # The phases of that load and of A's save are on /metrics, and the descriptors per chunk.
    assert b.metric("vllm:mctier_store_phase_seconds_count", phase="load_transfer") >= 1
    assert b.metric("vllm:mctier_store_phase_seconds_count", phase="load_recheck") >= 1
    assert a.metric("vllm:mctier_store_phase_seconds_count", phase="save_transfer") >= 1
    chunks = b.metric("vllm:mctier_store_io_chunks_total", kind="load")
    assert chunks >= PREFIX // 64 and b.metric("vllm:mctier_store_io_ranges_total", kind="load") >= chunks
    # B (MultiConnector child) saved its new tail chunk: A reuses it the other way round.
    time.sleep(1.0)
    q2 = q[:576] + prompt_ids(40, 3)
    r2 = a.complete(q2, 8)
    assert cached_tokens(r2) == 576
    # [0, 512) came from A's pass over p, [512, 576) from B's pass over q after its hit.
    assert r2["choices"][0]["token_ids"] == baseline.tokens(q2, 8, cached_prefix=576, writers=[p, q])
    assert a.metric("vllm:mctier_store_loads_total", kind="sync") == 1
    assert a.metric("vllm:mctier_store_loads_total", kind="background") == 0
    # A's 9 chunks came through staging in one get (they fit its buffer), none straight.
    assert a.metric("vllm:mctier_store_phase_seconds_count", phase="load_staging") == 1
    assert a.metric("vllm:mctier_store_phase_seconds_count", phase="load_transfer") == 0


def test_engines_hashing_with_xxhash_store_under_mctiers_own_chain(engines, store_cluster, raw):
    """The engines publish a key space without vLLM's block hashes; the tools derive that same
    key space from the same settings with ``--prefix-caching-hash-algo xxhash`` (and another,
    vLLM-hashed one without it); a served prompt's objects are the own chain's keys of its ids."""
    from mcstore.keys import EngineMeta
    from mcstore.tools.engine import derive_meta

    a, _ = engines
    metas = [msgspec.json.decode(raw.get(k), type=EngineMeta) for k in all_keys(store_cluster) if k.endswith("/meta")]
    assert metas and all(m.block_hashes is None for m in metas), metas
    kv = _a_kv(store_cluster.master_addr)
    derived = derive_meta(a.model, kv, block_size=32, dtype=a.dtype, prefix_caching_hash_algo="xxhash")
    assert derived.block_hashes is None and derived.fingerprint in {m.fingerprint for m in metas}
    default = derive_meta(a.model, kv, block_size=32, dtype=a.dtype)
    assert default.block_hashes is not None and default.fingerprint not in {m.fingerprint for m in metas}
    p = prompt_ids(PREFIX + 20, 5)
    new = _serve_and_wait_saved(a, p, store_cluster, all_keys(store_cluster))
    ks = derived.key_space()
    assert new == set(ks.all_rank_keys(ks.links(p)))


def test_negative_control_corrupted_bytes_change_tokens(engines, baseline, store_cluster, raw):
    """Noise with a valid trailer (what a store bug that kept checksums intact would serve) is
    used as KV and changes the tokens; noise without one is caught by the checksum and
    recomputed, so the tokens stay right."""
    a, b = engines
    p, q = _shared(11, 12)
    new = _serve_and_wait_saved(a, p, store_cluster, all_keys(store_cluster))
    rng = np.random.default_rng(0)
    want = baseline.tokens(q, 8, cached_prefix=PREFIX)
    tlen = len(worker_trailer(b"", ""))
    for k in new:
        size = raw.get_size(k)
        assert size > tlen
        noise = (rng.standard_normal((size - tlen) // 2) * 3).astype(np.float16).tobytes()
        trailer = worker_trailer(noise, k)
        assert raw.upsert(k, noise + trailer) == 0
    r = b.complete(q, 8)
    assert cached_tokens(r) == PREFIX
    assert r["choices"][0]["token_ids"] != want
    # Same again with a broken trailer: B (fresh prompt tail) refuses the chunks.
    p2, q2 = _shared(13, 14)
    new = _serve_and_wait_saved(a, p2, store_cluster, all_keys(store_cluster))
    for k in new:
        data = bytearray(raw.get(k))
        data[100:108] = rng.integers(0, 255, 8, dtype=np.uint8).tobytes()
        assert raw.upsert(k, bytes(data)) == 0
    fails0 = b.metric("vllm:mctier_store_failures_total", kind="load_checksum")
    r = b.complete(q2, 8)
    assert b.metric("vllm:mctier_store_failures_total", kind="load_checksum") == fails0 + 1
    assert r["choices"][0]["token_ids"] == baseline.tokens(q2, 8)


def test_negative_control_staged_load_uses_corrupted_bytes(engines, baseline, store_cluster, raw):
    """The same control on the staged path: B stores a prefix, its objects are replaced by noise
    with a valid trailer, and A, which loads every chunk through host staging, serves other
    tokens than the right ones. With the reuse test, where A's staged load gives the right
    tokens, this shows A's tokens follow the bytes it fetched."""
    a, b = engines
    p, q = _shared(15, 16)
    new = _serve_and_wait_saved(b, p, store_cluster, all_keys(store_cluster))
    rng = np.random.default_rng(1)
    tlen = len(worker_trailer(b"", ""))
    for k in new:
        noise = (rng.standard_normal((raw.get_size(k) - tlen) // 2) * 3).astype(np.float16).tobytes()
        assert raw.upsert(k, noise + worker_trailer(noise, k)) == 0
    staged0 = a.metric("vllm:mctier_store_phase_seconds_count", phase="load_staging")
    r = a.complete(q, 8)
    assert cached_tokens(r) == PREFIX
    assert a.metric("vllm:mctier_store_phase_seconds_count", phase="load_staging") == staged0 + 1
    assert r["choices"][0]["token_ids"] != baseline.tokens(q, 8, cached_prefix=PREFIX, writers=[p])


def test_cache_salt_isolation(engines, baseline, store_cluster):
    a, b = engines
    p, q = _shared(21, 22)
    # B writes under salt "alice"; A (store tier alone: no other connector that ignores
    # salts, and no local cache of q) reads under other salts, then under "alice".
    _serve_and_wait_saved(b, p, store_cluster, all_keys(store_cluster), cache_salt="alice")
    r = a.complete(q, 8, cache_salt="bob")
    assert cached_tokens(r) == 0
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8)
    r = a.complete(q, 8)  # no salt either
    assert cached_tokens(r) == 0
    q3 = p[:PREFIX] + prompt_ids(90, 23)  # q is now in A's and the baseline's local caches
    r = a.complete(q3, 8, cache_salt="alice")
    assert cached_tokens(r) == PREFIX
    assert r["choices"][0]["token_ids"] == baseline.tokens(q3, 8, cached_prefix=PREFIX, writers=[p])


def test_writer_killed_between_putstart_and_putend(engines, baseline, store_cluster, raw):
    a, b = engines
    p, q = _shared(31, 32)
    keys = sorted(_serve_and_wait_saved(a, p, store_cluster, all_keys(store_cluster)))
    sizes = [raw.get_size(k) for k in keys]
    assert all(rc == 0 for rc in raw.batch_remove(keys, True))
    kill_mid_put(store_cluster.master_addr, keys, sizes)
    assert raw.batch_is_exist(keys) == [0] * len(keys)
    r = b.complete(q, 8)
    assert cached_tokens(r) == 0
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8)


def _ordered_chunk_keys(engine, prompt, cluster, n_chunks) -> list[str]:
    """Keys of ``prompt``'s first chunks in chain order: serve growing prefixes, one chunk each."""
    keys = []
    for j in range(n_chunks):
        before = all_keys(cluster)
        engine.complete(prompt[: 64 * (j + 1) + 10], 1)
        deadline = time.monotonic() + 10
        while not (new := all_keys(cluster) - before):
            assert time.monotonic() < deadline, f"chunk {j} was not saved"
            time.sleep(0.1)
        assert len(new) == 1, new
        keys.append(new.pop())
    return keys


def test_bad_objects_mid_prompt_are_recomputed(engines, baseline, store_cluster, raw):
    """Chunk 3 replaced by an object of another size and chunk 5 removed: B loads chunks 0-2,
    reports the blocks of chunk 3 and every chunk after it as load errors, and vLLM recomputes
    from there; tokens stay right."""
    a, b = engines
    p, q = _shared(91, 92)
    keys = _ordered_chunk_keys(a, p, store_cluster, 8)
    assert raw.upsert(keys[3], b"\x01" * 1000) == 0
    assert raw.remove(keys[5], True) == 0
    fails0 = b.metric("vllm:mctier_store_failures_total")
    r = b.complete(q, 8)
    # B used chunks 0-2 (A computed them one pass each, above) and recomputed the rest.
    writers = [p[:64 * (j + 1) + 10] for j in range(3)]
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=192, writers=writers)
    # Mooncake reports a short object as a transfer failure (-800) or bad params (-600).
    assert b.metric("vllm:mctier_store_failures_total") == fails0 + 1
    assert b.metric("vllm:mctier_store_lookups_total", kind="hit") >= 1


def test_bad_objects_mid_prompt_in_a_synchronous_load_are_recomputed(engines, baseline, store_cluster, raw):
    """The same faults on A, whose load is synchronous: vLLM scheduled the request and ran its
    forward in the step that loaded chunks 0-2 and failed at chunk 3. The step reports the
    blocks of chunk 3 and every chunk after it as load errors; vLLM drops that step's output,
    rewinds the request to the first bad block and recomputes from there: tokens stay right."""
    a, b = engines
    p, q = _shared(93, 94)
    keys = _ordered_chunk_keys(b, p, store_cluster, 8)  # B writes: A has no local copy of p
    assert raw.upsert(keys[3], b"\x01" * 1000) == 0
    assert raw.remove(keys[5], True) == 0
    fails0 = a.metric("vllm:mctier_store_failures_total")
    sync0 = a.metric("vllm:mctier_store_loads_total", kind="sync")
    r = a.complete(q, 8)
    writers = [p[:64 * (j + 1) + 10] for j in range(3)]
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=192, writers=writers)
    assert a.metric("vllm:mctier_store_failures_total") == fails0 + 1
    assert a.metric("vllm:mctier_store_loads_total", kind="sync") == sync0 + 1


def test_master_stopped_then_restarted(engines, baseline, store_cluster):
    a, b = engines
    store_cluster.stop_master()
    try:
        for i in range(3):
            p, q = prompt_ids(600, 40 + i), prompt_ids(600, 50 + i)
            t0 = time.monotonic()
            ra = a.complete(p, 8)
            rb = b.complete(q, 8)
            assert time.monotonic() - t0 < 15, "a dead master must not stall requests"
            assert ra["choices"][0]["token_ids"] == baseline.tokens(p, 8)
            assert rb["choices"][0]["token_ids"] == baseline.tokens(q, 8)
            assert cached_tokens(rb) == 0
    finally:
        store_cluster.restart_master()
    # Data is gone with the old master; saves and hits come back with the new one.
    deadline = time.monotonic() + 60
    attempt = 0
    while True:
        attempt += 1
        p, q = _shared(60 + attempt, 80 + attempt)
        a.complete(p, 4)
        time.sleep(1.5)
        r = b.complete(q, 8)
        if cached_tokens(r) == PREFIX:
            assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=PREFIX, writers=[p])
            break
        assert time.monotonic() < deadline, "no store hit within 60 s of the master restart"
