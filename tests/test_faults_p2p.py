"""Fault injection on the P2P handoff: "loads never hang and never lie".

Bad input (kv_transfer_params, side-channel messages, bootstrap registrations), a prefill
instance slower than the decode side's transfer deadline, decode requests aborted by their
client before and after their pull was scheduled, and a prefill instance killed mid-handoff.

One deployment for the module (``tests.support.Dep``): a real mooncake_master + store server,
a prefill (P, core 0) and a decode (D, core 1) engine with ``TieredConnector`` on the tiny
model, ``mctier proxy`` in front, and the session's no-connector ``baseline``. Every case
checks, afterwards:

* every request ended within its deadline, with the greedy token ids of the no-connector
  run or a clear error;
* no block leaked: both engines' ``vllm:kv_cache_usage_perc`` is back to its idle value
  within a few seconds (prefix-cached blocks count as free);
* both engines still serve (a fresh request through the proxy matches the baseline).

Timing windows are made deterministic with real stalls, not fakes: a process frozen with
SIGSTOP is a real component that stopped making progress (P's EngineCore, so its prefill
stalls while its worker's side channel still answers WAIT; D's EngineCore before it saw a
request). The case that kills P comes last (P is not restarted). Runtime ~2 min on 2 cores
(engine start ~75 s of it).
"""

from __future__ import annotations

import time

import msgspec
import pytest
import requests
import zmq

from tests.harness import prompt_ids
from tests.support import (
    MAX_TOKENS,
    SETTLE,
    TRANSFER_TIMEOUT,
    Call,
    counter,
    engine_core,
    fault_cluster,
    fault_deployment,
    frozen,
    plan_sources,
    raw_post,
    recovered,
    toks,
    usage,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


@pytest.fixture(scope="module")
def cluster():
    yield from fault_cluster()


@pytest.fixture(scope="module")
def dep(cluster, baseline):
    yield from fault_deployment(cluster, baseline, "faults-p2p")


# -- 6. bad input: kv_transfer_params, side channel, bootstrap ------------------------------


def test_malformed_kv_transfer_params(dep, baseline):
    eid = dep.engine_id()
    bad_d = [
        {"do_remote_prefill": True, "transfer_id": 5, "remote_engine_id": eid, "remote_bootstrap_addr": dep.boot},
        {"do_remote_prefill": True, "remote_engine_id": eid, "remote_bootstrap_addr": dep.boot},  # no transfer_id
        {"do_remote_prefill": "yes", "transfer_id": ["x"], "remote_engine_id": None, "remote_bootstrap_addr": 7},
        # Forced to p2p: on the tiny model auto may recompute ~230 tokens and never ask the bootstrap.
        {"do_remote_prefill": True, "transfer_id": "faults-unknown-engine", "remote_engine_id": "no-such-engine",
         "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"},
        {"do_remote_prefill": True, "transfer_id": "faults-no-hold", "remote_engine_id": eid,
         "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"},  # valid shape, but P never prefilled it
        {"kv_source": 42},
        {"kv_source": "bogus"},
        {"kv_source": "p2p"},  # forced, but nothing to pull
    ]
    bad_p = [{"do_remote_decode": True, "transfer_id": 12}, {"do_remote_decode": True},
             {"do_remote_decode": "no", "transfer_id": {"a": 1}}]
    invalid0 = counter(dep.D, "p2p_failures", kind="invalid_params")
    boot0 = counter(dep.D, "p2p_failures", kind="bootstrap")
    opened0 = counter(dep.P, "p2p_holds", kind="opened")
    for i, params in enumerate(bad_d + bad_p):
        e = dep.D if i < len(bad_d) else dep.P
        p = prompt_ids(200 + 10 * i, 1000 + i)
        t0 = time.monotonic()
        r = requests.post(e.url + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": params})
        took = time.monotonic() - t0
        assert took < TRANSFER_TIMEOUT + 10, (params, took)
        if r.status_code == 200:
            assert toks(r.json()) == baseline.tokens(p, MAX_TOKENS), params
        else:
            assert r.status_code == 400 and r.json()["error"]["message"], (params, r.status_code, r.text)
    # A non-object kv_transfer_params is refused by the server, or ignored; never a crash.
    p = prompt_ids(64, 1100)
    r = requests.post(dep.D.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": "garbage"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert toks(r.json()) == baseline.tokens(p, MAX_TOKENS)
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="invalid_params") >= invalid0 + 2, 10)
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="bootstrap") >= boot0 + 1, 10)
    assert counter(dep.P, "p2p_holds", kind="opened") == opened0  # P held nothing for malformed params
    recovered(dep, baseline, 6)


