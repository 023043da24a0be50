"""KV cache groups on the store tier (vLLM's hybrid allocator on), without an engine: which blocks
of each group a chunk's objects hold and a load fills (``mcstore.groups``), where a hit is cut
back, the keys that name the group (``mcstore.keys``), and the references a save holds on
sliding-window blocks, on vLLM's own ``BlockPool``. The same in real engines:
``tests/test_layouts_e2e.py``."""

from __future__ import annotations

import pytest

from kvcore.kvgroups import NULL_BLOCK, KVGroup
from mcstore.groups import Pins, StoreGroups
from mcstore.keys import KeySpace, fingerprint
from mcstore.protocol import SaveJob

pytestmark = pytest.mark.unit

BS, CB = 32, 4  # 128-token chunks
FULL = KVGroup(1, ("model.layers.1.self_attn.attn",), BS)
SWA = KVGroup(0, ("model.layers.0.self_attn.attn",), BS, window=64)  # keeps 2 blocks before a boundary


def test_a_sliding_group_keeps_the_blocks_vllm_keeps():
    # vLLM's SlidingWindowManager: skipped tokens max(0, n - w + 1 - extra), whole blocks freed.
    assert [SWA.first_kept(n) for n in (0, 63, 64, 96, 97, 512)] == [0, 0, 0, 1, 1, 14]
    assert SWA.tail_blocks() == 2 and FULL.tail_blocks() is None and FULL.first_kept(512) == 0
    assert KVGroup(0, (), BS, window=33).tail_blocks() == 1
    assert KVGroup(0, (), BS, window=64, extra=1).tail_blocks() == 2
    assert KVGroup(0, (), BS, window=64, extra=2).tail_blocks() == 3


def test_each_group_saves_its_own_blocks_a_sliding_one_the_chunks_tail():
    g = StoreGroups([SWA, FULL], CB)
    swa_ids = [NULL_BLOCK] * 4 + list(range(100, 112))  # vLLM freed chunk 0's sliding blocks already
    full_ids = list(range(200, 216))
    ios = g.save_ios("L2", 2, [swa_ids, full_ids])
    assert [(c.group, c.block_ids, c.first, c.blocks) for c in ios] == [
        (0, [106, 107], 0, 2),  # blocks 10, 11: the window of a hit at the chunk's end
        (1, [208, 209, 210, 211], 0, 0)]
    assert g.save_ios("L0", 0, [swa_ids, full_ids]) is None  # a kept block is gone: not saved


def test_a_load_fills_a_sliding_group_inside_the_window_only():
    g = StoreGroups([SWA, FULL], CB)
    # A 512-token hit from token 0: vLLM hands null blocks for the sliding group's first 14.
    swa_ids = [NULL_BLOCK] * 14 + [300, 301]
    full_ids = list(range(400, 416))
    ios = [io for c in range(4) for io in g.load_ios(f"L{c}", c, c * CB, (c + 1) * CB, 512, [swa_ids, full_ids])]
    assert [(c.link, c.group, c.block_ids, c.first) for c in ios if c.group == 0] == [("L3", 0, [300, 301], 0)]
    assert [c.block_ids for c in ios if c.group == 1] == [full_ids[i:i + 4] for i in range(0, 16, 4)]
    # A load from a local hit inside the last chunk: only the blocks past it.
    (s, f) = g.load_ios("L3", 3, 15, 16, 512, [swa_ids, full_ids])
    assert (s.block_ids, s.first, f.block_ids, f.first) == ([301], 1, [415], 3)
    # Blocks the objects do not hold are never planned (usable() keeps hits from needing them).
    with pytest.raises(ValueError, match="not all stored"):
        g.load_ios("L3", 3, 12, 15, 15 * BS, [[NULL_BLOCK] * 13 + [1, 2], full_ids])


def test_a_hit_is_cut_back_until_every_sliding_block_it_needs_is_stored():
    g = StoreGroups([SWA, FULL], CB)
    assert g.usable(512, 4, 128) == (512, 4)  # at a chunk boundary: the stored tail covers it
    assert g.usable(511, 4, 128) == (511, 4)  # the prompt's last token left to the engine: still covered
    # A 33-token window keeps one block before a boundary, but a hit one token short of it needs two.
    g33 = StoreGroups([KVGroup(0, (), BS, window=33), FULL], CB)
    assert g33.usable(512, 4, 128) == (512, 4)
    assert g33.usable(511, 4, 128) == (384, 3)
    # Full attention only: nothing to cut.
    assert StoreGroups([FULL], CB).usable(500, 4, 128) == (500, 4)


