"""A step's lookups as one batch all the way (issue 47, the scheduler stall): the directory reads
of every lookup of a batch with partial hits in one ``get_batch`` and the parts of the objects
they name in one ``batch_is_exist`` (:func:`mcstore.lookup.finish_many`), the keys made on the
lookup thread (the scheduler's thread only queues a lookup, O(1), no hashing), and the
lookup thread keeping off the GIL while the scheduler's step runs, except while it waits.
Pure logic with a stand-in client, then against a real mooncake_master (no engine)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from mcstore.batchlookup import LookupQueue
from mcstore.config import load_config
from mcstore.keys import Directory, KeySpace, fingerprint
from mcstore.lookup import Probe, finish, finish_many, reach
from tests.support import wait_for

BS, CB = 32, 4  # tokens per block, blocks per chunk
CHUNK = BS * CB
KS = KeySpace(fingerprint({"t": "lookup-batch"}), CHUNK, block_tokens=BS)


def _toks(n: int, seed_: int) -> list[int]:
    import random

    rng = random.Random(seed_)
    return [rng.randrange(4, 30_000) for _ in range(n)]


def _writers(n: int, seed_: int = 0) -> list[list[int]]:
    """Prompts of one whole chunk and a tail of 3 blocks (a part object): what a save stores."""
    return [_toks(CHUNK + 3 * BS, seed_ + i) for i in range(n)]


def _objects(writer: list[int]) -> dict[str, bytes]:
    """What the store holds after ``writer``'s save: chunk 0, the part object of its 3 tail
    blocks, and the directory entries of both (keys as the store tier names them)."""
    hs = KS.hashes(writer)
    out = {k: b"kv" for k in KS.all_rank_keys(KS.links(writer))}
    out.update({k: b"kv" for k in KS.all_rank_keys([KS.part_link(hs[CB + 2], 3)])})
    out[KS.dir_key(hs[0])] = Directory.of(hs[:CB]).encode()
    out[KS.dir_key(hs[CB])] = Directory.of(hs[CB:CB + 3]).encode()
    return out


def _readers(writers: list[list[int]]) -> list[list[int]]:
    """Each writer's chunk and 2 of its tail blocks, then other tokens: a hit of CHUNK + 2 blocks."""
    return [w[:CHUNK + 2 * BS + 5] + _toks(2 * BS, 1000 + i) for i, w in enumerate(writers)]


class _Dict:
    """A store client over a dict: ``exists``, ``fetch``, ``fetch_many``, every call recorded."""

    available = True

    def __init__(self, objects: dict[str, bytes], many: bool = True):
        self.objects = objects
        self.calls: list[tuple[str, int]] = []
        if not many:
            self.fetch_many = None

    def exists(self, keys):
        self.calls.append(("exists", len(keys)))
        return [1 if k in self.objects else 0 for k in keys]

    def fetch(self, key, max_bytes):
        self.calls.append(("fetch", 1))
        raw = self.objects.get(key)
        return raw if raw is not None and len(raw) <= max_bytes else None

    def fetch_many(self, keys, max_bytes):
        self.calls.append(("fetch_many", len(keys)))
        return [r if r is not None and len(r) <= max_bytes else None for r in map(self.objects.get, keys)]

    def close(self):
        pass


@pytest.mark.unit
def test_finish_many_reads_every_directory_of_a_batch_in_one_call_and_answers_as_finish():
    writers = _writers(6)
    objects = {k: v for w in writers for k, v in _objects(w).items()}
    readers = _readers(writers)
    stranger = _toks(CHUNK + 2 * BS, 99)  # nothing stored: its chunk-0 entry is absent, no read
    whole = writers[0][:CHUNK] + _toks(7, 98)  # chunk 0 stored, no full block after it: no read
    prompts = readers + [stranger, whole]
    probes = [Probe(KS, KS.hashes(p), len(p)) for p in prompts]
    client = _Dict(objects)
    first = client.exists([k for pr in probes for k in pr.first_keys()])
    rcs, off = [], 0
    for pr in probes:
        rcs.append(first[off:off + len(pr.first_keys())])
        off += len(pr.first_keys())
    client.calls.clear()
    paused = []
    got = finish_many(client, [(pr, r, len(p) - 1) for pr, r, p in zip(probes, rcs, prompts)],
                      pause=lambda: paused.append(1))
    # One get_batch for the six readers' entries, one batch_is_exist for the six part objects.
    assert client.calls == [("fetch_many", 6), ("exists", 6)]
    assert [r.tokens for r in got] == [CHUNK + 2 * BS] * 6 + [0, CHUNK]
    assert [r.round_trips for r in got] == [3] * 6 + [1, 1]
    assert paused  # the lookup thread's hand-overs of the GIL
    # The same reaches, lookup by lookup, with the old sequential reads (a client without
    # fetch_many gets one fetch a directory).
    seq = _Dict(objects, many=False)
    assert [finish(seq, pr, r, len(p) - 1) for pr, r, p in zip(probes, rcs, prompts)] == got
    assert [c for c, _ in seq.calls].count("fetch") == 6
    assert [reach(client, pr, len(p) - 1) for pr, p in zip(probes, prompts)] == got


