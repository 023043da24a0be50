"""Store hits past the last whole chunk (key version 4): block hashes, part objects, directory
entries and the lookup that reads them (``mcstore.keys``, ``mcstore.lookup``), as pure logic,
then against a real mooncake_master and store server with a real ``StoreWorker`` on a
KV-shaped tensor (no vLLM engine): the objects a save writes, what another prompt's lookup
finds, the bytes its load puts in place, and a vanished or wrong-sized object becoming a
load error for exactly its blocks."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import msgspec
import pytest

from mcstore.keys import HASH_BYTES, Directory, KeySpace, chain, fingerprint, seed
from mcstore.lookup import Partial, Probe, reach

BS, CB = 32, 4  # tokens per block, blocks per chunk
CHUNK = BS * CB
FP = fingerprint({"t": "partial"})


def _ks(tp: int = 1, pp: int = 1) -> KeySpace:
    return KeySpace(FP, CHUNK, tp, pp_size=pp, block_tokens=BS)


def _toks(n: int, seed_: int) -> list[int]:
    import random

    rng = random.Random(seed_)
    return [rng.randrange(4, 30_000) for _ in range(n)]


# -- keys and directory entries (pure) ------------------------------------------------------


@pytest.mark.unit
def test_own_chain_hashes_blocks_and_links_end_chunks():
    ks = _ks()
    p = _toks(3 * CHUNK + 2 * BS + 5, 1)
    hs = ks.hashes(p)
    assert hs == chain(seed(FP), p, BS) and len(hs) == 3 * CB + 2 and all(len(h) == HASH_BYTES for h in hs)
    # Chunk i's link: H(fingerprint, hash of its last block); a part object's: of its last block, -b{n}.
    assert ks.links(p) == [f"{ks.prefix}/{hashlib.sha256(FP.encode() + hs[i * CB + CB - 1]).hexdigest()}"
                           for i in range(3)]
    assert ks.object_link(hs[4:8]) == ks.links(p)[1]
    assert ks.object_link(hs[12:14]) == ks.part_link(hs[13], 2) == \
        f"{ks.prefix}/{hashlib.sha256(FP.encode() + hs[13]).hexdigest()}-b2"
    for bad in (0, CB):
        with pytest.raises(ValueError):
            ks.part_link(hs[0], bad)
    # A prompt that shares 2 blocks and 10 tokens shares exactly 2 block hashes.
    q = p[:2 * BS + 10] + _toks(200, 2)
    assert ks.hashes(q)[:2] == hs[:2] and not set(ks.hashes(q)[2:]) & set(hs)
    # Directory keys: by the first block's hash, per fingerprint.
    assert ks.dir_key(hs[4]) != ks.dir_key(hs[5])
    assert ks.dir_key(hs[4]).startswith(f"{ks.prefix}/d/")
    assert KeySpace(fingerprint({"t": "other"}), CHUNK, block_tokens=BS).dir_key(hs[4]) != ks.dir_key(hs[4])
    with pytest.raises(ValueError, match="whole number"):
        KeySpace(FP, CHUNK, block_tokens=48)


@pytest.mark.unit
def test_directory_entries_decode_only_when_well_formed():
    hs = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    d = Directory.of(hs)
    assert Directory.decode(d.encode(), CB) == d
    assert Directory.decode(d.encode(), 2) is None  # more hashes than a chunk has blocks
    mixed = Directory(hs[:2] + [hashlib.sha256(b"x").digest()], d.check)  # another writer's last hash
    assert Directory.decode(msgspec.msgpack.encode(mixed), CB) is None
    short = Directory([h[:16] for h in hs], hashlib.sha256(b"".join(h[:16] for h in hs)).digest()[:16])
    assert Directory.decode(msgspec.msgpack.encode(short), CB) is None
    for raw in (b"", b"\x00" * 10, d.encode()[:-3], b"\x92\x90\xc4\x00", b"x" * 10_000):
        assert Directory.decode(raw, CB) is None
    assert Directory.decode(Directory.of([]).encode(), CB) is None


# -- the lookup's logic (pure: answers given) -------------------------------------------------


@pytest.mark.unit
def test_probe_asks_chunks_and_two_directories_first():
    ks = _ks(tp=2)
    p = _toks(3 * CHUNK + BS + 3, 3)
    hs = ks.hashes(p)
    pr = Probe(ks, hs, len(p))
    keys = pr.first_keys()
    # Every part of every whole chunk, then the entries of chunk 0 and of chunk 3 (after the last whole one).
    assert keys == ks.all_rank_keys(ks.links(p)) + [ks.dir_key(hs[0]), ks.dir_key(hs[3 * CB])]
    ones = [1] * len(keys)
    assert pr.present(ones) == 3
    assert pr.present([1, 1, 1, 0, 1, 1] + ones[6:]) == 1  # a missing TP part misses the chunk
    # After 3 whole chunks the prompt has one more full block: that entry is read, unless the
    # first call found it absent, or it could add no token below the cap.
    assert pr.directory_key(3, ones, len(p) - 1) == ks.dir_key(hs[12])
    assert pr.directory_key(3, ones[:-1] + [0], len(p) - 1) is None
    assert pr.directory_key(3, ones, 3 * CHUNK) is None
    assert pr.directory_key(1, ones, len(p) - 1) == ks.dir_key(hs[4])  # not asked first: read
    assert Probe(ks, hs, len(p), partial=False).first_keys() == ks.all_rank_keys(ks.links(p))
    # A prompt of whole chunks only: nothing after them to ask about.
    whole = Probe(ks, ks.hashes(p[:2 * CHUNK]), 2 * CHUNK)
    assert whole.first_keys() == ks.all_rank_keys(whole.links) + [ks.dir_key(hs[0])]
    assert whole.directory_key(2, [1] * 5, 2 * CHUNK) is None


@pytest.mark.unit
def test_probe_matches_the_leading_blocks_a_directory_names():
    ks = _ks()
    writer = _toks(2 * CHUNK + 3 * BS, 4)
    wh = ks.hashes(writer)
    reader = writer[:CHUNK + 2 * BS + 7] + _toks(300, 5)  # diverges inside block 2 of chunk 1
    pr = Probe(ks, ks.hashes(reader), len(reader))
    entry = Directory.of(wh[CB:2 * CB]).encode()  # the writer's chunk 1
    assert pr.match(1, entry) == Partial(1, ks.links(writer)[1], CB, 2)
    assert pr.reach(1, pr.match(1, entry)).tokens == CHUNK + 2 * BS
    tail = Directory.of(wh[2 * CB:]).encode()  # the writer's tail: 3 blocks of chunk 2
    ext = writer + _toks(100, 6)  # the next turn extends the writer's prompt
    pe = Probe(ks, ks.hashes(ext), len(ext))
    assert pe.match(2, tail) == Partial(2, ks.part_link(wh[-1], 3), 3, 3)
    # An entry of another prefix (its first hash not ours), absent, or malformed: nothing.
    assert pr.match(0, entry) is None and pr.match(1, None) is None and pr.match(1, entry[:-1]) is None


# -- against a real master and a real worker --------------------------------------------------


@pytest.fixture(autouse=True)
def _client_env(monkeypatch):
    from mcstore.server import CLIENT_ENV

    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)


BLOCKS = 64


def _worker(master: str, ks: KeySpace, rank: int = 0):
    import torch

    from mcstore.config import load_config
    from mcstore.worker import StoreWorker

    cfg = load_config({"master": master, "chunk_tokens": CHUNK}, env={})
    w = StoreWorker(cfg, ks, BS, BLOCKS, rank, load=True, save=True)
    buf = torch.empty(2, BLOCKS, 2, BS, 16, dtype=torch.float32)  # two layers of CPU-layout pages
    w.register_kv_caches({f"layer{i}": buf[i] for i in range(2)})
    return w, buf


def _until(pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not (out := pred()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return out


def _scheduler(master: str, ks: KeySpace, save: bool = True):
    from mcstore.config import load_config
    from mcstore.scheduler import StoreScheduler

    return StoreScheduler(load_config({"master": master, "chunk_tokens": CHUNK}, env={}), ks, BS, load=True,
                          save=save)


def _lookup(s, req, timeout_s: float = 10.0) -> int:
    """The scheduler's lookup, asked again (as vLLM does at each step) until it is answered."""
    deadline = time.monotonic() + timeout_s
    while (hit := s.lookup(req)) is None:
        assert time.monotonic() < deadline, f"lookup of {req.request_id} unanswered after {timeout_s}s"
        time.sleep(0.005)
    return hit