def test_keys_name_the_group_and_a_chunk_needs_every_groups_parts():
    legacy = KeySpace(fingerprint({"t": "groups"}), 128, tp_size=2)
    grouped = KeySpace(fingerprint({"t": "groups"}), 128, tp_size=2, groups=2)
    assert legacy.key("L", 1) == "L/tp1" and legacy.parts == 2  # one full group: keys as before
    assert grouped.key("L", 1, group=1) == "L/g1tp1" and grouped.parts == 4
    assert grouped.all_rank_keys(["A", "B"]) == ["A/g0tp0", "A/g0tp1", "A/g1tp0", "A/g1tp1",
                                                 "B/g0tp0", "B/g0tp1", "B/g1tp0", "B/g1tp1"]
    assert grouped.stage(0).groups == 2
    assert {grouped.part_of(r, group=g) for g in (0, 1) for r in (0, 1)} == {0, 1, 2, 3}
    pp = KeySpace(fingerprint({"t": "groups"}), 128, pp_size=2, groups=2).stage(1)
    assert pp.key("L", 0, group=1) == "L/g1pp1tp0"


def test_a_save_holds_its_sliding_blocks_until_every_worker_reports_it():
    from vllm.v1.core.block_pool import BlockPool

    from mcstore.protocol import ChunkIO

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    swa, full = pool.get_new_blocks(2), pool.get_new_blocks(4)
    free0 = pool.get_num_free_blocks()
    pins = Pins(StoreGroups([SWA, FULL], CB), workers=2)
    job = SaveJob("r", [ChunkIO("L", 0, [b.block_id for b in swa], 0, 2, 0),
                        ChunkIO("L", 0, [b.block_id for b in full], 0, 0, 1)])
    pins.pin(job, pool)
    assert job.pin == 0 and pins.pending()
    pool.free_blocks(swa)  # vLLM frees them behind the window while the save has not run
    assert pool.get_num_free_blocks() == free0  # still held: not handed to another request
    assert all(b.ref_cnt == 1 for b in swa) and all(b.ref_cnt == 1 for b in full)  # full ones: not pinned
    pins.done([0], pool)
    assert pins.pending() and pool.get_num_free_blocks() == free0  # one worker of two
    pins.done([0, 7], pool)  # an unknown pin is ignored
    assert not pins.pending() and pool.get_num_free_blocks() == free0 + 2
    # A job without sliding blocks takes no pin.
    only_full = SaveJob("r2", [ChunkIO("L", 0, [b.block_id for b in full], 0, 0, 1)])
    pins.pin(only_full, pool)
    assert only_full.pin == -1 and not pins.pending()


# -- against a real master and a real worker ----------------------------------------------------

NBLK = 64


class _Manager:
    """What the scheduler reads of vLLM's KV cache manager: each group's block ids of a request,
    and vLLM's own block pool (for the pins)."""

    def __init__(self, ids):
        from vllm.v1.core.block_pool import BlockPool

        self.ids = ids
        self.block_pool = BlockPool(num_gpu_blocks=NBLK, enable_caching=True, hash_block_size=BS)
        self.block_pool.get_new_blocks(NBLK - 1)  # every block the test names is a request's

    def get_block_ids(self, rid):
        return tuple(self.ids[rid])


def _request(tokens, rid):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_tokens=len(tokens), num_computed_tokens=0, cache_salt=None, lora_request=None,
                           mm_features=None)


