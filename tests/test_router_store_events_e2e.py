"""The router's store view from the store tier's KV events, on real components.

A real mooncake_master and store server; two plain engines (the tiny model) with the
``StoreConnector`` (chunks of 64 tokens), each publishing vLLM's KV events over ZMQ (the store
tier's ``BlockStored``/``BlockRemoved`` of medium ``mooncake`` among them); ``mctier proxy
--plain A B --store MASTER``, which finds the event streams through the engines'
``/kv_event_sources`` and keeps what the store tier's events say the store holds in one store
index (:mod:`multi.router.storeview`); the session's no-connector reference engine. That a
subscriber built from vLLM's own event decoder receives the store tier's events is
``tests/test_store_events_e2e.py``'s.

- A prompt shorter than a chunk costs the master no lookup (``short``: nothing the store could
  add is worth the round trip); a longer one the events say nothing of costs none either
  (``skipped``); a prompt whose
  chunks an engine saved is looked up and confirmed (``confirmed``), from the events of the
  engine that saved them, wherever the request goes.
- An object removed behind the router's back (the master's remove, as an operator's tool or an
  eviction would): the router's lookup finds less than the events said (``stale``), the route
  counts only on what is there, the view is corrected, and the answer's token ids are the
  no-connector engine's greedy ids for the same computation.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import msgspec
import pytest
import requests

from kvcore.procs import Proc, free_port
from tests.harness import LOGS, ROOT, Engine, cached_tokens, prompt_ids, start_engines
from tests.store_util import all_keys, raw_client, store_kv
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 64
BLOCK = 32
IPC_DIR = tempfile.mkdtemp(prefix="mct-rse-")


def events_args(name: str) -> list[str]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{IPC_DIR}/{name}",
           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return ["--kv-events-config", json.dumps(cfg)]


class Routed:
    def __init__(self, cluster, baseline):
        self.master = cluster.master_addr
        kv = store_kv(self.master)
        self.a = Engine("rse-A", 0, kv, extra_args=events_args("a"), dev_mode=True)
        self.b = Engine("rse-B", 1, kv, extra_args=events_args("b"), dev_mode=True)
        try:
            baseline.engine()  # started meanwhile
            start_engines(self.a, self.b)
            self.log = os.path.join(IPC_DIR, "decisions.jsonl")
            port = free_port()
            argv = [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port), "--plain", self.a.url,
                    self.b.url, "--store", self.master, "--policy", "kv", "--policy-config",
                    json.dumps({"calibrate": False}), "--health-interval", "1", "--decision-log", self.log]
            self.proxy = Proc("rse-router", argv, LOGS / f"rse-router-{port}.log", cwd=str(ROOT))
            self.proxy.wait_port(port, 60)
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        # Both event streams followed (the store index filters only then): the subscribers are up
        # once the router has counted a batch of each engine.
        for e in (self.a, self.b):
            e.complete(prompt_ids(40, 7000 + e.port % 97), 1)
            assert wait_for(lambda e=e: self.metric("mctier_router_events", instance=e.url, kind="batches") >= 1, 15)

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict:
        r = requests.post(self.url + "/v1/completions", timeout=120,
                          json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def checks(self) -> dict[str, float]:
        return {k: self.metric("mctier_router_store_checks_total", outcome=k)
                for k in ("short", "skipped", "confirmed", "stale", "unfiltered", "unanswered")}

    def records(self) -> list[dict]:
        with open(self.log) as f:
            return [json.loads(x) for x in f]

    def decision(self, n: int, after: int) -> dict:
        """The first decision record past the ``after`` earlier ones of an n-token prompt
        (written as its answer ends)."""
        got = wait_for(lambda: [d for d in self.records()[after:] if d["n"] == n][:1], 10)
        assert got, f"no decision record for a {n}-token prompt"
        return got[0]

    def store_blocks(self) -> float:
        return self.metric("mctier_router_index_blocks", view="store", kind="exact")

    def stop(self) -> None:
        if getattr(self, "proxy", None) is not None:
            self.proxy.stop()
        self.a.stop()
        self.b.stop()


@pytest.fixture(scope="module")
def rs(store_cluster, baseline):
    r = Routed(store_cluster, baseline)
    yield r
    r.stop()


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_the_store_view_answers_from_the_store_tiers_events(rs, baseline):
    p = prompt_ids(3 * CHUNK + 20, 7101)
    blocks = rs.store_blocks()
    rs.a.complete(p, 2)  # straight to A: A's store tier saves three chunks and announces them
    assert wait_for(lambda: rs.store_blocks() >= blocks + 3 * CHUNK // BLOCK, 20), rs.store_blocks()
    # Prompts nothing stored: no lookup (shorter than a chunk: not even the events asked).
    before = rs.checks()
    for n, seed, outcome, said in ((100, 7102, "skipped", 0), (100, 7103, "skipped", 0), (50, 7104, "short", None)):
        q, seen = prompt_ids(n, seed), len(rs.records())
        assert rs.complete(q)["choices"][0]["token_ids"] == baseline.tokens(q, 8)
        d = rs.decision(len(q), seen)
        assert (d["store"], d["store_check"], d["store_events"]) == (0, outcome, said)
    assert _delta(rs.checks(), before) == {"skipped": 2, "short": 1}
    # A prompt on A's chunks, with A's cache emptied: the events say 192 tokens, the lookup
    # confirms them, and the engine the router picks loads them from the store.
    rs.a.reset_prefix_cache()
    # A tail of more than a chunk: the router may still hold A's 192 tokens as cached (the engine
    # publishes the reset's event at its next step), and would not ask the store for less (short).
    q = p[:3 * CHUNK] + prompt_ids(CHUNK + 30, 7105)
    before, seen = rs.checks(), len(rs.records())
    resp = rs.complete(q)
    d = rs.decision(len(q), seen)
    assert (d["store"], d["store_check"], d["store_events"]) == (3 * CHUNK, "confirmed", 3 * CHUNK), d
    assert _delta(rs.checks(), before) == {"confirmed": 1}
    assert cached_tokens(resp) == 3 * CHUNK
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8, cached_prefix=3 * CHUNK, writers=[p])
    assert rs.metric("mctier_router_events", instance=rs.a.url, kind="store_stored") >= 3 * CHUNK // BLOCK


def _key_space(raw, cluster):
    """The engines' key space, from the metadata they published (one model, one key space)."""
    from mcstore.keys import EngineMeta

    metas = [msgspec.json.decode(raw.get(k), type=EngineMeta) for k in all_keys(cluster) if k.endswith("/meta")]
    assert len({m.fingerprint for m in metas}) == 1, metas
    return metas[0].key_space()


