"""The router's wait model and its admission decision, without engines: the queue ahead of a
request (``multi.router.instances.queue_ahead_s``), what the books record when a prefill ends
(``multi.router.ledger``) and the estimate admission compares with the target
(``multi.router.admission``)."""

from __future__ import annotations

import math

import pytest

from multi.policy import PolicyConfig
from multi.router.admission import LATE_WINDOW, estimate_s, rejection
from multi.router.choose import Chooser
from multi.router.honesty import PRIOR_MARGIN, Honesty
from multi.router.instances import Pool, make, queue_ahead_s

pytestmark = pytest.mark.unit

BPT = 4096.0
NO_DEPARTURE = float("-inf")


def test_the_queue_is_worked_through_in_order_from_the_last_departure():
    # Two prefills of 0.25 s sent together at t=10 behind nothing: 0.5 s of work at t=10.
    work = [(0.25, 10.0), (0.25, 10.0)]
    assert queue_ahead_s(work, NO_DEPARTURE, 10.0) == pytest.approx(0.5)
    assert queue_ahead_s(work, NO_DEPARTURE, 10.1) == pytest.approx(0.4)
    # The first of three sent at t=10 left at 10.35 (0.1 s late): the two behind it were
    # waiting, not computing. The one at the head starts at 10.35, the next after it.
    behind = [(0.25, 10.0), (0.25, 10.0)]
    assert queue_ahead_s(behind, 10.35, 10.36) == pytest.approx(0.49)
    # Without the departure (the earlier model) they counted as computing since they were
    # sent, and the queue behind a late first token came out near 0: 10.0 + 0.5 - 10.36.
    assert queue_ahead_s(behind, NO_DEPARTURE, 10.36) == pytest.approx(0.14)
    # A request sent after the last departure starts when it was sent.
    assert queue_ahead_s([(0.25, 11.0)], 10.35, 11.1) == pytest.approx(0.15)
    # Nothing queued: no wait, whenever the last one left.
    assert queue_ahead_s([], 10.35, 10.2) == 0.0
    assert queue_ahead_s([], NO_DEPARTURE, 10.0) == 0.0


def test_a_prefill_leaving_at_its_first_token_anchors_the_queue_behind_it():
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    routes = []
    for rid in ("a", "b", "c"):
        r = c.choose(pool, 544, lambda i: 0, 0, None, now=100.0)
        c.begin(r, e, 544, 0, rid, 100.0)
        routes.append(r)
    s = e.inflight["a"][0]
    assert e.queue_s(100.0) == pytest.approx(3 * s)
    # a's first token comes late, at 100 + 2s: b and c are both still ahead, b from now on.
    c.first_token(routes[0], e, "a", 100.0 + 2 * s)
    assert (e.departed, e.decoding) == (100.0 + 2 * s, {"a"})
    assert e.queue_s(100.0 + 2 * s) == pytest.approx(2 * s)
    # A time-less departure (end without a clock) leaves the anchor where it was.
    c.end(routes[1], e, "b")
    assert e.departed == 100.0 + 2 * s and e.queue_s(100.0 + 2 * s) == pytest.approx(s)


def test_the_margin_has_a_prior_from_the_first_request_that_answers_move():
    assert PRIOR_MARGIN == pytest.approx(1.5)
    assert estimate_s(0.4, 1.2) == pytest.approx(0.48)  # the margin on the whole estimate
    h = Honesty(min_samples=16)
    # Nothing measured: the prior (1.5 on a busy pool; the caller's 1 on an idle one).
    assert h.margin("direct") == pytest.approx(PRIOR_MARGIN)
    assert h.margin("direct", 1.0) == pytest.approx(1.0)
    # A few answers 2x their estimate (a burst slower than the probe): the margin follows
    # them before the window fills, the prior's 13 stand-ins notwithstanding.
    for _ in range(3):
        h.record("direct", 0.2, 0.4)
    assert h.margin("direct") == pytest.approx(2.0) and h.margin("direct", 1.0) == pytest.approx(2.0)
    # Answers as estimated keep the prior while it still outweighs them at the 0.9-quantile
    # (two stand-ins of 16: the 14th and 15th values, interpolated) ...
    h2 = Honesty(min_samples=16)
    for _ in range(14):
        h2.record("direct", 0.2, 0.2)
    assert h2.margin("direct") == pytest.approx(1.25)  # between 1 (14th) and 1.5 (15th)
    # ... and with 16 answers the window's own quantile rules: the prior is gone.
    for _ in range(2):
        h2.record("direct", 0.2, 0.2)
    assert h2.margin("direct") == pytest.approx(1.0)


