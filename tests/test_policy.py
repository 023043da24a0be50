"""The composite's cost model and its online calibration (pure Python)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kvcore.errors import ConfigError
from kvcore.plan import Source
from kvcore.tier import LoadPrior
from mcstore.config import composite_role
from multi.calibration import OnlineFit
from multi.config import load_config
from multi.policy import CostModel, Inputs, PolicyConfig, TierReach, requested_source

pytestmark = pytest.mark.unit

BPT = 8192.0  # bytes of KV per token (the small model)


def inputs(n, local=0, store=0, p2p=False, elapsed=0.0):
    return Inputs(prompt_tokens=n, local_tokens=local, bytes_per_token=BPT, prefill_elapsed_s=elapsed,
                  tiers=[TierReach("store", store), TierReach("p2p", n if p2p else 0, remote_prefill=True)])


def covers(plan, n):
    segs = plan.segments
    assert segs[0].start == 0 and segs[-1].end == n
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    assert segs[-1].source == Source.RECOMPUTE  # the last token is always computed


def test_short_prompt_recomputes_long_prompt_loads():
    m = CostModel(PolicyConfig())
    short, _, _ = m.choose(inputs(40, store=32, p2p=True))
    assert short.name == "recompute"
    long, plans, _ = m.choose(inputs(4096, store=4064, p2p=True))
    assert long.name in ("store", "store+p2p")
    for p in plans:
        covers(p, 4096)


def test_store_prefix_then_p2p_for_the_rest():
    m = CostModel(PolicyConfig())
    plan, plans, _ = m.choose(inputs(4096, store=2048, p2p=True))
    assert plan.name == "store+p2p", [(p.name, p.seconds) for p in plans]
    assert [(s.start, s.end, s.source) for s in plan.segments] == [
        (0, 2048, "store"), (2048, 4095, "p2p"), (4095, 4096, "recompute")]


def test_local_prefix_is_never_reloaded():
    m = CostModel(PolicyConfig())
    plan, plans, _ = m.choose(inputs(4096, local=1024, store=2048, p2p=True))
    for p in plans:
        covers(p, 4096)
        assert p.segments[0].source == Source.LOCAL and p.segments[0].end == 1024
    assert plan.tokens("store") == 1024


def test_forced_sources_are_obeyed_or_fall_back():
    m = CostModel(PolicyConfig())
    x = inputs(4096, store=2048, p2p=True)
    assert m.choose(x, "recompute")[0].name == "recompute"
    assert m.choose(x, "store")[0].name == "store"
    assert m.choose(x, "p2p")[0].name == "p2p"
    plan, _, reason = m.choose(inputs(4096), "store")
    assert plan.name == "recompute" and "nothing" in reason
    assert requested_source({"kv_source": "p2p"}, "auto") == ("p2p", None)
    src, warning = requested_source({"kv_source": 7}, "auto")
    assert src == "auto" and "kv_source" in warning


def test_no_sources_means_recompute():
    plan, plans, _ = CostModel(PolicyConfig()).choose(inputs(4096))
    assert [p.name for p in plans] == ["recompute"] and plan.tokens(Source.RECOMPUTE) == 4096


def test_fit_converges_and_resists_outliers():
    rng = random.Random(0)
    true = [0.004, 2e-4, 3e-8]
    fit = OnlineFit([0.05, 1e-3, 0.0], lower=[0, 1e-7, 0], upper=[5, 1, 1e-3], scale=[1, 1e3, 1e6])
    for i in range(60):
        n = rng.randint(1, 4096)
        c = rng.randint(0, 4096)
        x = [1.0, n, n * (c + n / 2)]
        y = sum(a * b for a, b in zip(true, x)) * rng.uniform(0.9, 1.1)
        if i == 30:
            y *= 100  # one wild sample
        fit.update(x, y)
    for n, c in ((32, 0), (512, 0), (2048, 1024), (4096, 4096)):
        x = [1.0, n, n * (c + n / 2)]
        want = sum(a * b for a, b in zip(true, x))
        assert 0.7 < fit.predict(x) / want < 1.4, (n, c)
    assert fit.clipped >= 1


def test_a_wild_first_load_sample_moves_the_load_fit_at_most_clip_times():
    """A cost model's load fit clips from its first sample (a first handoff can pay a
    connection's set-up): one sample 49x its estimate leaves the next estimate within 4x
    of the prior's; a plain fit (clip after 3) follows that sample almost all the way."""
    model = CostModel(PolicyConfig())
    prior = LoadPrior(latency_s=0.002, bandwidth_gbps=2.0)
    fit = model.load_fit("p2p", prior)
    small, big = 160e3, 8e6
    before = fit.predict([1.0, big])
    fit.update([1.0, small], 49 * fit.predict([1.0, small]))
    assert fit.predict([1.0, big]) <= 4.0 * before * 1.01 and fit.clipped == 1
    plain = OnlineFit([0.002, 1 / 2e9], lower=[0.0, 1e-12], upper=[30.0, 1e-3], scale=[1.0, 1e9])
    plain.update([1.0, small], 49 * plain.predict([1.0, small]))
    assert plain.predict([1.0, small]) > 20 * (0.002 + small / 2e9) and plain.clipped == 0


