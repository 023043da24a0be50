"""The store tier's non-blocking lookup against a real mooncake_master (no engine): the lookups
of the requests that arrived since the last step go to the master as one batch; answered within
the step's wait (``lookup_wait_ms``) they answer in that step, otherwise vLLM is told to ask again
later; the answers equal the blocking lookup's; a master that stops answering makes lookups
misses within their deadline, the scheduler's thread never held longer than the step's wait.
(With engines: tests/test_store_events_e2e.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mcstore.config import load_config
from mcstore.keys import KeySpace, fingerprint
from mcstore.scheduler import StoreScheduler
from mcstore.server import CLIENT_ENV
from tests.support import frozen

pytestmark = pytest.mark.integration

BS, CHUNK = 32, 64
KS = KeySpace(fingerprint({"t": "lookup"}), CHUNK)


@pytest.fixture(autouse=True)
def _client_env(monkeypatch):
    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)


def _sched(master: str, **extra) -> StoreScheduler:
    cfg = load_config({"master": master, "chunk_tokens": CHUNK, **extra}, env={})
    return StoreScheduler(cfg, KS, BS, load=True, save=False)


def _request(rid: str, seed: int, n: int = 3 * CHUNK + 5):
    tokens = [(seed * 7919 + i * 31) % 2000 + 4 for i in range(n)]
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=n, num_tokens=n,
                           num_computed_tokens=0, cache_salt=None, lora_request=None, mm_features=None)


def _store(raw, req, chunks: int) -> None:
    """Objects for the first ``chunks`` chunks of ``req``'s prompt (a lookup asks only whether
    they exist; their bytes are the worker's business)."""
    for k in KS.all_rank_keys(KS.links(req.prompt_token_ids)[:chunks]):
        assert raw.put(k, b"kv") == 0


def _step():
    return SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={}, scheduled_new_reqs=[])


def _answers(s: StoreScheduler, reqs, timeout_s: float = 10.0, max_call_s: list | None = None) -> dict:
    """vLLM's question for each request, asked once per step until answered: rid -> answer."""
    out, deadline = {}, time.monotonic() + timeout_s
    while len(out) < len(reqs):
        assert time.monotonic() < deadline, f"unanswered after {timeout_s}s: {[r.request_id for r in reqs]}"
        for r in reqs:
            if r.request_id not in out:
                t0 = time.monotonic()
                got = s.get_num_new_matched_tokens(r, 0)
                if max_call_s is not None:
                    max_call_s.append(time.monotonic() - t0)
                if got != (None, False):
                    out[r.request_id] = got
        s.build_connector_meta(_step())
        time.sleep(0.002)  # the step's forward
    return out


def test_lookups_of_one_step_go_as_one_batch_and_answer_as_the_lookup_blocking(store_cluster, raw):
    full, part, none = _request("full", 1), _request("part", 2), _request("none", 3)
    _store(raw, full, 3)
    _store(raw, part, 1)
    s = _sched(store_cluster.master_addr, lookup_wait_ms=0)
    blocking = _sched(store_cluster.master_addr, lookup_blocking=True)
    try:
        for r in (full, part, none):
            assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # asked, not answered
        assert s.lookups.batches == 0  # without a wait nothing goes out before the step ends
        got = _answers(s, [full, part, none])
        assert s.lookups.batches == 1 and s.lookups.calls == 1  # the step's three lookups, one batch_is_exist
        # 3 chunks of 64 hit in full (the prompt's last 5 tokens are the engine's), 1 of 3, none.
        assert got == {"full": (3 * CHUNK, True), "part": (CHUNK, True), "none": (0, False)}
        assert {r.request_id: blocking.get_num_new_matched_tokens(r, 0) for r in (full, part, none)} == got
        counters = s.stats.data["counters"]
        assert counters["lookups:hit"] == 2 and counters["lookups:miss"] == 1
        assert len(s.stats.data["ops"]["lookup_wait"]) == 3
    finally:
        s.close()
        blocking.close()


