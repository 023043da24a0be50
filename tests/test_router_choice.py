"""The kv policy's choice among plain instances: its score (the estimate plus what the
prefill costs the requests waiting there); a prompt held nowhere in turn among the scores
within ``multi.router.choose.NEW_BAND`` of the cheapest; otherwise, among scores within the
estimates' accuracy of each other (``multi.router.choose.NEAR``, then their measured
spread): affinity, then balance."""

from __future__ import annotations

import time

import pytest

from multi.policy import PolicyConfig
from multi.router.choose import NEW_BAND, Candidate, Chooser, Prompt
from multi.router.index import BlockIndex, chain
from multi.router.instances import Pool, make

pytestmark = pytest.mark.unit

BS = 32
BPT = 4096.0


def plain_pair(slower: float) -> tuple[Chooser, Pool]:
    """Two plain instances seeded as by the start-up probe, the second ``slower`` times the
    first's compute (two engines of one host differ by that much from the probe's noise)."""
    pool = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    c = Chooser("kv", BPT, PolicyConfig(calibrate=False))
    e0, e1 = pool.role("plain")
    base = [float(x) for x in c.fit(e0).compute_coef]
    c.seed(e0, base, weight=6)
    c.seed(e1, [x * slower for x in base], weight=6)
    return c, pool


def test_prompts_held_nowhere_go_in_turn_while_within_twice_the_cheapest():
    # Nothing of these prompts is cached anywhere: where each lands, its conversation's next
    # turns follow. e1 is 15% slower by its fit, e0 has a request in flight. Placed
    # by the queue of the moment, consecutive conversations shared an engine and met again at
    # every turn; in turn, as round-robin's, they alternate (docs/benchmarks/router.md).
    c, pool = plain_pair(1.15)
    e0, e1 = pool.role("plain")
    now = time.monotonic()
    e0.outstanding, e0.inflight["a"] = 1, (0.0, now)
    n = 400
    est = {i.url: c.plain_score(Prompt(n), Candidate(i), now) for i in (e0, e1)}
    assert est[e0.url] < est[e1.url] <= NEW_BAND * est[e0.url], est
    routes = [c.choose(pool, n, lambda i: 0, 0, None, now=now) for _ in range(4)]
    assert [r.target for r in routes] == [e0, e1, e0, e1]
    assert {r.reason for r in routes} == {"in turn"}  # what the decision log says
    # A prompt of which e1 holds a prefix, in between, does not move the new prompts' turn.
    assert c.choose(pool, n, lambda i: BS if i is e1 else 0, 0, None, now=now).target is e1
    assert c.choose(pool, n, lambda i: 0, 0, None, now=now).target is e0
    # Beyond twice the cheapest the turn passes to the next within it, busy or not.
    c2, pool2 = plain_pair(3.0)
    f0, f1 = pool2.role("plain")
    f0.outstanding, f0.inflight["a"] = 1, (0.0, now)
    est = {i.url: c2.plain_score(Prompt(n), Candidate(i), now) for i in (f0, f1)}
    assert est[f1.url] > NEW_BAND * est[f0.url], est
    assert [c2.choose(pool2, n, lambda i: 0, 0, None, now=now).target for _ in range(3)] == [f0, f0, f0]


def test_near_the_best_a_held_prefix_goes_beside_requests_decoding_rather_than_one_prefilling():
    # Both hold the prompt's first block. e0 has one request in flight still without its first
    # token, though predicted to have it by now (so its score does not count it as pending):
    # this prompt would share its steps. e1 has two in flight, both decoding. The scores are
    # within the tie band: fewer in flight would pick e0 (least-outstanding's choice), fewer
    # without a first token picks e1.
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    now = time.monotonic()
    e0.outstanding, e0.inflight["a"] = 1, (0.001, now - 1.0)
    assert not e0.pending(now)
    e1.outstanding, e1.decoding = 2, {"b", "c"}
    n = 400
    est = {i.url: c.plain_score(Prompt(n), Candidate(i, BS), now) for i in (e0, e1)}
    assert max(est.values()) <= 1.25 * min(est.values()), est
    assert c.choose(pool, n, lambda i: BS, 0, None, now=now).target is e1
    # Both without requests prefilling: in turn, whatever each has decoding (the score counts
    # what decoding requests cost; fewer in flight broke a closed loop's alternation).
    e0.inflight.clear()
    picks = [c.choose(pool, n, lambda i: BS, 0, None, now=now).target for _ in range(4)]
    assert picks[0] is not picks[1] and picks[:2] == picks[2:], picks