def test_an_object_removed_behind_the_routers_back_is_caught_by_the_lookup(rs, baseline, store_cluster):
    p = prompt_ids(3 * CHUNK + 20, 7201)
    stored = rs.metric("mctier_router_events", instance=rs.b.url, kind="store_stored")
    rs.b.complete(p, 2)  # straight to B: three chunks saved and announced
    assert wait_for(lambda: rs.metric("mctier_router_events", instance=rs.b.url, kind="store_stored")
                    >= stored + 3 * CHUNK // BLOCK, 20)
    # Chunk 0 removed from the store behind everyone's back (the master's remove): the router's
    # store index and B's tier still think it is there.
    raw = raw_client(rs.master)
    try:
        ks = _key_space(raw, store_cluster)
        gone = ks.all_rank_keys(ks.links(p)[:1])
        assert set(gone) <= all_keys(store_cluster)
        assert all(raw.remove(k) == 0 for k in gone)
    finally:
        raw.close()
    assert not set(gone) & all_keys(store_cluster)
    rs.b.reset_prefix_cache()
    q = p[:3 * CHUNK] + prompt_ids(CHUNK + 30, 7202)  # more than a chunk past B's 192 (as above)
    before, seen = rs.checks(), len(rs.records())
    resp = rs.complete(q)
    # The events said 192 tokens, the lookup found none of them (a chain breaks at its first
    # missing chunk): the route counted on nothing from the store, and the engine computed the
    # whole prompt, as the no-connector engine does.
    d = rs.decision(len(q), seen)
    assert (d["store"], d["store_check"], d["store_events"]) == (0, "stale", 3 * CHUNK), d
    assert _delta(rs.checks(), before) == {"stale": 1}
    assert cached_tokens(resp) == 0
    assert resp["choices"][0]["token_ids"] == baseline.tokens(q, 8)