def test_lookups_of_the_requests_added_since_the_last_step_answer_within_the_steps_wait(store_cluster, raw):
    """vLLM adds requests between steps (``on_new_request``): the step's first question sends all
    their lookups as one batch and waits for it (``lookup_wait_ms``, generous here: an idle
    master answers in well under a millisecond); every request is answered in that step."""
    full, part, none = _request("w-full", 5), _request("w-part", 6), _request("w-none", 7)
    _store(raw, full, 3)
    _store(raw, part, 1)
    s = _sched(store_cluster.master_addr, lookup_wait_ms=50)
    try:
        s.get_num_new_matched_tokens(_request("warm", 8), 0)  # a warm client and lookup thread
        s.build_connector_meta(_step())
        for r in (full, part, none):
            s.on_new_request(r)
        assert s.lookups.batches == 1  # the warm-up's; the new ones wait for the step
        got = {r.request_id: s.get_num_new_matched_tokens(r, 0) for r in (full, part, none)}
        assert got == {"w-full": (3 * CHUNK, True), "w-part": (CHUNK, True), "w-none": (0, False)}
        assert s.lookups.batches == 2 and s.lookups.calls == 2  # the three in one batch_is_exist
    finally:
        s.close()


def test_a_master_that_stops_answering_makes_lookups_misses_within_the_deadline(store_cluster, raw):
    """SIGSTOP on the master: a real master that stops answering (its TCP port still accepts,
    so the breaker stays closed and every lookup is asked). Each lookup is a miss once its
    deadline passes; no call of vLLM's hook blocks meanwhile. After SIGCONT, lookups answer
    again."""
    stored = _request("stored", 4)
    _store(raw, stored, 3)
    s = _sched(store_cluster.master_addr, lookup_timeout_ms=300, lookup_wait_ms=20)
    try:
        assert _answers(s, [stored]) == {"stored": (3 * CHUNK, True)}  # the client is warm
        reqs = [_request(f"frozen{i}", 10 + i) for i in range(4)]
        for r in reqs:
            _store(raw, r, 3)  # stored: only the silence makes them misses
        calls: list[float] = []
        with frozen(store_cluster.master.popen.pid):
            t0 = time.monotonic()
            got = _answers(s, reqs, timeout_s=5, max_call_s=calls)
            took = time.monotonic() - t0
        assert got == {r.request_id: (0, False) for r in reqs}  # misses: computed by the engine
        assert 0.3 <= took < 2.0, took  # at the deadline, not at Mooncake's RPC timeout
        assert max(calls) < 0.05, max(calls)  # never held much beyond the step's wait (20 ms)
        assert s.stats.data["counters"]["lookups:timeout"] == len(reqs)
        later = _request("later", 20)
        _store(raw, later, 2)
        deadline = time.monotonic() + 30  # the lookup thread's stuck call returns, the breaker recovers
        while True:
            s.stats.data["counters"].pop("lookups:timeout", None)
            ans = _answers(s, [later], timeout_s=5)["later"]
            if ans == (2 * CHUNK, True):
                break
            assert time.monotonic() < deadline, f"lookups still fail after the master resumed: {ans}"
            later = _request(f"later{time.monotonic()}", 20)  # the same prompt, asked anew
    finally:
        s.close()