def _cold_prompt_at_08_of_its_target():
    """Two seeded plain instances, idle; a cold 1,056-token prompt's route on the idle pool
    and a target it meets with 20% to spare there."""
    pool = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    for e in pool.role("plain"):
        c.seed(e, list(c.fit(e).compute_coef), weight=6)
    idle = c.choose(pool, 1056, lambda i: 0, 0, None, now=100.0)
    return pool, c, idle, idle.predicted / 0.8


def test_a_cold_prompt_that_the_probe_says_meets_the_target_gets_the_prior_margin_while_the_pool_is_busy():
    # e1 computes a request, e0 is idle. A cold prompt on e0 is predicted at 0.8 of its
    # target: alone on the host it meets it (the probe's condition), but with the other
    # engine sharing the cores the first answers of the P/D admission runs came 1.1-1.4x
    # their estimates (docs/benchmarks/router.md). Nothing measured yet: the prior 1.5
    # puts it past the target; with the lateness budget spent it is rejected.
    pool, c, idle, slo = _cold_prompt_at_08_of_its_target()
    assert idle.margin == pytest.approx(1.0) and idle.seconds == pytest.approx(idle.base_s)  # no wait
    assert c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0).kind == "direct"  # idle: admitted
    other = idle.target
    c.begin(c.choose(pool, 1056, lambda i: 0, 0, None, now=100.0), other, 1056, 0, "busy", 100.0)
    c.late.record(ttft_s=1.0, target_s=0.5)  # a late answer: no risk taken
    r = c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0)
    assert r.kind == "reject" and r.margin == pytest.approx(PRIOR_MARGIN) and "> target" in r.reason
    assert r.target is not other and r.predicted == pytest.approx(idle.predicted)  # idle there: no wait
    # Once the window has measured the kind as estimated, the same prompt is admitted safely.
    for _ in range(16):
        c.honesty.record("direct", 0.3, 0.3)
    ok = c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0)
    assert ok.kind == "direct" and not ok.risky


def test_a_route_that_meets_its_target_only_as_estimated_is_admitted_one_at_a_time_while_none_was_late():
    # The same cold prompt on a busy pool, nothing measured: past the target with the prior
    # margin, within it as estimated. Without the budget every such prompt was refused, and
    # the prefixes later requests reuse were never computed (the P/D admission run at
    # 94fb8f1: 7 admitted of 63). One at a time, while the last 32 admitted were on time.
    pool, c, idle, slo = _cold_prompt_at_08_of_its_target()
    other = idle.target
    c.begin(c.choose(pool, 1056, lambda i: 0, 0, None, now=100.0), other, 1056, 0, "busy", 100.0)
    r = c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0)
    assert r.kind == "direct" and r.risky and r.margin * r.predicted > slo >= r.predicted
    c.begin(r, r.target, 1056, 0, "risk", 100.0)
    assert c.late.inflight == {"risk"}
    second = c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0)
    assert second.kind == "reject"  # one at a time
    c.first_token(r, r.target, "risk", 100.5)
    # Its first token is out, but whether it was late is recorded when its answer ends (the
    # P/D admission run at 5e462d1 admitted a second at risk before the first's lateness
    # was known: both late): still one in flight.
    assert c.late.inflight == {"risk"} and c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.5).kind == "reject"
    c.end(r, r.target, "risk", 100.9)
    assert c.late.inflight == set()
    # It answered late: no risk for the next 32 admitted answers with a target.
    c.learn_request(r, r.target, 1056, 0, False, ttft_s=slo + 0.1, prefill_s=None)
    assert c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0).kind == "reject"
    for _ in range(LATE_WINDOW - 1):
        c.late.record(ttft_s=0.1, target_s=slo)
    assert c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0).kind == "reject"
    c.late.record(ttft_s=0.1, target_s=slo)  # the late one has left the window
    assert c.choose(pool, 1056, lambda i: 0, 0, slo, now=100.0).risky
    # A route past its target as estimated is never a risk to take.
    assert c.choose(pool, 1056, lambda i: 0, 0, 0.9 * r.predicted, now=100.0).kind == "reject"
    # A failed request (end without a first token) frees its place too.
    c.begin(r, r.target, 1056, 0, "risk2", 101.0)
    c.end(r, r.target, "risk2", 101.2)
    assert c.late.inflight == set()


