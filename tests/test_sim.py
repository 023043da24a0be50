"""bench.sim: the cluster simulator on tiny traces whose answers are computed by hand in
the comments, with the product's own router deciding (multi.router.choose.Chooser)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.cluster import Cluster, Store
from bench.sim.report import summarize
from bench.sim.router import simulate
from bench.sim.speeds import Decode, Link, Prefill, Speeds, a800x8
from bench.trace import Request
from kvcore.tier import LoadPrior
from multi.policy import PolicyConfig

# 0.1 s a prompt token, nothing else; a decode step 0.01 s whatever the batch.
PREFILL = Prefill(step_s=0.0, token_s=0.1, attn_s=0.0)


def speeds(bytes_per_token: float) -> Speeds:
    return Speeds(prefill=PREFILL, decode=Decode(step_s=0.01, per_seq_s=0.0), bytes_per_token=bytes_per_token,
                  p2p=Link(1.0), store=Link(1.0), ssd=Link(0.5), chunk_tokens=1000, max_seqs=8)


def true_cfg() -> PolicyConfig:
    """The router's model started at the true speeds, not learning: its choices are exact.
    All of a decode instance's compute counts 1.5 times, idle or not (``idle_compute_s=0``),
    so that the hand computations below stay short."""
    return PolicyConfig(prefill_step_s=0.0, prefill_token_s=0.1, prefill_attn_s=0.0, calibrate=False,
                        idle_compute_s=0.0,
                        tiers={"store": LoadPrior(latency_s=0.0, bandwidth_gbps=1.0),
                               "p2p": LoadPrior(latency_s=0.0, bandwidth_gbps=1.0)})


# Blocks of 4 tokens. B shares A's first two blocks (8 tokens); its usable prefix is 3
# blocks ((16 - 1) // 4: the last token is always computed).
A = Request(0.0, 16, 3, (1, 2, 3, 4))
B = Request(10_000.0, 16, 2, (1, 2, 5, 6))


def test_handoff_times_by_hand():
    # 1P1D, round-robin, 1e7 bytes a token (a P2P token takes 0.01 s).
    # A: P computes 16 tokens (1.6 s); D pulls [0, 15): 0.15 s, ready at 1.75; it computes
    #    the last prompt token (0.1 s): first token at 1.85, then 1.86 and 1.87 (3 tokens).
    # B at 10 s: P holds A's 4 blocks, B matches 2 (8 tokens): computes 8 (0.8 s, 10.8);
    #    D received A's blocks too, so it pulls [8, 15) only: 0.07 s; first token 10.97.
    res = simulate([A, B], speeds(1e7), Cluster(prefill=1, decode=1, cache_blocks=100, block=4), "round-robin")
    a, b = res
    assert (a.kind, b.kind) == ("pd", "pd")
    assert a.ttft == pytest.approx(1.85) and a.done == pytest.approx(1.87) and a.tpot == pytest.approx(0.01)
    assert b.ttft == pytest.approx(0.97) and b.done == pytest.approx(10.98)
    assert (a.local, a.computed, a.p2p) == (0, 16, 15)
    assert (b.local, b.computed, b.p2p) == (8, 8, 7)
    s = summarize(res, [A, B], 4, slo=1.0)
    assert s["hit_local"] == pytest.approx(8 / 32) and s["computed"] == pytest.approx(24 / 32)
    assert s["slo_attainment"] == 0.5 and s["ttft_p50"] == pytest.approx((1.85 + 0.97) / 2)
    assert s["reuse_of_ideal"] == pytest.approx(1.0)  # the ideal is B's 8 tokens too


def test_kv_router_follows_the_cache_round_robin_does_not():
    # 2 prefill instances, 1 decode. The router's model has the true speeds.
    # The router's estimates weigh compute on D by 1.5 (its decode batch), the last token too.
    # A: handoff via P0 (1.6 + 0.15 + 1.5 x 0.1 = 1.9 s) beats recomputing on D (1.5 x 1.6).
    # B: via P0 (its cache: 0.8 + 0.07 + 0.15 = 1.02) beats P1 (1.6 + 0.07 + 0.15) and D
    #    (1.5 x 0.8 = 1.2); actual: 0.8 + 0.07 + 0.1 = 0.97. Round-robin sends B to P1:
    #    1.6 + 0.07 + 0.1 = 1.77 s.
    cl = Cluster(prefill=2, decode=1, cache_blocks=100, block=4)
    kv = simulate([A, B], speeds(1e7), cl, "kv", policy_cfg=true_cfg())
    rr = simulate([A, B], speeds(1e7), cl, "round-robin", policy_cfg=true_cfg())
    assert [r.kind for r in kv] == ["pd", "pd"]
    assert kv[1].ttft == pytest.approx(0.97) and kv[1].local == 8
    assert kv[0].predicted == pytest.approx(1.9) and kv[1].predicted == pytest.approx(1.02)
    assert kv[1].candidates == pytest.approx({"pd http://sim-prefill-0": 1.02, "pd http://sim-prefill-1": 1.82,
                                              "direct http://sim-decode-0": 1.2})
    assert rr[1].ttft == pytest.approx(1.77) and rr[1].local == 0
    assert rr[1].candidates == {}  # round-robin weighs nothing


def test_decisions_pair_real_and_simulated_routes_by_order_and_length():
    # The simulated kv routes of A and B (as above: both pd, B's margin 1.02 - 1.2 = -0.18 s)
    # against a real log that sent B direct (margin +0.3 s) and has a third request the
    # simulator did not see. A pairs and agrees, B pairs and disagrees.
    from bench.sim import decisions

    kv = simulate([A, B], speeds(1e7), Cluster(prefill=2, decode=1, cache_blocks=100, block=4), "kv",
                  policy_cfg=true_cfg())
    real = [{"n": 16, "kind": "pd", "candidates": {"pd p": 1.0, "direct d": 2.0}, "cached_target": 0,
             "cached_prefill": 0, "store": 0, "wait_s": 0.0, "ttft_s": 1.9},
            {"n": 16, "kind": "direct", "candidates": {"pd p": 1.5, "pd q": 1.4, "direct d": 1.1},
             "cached_target": 8, "cached_prefill": 8, "store": 0, "wait_s": 0.1, "ttft_s": 1.0},
            {"n": 99, "kind": "direct", "candidates": {}, "cached_target": 0, "cached_prefill": 0, "store": 0, "wait_s": 0.0,
             "ttft_s": 1.0}]
    c = decisions.compare(real, kv)
    assert (c["real"], c["sim"], c["paired"], c["length_mismatch"]) == (3, 2, 2, 0)
    assert c["agree"] == 0.5 and c["table"] == {"real pd, sim pd": 1, "real direct, sim pd": 1}
    g = c["groups"]["real direct, sim pd"]
    assert g["real_margin_p50_s"] == pytest.approx(0.3) and g["sim_margin_p50_s"] == pytest.approx(-0.18)
    # Both decode instances held B's first 8 tokens (the simulated D received A's blocks).
    assert (g["real_cached_target_p50"], g["sim_cached_target_p50"], g["sim_cached_prefill_p50"]) == (8, 8, 8)
    assert g["sim_ttft_p50_s"] == pytest.approx(0.97) and g["real_store_p50"] == g["sim_store_p50"] == 0
    assert "50% took the same kind of route" in decisions.markdown(c)[0]


def test_store_hit_from_ssd_by_hand():
    # One plain instance without a prefix cache; the store's DRAM holds 2 blocks, its SSD
    # 100. 5e7 bytes a token.
    # A (1 output token): computes 16 tokens, first (and last) token at 1.6; saves its 4
    #    blocks: DRAM keeps the newest two (3, 4), blocks 1 and 2 go to SSD.
    # B: the store reaches 2 blocks (8 tokens), both on SSD. The router estimates the
    #    store plan at 0.4 (load at 1 GB/s) + 0.8 = 1.2 s against 1.6 s recomputing, so it
    #    loads; from SSD at 0.5 GB/s the load takes 0.8 s, then 8 tokens: TTFT 1.6 s.
    a1 = Request(0.0, 16, 1, (1, 2, 3, 4))
    b1 = Request(10_000.0, 16, 1, (1, 2, 5, 6))
    cl = Cluster(plain=1, cache_blocks=0, store_dram_blocks=2, store_ssd_blocks=100, block=4)
    a, b = simulate([a1, b1], speeds(5e7), cl, "kv", policy_cfg=true_cfg())
    assert a.ttft == pytest.approx(1.6) and a.done == pytest.approx(1.6)
    assert b.plan == "store" and b.predicted == pytest.approx(1.2)
    assert (b.local, b.store, b.store_ssd, b.computed) == (0, 8, 8, 8)
    assert b.ttft == pytest.approx(1.6)
    # Without the store, B recomputes everything: the same 1.6 s here, but 16 tokens.
    _, b0 = simulate([a1, b1], speeds(5e7), Cluster(plain=1, cache_blocks=0, block=4), "kv", policy_cfg=true_cfg())
    assert (b0.plan, b0.store, b0.computed) == ("recompute", 0, 16)


def test_admission_rejects_what_cannot_meet_the_target():
    # Both at once on one plain instance: A's 1.6 s is queued ahead of B, whose estimate
    # (queue 1.6 + wait prior 1 x 1 request x 1.6 + own 1.6) passes a 2 s target: rejected.
    a1 = Request(0.0, 16, 1, (1, 2, 3, 4))
    b1 = Request(0.0, 16, 1, (7, 8, 9, 10))
    cl = Cluster(plain=1, cache_blocks=0, block=4)
    a, b = simulate([a1, b1], speeds(5e7), cl, "kv", slo=2.0, policy_cfg=true_cfg())
    assert a.kind == "direct" and a.ttft == pytest.approx(1.6)
    assert b.kind == "reject" and b.first is None and b.predicted == pytest.approx(4.8)
    s = summarize([a, b], [a1, b1], 4, slo=2.0)
    assert (s["served"], s["rejected"], s["slo_attainment"]) == (1, 1, 0.5)
    # Without a target both are served, one after the other: B's first token at 3.2 s.
    a, b = simulate([a1, b1], speeds(5e7), cl, "kv", policy_cfg=true_cfg())
    assert b.ttft == pytest.approx(3.2)


def test_decode_steps_slow_with_the_batch_and_the_context():
    # A step of b sequences holding T context tokens: 0.01 + 0.001 b + 1e-5 T seconds.
    sp = Speeds(prefill=PREFILL, decode=Decode(step_s=0.01, per_seq_s=0.001, per_ctx_s=1e-5), bytes_per_token=1.0,
                p2p=Link(1.0), store=Link(1.0), ssd=Link(1.0), chunk_tokens=1000)
    assert sp.step_s(2, 100, 0, 0) == pytest.approx(0.01 + 0.002 + 0.001)
    # With a prefill chunk of 10 after 6 cached: one forward, the prefill's terms added.
    assert sp.step_s(2, 100, 10, 6) == pytest.approx(0.013 + 1.0)
    # One plain instance, 1-token prompts, 3 output tokens each, both arrive at 0.
    # A prefills (0.1 s), then A decodes alone... the sum of step times is what TPOT reports.
    reqs = [Request(0.0, 1, 3, (1,)), Request(0.0, 1, 3, (2,))]
    a, b = simulate(reqs, sp, Cluster(plain=1, cache_blocks=0, block=4), "round-robin")
    # t=0.1: A's prefill ends (first token). Step 2: A decodes (ctx 1) + B's prefill:
    # 0.01 + 0.001 + 1e-5 + 0.1 = 0.11101 -> 0.21101 (B's first token, A's second).
    # Step 3: A and B (ctx 2 + 1): 0.01 + 0.002 + 3e-5 = 0.01203 -> 0.22304 (A done).
    # Step 4: B alone (ctx 2): 0.01 + 0.001 + 2e-5 = 0.01102 -> 0.23406 (B done).
    assert a.ttft == pytest.approx(0.1) and a.done == pytest.approx(0.22304)
    assert b.ttft == pytest.approx(0.21101) and b.done == pytest.approx(0.23406)


def test_store_lru_moves_dram_evictions_to_ssd_and_drops_ssd_evictions():
    s = Store(dram_blocks=2, ssd_blocks=2)
    s.save([1, 2, 3])
    assert list(s.dram.d) == [2, 3] and list(s.ssd.d) == [1]
    s.save([4, 5])
    assert list(s.dram.d) == [4, 5] and list(s.ssd.d) == [2, 3]  # 1 fell off the SSD
    assert s.reach([2, 3, 4]) == (3, 2) and s.reach([1, 2]) == (0, 0)
    # Chunks of 2 blocks: a partial chunk is not saved, and a reach ends on a chunk.
    c = Store(dram_blocks=10, ssd_blocks=0, chunk=2)
    c.save([1, 2, 3])
    assert list(c.dram.d) == [1, 2]
    c.save([1, 2, 3, 4, 5, 6])
    assert c.reach([1, 2, 3, 4, 5, 9]) == (4, 0) and c.reach([1, 2, 3, 9]) == (2, 0)


def test_a800_preset_is_in_the_range_of_its_sources():
    sp = a800x8()
    # 12K-token prefill on 8 A800 at 50% MFU: 1 to 3 s; a decode step of 64 x 12K context: 20 to 80 ms.
    assert 1.0 < sp.prefill.seconds(0, 12_000) < 3.0
    assert 0.02 < sp.step_s(64, 64 * 12_000, 0, 0) < 0.08
    assert sp.bytes_per_token == 327_680 and set(sp.sources) >= {"gpu", "model", "p2p", "store", "mfu"}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="known: kv, least-outstanding, round-robin, prefix-affinity"):
        simulate([A], speeds(1.0), Cluster(plain=1), "fastest")


def test_router_estimates_stay_honest_under_load_with_the_wait_floor(monkeypatch):
    """The first 1,500 requests of the conversation trace on 8P8D with a store: with the
    wait fit weighting waits under a second by absolute error (multi.router.choose.WAIT_FLOOR_S),
    few handoffs take more than twice the router's estimate; with purely relative errors
    (floor 0, the control) the queue's coefficient collapses and many do."""
    import multi.router.choose as route
    from bench import trace as T
    from bench.sim.cli import policy_cfg

    reqs, sp = T.load("conversation", 1500), a800x8()
    cl = Cluster(prefill=8, decode=8, cache_blocks=1800, store_dram_blocks=100_000, block=512)

    def run(floor: float) -> tuple[int, int]:
        monkeypatch.setattr(route, "WAIT_FLOOR_S", floor)
        res = simulate(reqs, sp, cl, "kv", policy_cfg=policy_cfg(sp))
        return (sum(r.kind == "pd" and r.ttft > 2 * r.predicted for r in res),
                sum(r.ttft > 10 for r in res))

    (off, miss), (off0, miss0) = run(1.0), run(0.0)
    assert off < 100 and off0 > 2 * off, (off, off0)
    assert miss < miss0, (miss, miss0)


