"""KV cache groups in the P2P handoff (``p2p.groups``, vLLM's hybrid allocator on): the per-group
plan, what the prefill side serves, the wire messages' bounds and signatures, and (integration)
a real Transfer Engine pair moving each group's blocks over that group's layers only. The same
in real engines: ``tests/test_p2p_hma_e2e.py``."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from kvcore.kvgroups import KVGroup
from p2p.groups import MAX_GROUPS, held, plan, serve_ranges
from p2p.protocol import (
    BlockRange,
    PullReply,
    PullRequest,
    Status,
    decode_to_decode,
    decode_to_prefill,
    encode,
    refusal,
    sign,
)
from tests.support import wait_for

BS = 32
SLIDING = KVGroup(0, ("a",), BS, window=64)
FULL = KVGroup(1, ("b",), BS)


@pytest.mark.unit
def test_plan_pulls_the_full_group_whole_and_the_sliding_group_inside_its_window():
    n = 513  # 17 blocks; vLLM keeps the sliding group's blocks from (513 - 64 + 1) // 32 = 14 on
    sliding_ids = [0] * 14 + [40, 41, 42]  # the decode's null blocks before the window
    full_ids = list(range(100, 117))
    assert plan([SLIDING, FULL], [sliding_ids, full_ids], 0, n) == [(14, [40, 41, 42]), (0, full_ids)]
    # 5 blocks from the decode's own prefix cache: pulled from block 5 on (the sliding group's
    # window starts later anyway).
    assert plan([SLIDING, FULL], [sliding_ids, full_ids], 5, n) == [(14, [40, 41, 42]), (5, full_ids[5:])]
    # A local hit inside the window: the sliding group from there on.
    assert plan([SLIDING, FULL], [sliding_ids, full_ids], 15, n) == [(15, [41, 42]), (15, full_ids[15:])]
    # A prompt shorter than the window: every block of both.
    assert plan([SLIDING, FULL], [[7, 8], [9, 10]], 0, 40) == [(0, [7, 8]), (0, [9, 10])]
    # n = 543: the last prompt token's window starts in block 14, first_kept(543) is 15. vLLM
    # allocates block 14 when it counts 542 tokens loaded (a composite's plan): it is pulled; when
    # it counts 543 (the P2P tier alone) block 14 is null: the pull starts at 15.
    full_ids = list(range(100, 117))
    assert plan([SLIDING, FULL], [[0] * 14 + [40, 41, 42], full_ids], 0, 543)[0] == (14, [40, 41, 42])
    assert plan([SLIDING, FULL], [[0] * 15 + [41, 42], full_ids], 0, 543)[0] == (15, [41, 42])


@pytest.mark.unit
@pytest.mark.parametrize("sliding_ids,full_ids,needle", [
    ([0] * 15 + [41, 42], list(range(100, 117)), "group 0: decode blocks [14, 17)"),  # a null in the window
    ([0] * 14 + [40, 41, 42], list(range(100, 116)), "group 1: decode blocks [0, 17)"),  # a block missing
])
def test_plan_refuses_a_block_table_it_cannot_fill(sliding_ids, full_ids, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        plan([SLIDING, FULL], [sliding_ids, full_ids], 0, 513)
    with pytest.raises(ValueError, match="1 block tables for 2"):
        plan([SLIDING, FULL], [full_ids], 0, 513)


@pytest.mark.unit
def test_prefill_serves_each_groups_range_and_never_a_freed_block():
    hold = held([[0] * 14 + [40, 41, 42, 43], list(range(100, 118))], 513, BS)  # the prompt's 17 blocks
    assert [len(g) for g in hold] == [17, 17]
    assert serve_ranges(hold, [(14, 3), (0, 17)]) == [40, 41, 42] + list(range(100, 117))
    assert serve_ranges(hold, [(16, 1), (16, 1)]) == [42, 116]
    assert "freed" in serve_ranges(hold, [(13, 4), (0, 17)])  # block 13 of the sliding group is null
    assert "holds 17" in serve_ranges(hold, [(14, 4), (0, 17)])
    assert "holds 17" in serve_ranges(hold, [(14, 3), (1, 17)])
    assert "2 KV cache groups" not in serve_ranges(hold, [(14, 3)]) and "1 KV cache groups" in \
        serve_ranges(hold, [(14, 3)])


@pytest.mark.unit
def test_wire_ranges_are_bounded_and_checked():
    ok = PullRequest("t", "r", 0, 1, 0, 20, ranges=[BlockRange(14, 3), BlockRange(0, 17)])
    assert decode_to_prefill(encode(ok)) == ok
    for bad in (
        {"ranges": [[-1, 3]]},  # a negative start
        {"ranges": [[0, 1 << 31]]},  # a count past the bound
        {"ranges": [[0, 1, 2]]},  # not a (start, count) pair
        {"ranges": [["0", 1]]},  # not integers
        {"ranges": [[0, 1]] * (MAX_GROUPS + 1)},  # more groups than any model has
    ):
        data = msgspec.msgpack.encode({"type": "pull", "transfer_id": "t", "req_id": "r", "tp_rank": 0,
                                       "tp_size": 1, "num_blocks": 1, **bad})
        with pytest.raises(msgspec.ValidationError):
            decode_to_prefill(data)
    # A READY reply's block ids: non-negative, bounded.
    with pytest.raises(msgspec.ValidationError):
        decode_to_decode(msgspec.msgpack.encode({"type": "reply", "status": 0, "transfer_id": "t",
                                                 "block_ids": [1, -2]}))
    assert decode_to_decode(encode(PullReply(Status.READY, "t", block_ids=[1, 2]))).block_ids == [1, 2]


@pytest.mark.unit
def test_the_signature_covers_the_group_ranges():
    secret = b"s" * 32
    msg = sign(PullRequest("t", "r", 0, 1, 0, 20, ranges=[BlockRange(14, 3), BlockRange(0, 17)]), secret)
    assert refusal(decode_to_prefill(encode(msg)), secret) is None
    tampered = msgspec.structs.replace(msg, ranges=[BlockRange(13, 4), BlockRange(0, 17)])
    assert refusal(decode_to_prefill(encode(tampered)), secret) == "bad_signature"


@pytest.mark.unit
def test_a_grouped_hold_does_not_serve_an_ungrouped_pull_and_vice_versa():
    from p2p.holds import Hold, SideChannel

    grouped = Hold("r", "t", [0, 5], 0.0, 1.0, groups=[[0, 5], [6, 7]])
    plain = Hold("r", "t", [6, 7], 0.0, 1.0)
    by_ranges = PullRequest("t", "r", 0, 1, 0, 3, ranges=[BlockRange(1, 1), BlockRange(0, 2)])
    by_start = PullRequest("t", "r", 0, 1, 0, 2)
    assert SideChannel._blocks_for(by_ranges, grouped) == [5, 6, 7]
    assert SideChannel._blocks_for(by_start, plain) == [6, 7]
    assert "mismatch" in SideChannel._blocks_for(by_start, grouped)
    assert "mismatch" in SideChannel._blocks_for(by_ranges, plain)
    # num_blocks must be the ranges' total (what a release check and the logs go by).
    assert "their total" in SideChannel._blocks_for(
        PullRequest("t", "r", 0, 1, 0, 2, ranges=[BlockRange(1, 1), BlockRange(0, 2)]), grouped)


class _GroupedSide:
    """One instance's KV in two groups of one layer each (separate tensors, so a write into the
    wrong group's layer shows), a Transfer Engine with it registered."""

    def __init__(self, seed: int, num_blocks: int = 48):
        import torch

        from kvcore.geometry import KVGeometry
        from p2p.transfer import TransferEngineHandle

        g = torch.Generator().manual_seed(seed)
        self.kv = {name: torch.randn(num_blocks, 2, 32, 64, generator=g) for name in ("a", "b")}
        self.geo = KVGeometry.from_kv_caches(self.kv, num_blocks)
        self.geos = [KVGeometry.from_kv_caches({n: self.kv[n]}, num_blocks) for n in ("a", "b")]
        self.engine = TransferEngineHandle("127.0.0.1", "tcp", "", "P2PHANDSHAKE")
        self.engine.register(self.geo.buffers)