def test_side_channel_garbage_is_rejected_and_counted(dep, baseline):
    from p2p.protocol import PullDone, PullReply, PullRequest, Status, decode_to_decode, encode

    rej = lambda k: counter(dep.P, "p2p_rejected", kind=k)  # noqa: E731
    before = {k: rej(k) for k in ("undecodable", "unknown_transfer", "tp_mismatch")}
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(dep.side_channel())
    try:
        for junk in (b"", b"\x00\xffgarbage", msgspec.msgpack.encode({"foo": 1}),
                     msgspec.msgpack.encode({"type": "pull", "transfer_id": 7})):
            s.send(junk)
        s.send_multipart([b"two", b"frames"])
        s.send(encode(PullDone("faults-nope", "r", True)))
        s.send(encode(PullRequest("faults-nope", "r", 0, 1, 0, 4, wait_s=0.0)))
        s.send(encode(PullRequest("faults-nope-tp", "r", 0, 8, 0, 4, wait_s=0.0)))
        replies = []
        deadline = time.monotonic() + 5
        while len(replies) < 3 and time.monotonic() < deadline:
            if s.poll(200):
                replies.append(decode_to_decode(s.recv()))
    finally:
        s.close(0)
    errors = sorted(r.transfer_id for r in replies if isinstance(r, PullReply) and r.status == Status.ERROR)
    assert errors == ["faults-nope", "faults-nope-tp"], replies  # answered, at once, not held open
    # Counters reach /metrics with P's next step: a handoff, which must still work.
    p = prompt_ids(400, 1200)
    r = dep.complete(p, kv_source="p2p")  # forced: on the tiny model auto may recompute 400 tokens
    assert "p2p" in plan_sources(r) and toks(r) == baseline.tokens(p, MAX_TOKENS)
    assert wait_for(lambda: rej("undecodable") >= before["undecodable"] + 4, 10), rej("undecodable")
    assert wait_for(lambda: rej("unknown_transfer") >= before["unknown_transfer"] + 2, 10), rej("unknown_transfer")
    assert rej("tp_mismatch") >= before["tp_mismatch"] + 1
    recovered(dep, baseline, 61)