def test_host_contention_slows_a_step_by_the_other_busy_engines():
    # Two plain instances on one host, contention 0.5, prefill chunks of 4 tokens (0.4 s).
    # A step's length is fixed when it starts, from the engines busy then. Both arrive at 0:
    # A's first chunk starts while B's engine is idle (0.4 s), every later chunk of either
    # while the other is busy (0.6 s): A 0.4 + 3 x 0.6 = 2.2 s, B 4 x 0.6 = 2.4 s.
    sp = replace(speeds(1.0), contention=0.5, chunk_tokens=4)
    cl = Cluster(plain=2, cache_blocks=0, block=4)
    together = simulate([Request(0.0, 16, 1, (1, 2, 3, 4)), Request(0.0, 16, 1, (5, 6, 7, 8))], sp, cl, "round-robin")
    assert [r.ttft for r in together] == pytest.approx([2.2, 2.4])
    apart = simulate([Request(0.0, 16, 1, (1, 2, 3, 4)), Request(5_000.0, 16, 1, (5, 6, 7, 8))], sp, cl, "round-robin")
    assert [r.ttft for r in apart] == pytest.approx([1.6, 1.6])
    # The router's overhead delays everything by its amount.
    late = simulate([Request(0.0, 16, 1, (1, 2, 3, 4))], replace(speeds(1.0), overhead_s=0.25), cl, "round-robin")
    assert late[0].ttft == pytest.approx(1.85)