def test_an_instance_holding_the_prefix_keeps_it_while_its_estimate_is_near_the_best():
    # e1 holds 30 of the prompt's 31 blocks but has work queued: its estimate is 1.15x that of
    # computing the whole prompt on idle e0. Near the best: it stays with e1 (a conversation's
    # home), where the cheapest estimate alone would copy the prefix to e0.
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    tokens = [(i * 31) % 2000 + 4 for i in range(BS * 31)]
    index = BlockIndex(BS)
    index.record(e1.url, chain(tokens[:BS * 30], BS))
    hashes = chain(tokens, BS)
    match = lambda i: index.match(i.url, hashes) * BS  # noqa: E731
    now = time.monotonic()
    n = len(tokens)
    cold = c.direct_estimate(Prompt(n), Candidate(e0), now).seconds
    hit = c.direct_estimate(Prompt(n), Candidate(e1, BS * 30), now).seconds
    e1.outstanding, e1.inflight["q"] = 1, (1.15 * cold - hit, now)
    queued = c.direct_estimate(Prompt(n), Candidate(e1, BS * 30), now).seconds
    assert cold < queued <= 1.25 * cold
    assert c.choose(pool, n, match, 0, None, now=now).target is e1
    # With more queued than the band allows, the idle instance computes it.
    e1.inflight["q"] = (2.0 * cold, now)
    assert c.choose(pool, n, match, 0, None, now=now).target is e0


def test_a_home_whose_queue_its_prefill_would_delay_gives_the_turn_to_an_idle_instance():
    # A conversation's home e1 holds half the prompt; two requests routed there before still
    # wait for their first token. Its estimate alone is the cheapest (the queue costs this
    # request less than recomputing its prefix on idle e0), but its prefill would go into
    # the step of the two waiting there: counted once for each, e1 costs more, and e0 takes
    # it. The estimate alone kept such homes and piled the conversations in flight together
    # on one engine (multi-turn chat on plain engines, docs/benchmarks/router.md).
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    n, half = BS * 31, BS * 15
    now = time.monotonic()
    cold = c.direct_estimate(Prompt(n), Candidate(e0), now)
    warm = c.direct_estimate(Prompt(n), Candidate(e1, half), now)
    q = 0.45 * (cold.seconds - warm.seconds)  # two prefills of this much, queued just now
    e1.outstanding, e1.inflight["a"], e1.inflight["b"] = 2, (q, now), (q, now)
    home = c.direct_estimate(Prompt(n), Candidate(e1, half), now)
    assert home.seconds < cold.seconds  # the estimate alone: stay home
    assert len(e1.pending(now)) == 2
    assert c.plain_score(Prompt(n), Candidate(e1, half), now) == pytest.approx(
        home.seconds + 2 * home.parts["compute_s"])
    match = lambda i: half if i is e1 else 0  # noqa: E731
    assert c.choose(pool, n, match, 0, None, now=now).target is e0
    # Once they have their first tokens (nothing left waiting), the home keeps its turn.
    e1.inflight.clear()
    assert c.choose(pool, n, match, 0, None, now=now).target is e1


def test_the_tie_band_narrows_to_the_estimates_measured_spread():
    # e1 holds a block of the prompt but computes 12% slower: its estimate is ~1.1x idle
    # e0's. Until the honesty window has measured the estimates, that is inside the
    # +-25% band and the prefix keeps it on e1; once answers show the estimates typically
    # within 4%, a 10% difference is a real one and e0, the cheaper, takes it.
    c, pool = plain_pair(1.12)
    e0, e1 = pool.role("plain")
    n = BS * 20
    now = time.monotonic()
    match = lambda i: BS if i is e1 else 0  # noqa: E731
    a = c.direct_estimate(Prompt(n), Candidate(e0), now).seconds
    b = c.direct_estimate(Prompt(n), Candidate(e1, BS), now).seconds
    assert 1.04 < b / a < 1.25
    assert c.near() == pytest.approx(1.25)
    assert c.choose(pool, n, match, 0, None, now=now).target is e1
    for i in range(32):
        c.honesty.record("direct", 0.2, 0.2 * (1.04 if i % 2 else 1 / 1.04))
    assert c.near() == pytest.approx(1.04)
    assert c.choose(pool, n, match, 0, None, now=now).target is e0


def test_the_tie_band_is_the_error_of_nine_estimates_in_ten_not_the_typical_one():
    # Three answers in four exact, one in four 20% late: the typical (median) error is 0, but
    # a 10% difference between two scores is within what one estimate in ten misses by. The
    # median made the band 0-9% on the fast CPU class, and scores apart by noise broke a closed
    # loop's alternation (docs/benchmarks/router.md).
    c, pool = plain_pair(1.0)
    for i in range(40):
        c.honesty.record("direct", 0.2, 0.2 * (1.2 if i % 4 == 0 else 1.0))
    assert c.honesty.spread("direct") == pytest.approx(0.0)
    assert c.near() == pytest.approx(1.2)
    e0, e1 = pool.role("plain")
    est = {e0.url: 1.0, e1.url: 1.1}
    assert Chooser._near_best([e1, e0], est, lambda i: 0, c.near()) is e1  # a tie: the turn's first
    assert Chooser._near_best([e1, e0], {e0.url: 1.0, e1.url: 1.3}, lambda i: 0, c.near()) is e0
