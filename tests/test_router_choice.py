"""The kv policy's choice among plain instances whose estimates are within the estimates'
own accuracy of each other (``multi.router.choose.NEAR``): affinity, then balance."""

from __future__ import annotations

import time

import pytest

from multi.policy import PolicyConfig
from multi.router.choose import Candidate, Chooser, Prompt
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


def test_a_new_prefix_goes_to_the_less_busy_of_instances_near_the_best():
    # Nothing cached anywhere: where this prompt lands, its conversation's next turns follow.
    # e0 is 15% faster by its fit but has a request in flight; e1 is idle: the choice by a
    # 15% difference (inside the estimates' +-25%) piled conversations on one engine.
    c, pool = plain_pair(1.15)
    e0, e1 = pool.role("plain")
    now = time.monotonic()
    e0.outstanding, e0.inflight["a"] = 1, (0.0, now)
    n = 400
    est = {i.url: c.direct_estimate(Prompt(n), Candidate(i), now).seconds for i in (e0, e1)}
    assert est[e0.url] < est[e1.url] <= 1.25 * est[e0.url]
    assert c.choose(pool, n, lambda i: 0, 0, None, now=now).target is e1
    # Outside the band the cheaper still wins, busy or not.
    c2, pool2 = plain_pair(2.0)
    f0, f1 = pool2.role("plain")
    f0.outstanding, f0.inflight["a"] = 1, (0.0, now)
    assert c2.choose(pool2, n, lambda i: 0, 0, None, now=now).target is f0


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