def test_capacity_search_brackets_then_bisects_to_the_last_rate_that_met_the_target():
    from bench.sim.capacity import MAX_RATE, MIN_RATE, capacity

    # A deployment that meets the target up to 3x the trace's rate: from 1, doubling
    # meets at 2 and misses at 4; bisecting [2, 4] in log rate ends with hi/lo <= 1.05
    # and lo met the target: 3/1.05 < lo <= 3.
    step = lambda r: 0.95 if r <= 3.0 else 0.5  # noqa: E731
    c = capacity(step, target=0.9, tol=0.05)
    assert c["bound"] is None and 3 / 1.05 < c["rate"] <= 3.0
    assert [r for r, _ in c["runs"][:3]] == [1.0, 2.0, 4.0]
    assert all((a >= 0.9) == (r <= 3.0) for r, a in c["runs"])
    # Below the trace's rate: halving from 1 finds 0.25 met, 0.5 missed.
    c = capacity(lambda r: 1.0 if r <= 0.3 else 0.0, target=0.9, tol=0.05)
    assert 0.3 / 1.05 < c["rate"] <= 0.3 and [r for r, _ in c["runs"][:3]] == [1.0, 0.5, 0.25]
    # The bounds are reported, not extrapolated.
    assert capacity(lambda r: 0.0)["rate"] is None and capacity(lambda r: 0.0)["bound"] == "below_min"
    c = capacity(lambda r: 1.0)
    assert c["rate"] == MAX_RATE and c["bound"] == "above_max"
    assert min(r for r, _ in capacity(lambda r: 0.0)["runs"]) == MIN_RATE