def _request(tokens, rid):
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_tokens=len(tokens), num_computed_tokens=0, cache_salt=None, lora_request=None,
                           mm_features=None)


class _Blocks:
    """What ``request_block_ids`` reads of vLLM's KV cache manager: the request's block ids."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self, rid):
        return (self.ids[rid],)


def _save_prompt(sched, w, tokens, rid, block_ids):
    """The scheduler plans the prompt's saves as vLLM would after one prefill step of it, and
    the worker writes them: SaveJob with its whole chunks, its tail and their directory entries."""

    req = _request(tokens, rid)
    sched.bind_kv_cache_manager(_Blocks({rid: block_ids}))
    sched._state(req)
    out = SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(), num_scheduled_tokens={rid: len(tokens)})
    meta = sched.build_connector_meta(out)
    w.wait_for_save(meta)
    w.get_finished({rid})
    _until(lambda: rid in (w.get_finished(set())[0] or set()))
    return meta.saves[0]


@pytest.mark.integration
def test_saved_tail_and_a_divergent_chunk_are_found_and_loaded(store_cluster):
    """A writer's prompt of 2 whole chunks and 3 more blocks is saved as 2 chunk objects, a
    3-block part object and 3 directory entries. A reader that diverges inside block 2 of
    chunk 1 reaches chunk 0 plus 2 blocks; one that extends the prompt reaches all of it;
    each load puts exactly the writer's pages in its blocks."""
    import torch

    from mcstore.client import StoreClient
    from mcstore.config import load_config
    from mcstore.protocol import StoreMetadata

    ks = _ks()
    master = store_cluster.master_addr
    w, buf = _worker(master, ks)
    sched = _scheduler(master, ks)
    client = StoreClient(load_config({"master": master}, env={}), "probe", segment=False)
    try:
        buf.normal_()
        writer = _toks(2 * CHUNK + 3 * BS + 20, 10)
        src = list(range(1, 12))  # 11 blocks: 2 chunks of 4, a tail of 3 (the 20 tokens after are no block)
        job = _save_prompt(sched, w, writer, "w", src)
        wh = ks.hashes(writer)
        assert [(c.index, c.blocks, c.block_ids) for c in job.chunks] == [
            (0, 0, src[0:4]), (1, 0, src[4:8]), (2, 3, src[8:11])]
        assert [d.key for d in job.dirs] == [ks.dir_key(wh[0]), ks.dir_key(wh[4]), ks.dir_key(wh[8])]
        part = ks.part_link(wh[10], 3)
        assert client.exists([f"{link}/tp0" for link in [*ks.links(writer), part]]) == [1, 1, 1]
        assert client.exists([d.key for d in job.dirs]) == [1, 1, 1]

        reader = writer[:CHUNK + 2 * BS + 7] + _toks(200, 11)
        r = reach(client, Probe(ks, ks.hashes(reader), len(reader)), len(reader) - 1)
        assert (r.chunks, r.partial, r.tokens, r.round_trips) == (1, Partial(1, ks.links(writer)[1], CB, 2),
                                                                  CHUNK + 2 * BS, 3)
        ext = writer + _toks(150, 12)
        r2 = reach(client, Probe(ks, ks.hashes(ext), len(ext)), len(ext) - 1)
        assert (r2.chunks, r2.partial, r2.tokens) == (2, Partial(2, part, 3, 3), 2 * CHUNK + 3 * BS)
        stranger = _toks(3 * CHUNK, 13)
        r3 = reach(client, Probe(ks, ks.hashes(stranger), len(stranger)), len(stranger) - 1)
        assert (r3.tokens, r3.round_trips) == (0, 1)  # chunk 0's entry was asked in the first call: absent

        # `mctier inspect lookup` and the router's store view reach as far (the engine's own lookup).
        from mcstore.keys import engine_meta
        from mcstore.tools.inspect import Inspector
        from multi.router.storeview import StoreView

        insp = Inspector(master, f"http://127.0.0.1:{store_cluster.metrics_port}", engine_meta(ks, "mct", "m", {}))
        view = StoreView(master, "http://unused")
        view._client, view._ks = client, ks  # the key space it would read from the engine's published one
        try:
            for q, want in ((reader, CHUNK + 2 * BS), (ext, 2 * CHUNK + 3 * BS), (stranger, 0)):
                lk = insp.lookup(q)
                assert lk.hit_tokens == view.reach(q) == want
            lk = insp.lookup(ext)
            assert [c.present for c in lk.chunks] == [True, True] + [False] * (len(ext) // CHUNK - 2)
            assert (lk.partial.index, lk.partial.start, lk.partial.end, lk.partial.blocks, lk.partial.present,
                    lk.partial.keys) == (2, 2 * CHUNK, 2 * CHUNK + 3 * BS, 3, True, [f"{part}/tp0"])
        finally:
            insp.close()

        # The reader's scheduler plans those loads; the worker fills the blocks from the objects.
        rs = _scheduler(master, ks, save=False)
        req = _request(reader, "r")
        assert _lookup(rs, req) == CHUNK + 2 * BS
        dst = list(range(20, 27))
        rs.plan_load(req, 0, CHUNK + 2 * BS, dst)
        ext_req = _request(ext, "e")
        assert _lookup(rs, ext_req) == 2 * CHUNK + 3 * BS
        dst2 = list(range(30, 41))
        rs.plan_load(ext_req, BS, 2 * CHUNK + 3 * BS, dst2)  # a local hit of one block first
        meta = rs.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                                       num_scheduled_tokens={}))
        assert [[(c.index, c.first, c.blocks, len(c.block_ids)) for c in j.chunks] for j in meta.loads] == [
            [(0, 0, 0, 4), (1, 0, 0, 2)], [(0, 1, 0, 3), (1, 0, 0, 4), (2, 0, 3, 3)]]
        w.start_load_kv(StoreMetadata(loads=meta.loads))
        _loaded(w, {"r", "e"})
        assert w.get_block_ids_with_load_errors() == set()
        for s, d in [*zip(src[:6], dst[:6]), *zip(src[1:11], dst2[1:11])]:
            assert torch.equal(buf[:, s], buf[:, d]), (s, d)
        assert not torch.equal(buf[:, src[6]], buf[:, dst[6]])  # the block after the match: not loaded
    finally:
        client.close()
        sched.close()
        w.close()