def _until(pred, timeout=15.0):
    import time

    deadline = time.monotonic() + timeout
    while not (out := pred()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return out


@pytest.mark.integration
def test_groups_are_saved_and_loaded_at_their_own_block_ids(store_cluster, monkeypatch):
    """A real worker on one KV tensor that a sliding layer (group 0) and a full layer (group 1)
    share, as vLLM's hybrid allocator lays them out: a 4-chunk prompt's save writes each group's
    object per chunk (the sliding one 2 blocks of 4) and holds the sliding blocks until the worker
    reports the job; a reader's hit loads the full group's 16 blocks and the sliding group's last
    2 into other block ids, the writer's bytes exactly and nothing else; a vanished object fails
    the whole request (vLLM's failed_recving), never a block id."""
    import random
    from types import SimpleNamespace

    import torch

    from mcstore.client import StoreClient
    from mcstore.config import load_config
    from mcstore.protocol import StoreMetadata
    from mcstore.scheduler import StoreScheduler
    from mcstore.server import CLIENT_ENV
    from mcstore.worker import StoreWorker

    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    master = store_cluster.master_addr
    cfg = load_config({"master": master, "chunk_tokens": BS * CB, "lookup_blocking": True}, env={})
    ks = KeySpace(fingerprint({"t": "groups-integration"}), BS * CB, block_tokens=BS, groups=2)
    groups = [SWA, FULL]
    w = StoreWorker(cfg, ks, BS, NBLK, 0, load=True, save=True, groups=groups)
    buf = torch.empty(NBLK, 2, BS, 16, dtype=torch.float32)  # CPU-layout pages, one tensor for both layers
    w.register_kv_caches({g.layers[0]: buf for g in groups})
    sched = StoreScheduler(cfg, ks, BS, load=True, save=True, groups=StoreGroups(groups, CB), workers=1)
    client = StoreClient(cfg, "probe", segment=False)
    try:
        buf.normal_()
        rng = random.Random(5)
        writer = [rng.randrange(4, 30000) for _ in range(4 * CB * BS + 40)]
        src = {0: list(range(1, 17)), 1: list(range(17, 33))}  # each group's blocks of the prompt
        mgr = _Manager({"w": [src[0], src[1]]})
        sched.bind_kv_cache_manager(mgr)
        sched._state(_request(writer, "w"))
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                                          num_scheduled_tokens={"w": len(writer)}))
        (job,) = meta.saves
        assert [(c.index, c.group, c.block_ids) for c in job.chunks if c.index == 3] == [
            (3, 0, src[0][14:16]), (3, 1, src[1][12:16])]
        assert job.pin == 0 and sched.pins.pending()
        pool = mgr.block_pool
        assert all(pool.blocks[b].ref_cnt == 2 for c in job.chunks if c.group == 0 for b in c.block_ids)
        w.wait_for_save(meta)
        w.next_step()
        w.get_finished({"w"})
        _until(lambda: "w" in (w.get_finished(set())[0] or set()))
        links = ks.links(writer)
        page = 2 * BS * 16 * 4
        sizes = {k: client.store.get_size(k) for k in ks.all_rank_keys(links)}
        assert sizes == {ks.key(link, 0, group=g): (2 if g == 0 else CB) * page for link in links for g in (0, 1)}
        # Each chunk's tokens counted once, whatever its groups' objects hold; every object's bytes.
        counters = w.stats.data["counters"]
        assert counters["saved_tokens"] == 4 * CB * BS and counters["saved_bytes"] == sum(sizes.values())
        news = w.worker_meta()
        assert news.saved == [0]
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=news, finished_sending=set()))
        assert not sched.pins.pending()
        assert all(pool.blocks[b].ref_cnt == 1 for c in job.chunks if c.group == 0 for b in c.block_ids)

        # A reader sharing the 4 chunks: its hit is theirs, loaded at its own block ids.
        reader = writer[:4 * CB * BS] + [rng.randrange(4, 30000) for _ in range(50)]
        req = _request(reader, "r")
        assert sched.lookup(req) == 4 * CB * BS
        dst = {0: [NULL_BLOCK] * 14 + [40, 41], 1: list(range(42, 58))}
        before = buf.clone()
        sched.plan_load(req, 0, 4 * CB * BS, [dst[0], dst[1]])
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                                          num_scheduled_tokens={}))
        (load,) = meta.loads
        assert not load.sync and load.tokens == 4 * CB * BS
        assert sorted((c.group, len(c.block_ids)) for c in load.chunks) == [(0, 2)] + [(1, 4)] * 4
        w.start_load_kv(StoreMetadata(loads=meta.loads))
        _until(lambda: "r" in w.get_transfer_results(set()).finished_recving)
        assert w.get_block_ids_with_load_errors() == set()
        pairs = [*zip(src[1], dst[1]), (src[0][14], 40), (src[0][15], 41)]
        for s, d in pairs:
            assert torch.equal(buf[d], before[s]), (s, d)
        untouched = [b for b in range(NBLK) if b not in {d for _, d in pairs}]
        assert torch.equal(buf[untouched], before[untouched])

        # Chunk 2's full-group object vanishes: the whole request's load fails, no block is named.
        req2 = _request(reader, "r2")
        assert sched.lookup(req2) == 4 * CB * BS
        client.remove([ks.key(links[2], 0, group=1)], force=True)
        sched.plan_load(req2, 0, 4 * CB * BS, [dst[0], dst[1]])
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(),
                                                          num_scheduled_tokens={}))
        w.start_load_kv(StoreMetadata(loads=meta.loads))
        res = _until(lambda: (r := w.get_transfer_results(set())).finished_recving and r)
        assert res.finished_recving == {"r2"} and res.failed_recving == {"r2"}
        assert w.get_block_ids_with_load_errors() == set()
        # Now the lookup stops before the missing chunk.
        assert sched.lookup(_request(reader, "r3")) == 2 * CB * BS
    finally:
        client.close()
        sched.close()
        w.close()