def test_handoff_overhead_from_the_routers_log_sets_the_simulated_p2p_latency(tmp_path):
    # Two idle handoffs of 1,001 and 2,001 tokens at 1e6 bytes a token and 1 GB/s: their
    # bytes take 1.0 and 2.0 s; the router saw 1.15 and 2.25 s from the prefill's answer to
    # the first token: fixed parts 0.15 and 0.25, median 0.2. A direct request and a
    # handoff without a first token (not streamed) are not handoff samples.
    import json

    from bench.replay_speeds import handoff_overhead
    from bench.sim.speeds import from_measured

    log = [{"kind": "pd", "n": 1001, "prefill_s": 0.5, "ttft_s": 1.65},
           {"kind": "pd", "n": 2001, "prefill_s": 1.0, "ttft_s": 3.25},
           {"kind": "direct", "n": 10, "prefill_s": None, "ttft_s": 0.1},
           {"kind": "pd", "n": 10, "prefill_s": 0.1, "ttft_s": None}]
    h = handoff_overhead(log, 1_000_000, 1.0)
    assert h["overhead_s"] == pytest.approx(0.2) and [g["n"] for g in h["gaps"]] == [1001, 2001]
    assert handoff_overhead(log, 1_000_000, None)["overhead_s"] is None
    # The simulator's P2P link: that fixed part less the decode step it simulates itself.
    m = {"prefill": {"step_s": 0.0, "token_s": 1e-4, "attn_s": 0.0}, "decode": {"step_s": 0.01, "per_seq_s": 0.0},
         "bytes_per_token": 1_000_000, "p2p": {"gbps": 1.0, "latency_s": 0.001, "handoff": h}}
    (tmp_path / "speeds.json").write_text(json.dumps(m))
    assert from_measured(tmp_path / "speeds.json").p2p.latency_s == pytest.approx(0.19)
    del m["p2p"]["handoff"]
    (tmp_path / "speeds.json").write_text(json.dumps(m))
    assert from_measured(tmp_path / "speeds.json").p2p.latency_s == pytest.approx(0.001)