def _loaded(w, rids: set[str]) -> None:
    """Wait until the worker reported every load of ``rids`` finished (each report comes once)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 15
    while not rids <= seen:
        assert time.monotonic() < deadline, f"loads of {rids - seen} not reported"
        seen |= w.get_finished(set())[1] or set()
        time.sleep(0.02)


@pytest.mark.integration
def test_a_vanished_or_wrong_sized_partial_object_fails_exactly_its_blocks(store_cluster):
    """The lookup found a writer's chunk 0 and 2 leading blocks of its chunk 1; then chunk 1's
    object is removed (or replaced by one of another size) before the load: chunk 0 loads, the
    2 blocks are the load's errors, nothing else."""
    from mcstore.protocol import StoreMetadata
    from tests.store_util import raw_client

    ks = _ks()
    master = store_cluster.master_addr
    w, buf = _worker(master, ks)
    sched = _scheduler(master, ks)
    raw = raw_client(master)
    try:
        for case in ("removed", "wrong_size"):
            writer = _toks(2 * CHUNK + 5, 20 if case == "removed" else 21)
            _save_prompt(sched, w, writer, f"w-{case}", list(range(1, 9)))
            reader = writer[:CHUNK + 2 * BS + 1] + _toks(100, 22)
            rs = _scheduler(master, ks, save=False)
            req = _request(reader, f"r-{case}")
            assert _lookup(rs, req) == CHUNK + 2 * BS
            target = f"{ks.links(writer)[1]}/tp0"
            if case == "removed":
                assert raw.remove(target, True) == 0
            else:
                assert raw.upsert(target, b"\x01" * 1000) == 0
            dst = list(range(40, 46))
            rs.plan_load(req, 0, CHUNK + 2 * BS, dst)
            meta = rs.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                                           num_scheduled_tokens={}))
            loaded0 = w.stats.data["counters"].get("loaded_tokens", 0)
            w.start_load_kv(StoreMetadata(loads=meta.loads))  # synchronous off: finishes in the background
            _loaded(w, {req.request_id})
            assert w.get_block_ids_with_load_errors() == {44, 45}, case
            assert w.stats.data["counters"]["loaded_tokens"] - loaded0 == CHUNK
            rs.close()
    finally:
        raw.close()
        sched.close()
        w.close()


