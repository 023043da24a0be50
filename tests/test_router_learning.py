"""What the router learns and how it stays honest, without engines: the start-up probe's
seeding (``multi.router.fits``), learning from answers measured under concurrency
(``multi.router.ledger``), the honesty check's fallback and admission margin
(``multi.router.honesty``), and the fixed policies ``direct`` and ``handoff``. The probe
on real engines is in ``tests/test_router_e2e.py``."""

from __future__ import annotations

import math
import random

import pytest

from multi.policy import PolicyConfig
from multi.router.choose import Chooser
from multi.router.fits import PROBED_WAIT, probe_compute
from multi.router.honesty import Honesty
from multi.router.instances import Pool, make

pytestmark = pytest.mark.unit

BPT = 4096.0
CFG = PolicyConfig()


def true_compute(step: float, token: float, n: int, c: int = 0) -> float:
    """A machine whose attention term is the prior's ratio times its per-token cost."""
    attn = CFG.prefill_attn_s / CFG.prefill_token_s * token
    return step + token * n + attn * n * (c + n / 2)


def test_probe_timings_of_two_lengths_give_the_machine_s_step_and_token_cost():
    # A machine 20x faster per token than the prior, with a 6 ms fixed cost.
    step, token = 0.006, 1.5e-5
    samples = [(32, true_compute(step, token, 32)), (1024, true_compute(step, token, 1024))]
    got = probe_compute(samples, CFG)
    assert got == pytest.approx([step, token, CFG.prefill_attn_s / CFG.prefill_token_s * token], rel=1e-6)
    # More timings: least squares over all of them.
    noisy = samples + [(32, samples[0][1] * 1.02), (1024, samples[1][1] * 0.98)]
    assert probe_compute(noisy, CFG)[1] == pytest.approx(token, rel=0.05)
    # One length cannot separate the step from the per-token cost; a shorter long prompt
    # than short one gives no positive per-token cost: the priors stay.
    assert probe_compute([(32, 0.01), (32, 0.011)], CFG) is None
    assert probe_compute([(32, 0.02), (1024, 0.01)], CFG) is None


def test_seeding_replaces_the_priors_of_that_instance_only():
    pool = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    e0, e1 = pool.role("plain")
    c = Chooser("kv", BPT, PolicyConfig())
    prior = c.prefill_work(e0, 1088, 0)
    compute = probe_compute([(32, true_compute(0.006, 1.5e-5, 32)), (1024, true_compute(0.006, 1.5e-5, 1024))], CFG)
    c.seed(e0, compute, weight=6)
    assert c.prefill_work(e0, 1088, 0) == pytest.approx(true_compute(0.006, 1.5e-5, 1088), rel=1e-6)
    assert c.prefill_work(e1, 1088, 0) == pytest.approx(prior)
    assert list(c.fit(e0).fit.coef[3:]) == PROBED_WAIT  # the work ahead at the measured speed, nothing else
    # The estimate of an idle instance is now the machine's, ~20x below the prior's.
    r = c.choose(pool, 1088, lambda i: 0, 0, None)
    assert r.target is e0 and r.predicted == pytest.approx(true_compute(0.006, 1.5e-5, 1088), rel=1e-6)
    assert prior > 10 * r.predicted


def test_the_handoff_probe_sets_the_p2p_latency():
    pool = Pool([make("prefill", "http://127.0.0.1:8100"), make("decode", "http://127.0.0.1:8200")])
    p = pool.role("prefill")[0]
    c = Chooser("kv", BPT, PolicyConfig())
    fit = c.model(p).load_fit("p2p")
    per_byte = fit.coef[1]
    c.seed_handoff(p, 0.012, 1023)
    assert fit.coef[0] == pytest.approx(max(0.0, 0.012 - 1023 * BPT * per_byte))
    assert c.model(p).load_fit("p2p").predict([1.0, 1023 * BPT]) == pytest.approx(0.012)