@pytest.fixture(scope="module")
def grouped_pair():
    from kvcore.metrics import TierStats
    from p2p import bootstrap
    from p2p.holds import SideChannel
    from p2p.protocol import RegisterPayload
    from p2p.puller import Puller

    prod, cons = _GroupedSide(1), _GroupedSide(2)
    boot = bootstrap.BootstrapServer("127.0.0.1", 0).start()
    lock = threading.Lock()
    pstats, dstats = TierStats(), TierStats()
    side = SideChannel(prod.geo.regions, prod.engine.addr, pstats, lock, abort_timeout_s=10.0)
    bootstrap.register(boot.url, RegisterPayload("eng-P", 0, 0, 0, side.addr), timeout=5)
    puller = Puller(cons.geo, cons.engine, dstats, lock, bootstrap_timeout_s=5, peer_silence_timeout_s=4.0,
                    group_geometries=cons.geos)
    yield prod, cons, side, puller, boot, dstats
    puller.close()
    side.close()
    boot.stop()
    prod.engine.close()
    cons.engine.close()


def _grouped_job(boot, tid, groups):
    from p2p.puller import PullJob

    return PullJob(f"req-{tid}", tid, boot.url, "eng-P", 0, [b for _, ids in groups for b in ids],
                   time.monotonic() + 10, groups=groups)