@pytest.mark.parametrize("sigma", [0.15, 0.4])
def test_a_load_fit_tends_to_the_mean_of_samples_that_spread(sigma):
    """Handoffs of 4 MB whose times spread log-normally (median 27 ms; sigma 0.4 is what the
    AVX2 host's handoffs spread by), the fit started 2x fast: over the last 100 of 200
    samples the estimate averages within 10% of the samples' mean. Weighted by each
    sample's own seconds (until 2026-12-05) it sat near exp(mu - 1.5 sigma^2), 0.73x the
    mean at sigma 0.4, below the median, and ``auto`` took a handoff slower than the store."""
    model = CostModel(PolicyConfig())
    fit = model.load_fit("p2p", LoadPrior(latency_s=0.0135 - 4.19e6 / 2e9, bandwidth_gbps=2.0))
    rng = random.Random(7)
    x, est, seen = [1.0, 4.19e6], [], []
    for i in range(200):
        y = 0.027 * math.exp(rng.gauss(0.0, sigma))
        if i >= 100:
            est.append(fit.predict(x))
            seen.append(y)
        fit.update(x, y)
    mean = 0.027 * math.exp(sigma ** 2 / 2)
    assert 0.9 < statistics.mean(est) / mean < 1.1, (statistics.mean(est), mean, statistics.mean(seen))


def test_a_fit_weighted_by_the_sample_is_the_previous_one_and_a_wrong_weighting_is_refused():
    """``relative_to="sample"`` (the router's wait fit) weights each sample by its own seconds:
    on samples that spread it sits below the one weighted by its prediction."""
    rng = random.Random(3)
    by = {w: OnlineFit([0.02, 0.0], lower=[0.0, 0.0], upper=[1.0, 1.0], scale=[1.0, 1.0], relative_to=w)
          for w in ("prediction", "sample")}
    for _ in range(200):
        y = 0.027 * math.exp(rng.gauss(0.0, 0.4))
        for fit in by.values():
            fit.update([1.0, 0.0], y)
    assert by["sample"].predict([1.0, 0.0]) < 0.85 * by["prediction"].predict([1.0, 0.0])
    with pytest.raises(ValueError, match="relative_to must be"):
        OnlineFit([0.0], lower=[0.0], upper=[1.0], scale=[1.0], relative_to="median")


def test_fit_stays_within_bounds():
    fit = OnlineFit([0.01, 1e-9], lower=[0.0, 1e-12], upper=[1.0, 1e-6], scale=[1.0, 1e9])
    for _ in range(20):
        fit.update([1.0, 1e6], 1e5)  # absurd measurement
    assert fit.coef[0] <= 1.0 and fit.coef[1] <= 1e-6


def test_config_errors():
    with pytest.raises(ConfigError, match="at least one tier"):
        load_config({})
    with pytest.raises(ConfigError, match="polcy"):
        load_config({"store": {}, "polcy": {}})
    with pytest.raises(ConfigError, match="default_source"):
        load_config({"p2p": {}, "default_source": "disk"})
    with pytest.raises(ConfigError, match="idle_compute_s"):
        load_config({"p2p": {}, "policy": {"idle_compute_s": -1}})
    cfg = load_config({"p2p": {}, "policy": {"local_compute_weight": 1.0}})
    assert cfg.policy.local_compute_weight == 1.0 and composite_role("kv_consumer", cfg.write_back) == "kv_consumer"
    assert composite_role("kv_consumer", load_config({"store": {}, "write_back": True}).write_back) == "kv_both"


@pytest.mark.parametrize("factor", [0.1, 10.0, 40.0])
def test_calibration_from_wrong_defaults_converges(factor):
    """A machine ``factor`` times slower than the defaults (another CPU class, another dtype):
    after 40 forward passes (one prefill for four decode steps, timing noise of 15%) the
    estimates are within 30% on average; with ``calibrate: false`` they stay wrong."""
    from multi.policy import ForwardSample

    cfg = PolicyConfig()
    true = [factor * cfg.prefill_step_s, factor * cfg.prefill_token_s, factor * cfg.prefill_attn_s]

    def errors(calibrate: bool) -> float:
        model = CostModel(PolicyConfig(calibrate=calibrate))
        rng = random.Random(1)
        errs = []
        for i in range(60):
            n, c = (rng.randint(300, 1200), 0) if i % 5 == 0 else (1, rng.randint(300, 1200))
            seconds = sum(a * b for a, b in zip(true, [1.0, n, n * (c + n / 2)])) * rng.uniform(0.85, 1.15)
            kind, est, measured = model.learn(ForwardSample([n], [c], seconds))
            assert kind == "forward" and measured == seconds
            errs.append(abs(est - seconds) / seconds)
        return sum(errs[40:]) / 20

    assert errors(calibrate=True) < 0.3
    assert errors(calibrate=False) > 0.8