def test_answers_under_concurrency_teach_the_speed_with_the_queue_modelled():
    # One plain instance, probed while something else slowed the machine (its compute
    # seeded 1.6x too slow), then answering requests of varied length while others are in
    # flight: each first token comes after the prefill work ahead of it (at the true speed)
    # plus its own compute plus 2 ms per decoding request. Learning from every answer (none
    # is alone), the predicted TTFT comes within 25% (median) of the actual.
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    rng = random.Random(1)
    step, token = 0.006, 1.5e-5

    def run(learn: bool) -> float:
        c = Chooser("kv", BPT, PolicyConfig(calibrate=learn))
        slow = [(n, 1.6 * true_compute(step, token, n)) for n in (32, 1024)]
        c.seed(e, probe_compute(slow, CFG), weight=6, scale_s=slow[1][1])
        errors = []
        for i in range(200):
            n, cached = rng.choice([(1088, 1024), (1088, 0), (320, 0), (2080, 2048)])
            now = 1000.0 + i
            e.inflight.clear()  # requests already there: one prefilling (routed 0.01 s ago), two decoding
            e.inflight["ahead"] = (c.prefill_work(e, 1088, 0), now - 0.01)
            e.decoding = {"a", "b"}
            e.outstanding = 3
            r = c.choose(pool, n, lambda i, cached=cached: cached, 0, None, now=now)
            ahead_left = max(0.0, true_compute(step, token, 1088) - 0.01)
            actual = ahead_left + true_compute(step, token, n - cached, cached) + 2 * 0.002
            if i >= 50:
                errors.append(abs(math.log(actual / r.predicted)))
            c.learn_request(r, e, n, cached, alone=False, ttft_s=actual, prefill_s=None)
        return sorted(errors)[len(errors) // 2]

    learned, frozen = run(True), run(False)
    assert learned < math.log(1.25) < frozen, (learned, frozen)


def test_honesty_falls_back_on_drift_and_comes_back_when_estimates_agree():
    h = Honesty(disaggregated=True, window=32, min_samples=8, hold=16)
    # Agreeing estimates: kv decides.
    for _ in range(20):
        h.record("pd", 0.1, 0.11, {"pd": 0.1, "direct": 0.05})
    assert h.fallback is None and h.drift("pd") == pytest.approx(math.log(1.1))
    # The handoff's estimates drift 3x low: after enough of them in the window, kv falls back.
    # The window says direct serves sooner (0.05 x its ratio 1 < 0.1 x 3).
    for _ in range(8):
        h.record("direct", 0.05, 0.05, {"pd": 0.1, "direct": 0.05})
    for i in range(30):
        h.record("pd", 0.1, 0.3, {"pd": 0.1, "direct": 0.05})
        if h.fallback:
            break
    assert h.fallback == "direct" and h.switches == 1
    assert h.state()["mode"] == "direct"
    # Under the fallback the estimates of the routes taken agree again, but it holds for
    # `hold` answers first.
    for i in range(15):
        h.record("direct", 0.05, 0.052)
    assert h.fallback == "direct"
    h.record("direct", 0.05, 0.052)
    assert h.fallback is None and h.state()["mode"] == "kv"
    # Drifting again soon after: the next fallback holds twice as long. Direct is now 4x
    # off and the handoff right: 0.05 x 4 > 0.06 x 1.
    for _ in range(8):
        h.record("pd", 0.06, 0.06, {"pd": 0.06, "direct": 0.05})
    for _ in range(8):
        h.record("direct", 0.05, 0.2, {"pd": 0.06, "direct": 0.05})
    assert h.fallback == "handoff" and h.switches == 2
    for _ in range(31):
        h.record("pd", 0.06, 0.06)
    assert h.fallback == "handoff"
    # A kind with too few answers of its own takes the other kind's ratio (a bias of the machine).
    alone = Honesty(disaggregated=True, min_samples=8)
    for _ in range(8):
        alone.record("direct", 0.05, 0.2, {"pd": 0.06, "direct": 0.05})
    assert alone.fallback == "direct"  # 0.05 x 4 < 0.06 x 4
    h.record("pd", 0.06, 0.06)
    assert h.fallback is None


def test_honesty_in_a_plain_pool_falls_back_to_least_outstanding_and_can_be_off():
    h = Honesty(disaggregated=False, min_samples=8)
    for _ in range(8):
        h.record("direct", 0.1, 1.0)
    assert h.fallback == "least-outstanding"
    off = Honesty(enabled=False, min_samples=8)
    for _ in range(20):
        off.record("direct", 0.1, 1.0)
    assert off.fallback is None and off.drift("direct") == pytest.approx(math.log(10))
    # Nonsense answers are not recorded.
    off.record("direct", 0.0, 1.0)
    off.record("direct", 0.1, float("nan"))
    assert len(off.window) == 20


def test_admission_margin_is_the_window_s_upper_ratio():
    h = Honesty(min_samples=8)
    assert h.margin("pd") == pytest.approx(1.5)  # nothing known: the prior (PRIOR_MARGIN)
    assert h.margin("pd", 1.0) == 1.0  # the caller's prior (an idle pool's): the estimate as it is
    for x in [1.0] * 9 + [2.0]:
        h.record("pd", 1.0, x)
    assert 1.0 < h.margin("pd") <= 2.0
    for _ in range(40):
        h.record("direct", 1.0, 10.0)
    assert h.margin("direct") == 3.0  # clamped


def test_the_kv_policy_routes_by_its_fallback_and_still_estimates():
    pool = Pool([make("prefill", "http://127.0.0.1:8100"), make("decode", "http://127.0.0.1:8200")])
    p, d = pool.role("prefill")[0], pool.role("decode")[0]
    c = Chooser("kv", BPT, PolicyConfig(idle_compute_s=0.0))
    assert c.choose(pool, 3000, lambda i: 0, 0, None).kind == "pd"
    c.honesty.fallback = "direct"
    r = c.choose(pool, 3000, lambda i: 0, 0, None)
    assert (r.kind, r.target, r.mode) == ("direct", d, "fallback direct")
    assert set(r.alternatives) == {"direct", "pd"} and r.predicted > 0
    c.honesty.fallback = "handoff"
    r = c.choose(pool, 40, lambda i: 0, 0, None)
    assert (r.kind, r.prefill, r.mode) == ("pd", p, "fallback handoff")


def test_direct_and_handoff_are_fixed_policies():
    pool = Pool([make("prefill", f"http://127.0.0.1:810{i}") for i in range(2)] + [make("decode", "http://127.0.0.1:8200")])
    p0, p1 = pool.role("prefill")
    cached = {p1.url: 320}
    match = lambda i: cached.get(i.url, 0)  # noqa: E731
    direct = Chooser("direct", BPT, PolicyConfig(calibrate=False))
    assert all(direct.choose(pool, n, match, 0, None).kind == "direct" for n in (40, 3000))
    handoff = Chooser("handoff", BPT, PolicyConfig(calibrate=False))
    # Every request handed off, through the prefill instance with the fewest in flight and,
    # among those, the longest cached prefix.
    r = handoff.choose(pool, 400, match, 0, None)
    assert (r.kind, r.prefill, r.reason) == ("pd", p1, "handoff")
    p1.outstanding = 1
    assert handoff.choose(pool, 400, match, 0, None).prefill is p0
    plain = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    e0, e1 = plain.role("plain")
    e0.outstanding = 1
    assert direct.choose(plain, 100, lambda i: 0, 0, None).target is e1


def test_a_request_leaves_the_queue_at_its_first_token_and_decodes_until_its_end():
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    r = c.choose(pool, 2000, lambda i: 0, 0, None)
    assert c.begin(r, e, 2000, 0, "a", 0.0) is True
    assert e.queue_s(0.0) > 0 and e.outstanding == 1
    c.first_token(r, e, "a")
    assert (e.inflight, e.decoding, e.outstanding) == ({}, {"a"}, 1)
    assert c.wait_features(e, 0.0, 0.1) == [1.0, 0.1, 0.0, 1.0]
    assert c.begin(r, e, 2000, 0, "b", 0.0) is False  # one decoding: not alone
    c.end(r, e, "a")
    c.end(r, e, "b")  # failed before its first token
    assert (e.inflight, e.decoding, e.outstanding) == ({}, set(), 0)
    # A handoff decodes on the decode instance.
    pd = Pool([make("prefill", "http://127.0.0.1:8100"), make("decode", "http://127.0.0.1:8200")])
    p, d = pd.role("prefill")[0], pd.role("decode")[0]
    r = Chooser("handoff", BPT, PolicyConfig(calibrate=False)).choose(pd, 2000, lambda i: 0, 0, None)
    c.begin(r, p, 2000, 0, "h", 0.0)
    c.prefill_done(p, "h")
    c.first_token(r, p, "h")
    assert (p.outstanding, d.outstanding, d.decoding) == (0, 1, {"h"})
    c.end(r, p, "h")
    assert (p.outstanding, d.outstanding, d.decoding) == (0, 0, set())


def test_handoff_needs_prefill_instances():
    from multi.router.cli import build_app, parse_args

    with pytest.raises(SystemExit, match="--policy handoff needs --prefill and --decode"):
        build_app(parse_args(["--plain", "http://127.0.0.1:9", "--policy", "handoff", "--kv-bytes-per-token", "1"]))


def test_kv_serves_a_request_whole_on_a_prefill_instance_when_that_is_sooner():
    # Measured: the prefill instance answers a whole request in 10 ms + 50 us a token, the
    # decode instance (its connector's cost per request) in 30 ms + 55 us. A short prompt:
    # whole on the prefill instance beats both the decode instance and a handoff.
    pool = Pool([make("prefill", "http://127.0.0.1:8100"), make("decode", "http://127.0.0.1:8200")])
    p, d = pool.role("prefill")[0], pool.role("decode")[0]
    c = Chooser("kv", BPT, PolicyConfig(local_compute_weight=1.0), direct_to_prefill=True)
    c.seed(p, [0.010, 5e-5, 0.0], weight=6)
    c.seed(d, [0.030, 5.5e-5, 0.0], weight=6)
    r = c.choose(pool, 300, lambda i: 0, 0, None)
    assert (r.kind, r.target, r.reason) == ("direct", p, "prefill instance serves it whole")
    assert set(r.candidates) == {f"direct {d.url}", f"direct {p.url}", f"pd {p.url}"}
    assert r.alternatives["direct"] == pytest.approx(r.predicted)
    # Busy with prefill work queued, the prefill instance is not: the decode instance takes it.
    p.inflight["x"] = (1.0, 0.0)
    p.outstanding = 1
    r = c.choose(pool, 300, lambda i: 0, 0, None, now=0.0)
    assert (r.kind, r.target) == ("direct", d)
    # Without it (or with another policy) a prefill instance only prefills.
    p.inflight.clear()
    p.outstanding = 0
    off = Chooser("kv", BPT, PolicyConfig(local_compute_weight=1.0))
    off.seed(p, [0.010, 5e-5, 0.0], weight=6)
    off.seed(d, [0.030, 5.5e-5, 0.0], weight=6)
    r = off.choose(pool, 300, lambda i: 0, 0, None)
    assert r.target is d and set(r.candidates) == {f"direct {d.url}", f"pd {p.url}"}


def test_kv_s_direct_fallback_serves_where_kv_may():
    pool = Pool([make("prefill", "http://127.0.0.1:8100"), make("decode", "http://127.0.0.1:8200")])
    p, d = pool.role("prefill")[0], pool.role("decode")[0]
    c = Chooser("kv", BPT, PolicyConfig(), direct_to_prefill=True)
    c.honesty.fallback = "direct"
    d.outstanding = 2
    r = c.choose(pool, 300, lambda i: 0, 0, None)
    assert (r.kind, r.target, r.mode) == ("direct", p, "fallback direct")
    # The fixed policy itself stays on the decode instance.
    assert Chooser("direct", BPT, PolicyConfig(), direct_to_prefill=True).choose(pool, 300, lambda i: 0, 0,
                                                                                 None).target is d