@pytest.mark.integration
def test_te_pair_moves_each_group_at_its_own_block_ids_over_its_own_layers(grouped_pair):
    prod, cons, side, puller, boot, dstats = grouped_pair
    # The prefill's 4 prompt blocks: its sliding group ("a") freed the first two (null).
    side.add_hold("p-1", "x-1", [], groups=[[0, 0, 7, 8], [3, 4, 5, 6]])
    before = {n: t.clone() for n, t in cons.kv.items()}
    puller.submit(_grouped_job(boot, "x-1", [(2, [20, 21]), (0, [30, 31, 32, 33])]))
    res = wait_for(puller.take_results, 10, 0.02, what="the grouped pull's result")
    assert [(r.ok, r.cause) for r in res] == [(True, "")], res
    for d, p in zip([20, 21], [7, 8]):
        assert (cons.kv["a"][d] == prod.kv["a"][p]).all()
    for d, p in zip([30, 31, 32, 33], [3, 4, 5, 6]):
        assert (cons.kv["b"][d] == prod.kv["b"][p]).all()
    # Nothing else written: not the other group's block ids in either layer, nor any other block.
    touched = {"a": {20, 21}, "b": {30, 31, 32, 33}}
    for n, t in cons.kv.items():
        for b in range(t.shape[0]):
            if b not in touched[n]:
                assert (t[b] == before[n][b]).all(), (n, b)
    assert dstats.data["counters"]["bytes:pulled"] == 6 * cons.geos[0].block_bytes
    assert wait_for(side.take_finished, 10, 0.02, what="the hold's release") == {"p-1"}


@pytest.mark.integration
def test_te_pair_refuses_a_pull_of_blocks_the_prefill_freed(grouped_pair):
    """A decode asking for a sliding group's block the prefill already freed gets an error (the
    request is recomputed), never the null block's bytes; the hold is let go."""
    prod, cons, side, puller, boot, dstats = grouped_pair
    side.add_hold("p-2", "x-2", [], groups=[[0, 0, 7, 8], [3, 4, 5, 6]])
    before = cons.kv["a"][22].clone()
    puller.submit(_grouped_job(boot, "x-2", [(1, [22, 23, 24]), (0, [34, 35, 36, 37])]))
    res = wait_for(puller.take_results, 10, 0.02, what="the grouped pull's result")
    assert [(r.ok, r.cause) for r in res] == [(False, "remote")], res
    assert "freed" in res[0].detail
    assert (cons.kv["a"][22] == before).all()
    assert wait_for(side.take_finished, 10, 0.02, what="the hold's release") == {"p-2"}


def _prefill(groups):
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    from p2p.config import load_config
    from p2p.scheduler import P2PScheduler

    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    tables: dict[str, list[list[int]]] = {}
    manager = SimpleNamespace(block_pool=pool, get_block_ids=lambda rid: tables[rid])
    sched = P2PScheduler(SimpleNamespace(cache_config=SimpleNamespace(block_size=BS)),
                         load_config({}, "kv_producer"), "kv_producer", groups=groups)
    sched.bind_kv_cache_manager(manager)
    return sched, pool, tables


def _finished_request(rid: str, n: int, status: str = "FINISHED_LENGTH_CAPPED"):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), num_computed_tokens=0,
                           kv_transfer_params={"do_remote_decode": True, "transfer_id": f"x-{rid}"},
                           status=SimpleNamespace(name=status))


