"""The kv policy's plain pool, by conversation (:mod:`multi.router.homes`): a new conversation
goes to the instance given the fewest of the kv policy's recent requests; a home keeps its turns while its score
is within ``near**2`` of the best."""

from __future__ import annotations

import time

import pytest

from multi.router.choose import Candidate, Prompt
from multi.router.homes import WINDOW
from multi.router.index import BlockIndex, chain
from tests.test_router_choice import BS, plain_pair

pytestmark = pytest.mark.unit


def test_a_new_conversation_goes_to_the_instance_given_fewer_requests_whatever_the_turn():
    # Conversation A starts on one instance; two turns of a conversation homed on the other
    # follow; then conversation B starts, both instances idle and equal. By turn B went to
    # the first request's other instance whatever was homed where, and consecutive new
    # conversations stayed paired on one engine for all their next turns.
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    now = time.monotonic()
    first = c.choose(pool, 300, lambda i: 0, 0, None, now=now).target
    other = e1 if first is e0 else e0
    for _ in range(2):
        assert c.choose(pool, 300, lambda i: BS * 5 if i is other else 0, 0, None, now=now).target is other
    assert c.choose(pool, 300, lambda i: 0, 0, None, now=now).target is first
    # Even counts: the one given a request least recently.
    assert c.choose(pool, 300, lambda i: 0, 0, None, now=now).target is other
    assert list(c.homes.recent) == [first.url, other.url, other.url, first.url, other.url]


def test_new_conversations_go_where_fewest_recent_ones_went_within_the_band_only():
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    now = time.monotonic()
    for _ in range(3):
        c.homes.placed(e0.url)
    c.homes.placed(e1.url)
    # e1 has a request in flight and was given the last one, but e0 holds three of the last
    # four new conversations: e1 takes this one (the same estimate band).
    e1.outstanding = 1
    assert c.choose(pool, 300, lambda i: 0, 0, None, now=now).target is e1
    # Outside the band the cheaper wins: e1 twice as slow.
    c2, pool2 = plain_pair(2.0)
    f0, f1 = pool2.role("plain")
    for _ in range(3):
        c2.homes.placed(f0.url)
    assert c2.choose(pool2, 300, lambda i: 0, 0, None, now=now).target is f0


def test_the_placements_remembered_are_bounded_and_rejected_ones_not_counted():
    c, pool = plain_pair(1.0)
    now = time.monotonic()
    for _ in range(WINDOW + 9):
        c.choose(pool, 300, lambda i: 0, 0, None, now=now)
    assert len(c.homes.recent) == WINDOW
    before = list(c.homes.recent)
    assert c.choose(pool, 300, lambda i: 0, 0, 1e-6, now=now).kind == "reject"
    assert list(c.homes.recent) == before
    # An admitted turn some instance holds a prefix of counts where it is served.
    assert c.choose(pool, 300, lambda i: BS, 0, None, now=now).target.url == c.homes.recent[-1]


def test_a_home_keeps_its_turn_within_near_squared_and_gives_it_up_beyond():
    # e1 holds 30 of the prompt's 31 blocks with work queued: its score is 1.4x that of
    # computing the whole prompt on idle e0. Outside one estimate's band (1.25x), inside two
    # (1.5625x): the turn stays home, where the band alone moved it and left the prefix on
    # both engines.
    c, pool = plain_pair(1.0)
    e0, e1 = pool.role("plain")
    tokens = [(i * 31) % 2000 + 4 for i in range(BS * 31)]
    index = BlockIndex(BS)
    index.record(e1.url, chain(tokens[:BS * 30], BS))
    hashes = chain(tokens, BS)
    match = lambda i: index.match(i.url, hashes) * BS  # noqa: E731
    now = time.monotonic()
    n = len(tokens)
    cold = c.plain_score(Prompt(n), Candidate(e0), now)
    hit = c.direct_estimate(Prompt(n), Candidate(e1, BS * 30), now).seconds
    e1.outstanding, e1.inflight["q"] = 1, (1.4 * cold - hit, now)
    home = c.plain_score(Prompt(n), Candidate(e1, BS * 30), now)
    assert 1.25 * cold < home < 1.25 ** 2 * cold
    assert c.choose(pool, n, match, 0, None, now=now).target is e1
    e1.inflight["q"] = (1.7 * cold - hit, now)
    assert c.plain_score(Prompt(n), Candidate(e1, BS * 30), now) > 1.25 ** 2 * cold
    assert c.choose(pool, n, match, 0, None, now=now).target is e0
