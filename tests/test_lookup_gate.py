"""The store lookup's gate (mcstore.lookupgate) on its own: the yield it learns from answers, the
wait it allows, the requests it lets through while closed, and the late answers it still counts.
With a real master and the scheduler: tests/test_store_lookup.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mcstore.batchlookup import Lookup
from mcstore.lookupgate import MAX_WATCHED, MIN_SHARE, WINDOW, LookupGate

pytestmark = pytest.mark.unit


def _answered(tokens: int) -> Lookup:
    lk = Lookup([], None, time.monotonic() + 10)
    lk.result, lk.done = (SimpleNamespace(tokens=tokens), None), True
    return lk


def test_a_fresh_gate_waits_as_the_token_threshold_alone_says():
    g = LookupGate(min_tokens=256, probe_every=8)
    assert g.share == 1.0
    assert g.worth_waiting(512, 256) and not g.worth_waiting(512, 257)
    assert all(g.ask(100) for _ in range(20))  # asked: an answer in before vLLM asks is used


def test_misses_close_the_gate_and_then_one_request_in_probe_every_is_asked():
    g = LookupGate(min_tokens=256, probe_every=8)
    for _ in range(30):
        g.note(0, 1024, 0)
    assert g.share == pytest.approx((1 - 1 / WINDOW) ** 30)  # 0.144: 147 of 1,024 tokens expected
    assert g.worth_waiting(1024, 0) and g.worth_waiting(256, 0)  # 0.144 * 256 >= 256 / 8: still worth it
    for _ in range(30):
        g.note(0, 1024, 0)
    assert g.share < MIN_SHARE  # 0.021
    assert not g.worth_waiting(1024, 0) and g.worth_waiting(4096, 0)
    assert g.worth_waiting(1024, 0, steered=True) and not g.worth_waiting(255, 0, steered=True)
    asked = [g.ask(1024) for _ in range(24)]
    assert asked == ([False] * 7 + [True]) * 3
    assert all(g.ask(4096) for _ in range(5))  # a long prompt is still worth it


def test_hits_reopen_it_counting_only_the_tokens_past_the_prefix_cache():
    g = LookupGate(min_tokens=256, probe_every=8)
    g.share = 0.0
    g.note(1000, 1024, 1000)  # the store had nothing the prefix cache had not
    assert g.share == 0.0 and not g.worth_waiting(1024, 0)
    g.note(1023, 1024, 0)
    assert g.share == pytest.approx(1023 / 1024 / WINDOW)
    assert g.worth_waiting(1024, 0)  # one whole prompt found: 1/16 of 1,024 >= 256 / 8
    assert not g.worth_waiting(1024, 1024 - 255)  # but never for fewer than 256 past the cache


def test_a_given_up_lookups_late_answer_still_counts_and_expired_ones_are_dropped():
    g = LookupGate(min_tokens=256, probe_every=8)
    g.share = 0.0
    late, lost = Lookup([], None, time.monotonic() + 10), Lookup([], None, time.monotonic() - 1)
    g.watch(late, 1024, 0)
    g.watch(lost, 1024, 0)
    g.poll()
    assert g.share == 0.0 and len(g._watched) == 1  # the expired one dropped, the other awaited
    late.result, late.done = (SimpleNamespace(tokens=1024), None), True
    g.poll()
    assert g.share == pytest.approx(1 / WINDOW) and not g._watched


def test_the_watched_lookups_are_bounded_and_the_oldest_cancelled():
    g = LookupGate(min_tokens=256, probe_every=8)
    lks = [Lookup([], None, time.monotonic() + 10) for _ in range(MAX_WATCHED + 3)]
    for lk in lks:
        g.watch(lk, 1024, 0)
    assert len(g._watched) == MAX_WATCHED
    assert [lk.cancelled for lk in lks[:4]] == [True, True, True, False]
    g.close()
    assert all(lk.cancelled for lk in lks) and not g._watched


def test_probe_every_zero_is_no_gate():
    g = LookupGate(min_tokens=256, probe_every=0)
    for _ in range(50):
        g.note(0, 1024, 0)
    g.poll()
    assert g.share == 1.0 and all(g.ask(300) for _ in range(20))
    lk = _answered(0)
    g.watch(lk, 1024, 0)
    assert lk.cancelled and not g._watched