def test_rejection_when_the_estimate_exceeds_the_target_with_retry_after():
    assert rejection(0.49, 0.5) is None
    assert rejection(0.5, 0.5) is None  # meets it exactly
    assert rejection(0.7, None) is None  # no target
    reason, retry = rejection(0.51, 0.5)
    assert retry == 1 and "0.510s > target 0.500s" in reason
    assert rejection(7.6, 0.5)[1] == math.ceil(7.1)


def test_a_burst_above_capacity_is_rejected_once_the_queue_ahead_misses_the_target():
    # One plain instance, requests of 0.25 s own compute arriving every 0.1 s (2.5x what it
    # serves). Each admitted one's first token comes after the queue ahead (the engine works
    # them in order, 10% slower than predicted). Admission with a 0.6 s target admits while
    # the queue is short, then rejects; every admitted one meets the target.
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    c.seed(e, list(c.fit(e).compute_coef), weight=6)  # as the start-up probe: the wait is the queue
    own = c.prefill_work(e, 544, 0)
    slo = 2.4 * own
    engine_free, admitted, rejected, first, routes = 0.0, [], 0, {}, {}
    for i in range(30):
        now = i * 0.4 * own
        for rid, t in sorted(first.items(), key=lambda kv: kv[1]):  # first tokens out by now
            if t <= now and rid in e.inflight:
                c.first_token(routes[rid], e, rid, t)
        r = c.choose(pool, 544, lambda inst: 0, 0, slo, now=now)
        if r.kind == "reject":
            rejected += 1
            assert r.retry_after >= 1
            assert 0 < r.seconds - r.base_s < r.seconds  # the decision log's wait_s: the wait alone
            continue
        rid = str(i)
        routes[rid] = r
        c.begin(r, e, 544, 0, rid, now)
        engine_free = max(engine_free, now) + 1.1 * own
        first[rid] = engine_free
        admitted.append((rid, now, r.predicted))
    assert rejected >= 10 and len(admitted) >= 8
    within = [first[rid] - t0 <= slo for rid, t0, _ in admitted]
    assert sum(within) / len(within) >= 0.9, [(first[r] - t, p) for r, t, p in admitted]
    # Each admitted one's predicted time to first token is within 25% of what happened.
    for rid, t0, predicted in admitted:
        assert abs(math.log((first[rid] - t0) / predicted)) < math.log(1.25)


def test_a_prefill_that_would_push_a_request_queued_before_it_past_its_target_is_rejected():
    # H computes; A (mostly cached) is queued behind it, not started, admitted with target T.
    # A cold prompt R arrives: its own estimate meets T, but the engine puts A and R into
    # one step, so A's first token would come only with R's, past A's deadline. In the P/D
    # admission run 6 of 45 admitted requests missed their target this way
    # (docs/benchmarks/router.md): R is rejected, and admitted once A has its first token.
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    c.seed(e, list(c.fit(e).compute_coef), weight=6)
    n, t0 = 544, 100.0
    rh = c.choose(pool, n, lambda i: 0, 0, None, now=t0)
    c.begin(rh, e, n, 0, "h", t0)
    ra = c.choose(pool, n, lambda i: 512, 0, None, now=t0)
    c.begin(ra, e, n, 512, "a", t0)
    now = t0 + 0.01
    starts = {r: se[0] for r, se in e.pending(now).items()}
    assert starts["h"] <= now < starts["a"]  # H computes, A waits for the next step
    dry = c.choose(pool, n, lambda i: 0, 0, None, now=now)
    est = estimate_s(dry.predicted, dry.margin)
    slo = est + 0.005  # R alone meets it
    e.deadlines.update(h=t0 + slo, a=t0 + slo)  # as begin records them with that target
    r = c.choose(pool, n, lambda i: 0, 0, slo, now=now)
    assert r.kind == "reject" and "would push 1 admitted request" in r.reason and r.retry_after == 1
    # A's first token is out: nothing queued behind H is left to push; R is admitted.
    c.first_token(ra, e, "a", now)
    assert "a" not in e.deadlines
    assert c.choose(pool, n, lambda i: 0, 0, slo, now=now).kind == "direct"