@pytest.mark.unit
def test_finish_many_an_incomplete_or_unreadable_object_is_no_partial_hit():
    writers = _writers(3, seed_=10)
    objects = {k: v for w in writers for k, v in _objects(w).items()}
    hs1 = KS.hashes(writers[1])
    del objects[KS.all_rank_keys([KS.part_link(hs1[CB + 2], 3)])[0]]  # writer 1's part object gone
    objects[KS.dir_key(KS.hashes(writers[2])[CB])] = b"\x92garbage"  # writer 2's entry malformed
    readers = _readers(writers)
    probes = [Probe(KS, KS.hashes(p), len(p)) for p in readers]
    client = _Dict(objects)
    items = [(pr, client.exists(pr.first_keys()), len(p) - 1) for pr, p in zip(probes, readers)]
    client.calls.clear()
    got = finish_many(client, items)
    assert [r.tokens for r in got] == [CHUNK + 2 * BS, CHUNK, CHUNK]
    assert [r.partial is not None for r in got] == [True, False, False]
    assert client.calls == [("fetch_many", 3), ("exists", 2)]  # the malformed entry names nothing
    assert finish_many(client, []) == []


def _request(tokens, rid):
    n = len(tokens)
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=n, num_tokens=n,
                           num_computed_tokens=0, cache_salt=None, lora_request=None, mm_features=None)


def _step():
    return SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={}, scheduled_new_reqs=[])


def _sched(client, **extra):
    from mcstore.scheduler import StoreScheduler

    cfg = load_config({"master": "h:1", "chunk_tokens": CHUNK, **extra}, env={})
    return StoreScheduler(cfg, KS, BS, load=True, save=False, client=client)


@pytest.mark.unit
def test_the_scheduler_queues_lookups_without_hashing_and_its_batch_reads_directories_once(monkeypatch):
    import mcstore.reqstate as sched_mod

    writers = _writers(5, seed_=20)
    client = _Dict({k: v for w in writers for k, v in _objects(w).items()})
    s = _sched(client, lookup_wait_ms=0)
    hashed_on: list[str] = []
    real = sched_mod.block_hashes

    def spy(ks, request, nblocks):
        hashed_on.append(threading.current_thread().name)
        return real(ks, request, nblocks)

    monkeypatch.setattr(sched_mod, "block_hashes", spy)
    try:
        reqs = [_request(p, f"r{i}") for i, p in enumerate(_readers(writers))]
        for r in reqs:
            s.on_new_request(r)
        assert hashed_on == []  # queued in O(1): no hash on the scheduler's thread
        assert all(s.get_num_new_matched_tokens(r, 0) == (None, False) for r in reqs)
        s.build_connector_meta(_step())
        wait_for(lambda: all(s._reqs[r.request_id].pending.done for r in reqs), 10)
        got = [s.get_num_new_matched_tokens(r, 0) for r in reqs]
        assert got == [(CHUNK + 2 * BS, True)] * 5
        assert hashed_on == ["mcstore-lookup-scheduler"] * 5
        assert s.lookups.batches == 1 and s.lookups.calls == 1
        assert client.calls == [("exists", 5 * 3), ("fetch_many", 5), ("exists", 5)]
        # The request's hashes and links were adopted from its lookup, not made twice.
        st = s._reqs["r0"]
        assert st.links == KS.links(reqs[0].prompt_token_ids) and st.hashes == KS.hashes(reqs[0].prompt_token_ids)
        assert hashed_on == ["mcstore-lookup-scheduler"] * 5
        assert s.stats.data["counters"]["partial_hit_tokens"] == 5 * 2 * BS
    finally:
        s.close()


class _Slow(_Dict):
    """A master that takes ``delay`` seconds to answer batch_is_exist."""

    delay = 0.0

    def exists(self, keys):
        time.sleep(self.delay)
        return super().exists(keys)