def test_bootstrap_register_conflict_is_refused(dep, baseline):
    q0 = requests.get(dep.boot + "/query", timeout=5).json()
    eid, addr = q0["0"]["engine_id"], q0["0"]["worker_addr"]["0"]["0"]
    cases = [
        {"engine_id": "intruder", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:1"},
        {"engine_id": eid, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:2"},
        {"engine_id": eid},
        {"engine_id": eid, "dp_rank": "zero", "tp_rank": 0, "pp_rank": 0, "addr": addr},
    ]
    for body in cases:
        r = requests.post(dep.boot + "/register", json=body, timeout=5)
        assert r.status_code == 400 and r.json()["detail"], (body, r.status_code, r.text)
    r = requests.post(dep.boot + "/register", data=b"{not json", timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    # An identical retry of the real registration is fine; the table is unchanged.
    assert requests.post(dep.boot + "/register", timeout=5, json={
        "engine_id": eid, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr}).status_code == 200
    assert requests.get(dep.boot + "/query", timeout=5).json() == q0
    p = prompt_ids(350, 1300)
    r = dep.complete(p, kv_source="p2p")
    assert "p2p" in plan_sources(r) and toks(r) == baseline.tokens(p, MAX_TOKENS)
    recovered(dep, baseline, 62)


# -- 7. a peer slower than the transfer deadline ---------------------------------------------


def test_prefill_slower_than_transfer_deadline(dep, baseline):
    """P stalls (its engine core frozen: neither prefill nor side channel make progress) for
    longer than D's transfer_timeout_s. D gives up at its deadline and recomputes; when P
    resumes and finishes the prefill, it must not hold the blocks for ABORT_TIMEOUT."""
    eid = dep.engine_id()
    prompt = prompt_ids(700, 1800)
    tid = "faults-slow-1"
    timeouts0 = counter(dep.D, "p2p_failures", kind="timeout") + counter(dep.D, "p2p_failures", kind="peer")
    expired0 = counter(dep.P, "p2p_holds", kind="expired")
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = dep.D.complete(prompt, MAX_TOKENS, timeout=60, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"})
        took = time.monotonic() - t0
        time.sleep(1.0)  # P stays stalled a little past D's deadline
    assert TRANSFER_TIMEOUT - 0.5 < took < TRANSFER_TIMEOUT + 8, took
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)
    assert plan_sources(r)[0] == "p2p"  # it was planned as a pull, and fell back
    cp.get(60)  # P's own request ends once it resumes
    assert wait_for(lambda: counter(dep.D, "p2p_failures", kind="timeout") + counter(dep.D, "p2p_failures", kind="peer")
                    >= timeouts0 + 1, 10)
    recovered(dep, baseline, 7)  # P's blocks free within SETTLE, not at ABORT_TIMEOUT
    assert counter(dep.P, "p2p_holds", kind="expired") == expired0


# -- 2b. decode request aborted by its client -----------------------------------------------


def test_decode_aborted_before_its_pull_was_scheduled(dep, baseline):
    """P finished and holds the blocks; the client of the decode request disconnects before D's
    scheduler ever saw the request (D's engine core frozen meanwhile): D must tell P to let go."""
    eid = dep.engine_id()
    prompt = prompt_ids(600, 1900)
    tid = "faults-abort-before"
    freed = lambda: (counter(dep.P, "p2p_holds", kind="released")  # noqa: E731
                     + counter(dep.P, "p2p_holds", kind="early_release"))
    freed0 = freed()
    dep.P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    assert wait_for(lambda: usage(dep.P) > dep.idle["P"], 10), "P does not hold the prefill's blocks"
    with frozen(engine_core(dep.D).pid):
        s = raw_post(dep.D, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"}})
        time.sleep(0.5)
        s.close()
        time.sleep(0.5)
    assert wait_for(lambda: freed() >= freed0 + 1, SETTLE), "P still holds the aborted request's blocks"
    recovered(dep, baseline, 21)


def test_decode_aborted_after_its_pull_was_scheduled(dep, baseline):
    """D scheduled the pull and waits for P (stalled mid-prefill) when the client disconnects;
    P then finishes. Neither side may keep the blocks."""
    eid = dep.engine_id()
    prompt = prompt_ids(800, 1950)
    tid = "faults-abort-after"
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        s = raw_post(dep.D, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"}})
        assert wait_for(lambda: usage(dep.D) > dep.idle["D"], 5), "D did not allocate blocks for the pull"
        time.sleep(0.3)
        s.close()
        time.sleep(0.7)
    cp.get(60)
    recovered(dep, baseline, 22)



# -- 2a. the prefill instance dies mid-handoff (last: P is not restarted) ---------------------


def test_prefill_killed_mid_handoff(dep, baseline):
    eid = dep.engine_id()
    prompt = prompt_ids(900, 2100)
    tid = "faults-kill-p"
    with frozen(engine_core(dep.P).pid):
        cp = Call(dep.P.complete, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        cp.start()
        cd = Call(dep.D.complete, prompt, MAX_TOKENS, timeout=60, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": eid,
            "remote_bootstrap_addr": dep.boot, "kv_source": "p2p"})
        cd.start()
        assert wait_for(lambda: usage(dep.D) > dep.idle["D"], 5), "D did not start its pull"
        dep.P.proc.kill()  # SIGKILL the whole prefill process group, mid-handoff
    r = cd.get(TRANSFER_TIMEOUT + 30)
    assert cd.took < TRANSFER_TIMEOUT + 10, cd.took
    assert toks(r) == baseline.tokens(prompt, MAX_TOKENS)
    cp.join(30)
    assert cp.error is not None  # P's own client sees the failure, it does not hang
    assert dep.D.proc.alive()
    recovered(dep, baseline, 2)