@pytest.mark.unit
@pytest.mark.parametrize("status,held_", [("FINISHED_LENGTH_CAPPED", True), ("FINISHED_ABORTED", False)])
def test_prefill_pins_the_window_it_still_has_to_send(status, held_):
    """A prefill request that keeps generating after its prompt: vLLM frees its sliding group's
    blocks behind the window, the decode's window included. The scheduler pins those blocks at
    the first step that sees the prompt computed, holds them under their own ids when the
    request finishes (where vLLM's table has nulls by then), and frees them when the hold is sent
    (or at once when nothing is held)."""
    sched, pool, tables = _prefill([SLIDING, FULL])
    n = 513  # 17 blocks; the decode needs the sliding group's blocks 14..16
    sliding, full = pool.get_new_blocks(17), pool.get_new_blocks(17)
    tables["p"] = [[b.block_id for b in sliding], [b.block_id for b in full]]
    window = [b.block_id for b in sliding[14:]]
    req = _finished_request("p", n, status)
    sched.update_state_after_alloc(req, None, 0)
    sched.build_connector_meta()
    assert sched.pins.pending() == 0  # the prompt is not computed yet
    req.num_computed_tokens = n
    sched.build_connector_meta()
    assert sched.pins.pending() == 1 and all(pool.blocks[b].ref_cnt == 2 for b in window)
    # Two tokens later vLLM freed blocks 0..14 of the sliding group (block 14: inside the decode's window).
    pool.free_blocks(sliding[:15])
    table = [[0] * 15 + [b.block_id for b in sliding[15:]], tables["p"][1]]
    free0 = pool.get_num_free_blocks()
    hold, _ = sched.request_finished(req, tuple(table))
    assert hold is held_
    meta = sched.build_connector_meta()
    if held_:
        ((rid, tid, first, _, groups),) = meta.holds
        assert (rid, tid) == ("p", "x-p") and groups[1] == tables["p"][1] and first == groups[0]
        assert groups[0] == [0] * 14 + window  # the pinned block 14 back where vLLM has a null
        assert serve_ranges(groups, [(14, 3), (0, 17)]) == window + tables["p"][1]
        assert pool.blocks[window[0]].ref_cnt == 1  # ours only
        sched.finished_sending({"p"})
    assert pool.blocks[window[0]].ref_cnt == 0 and sched.pins.pending() == 0
    assert pool.get_num_free_blocks() == free0 + 1  # block 14, freed once its hold ended


@pytest.mark.unit
def test_a_prefill_of_one_token_needs_no_pin():
    """The proxy's prefill (max_tokens 1) finishes the step its prompt is computed: no step sees
    it computed, nothing is pinned, its held window is vLLM's own blocks."""
    sched, pool, tables = _prefill([SLIDING, FULL])
    sliding, full = pool.get_new_blocks(17), pool.get_new_blocks(17)
    ids = [[0] * 14 + [b.block_id for b in sliding[14:]], [b.block_id for b in full]]
    tables["q"] = ids
    req = _finished_request("q", 513)
    sched.update_state_after_alloc(req, None, 0)
    sched.build_connector_meta()
    hold, _ = sched.request_finished(req, tuple(ids))
    assert hold and sched.pins.pending() == 0
    ((*_, groups),) = sched.build_connector_meta().holds
    assert groups == ids


def _group_tiers():
    from tests.test_tier_contract import three_tiers

    tiers = three_tiers(remote=False)
    for t in tiers.values():
        t.raw = []
        t.plan_load = (lambda t: lambda req, s, e, ids, expected_s=None: t.raw.append((s, e, ids)))(t)
    return tiers


@pytest.mark.unit
def test_the_composite_loads_from_one_tier_with_a_sliding_window_group():
    """With a sliding-window group the composite's plan loads from one tier at most (a store
    range ending before the prompt's end would need sliding blocks vLLM allocated as null), that
    tier gets each group's block ids, a failure is the whole request's (no block ids for the
    worker), and the tier it loads from answers which groups the load restores."""
    from types import SimpleNamespace

    from multi.policy import PolicyConfig
    from multi.scheduler import TieredScheduler
    from tests.test_tier_contract import request

    per_group = [[0] * 100 + list(range(200, 228)), list(range(300, 428))]
    blocks = SimpleNamespace(get_block_ids=lambda: tuple(per_group))
    tiers = _group_tiers()
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0, grouped=True, sliding=True)
    req = request("r1", 4096)
    ext, _ = s.get_num_new_matched_tokens(req, 0)
    used = [name for name, t in tiers.items() if s._decisions["r1"].ranges.get(name)]
    assert len(used) == 1 and ext > 0
    s.update_state_after_alloc(req, blocks, ext)
    (name,) = used
    assert [ids for *_, ids in tiers[name].raw] == [per_group]
    assert all(not t.raw for n, t in tiers.items() if n != name)
    assert s._loads["r1"] == {name: []}
    assert s.loading_tier(req) is tiers[name]
    # Groups without a sliding window: a plan may still split the prompt between tiers.
    s = TieredScheduler(_group_tiers(), PolicyConfig(), BS, 8192.0, grouped=True, sliding=False)
    assert s.get_num_new_matched_tokens(request("r2", 4096), 0) == (4095, True)
    assert len(s._decisions["r2"].ranges) == 3