@pytest.mark.unit
def test_a_step_waits_only_for_its_own_lookups_and_never_for_a_batch_expected_to_take_longer():
    writers = _writers(4, seed_=60)
    client = _Slow({k: v for w in writers for k, v in _objects(w).items()})
    s = _sched(client, lookup_wait_ms=50)
    reqs = [_request(p, f"s{i}") for i, p in enumerate(_readers(writers))]
    try:
        # A master that answers within the wait: answered in the step (the wait as before).
        client.delay = 0.005
        s.on_new_request(reqs[0])
        assert s.get_num_new_matched_tokens(reqs[0], 0) == (CHUNK + 2 * BS, True)
        s.build_connector_meta(_step())
        # One that does not: the step waits once, for its own lookup; the next step asks the
        # master nothing new and waits for nothing (the lookup is out already).
        client.delay = 0.2
        s.on_new_request(reqs[1])
        t0 = time.monotonic()
        assert s.get_num_new_matched_tokens(reqs[1], 0) == (None, False)
        assert 0.04 <= time.monotonic() - t0 < 0.15
        s.build_connector_meta(_step())
        t0 = time.monotonic()
        assert s.get_num_new_matched_tokens(reqs[1], 0) == (None, False)
        assert time.monotonic() - t0 < 0.02
        s.build_connector_meta(_step())
        wait_for(lambda: s._reqs["s1"].pending.done, 10)
        assert s.get_num_new_matched_tokens(reqs[1], 0) == (CHUNK + 2 * BS, True)
        s.build_connector_meta(_step())
        # The last batches took 0.2 s: a new batch is expected to take longer than the wait, so
        # the step does not wait for it at all; its answer comes at a later step, as good.
        assert s.lookups.expected_s(1) > 0.05
        for r in reqs[2:]:
            s.on_new_request(r)
        t0 = time.monotonic()
        assert [s.get_num_new_matched_tokens(r, 0) for r in reqs[2:]] == [(None, False)] * 2
        assert time.monotonic() - t0 < 0.02
        s.build_connector_meta(_step())
        wait_for(lambda: all(s._reqs[r.request_id].pending.done for r in reqs[2:]), 10)
        assert [s.get_num_new_matched_tokens(r, 0) for r in reqs[2:]] == [(CHUNK + 2 * BS, True)] * 2
        assert "lookups:timeout" not in s.stats.data["counters"]
    finally:
        s.close()


@pytest.mark.unit
def test_lookup_queue_keys_made_on_its_thread_and_a_failing_one_fails_alone():
    asked = []

    def exists(keys):
        asked.append(list(keys))
        return [1] * len(keys)

    q = LookupQueue(exists, "t")
    try:
        names = []

        def keys():
            names.append(threading.current_thread().name)
            return ["a", "b"]

        def broken():
            raise ValueError("no keys")

        ok = q.submit(keys, lambda rcs: sum(rcs), 5)
        bad = q.submit(broken, lambda rcs: 0, 5)
        plain = q.submit(["c"], lambda rcs: list(rcs), 5)
        q.flush()
        assert q.wait(ok, 5) and q.wait(bad, 5) and q.wait(plain, 5)
        assert names == ["mcstore-lookup-t"]
        assert ok.result == 2 and plain.result == [1]
        assert isinstance(bad.error, ValueError) and bad.result is None
        assert asked == [["a", "b", "c"]]  # one call for the batch, without the failed lookup's
    finally:
        q.close()


@pytest.mark.unit
def test_lookup_queue_answer_many_answers_a_batch_in_one_call():
    seen = []

    def many(items, pause):
        seen.append([ctx for ctx, _ in items])
        pause()
        return [ctx * sum(rcs) for ctx, rcs in items[:-1]] + [KeyError("last")]

    q = LookupQueue(lambda keys: [1] * len(keys), "many", answer_many=many)
    try:
        lks = [q.submit(["k"] * (i + 1), i + 10, 5) for i in range(3)]
        q.flush()
        assert all(q.wait(lk, 5) for lk in lks)
        assert seen == [[10, 11, 12]]
        assert [lk.result for lk in lks] == [10, 22, None] and isinstance(lks[2].error, KeyError)
    finally:
        q.close()