def test_a_lookup_that_could_add_less_than_a_chunk_past_the_prefix_cache_never_defers_its_request(store_cluster, raw):
    """``lookup_defer_min_tokens`` (default: one chunk): vLLM asks with the engine's own prefix
    cache at ``local`` tokens; when fewer than a chunk are left past it and the answer is not in,
    the request is not held for a step: the lookup is given up (0, counted ``short``) and those
    tokens are computed. With more left, it waits for the answer as before; an answer already
    in is used either way."""
    short, long_, ready = _request("short", 30), _request("long", 31), _request("ready", 32)
    for r in (short, long_, ready):
        _store(raw, r, 3)
    n = short.num_prompt_tokens
    s = _sched(store_cluster.master_addr, lookup_wait_ms=0)
    try:
        assert s.get_num_new_matched_tokens(short, n - CHUNK + 1) == (0, False)  # 63 left: not worth a step
        assert s.get_num_new_matched_tokens(long_, n - CHUNK) == (None, False)  # 64 left: asked, not answered
        assert s.stats.data["counters"]["lookups:short"] == 1
        assert _answers(s, [long_]) == {"long": (3 * CHUNK, True)}  # the 64 past the cache included
        s.on_new_request(ready)
        s.build_connector_meta(_step())  # the step sends its batch
        deadline = time.monotonic() + 10
        while not s._state(ready).pending.done:
            assert time.monotonic() < deadline, "the master did not answer"
            time.sleep(0.005)
        # Answered: its 3 chunks reach 5 tokens past the 187 cached here, and those are loaded.
        assert s.get_num_new_matched_tokens(ready, n - 10) == (3 * CHUNK - (n - 10), True)
        assert s.stats.data["counters"]["lookups:hit"] == 2 and s.stats.data["counters"]["lookups:short"] == 1
    finally:
        s.close()


def test_where_lookups_find_nothing_most_requests_are_not_asked_and_probes_reopen_the_gate(store_cluster, raw):
    """``lookup_probe_every`` (mcstore.lookupgate): after a run of misses even a whole prompt is
    not worth a step's wait, so new requests are answered 0 at once and only one in 8 is asked
    (not waited for: counted ``short``), the others not at all (``gated``: no batch goes to the
    master for them). Once the store holds the prompts, a probe's late answer raises the yield
    and requests wait for their lookups again and load what is stored."""
    s = _sched(store_cluster.master_addr, lookup_wait_ms=0)
    try:
        for i in range(50):  # the yield falls to (15/16)^50 = 0.040 < 1/8 of 64/197 (49: 0.042)
            r = _request(f"miss{i}", 100 + i)
            assert _answers(s, [r]) == {r.request_id: (0, False)}
        counters = s.stats.data["counters"]
        assert counters["lookups:miss"] == 50 and not s.gate.worth_waiting(3 * CHUNK + 5, 0)
        batches = s.lookups.batches
        for i in range(16):
            r = _request(f"gated{i}", 200 + i)  # not stored: nothing to learn
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)
            s.build_connector_meta(_step())
        assert counters["lookups:gated"] == 14 and counters["lookups:short"] == 2
        time.sleep(0.2)  # the lookup thread counts a batch once asked
        # Only the two probes went to the master (one batch if the second came while it was busy).
        assert batches + 1 <= s.lookups.batches <= batches + 2
        # A request whose sender chose its source (kv_transfer_params: a handoff's, a kv_source)
        # is not gated: it waits for its lookup as before, and its answer does not count.
        steered = _request("steered", 250)
        steered.kv_transfer_params = {"kv_source": "store"}
        _store(raw, steered, 3)
        deadline = time.monotonic() + 5
        while s.gate._watched:  # the two probes' answers (misses), counted
            assert time.monotonic() < deadline, "the probes were not answered"
            time.sleep(0.01)
            s.gate.poll()
        share = s.gate.share
        assert s.get_num_new_matched_tokens(steered, 0) == (None, False)
        assert _answers(s, [steered]) == {"steered": (3 * CHUNK, True)}
        assert s.gate.share == share and counters["lookups:gated"] == 14
        for i in range(200):
            r = _request(f"stored{i}", 300 + i)
            _store(raw, r, 3)
            got = s.get_num_new_matched_tokens(r, 0)
            if got == (None, False):  # waited for: the gate is open again
                assert _answers(s, [r]) == {r.request_id: (3 * CHUNK, True)}
                break
            assert got == (0, False)
            s.build_connector_meta(_step())
            time.sleep(0.005)  # the step's forward: a probe's answer comes in
        else:
            pytest.fail(f"the gate stayed closed over 200 stored prompts (yield {s.gate.share:.2f})")
        assert 7 <= i < 40, i  # the first probes' hits (one in 8 requests) reopen it
    finally:
        s.close()