@pytest.mark.integration
def test_partial_objects_of_every_tp_rank_are_needed(store_cluster):
    """TP 2: each rank saves its part of the tail; the first rank alone writes the directory
    entry. A lookup counts the tail only while both ranks' parts exist."""
    from mcstore.client import StoreClient
    from mcstore.config import load_config
    from tests.store_util import raw_client

    ks = _ks(tp=2)
    master = store_cluster.master_addr
    w0, _ = _worker(master, ks, rank=0)
    w1, _ = _worker(master, ks, rank=1)
    sched = _scheduler(master, ks)
    client = StoreClient(load_config({"master": master}, env={}), "probe", segment=False)
    raw = raw_client(master)
    try:
        writer = _toks(CHUNK + 2 * BS + 3, 30)
        job = _save_prompt(sched, w0, writer, "w", list(range(1, 7)))
        ext = writer + _toks(90, 31)
        part = ks.part_link(ks.hashes(writer)[5], 2)
        assert client.exists(ks.all_rank_keys([part])) == [1, 0]
        assert reach(client, Probe(ks, ks.hashes(ext), len(ext))).tokens == 0  # rank 1's parts all missing
        from mcstore.protocol import StoreMetadata

        w1.wait_for_save(StoreMetadata(saves=[job]))
        _until(lambda: "w" in (w1.get_finished({"w"})[0] or set()))
        assert reach(client, Probe(ks, ks.hashes(ext), len(ext))).tokens == CHUNK + 2 * BS
        assert w1.stats.data["ops"].get("phase:save_dirs") is None  # rank 1 wrote no directory entry
        assert raw.remove(f"{part}/tp1", True) == 0
        assert reach(client, Probe(ks, ks.hashes(ext), len(ext))).tokens == CHUNK
    finally:
        raw.close()
        client.close()
        sched.close()
        w0.close()
        w1.close()
