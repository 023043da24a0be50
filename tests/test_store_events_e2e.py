"""The store tier's lookup, KV events and cache reset on a real engine (real mooncake_master and
store server): store hits load through the non-blocking lookup; a subscriber built from vLLM's
own event decoder sees the tier's ``BlockStored`` after a save (with the hashes the engine's own
events give those blocks) and ``BlockRemoved`` after a remove; ``/reset_prefix_cache`` with
``reset_external`` empties the tier's caches and (``reset_removes_objects``) its objects; a
master that stops answering makes lookups misses and requests are computed, never stuck. Every
completion is checked against the no-connector baseline."""

from __future__ import annotations

import json
import os
import tempfile
import time

import msgspec
import pytest
import requests
import zmq

from kvcore.procs import free_port
from tests.harness import Engine, cached_tokens, prompt_ids
from tests.store_util import all_keys, store_kv, wait_saved
from tests.support import frozen, wait_metric

pytestmark = pytest.mark.e2e

CHUNK = 64
HANG_S = 60.0


class Subscriber:
    """vLLM's ZMQ KV events of one engine, decoded by vLLM's own ``KVEventBatch``."""

    def __init__(self, endpoint: str):
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.events: list = []

    def drain(self, wait_s: float = 0.0) -> list:
        end = time.monotonic() + wait_s
        while True:
            left = max(0.0, end - time.monotonic())
            if not self._sock.poll(int(left * 1000)):
                return self.events
            *_, payload = self._sock.recv_multipart()
            self.events += self._decoder.decode(payload).events

    def until(self, pred, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while not pred(self.drain(0.2)):
            assert time.monotonic() < deadline, f"events not seen in {timeout}s: {self.events}"
        return self.events

    def close(self) -> None:
        self._sock.close(0)


@pytest.fixture(scope="module")
def engine(store_cluster):
    ipc = os.path.join(tempfile.mkdtemp(prefix="mct-ev-"), "events")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{ipc}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    e = Engine("store-events", 0, store_kv(store_cluster.master_addr, reset_removes_objects=True),
               extra_args=["--kv-events-config", json.dumps(events)], dev_mode=True)
    e.wait_ready()
    sub = Subscriber(f"ipc://{ipc}")
    e.complete(prompt_ids(40, 900), 2)  # the subscription is live before the events tested
    sub.drain(1.0)
    yield e, sub
    sub.close()
    e.stop()


def _mooncake(events, kind: str) -> list:
    return [ev for ev in events if type(ev).__name__ == kind and ev.medium == "mooncake"]


def test_store_hit_through_the_non_blocking_lookup_and_its_stored_events(engine, baseline, store_cluster):
    e, sub = engine
    p = prompt_ids(3 * CHUNK + 20, 910)
    q = p[:3 * CHUNK] + prompt_ids(30, 911)
    sub.events.clear()
    before = all_keys(store_cluster)
    e.complete(p, 2)
    assert len(wait_saved(store_cluster, before, 3)) == 3
    events = sub.until(lambda evs: len(_mooncake(evs, "BlockStored")) >= 3)
    stored = _mooncake(events, "BlockStored")
    # One event per chunk, in vLLM's shape: its block hashes (those its own GPU events give the
    # same blocks), the tokens, block size, parent and group.
    gpu = {tuple(ev.token_ids): ev for ev in events if type(ev).__name__ == "BlockStored" and ev.medium != "mooncake"}
    own_hashes = [h for ev in events if type(ev).__name__ == "BlockStored" and ev.medium != "mooncake"
                  for h in ev.block_hashes]
    assert [ev.token_ids for ev in stored] == [p[i * CHUNK:(i + 1) * CHUNK] for i in range(3)]
    assert [h for ev in stored for h in ev.block_hashes] == own_hashes[:3 * CHUNK // 32], (stored, gpu)
    assert all(ev.block_size == 32 and ev.group_idx == 0 and len(ev.block_hashes) == CHUNK // 32 for ev in stored)
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == stored[0].block_hashes[-1]
    # A store hit through the non-blocking lookup: the local cache emptied, q loads 3 chunks.
    waits = e.metric("vllm:mctier_store_lookup_wait_seconds_count")
    e.reset_prefix_cache()
    r = e.complete(q, 8)
    assert cached_tokens(r) == 3 * CHUNK
    assert r["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=3 * CHUNK, writers=[p])
    assert e.metric("vllm:mctier_store_lookup_wait_seconds_count") > waits  # answered at a later step
    assert e.metric("vllm:mctier_store_loaded_tokens_total") >= 3 * CHUNK
    assert e.metric("vllm:mctier_store_loads_total", kind="sync") >= 1  # sync_load_max's in-step load still holds


def _key_space(raw, store_cluster):
    """The engine's key space, from the metadata it published (one engine in this module)."""
    from mcstore.keys import EngineMeta

    (meta,) = [msgspec.json.decode(raw.get(k), type=EngineMeta) for k in all_keys(store_cluster)
               if k.endswith("/meta")]
    return meta.key_space()


def test_removed_chunks_are_announced_and_reset_removes_the_engines_objects(engine, baseline, store_cluster, raw):
    e, sub = engine
    p = prompt_ids(4 * CHUNK + 10, 920)
    sub.events.clear()
    before = all_keys(store_cluster)
    e.complete(p, 2)
    wait_saved(store_cluster, before, 4)
    sub.until(lambda evs: len(_mooncake(evs, "BlockStored")) >= 4)
    announced = {tuple(ev.token_ids): ev for ev in _mooncake(sub.events, "BlockStored")}
    announced = [announced[tuple(p[i * CHUNK:(i + 1) * CHUNK])] for i in range(4)]
    # Chunk 0 removed behind the engine's back: its next lookup of p finds it gone (the chunks
    # after it are of no use then) and p is computed whole.
    ks = _key_space(raw, store_cluster)
    links = ks.links(p)
    assert set(ks.all_rank_keys(links)) <= all_keys(store_cluster)
    assert all(raw.remove(k) == 0 for k in ks.all_rank_keys(links[:1]))
    sub.events.clear()
    e.reset_prefix_cache()
    r = e.complete(p, 4)
    assert cached_tokens(r) == 0
    assert r["choices"][0]["token_ids"] == baseline.tokens(p, 4)
    removed = sub.until(lambda evs: _mooncake(evs, "BlockRemoved"))
    assert [ev.block_hashes for ev in _mooncake(removed, "BlockRemoved")] == [announced[0].block_hashes]
    assert all(ev.group_idx == 0 for ev in _mooncake(removed, "BlockRemoved"))
    # reset_external: the tier's caches and (reset_removes_objects) every object of its key
    # space go; the published engine metadata stays; what it had announced is removed.
    time.sleep(1.0)  # p's chunk 0 is saved again, the others found stored (all announced again)
    sub.drain(0.5)
    sub.events.clear()
    resets = e.metric("vllm:mctier_store_resets_total")
    resp = requests.post(e.url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
    assert resp.status_code == 200 and resp.json()["success"] is True
    left = all_keys(store_cluster)
    assert left and all(k.endswith("/meta") for k in left), sorted(left)[:5]
    r = e.complete(p, 4)
    assert cached_tokens(r) == 0  # nothing local, nothing in the store
    assert r["choices"][0]["token_ids"] == baseline.tokens(p, 4)
    # Events and the scheduler's counters go out with the engine's steps: p's made some.
    removed = [ev.block_hashes for ev in _mooncake(sub.until(lambda evs: _mooncake(evs, "BlockRemoved")),
                                                   "BlockRemoved")]
    assert announced[0].block_hashes in removed and announced[3].block_hashes in removed
    assert wait_metric(lambda: e.metric("vllm:mctier_store_resets_total"), lambda v: v > resets, 10) == resets + 1


def test_a_master_that_stops_answering_makes_lookups_misses_and_requests_computed(engine, baseline, store_cluster):
    e, _ = engine
    p = prompt_ids(3 * CHUNK + 5, 930)
    before = all_keys(store_cluster)
    e.complete(p, 2)
    wait_saved(store_cluster, before, 3)
    e.reset_prefix_cache()
    timeouts = e.metric("vllm:mctier_store_lookups_total", kind="timeout")
    with frozen(store_cluster.master.popen.pid):
        t0 = time.monotonic()
        r = e.complete(p, 4, timeout=HANG_S)
        took = time.monotonic() - t0
    assert took < HANG_S
    assert cached_tokens(r) == 0  # the stored prefix was a miss: computed
    assert r["choices"][0]["token_ids"] == baseline.tokens(p, 4)
    assert e.metric("vllm:mctier_store_lookups_total", kind="timeout") >= timeouts + 1