@pytest.mark.unit
def test_lookup_queue_keeps_off_the_gil_while_its_caller_is_busy_but_works_while_it_waits():
    """A busy caller (the scheduler's step) has the GIL to itself: the lookup thread's Python
    work stops at its next slice boundary, except while the caller waits; idle again, the
    thread finishes the batch."""
    made = []
    gate = threading.Event()

    def keys(i):
        def make():
            made.append(i)
            if i == 0:
                gate.set()
            time.sleep(0.001)  # 1 ms of key making each, past a slice
            return [f"k{i}"]
        return make

    q = LookupQueue(lambda ks: [1] * len(ks), "busy")
    try:
        lks = [q.submit(keys(i), lambda rcs: 1, 30) for i in range(20)]
        q.busy()
        q.flush()
        assert q.wait(lks[0], 0.005) is False  # works while the caller waits: not all 20 ms of it
        assert gate.is_set()
        n = len(made)
        time.sleep(0.05 * 0.6)  # busy, not waiting: the thread holds off (within MAX_BACKOFF_S)
        assert len(made) <= n + 1
        q.idle()
        assert q.wait(lks[-1], 5) and len(made) == 20
    finally:
        q.close()


# -- against a real master --------------------------------------------------------------------


@pytest.fixture
def _client_env(monkeypatch):
    from mcstore.server import CLIENT_ENV

    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.integration
def test_fetch_many_reads_small_objects_in_one_call_absent_and_oversized_as_none(store_cluster, _client_env):
    from mcstore.client import StoreClient
    from mcstore.config import StoreConfig

    c = StoreClient(StoreConfig(master=store_cluster.master_addr), "t-fetch", segment=False)
    try:
        assert c.upsert_small(["fm/a", "fm/b", "fm/big"], [b"alpha", b"beta", b"x" * 500]) == 0
        assert c.fetch_many(["fm/a", "fm/none", "fm/b", "fm/big"], 100) == [b"alpha", None, b"beta", None]
        assert c.fetch_many([], 100) == []
        assert [c.fetch(k, 100) for k in ("fm/a", "fm/none", "fm/big")] == [b"alpha", None, None]
    finally:
        c.close()


@pytest.mark.integration
def test_a_steps_partial_hits_read_their_directories_in_one_get_batch(store_cluster, _client_env):
    """Eight requests arriving at once, each sharing a stored prompt's chunk and two blocks of
    its tail (a part object, found through its directory entry): one batch_is_exist, one
    get_batch of the eight entries, one batch_is_exist of the eight part objects; the hits as
    the blocking lookup finds them, token for token."""
    from mcstore.scheduler import StoreScheduler
    from tests.store_util import raw_client

    writers = _writers(8, seed_=40)
    raw = raw_client(store_cluster.master_addr)
    cfg = load_config({"master": store_cluster.master_addr, "chunk_tokens": CHUNK, "lookup_wait_ms": 0}, env={})
    s = StoreScheduler(cfg, KS, BS, load=True, save=False)
    blocking = StoreScheduler(load_config({"master": store_cluster.master_addr, "chunk_tokens": CHUNK,
                                           "lookup_blocking": True}, env={}), KS, BS, load=True, save=False)
    try:
        for w in writers:
            for k, v in _objects(w).items():
                assert raw.put(k, v) == 0
        calls = []
        for name in ("exists", "fetch_many", "fetch"):
            real = getattr(s.client, name)

            def spy(*a, _real=real, _name=name):
                calls.append(_name)
                return _real(*a)

            setattr(s.client, name, spy)
        reqs = [_request(p, f"p{i}") for i, p in enumerate(_readers(writers))]
        others = [_request(_toks(CHUNK + 2 * BS, 500), "stranger"), _request(writers[0][:CHUNK] + [5] * 9, "whole")]
        for r in reqs + others:
            s.on_new_request(r)
        assert all(s.get_num_new_matched_tokens(r, 0) == (None, False) for r in reqs + others)
        s.build_connector_meta(_step())
        wait_for(lambda: all(s._reqs[r.request_id].pending.done for r in reqs + others), 10)
        got = {r.request_id: s.get_num_new_matched_tokens(r, 0) for r in reqs + others}
        want = {r.request_id: (CHUNK + 2 * BS, True) for r in reqs}
        want.update({"stranger": (0, False), "whole": (CHUNK, True)})
        assert got == want
        # The queue's own batch_is_exist (bound before the spies), then the batch's two more calls.
        assert s.lookups.batches == 1 and s.lookups.calls == 1
        assert calls == ["fetch_many", "exists"]
        assert {r.request_id: blocking.get_num_new_matched_tokens(r, 0) for r in reqs + others} == want
        assert s.stats.data["counters"]["partial_hit_tokens"] == 8 * 2 * BS
    finally:
        s.close()
        blocking.close()
        raw.close()