def test_begin_records_the_deadline_of_a_request_with_a_target():
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    r = c.choose(pool, 544, lambda i: 0, 0, 0.9, now=50.0)
    assert r.slo == 0.9
    c.begin(r, e, 544, 0, "x", 50.0)
    assert e.deadlines == {"x": pytest.approx(50.9)}
    c.end(r, e, "x", 51.0)
    assert e.deadlines == {}


def _one_seeded_plain():
    """One plain instance whose compute fit is seeded (its estimates are settled)."""
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    c.seed(e, list(c.fit(e).compute_coef), weight=6)
    return pool, e, c


def _cold_prompt_against_a(pool, e, c, n: int, t0: float, now: float, slack: float):
    """A cold prompt of ``n`` tokens at ``now`` whose own target is its estimate plus
    ``slack`` (it alone meets it), with request ``a`` (sent at ``t0``) given the same target."""
    dry = c.choose(pool, n, lambda i: 0, 0, None, now=now)
    slo = estimate_s(dry.predicted, dry.margin) + slack
    e.deadlines["a"] = t0 + slo
    return c.choose(pool, n, lambda i: 0, 0, slo, now=now)


def test_a_request_predicted_to_have_just_started_still_counts_as_queued():
    # A's predicted start passed 10 ms ago, but a predicted start errs as a predicted wait
    # does: within its wait counted with admission's margin (the prior 1.5x on a busy pool
    # before one is measured) it may still be waiting for the next step, and a cold R would
    # join it there.
    pool, e, c = _one_seeded_plain()
    n, t0 = 544, 100.0
    c.begin(c.choose(pool, n, lambda i: 0, 0, None, now=t0), e, n, 0, "h", t0)
    c.begin(c.choose(pool, n, lambda i: 512, 0, None, now=t0), e, n, 512, "a", t0)
    start_a, end_a = e.pending(t0)["a"]
    now = start_a + 0.01
    assert now < end_a and now < t0 + PRIOR_MARGIN * (start_a - t0)
    e.depart("h", start_a)  # H's first token, when predicted: A starts
    r = _cold_prompt_against_a(pool, e, c, n, t0, now, 0.005)
    assert r.kind == "reject" and "would push 1 admitted request" in r.reason


def test_a_late_request_still_without_its_first_token_counts_as_queued():
    # A was predicted to be done by now, but its first token has not come: it is late, not
    # done, and a cold R would still join its step (the P/D admission run at a72b3ea: a
    # cached request predicted at 0.18 s answered at 0.76 s, with a cold prefill admitted
    # after its predicted end).
    pool, e, c = _one_seeded_plain()
    n, t0 = 544, 100.0
    c.begin(c.choose(pool, n, lambda i: 0, 0, None, now=t0), e, n, 0, "h", t0)
    c.begin(c.choose(pool, n, lambda i: 512, 0, None, now=t0), e, n, 512, "a", t0)
    start_a, end_a = e.times(t0)["a"]
    e.depart("h", t0 + 1.2 * (start_a - t0))  # H's first token, 20% late: A starts then
    now = t0 + 1.2 * (start_a - t0) + (end_a - start_a) + 0.001  # A predicted done 1 ms ago
    assert "a" not in e.pending(now) and "a" in e.times(now)
    r = _cold_prompt_against_a(pool, e, c, n, t0, now, 0.005)
    assert r.kind == "reject" and "would push 1 admitted request" in r.reason


def test_a_request_past_its_predicted_end_counts_as_queued_whenever_it_was_predicted_to_start():
    # A was sent to an idle instance (predicted to start at once) and predicted done 1 ms ago,
    # but its first token has not come: behind the queue model, its start is not known
    # either, and a cold R admitted now could join its step (the P/D admission run at
    # 538d0db: two requests 0.05-0.1 s past their predicted end answered with a cold prefill
    # admitted then).
    pool, e, c = _one_seeded_plain()
    n, t0 = 544, 100.0
    c.begin(c.choose(pool, n, lambda i: 512, 0, None, now=t0), e, n, 512, "a", t0)
    start_a, end_a = e.times(t0)["a"]
    now = end_a + 0.001
    assert start_a == t0 and t0 + PRIOR_MARGIN * (start_a - t0) < now
    r = _cold_prompt_against_a(pool, e, c, n, t0, now, 0.0005)
    assert r.kind == "reject" and "would push 1 admitted request" in r.reason