def test_a_roles_own_prefill_speed_applies_to_that_role_only():
    # As test_handoff_times_by_hand, with the prefill instance at 0.2 s a token: A's 16
    # tokens take 3.2 s there, the pull 0.15 s, the decode instance's last token 0.1 s at
    # the common speed: first token at 3.45 s.
    sp = replace(speeds(1e7), role_prefill={"prefill": Prefill(step_s=0.0, token_s=0.2, attn_s=0.0)})
    a, = simulate([A], sp, Cluster(prefill=1, decode=1, cache_blocks=100, block=4), "round-robin")
    assert a.kind == "pd" and a.ttft == pytest.approx(3.45)


def test_sensitivity_reruns_the_simulation_with_the_prefill_speed_scaled():
    # 1P1D round-robin on A alone (test_handoff_times_by_hand: first token at 1.85 s, of
    # which 1.6 s are the prefill instance's 16 tokens): at x1.1 the prefill takes 1.76 s.
    from bench.sim.validate import SPEED_FACTORS, sensitivity

    rows = sensitivity([A], speeds(1e7), Cluster(prefill=1, decode=1, cache_blocks=100, block=4), "round-robin", 4, 10.0)
    assert [r["factor"] for r in rows] == list(SPEED_FACTORS)
    by = {r["factor"]: r for r in rows}
    assert by[1.0]["ttft_p50"] == pytest.approx(1.85) and by[1.1]["ttft_p50"] == pytest.approx(2.01)
    assert by[1.0]["share_p2p"] == pytest.approx(15 / 16) and by[1.0]["routes"]["pd"] == 1