def test_own_compute_is_weighted_by_what_it_stalls():
    m = CostModel(PolicyConfig(local_compute_weight=1.5, idle_compute_s=0.5))
    assert m.weighted(0.3, busy=0) == pytest.approx(0.3)  # alone and short: its time
    assert m.weighted(0.3, busy=2) == pytest.approx(0.45)  # other requests wait behind it
    assert m.weighted(1.0, busy=0) == pytest.approx(0.5 + 1.5 * 0.5)  # alone but long
    assert CostModel(PolicyConfig(idle_compute_s=0.0)).weighted(0.3, busy=0) == pytest.approx(0.45)


def test_plan_parts_give_the_compute_weighted_and_unweighted():
    # A plan's seconds add the weighted compute ("recompute_s"); "compute_s" is the fit's own
    # estimate, the figure a measured prefill is compared with (a long one differs by 1.5x).
    m = CostModel(PolicyConfig())
    for busy in (0, 2):
        x = inputs(8193, store=4096)
        x.busy = busy
        for p in m.plans(x):
            start = p.segments[-1].start
            assert p.parts["compute_s"] == pytest.approx(m.compute_s(start, 8193))
            assert p.parts["recompute_s"] == pytest.approx(m.weighted(p.parts["compute_s"], busy))
            assert p.parts["recompute_s"] > p.parts["compute_s"]


def test_idle_instance_computes_a_short_prompt_a_busy_one_hands_it_off():
    # 1,025 tokens, nothing stored, the prefill instance just started (priors: ~0.33 s of
    # compute, a handoff 0.03 s more). Alone, the decode instance computes it: sooner, and
    # nobody waits. With requests of its own, its compute counts 1.5x: the handoff wins.
    m = CostModel(PolicyConfig())
    x = inputs(1025, p2p=True)
    idle, plans, _ = m.choose(x)
    assert idle.name == "recompute", [(p.name, p.seconds) for p in plans]
    x.busy = 3
    busy, plans, _ = m.choose(x)
    assert busy.name == "p2p", [(p.name, p.seconds) for p in plans]
    # A long prompt is handed off even from an idle decode instance: past idle_compute_s
    # its compute would stall the handoffs that arrive meanwhile.
    long, plans, _ = m.choose(inputs(4097, p2p=True))
    assert long.name == "p2p", [(p.name, p.seconds) for p in plans]


def handoff_inputs(n, stored, remote_cached, elapsed=0.0):
    return Inputs(prompt_tokens=n, local_tokens=0, bytes_per_token=BPT, prefill_elapsed_s=elapsed,
                  tiers=[TierReach("store", stored),
                         TierReach("p2p", n, remote_prefill=True, remote_cached=remote_cached)])


@pytest.mark.parametrize("store_prior, p_loads", [(LoadPrior(latency_s=0.01, bandwidth_gbps=2.0), True),
                                                  (LoadPrior(latency_s=5.0, bandwidth_gbps=0.01), False)])
def test_a_handoff_waits_for_what_a_prefill_instance_without_the_prefix_does_first(store_prior, p_loads):
    # A fully stored 2,049-token prompt, routed (a router knows the prefill instance's own
    # cache) to a prefill instance that holds none of it: before it can hand over, it runs
    # its own choice, loading [0, 2048) from the store and computing the last token, or
    # computing all (when its store is slow). Counting only the last token's compute made
    # such a handoff look a store load cheaper than it was.
    m = CostModel(PolicyConfig(tiers={"store": store_prior}))
    n = 2049
    x = handoff_inputs(n, n - 1, remote_cached=0)
    plans = {p.name: p for p in m.plans(x)}
    load = m.load_s(x.tiers[0], (n - 1) * BPT)
    own = load + m.compute_s(n - 1, n) if p_loads else m.compute_s(0, n)
    assert plans["p2p"].parts["p2p_remote_s"] == pytest.approx(own)
    assert plans["p2p"].parts["p2p_remote_s"] > m.compute_s(n - 1, n)
    handoff = own + m.load_s(x.tiers[1], (n - 1) * BPT)
    assert plans["p2p"].seconds == pytest.approx(handoff + plans["p2p"].parts["recompute_s"])
    if p_loads:  # the same load on both sides, and the handoff's transfer on top: the store wins
        assert m.choose(x)[0].name == "store"


def test_a_prefill_instance_holding_the_prefix_only_computes_the_rest():
    # Its cache known to hold the prefix (a router's index), or unknown (a connector, which
    # takes it to hold what the store holds: in 1P1D it wrote it): no load, the rest only.
    # The time since the request arrived is the prefill instance's head start.
    m = CostModel(PolicyConfig())
    n = 2049
    for cached in (n - 1, None):
        p2p = {p.name: p for p in m.plans(handoff_inputs(n, n - 1, cached, elapsed=0.001))}["p2p"]
        assert p2p.parts["p2p_remote_s"] == pytest.approx(m.compute_s(n - 1, n) - 0.001)
    # Half stored, cache unknown: the compute of what the store does not hold.
    p2p = {p.name: p for p in m.plans(handoff_inputs(n, 1024, None))}["p2p"]
    assert p2p.parts["p2p_remote_s"] == pytest.approx(m.compute_s(1024, n))
