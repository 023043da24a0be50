"""Directory entries ride in their objects' put (``mcstore.saves``), against a real
mooncake_master and store server with a real ``StoreWorker`` (no vLLM engine): one Mooncake
transfer call per save, not a put and an upsert (each call keeps the saving thread polling on
the engine's core); an entry already there is still replaced (the last writer wins); an entry
whose object was not written does not stay."""

from __future__ import annotations

import pytest

from mcstore.keys import Directory
from tests.test_store_partial import BS, CB, CHUNK, _ks, _save_prompt, _scheduler, _toks, _worker

pytestmark = pytest.mark.integration


class _Calls:
    """Counts the worker client's transfer calls; ``fail``: object keys whose put is answered
    with an error (not sent), the rest of the call going through."""

    def __init__(self, client, fail=()):
        self.client, self.fail = client, set(fail)
        self.puts: list[list[str]] = []
        self.upserts: list[list[str]] = []
        self._put, self._upsert = client.put_from, client.upsert_small
        client.put_from, client.upsert_small = self.put_from, self.upsert_small

    def put_from(self, keys, ptrs, sizes):
        self.puts.append(list(keys))
        go = [i for i, k in enumerate(keys) if k not in self.fail]
        rcs = self._put([keys[i] for i in go], [ptrs[i] for i in go], [sizes[i] for i in go]) if go else []
        out = [-800] * len(keys)  # TRANSFER_FAIL for the failed ones
        for i, rc in zip(go, rcs):
            out[i] = rc
        return out

    def upsert_small(self, keys, values):
        self.upserts.append(list(keys))
        return self._upsert(keys, values)


def _entry(client, key):
    raw = client.get(key)
    return None if raw is None else Directory.decode(raw, CB)


def _setup(store_cluster):
    from mcstore.client import StoreClient
    from mcstore.config import load_config

    ks = _ks()
    master = store_cluster.master_addr
    w, buf = _worker(master, ks)
    buf.normal_()
    sched = _scheduler(master, ks)
    client = StoreClient(load_config({"master": master}, env={}), "probe", segment=False)
    return ks, w, sched, client


def test_entries_go_in_the_objects_put(store_cluster):
    """Two whole chunks and a 3-block tail: 3 objects and 3 entries in one put call, no upsert."""
    ks, w, sched, client = _setup(store_cluster)
    try:
        calls = _Calls(w.client)
        writer = _toks(2 * CHUNK + 3 * BS + 20, 40)
        job = _save_prompt(sched, w, writer, "w", list(range(1, 12)))
        objs = [ks.key(c.link, 0) for c in job.chunks]
        assert calls.puts == [objs + [d.key for d in job.dirs]] and calls.upserts == []
        wh = ks.hashes(writer)
        assert [_entry(client, d.key) for d in job.dirs] == [Directory.of(wh[0:4]), Directory.of(wh[4:8]),
                                                             Directory.of(wh[8:11])]
        assert w.stats.data["ops"].get("phase:save_dirs") is None  # no upsert phase
    finally:
        client.close()
        sched.close()
        w.close()


def test_an_entry_already_there_is_replaced(store_cluster):
    """Another writer's entry of the same first block: the put refuses it, the upsert after the
    object is written replaces it (the last writer wins, as before)."""
    ks, w, sched, client = _setup(store_cluster)
    try:
        writer = _toks(CHUNK + 2 * BS + 5, 41)
        wh = ks.hashes(writer)
        other = Directory.of([bytes(32)] * CB).encode()
        assert client.upsert(ks.dir_key(wh[0]), other) == 0
        calls = _Calls(w.client)
        job = _save_prompt(sched, w, writer, "w", list(range(1, 7)))
        assert len(calls.puts) == 1 and calls.upserts == [[ks.dir_key(wh[0])]]
        assert [_entry(client, d.key) for d in job.dirs] == [Directory.of(wh[0:4]), Directory.of(wh[4:6])]
    finally:
        client.close()
        sched.close()
        w.close()


def test_no_entry_stays_for_an_object_not_written(store_cluster):
    """The put of chunk 1's object fails, its entry's succeeds: the entry is removed; chunk 0's
    object and entry stay."""
    ks, w, sched, client = _setup(store_cluster)
    try:
        writer = _toks(2 * CHUNK + 7, 42)
        links = ks.links(writer)
        calls = _Calls(w.client, fail=[ks.key(links[1], 0)])
        job = _save_prompt(sched, w, writer, "w", list(range(1, 9)))
        assert len(calls.puts) == 1 and calls.upserts == []
        assert client.exists([ks.key(link, 0) for link in links]) == [1, 0]
        wh = ks.hashes(writer)
        assert [_entry(client, d.key) for d in job.dirs] == [Directory.of(wh[0:4]), None]
        assert w.stats.data["counters"]["failures:save_transfer"] == 1
    finally:
        client.close()
        sched.close()
        w.close()