def test_a_handoff_waits_for_the_step_its_busy_prefill_instance_is_computing():
    # 1P1D, round-robin. A (16 tokens) at 0 s: P computes it in one step, 0 to 1.6 s. C (16
    # other tokens) arrives at 0.1 s and waits; at 1.6 s P goes straight on to it (1.6 to
    # 3.2 s). With handoff_waits_step, A's pull (0.15 s) starts at 3.2 s, when P's step
    # ends: ready at 3.35, D's last token 0.1 s, first token at 3.45 s. Without: 1.85 s.
    c = Request(100.0, 16, 3, (5, 6, 7, 8))
    cl = Cluster(prefill=1, decode=1, cache_blocks=100, block=4)
    late = simulate([A, c], replace(speeds(1e7), handoff_waits_step=True), cl, "round-robin")
    plain = simulate([A, c], speeds(1e7), cl, "round-robin")
    assert late[0].prefilled == plain[0].prefilled == pytest.approx(1.6)
    assert late[0].ttft == pytest.approx(3.45) and plain[0].ttft == pytest.approx(1.85)
    # C's own prefill ends at 3.2 with P idle after it: its pull starts at once (behind A's
    # on D's NIC, 3.35 to 3.5).
    assert late[1].prefilled == pytest.approx(3.2) and late[1].ready == pytest.approx(3.5)
