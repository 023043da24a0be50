"""Attacks on a deployment without the shared secret (issue 49), on real engines: a prefill
(P, core 0) and a decode (D, core 1) instance of the tiny model and a prefill instance of the
same architecture with other weights (B, core 0), all ``TieredConnector`` on one store pool and
under one store ``model_id``; routers in front (P/D, direct, and B -> D). Each attack fails
cleanly: the victim's tokens equal the no-connector baseline's, no block stays held past its
request, every table stays within its bound.

Order matters: P is restarted in the last test."""

from __future__ import annotations

import sys
import time
from unittest import mock

import pytest
import requests
import zmq

from kvcore.procs import Proc, free_port
from p2p.protocol import PullRequest, RegisterPayload, encode
from tests.harness import CACHE, LOGS, ROOT, Engine, cached_tokens, model_dir, prompt_ids, start_engines, start_proxy
from tests.hostile import Hostile
from tests.store_util import all_keys, wait_saved
from tests.support import counter, plan_sources, toks, wait_for, wait_metric

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
CHUNK = 256


def _kv(role: str, master: str, boot: int, **p2p) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                # One model_id: without the weights in the fingerprint, A's and B's keys would be one.
                "store": {"master": master, "chunk_tokens": CHUNK, "model_id": "m"},
                "p2p": {"bootstrap_port": boot, **p2p}}}


class Sec:
    def __init__(self, cluster, baseline):
        from multi.cli.models import build

        self.cluster = cluster
        self.model_b = build("tiny", CACHE / "models" / "tiny-seed1", seed=1)  # the same shape, other weights
        self.boot_p, self.boot_b = free_port(), free_port()
        self.p_kv = _kv("kv_producer", cluster.master_addr, self.boot_p, abort_timeout_s=60)
        self.P = Engine("sec-P", 0, kv_config=self.p_kv)
        self.D = Engine("sec-D", 1, kv_config=_kv("kv_consumer", cluster.master_addr, free_port(),
                                                  transfer_timeout_s=20, peer_silence_timeout_s=3,
                                                  bootstrap_timeout_s=2))
        self.B = Engine("sec-B", 0, model=self.model_b,
                        kv_config=_kv("kv_producer", cluster.master_addr, self.boot_b, abort_timeout_s=60))
        self.routers: list[Proc] = []
        try:
            baseline.tokens(prompt_ids(40, 4900), 1)  # boots the baseline meanwhile
            start_engines(self.P, self.D, self.B)
            self.pd = self._router(start_proxy("sec-pd", f"{self.P.url}@{self.boot}", self.D.url, 120, wait_s=90))
            self.cross = self._router(start_proxy("sec-cross", f"{self.B.url}@http://127.0.0.1:{self.boot_b}",
                                                  self.D.url, 120, wait_s=90))
            self.direct = self._router(self._plain_router())
        except BaseException:
            self.stop()
            raise

    @property
    def boot(self) -> str:
        return f"http://127.0.0.1:{self.boot_p}"

    def _router(self, started: tuple[Proc, str]) -> str:
        self.routers.append(started[0])
        return started[1]

    def _plain_router(self) -> tuple[Proc, str]:
        port = free_port()
        proc = Proc("sec-direct", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port),
                                   "--plain", self.D.url, "--timeout", "120"], LOGS / f"sec-direct-{port}.log",
                    cwd=str(ROOT))
        proc.wait_port(port, 90)
        return proc, f"http://127.0.0.1:{port}"

    def query(self, boot: str | None = None) -> dict:
        return requests.get((boot or self.boot) + "/query", timeout=5).json()["0"]

    def stop(self) -> None:
        for r in self.routers:
            r.stop(grace=5)
        for e in (self.P, self.D, self.B):
            e.stop()


@pytest.fixture(scope="module")
def sec(store_cluster, baseline):
    s = Sec(store_cluster, baseline)
    yield s
    s.stop()


def _post(url: str, prompt, kv: dict | None = None, path: str = "/v1/completions", **body) -> requests.Response:
    payload = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True, **body}
    if kv is not None:
        payload["kv_transfer_params"] = kv
    return requests.post(url + path, json=payload, timeout=120)


def _ok(r: requests.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _p2p(e: Engine, name: str, kind: str) -> float:
    return counter(e, f"p2p_{name}", kind=kind)


def _nothing_held(e: Engine) -> bool:
    """Every hold the prefill opened has ended (released, early, duplicate, expired)."""
    ended = sum(_p2p(e, "holds", k) for k in ("released", "early_release", "duplicate", "expired"))
    return _p2p(e, "holds", "opened") == ended


def _evil(tid: str, boot: str, engine: str = "evil") -> dict:
    # kv_source: the composite would rather recompute a short prompt of the tiny model than pull it.
    return {"do_remote_decode": True, "do_remote_prefill": True, "remote_bootstrap_addr": boot,
            "remote_engine_id": engine, "transfer_id": tid, "kv_source": "p2p"}


P2P = {"kv_source": "p2p"}  # what a client may set: through the router, the handoff is used


def _victim(sec, baseline, attack: list[int], seed: int) -> None:
    """A later client with the attack prompt's head gets the no-connector tokens."""
    victim = attack[:64] + prompt_ids(30, seed)
    body = _ok(_post(sec.direct, victim))
    assert toks(body) == baseline.tokens(victim, MAX_TOKENS, cached_prefix=cached_tokens(body), writers=[attack])


# ------------------------------------------------------------------ through the router


@pytest.mark.parametrize("route", ["pd", "direct"])
def test_poisoning_through_the_router_never_reaches_the_attackers_address(sec, baseline, route):
    """Transfer fields from a client (pull from my bootstrap server) are dropped by the router on
    both routes: the decode never asks the attacker's address, and serves the right tokens."""
    attacker = Hostile("record")
    try:
        prompt = prompt_ids(64, 4910 + (route == "pd")) + prompt_ids(40, 4912 + (route == "pd"))
        pulls = _p2p(sec.D, "pulls", "ok")
        url = sec.pd if route == "pd" else sec.direct
        body = _ok(_post(url, prompt, {**_evil(f"xfer-evil-{route}", attacker.url), "kv_source": "p2p"}))
        assert toks(body) == baseline.tokens(prompt, MAX_TOKENS)
        time.sleep(1.0)
        assert attacker.hits == []
        if route == "pd":  # the router's own handoff still ran, from P
            assert wait_metric(lambda: _p2p(sec.D, "pulls", "ok"), lambda v: v > pulls, 10) == pulls + 1
        _victim(sec, baseline, prompt, 4914 + (route == "pd"))
        assert wait_for(lambda: _nothing_held(sec.P), 10)
    finally:
        attacker.close()


def test_the_router_refuses_oversized_bodies_and_prompts_and_text_plain_posts(sec):
    long = prompt_ids(4096 + 10, 4920)  # past the engines' max_model_len
    r = _post(sec.pd, long)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = requests.post(sec.pd + "/v1/completions", json={"model": "m", "prompt": "x" * (17 << 20)}, timeout=60)
    assert r.status_code == 413
    r = requests.post(sec.pd + "/v1/completions", data='{"model": "m", "prompt": [1, 2, 3]}',
                      headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415
    assert requests.get(sec.pd + "/health", timeout=10).json()["healthy"] is True


# ------------------------------------------------------------------ straight at the engines


def test_poisoning_directly_against_the_decode_fails_cleanly(sec, baseline):
    """No secret here: a client that reaches D itself names a bootstrap server. A file:// URL is
    refused at once, a server that answers a byte at a time fails at the bootstrap deadline, and
    an engine of other weights (B, holding the attack prompt's KV for the attacker's transfer id)
    is refused by the KV fingerprint; each request is recomputed with the right tokens, and B's
    hold is let go."""
    drip = Hostile("drip", every=0.3)
    try:
        invalid, boot_fail = _p2p(sec.D, "failures", "invalid_params"), _p2p(sec.D, "failures", "bootstrap")
        for i, (boot, what) in enumerate((("file:///etc/passwd", "file"), (drip.url, "drip"))):
            prompt = prompt_ids(64, 4930 + i) + prompt_ids(40, 4940 + i)
            t0 = time.monotonic()
            body = _ok(_post(sec.D.url, prompt, _evil(f"xfer-{what}", boot)))
            assert toks(body) == baseline.tokens(prompt, MAX_TOKENS)
            assert time.monotonic() - t0 < 15, what
        assert _p2p(sec.D, "failures", "invalid_params") == invalid + 1
        assert _p2p(sec.D, "failures", "bootstrap") == boot_fail + 1
        # B holds the attack prompt under the attacker's transfer id (a prefill request sent to B directly).
        prompt = prompt_ids(64, 4950) + prompt_ids(40, 4951)
        opened = _p2p(sec.B, "holds", "opened")
        _ok(_post(sec.B.url, prompt, {"do_remote_decode": True, "transfer_id": "xfer-weights"}, max_tokens=1))
        assert wait_metric(lambda: _p2p(sec.B, "holds", "opened"), lambda v: v > opened, 10) == opened + 1
        refused, protocol = _p2p(sec.B, "rejected", "fingerprint"), _p2p(sec.D, "failures", "protocol")
        engine_b = sec.query(f"http://127.0.0.1:{sec.boot_b}")["engine_id"]
        body = _ok(_post(sec.D.url, prompt, _evil("xfer-weights", f"http://127.0.0.1:{sec.boot_b}", engine_b)))
        assert toks(body) == baseline.tokens(prompt, MAX_TOKENS)
        assert wait_metric(lambda: _p2p(sec.B, "rejected", "fingerprint"), lambda v: v > refused, 10) == refused + 1
        assert _p2p(sec.D, "failures", "protocol") == protocol + 1
        assert wait_for(lambda: _nothing_held(sec.B), 10)
        _victim(sec, baseline, prompt, 4952)
    finally:
        drip.close()


def test_two_engines_of_other_weights_neither_share_the_pool_nor_pair(sec, baseline):
    """B and P: same architecture, same store model_id, other weights. What B stores, D never
    loads (a miss), while what P stores, D does load (the control); a handoff from B to D through
    a router is refused by the fingerprint, recomputed, and B's hold let go."""
    from mcstore.tools.engine import derive_meta

    a = derive_meta(str(model_dir("tiny")), sec.p_kv, block_size=32, dtype=sec.P.dtype)
    b = derive_meta(str(sec.model_b), sec.p_kv, block_size=32, dtype=sec.B.dtype)
    # The control: every field the fingerprint had before it digested the weights is the same
    # (the path aside, which model_id replaces in the keys), so these two engines' keys used to
    # be one; the weights' digest now tells them apart.
    before_weights = ("revision", "dtype", "cache_dtype", "platform", "kv_cache_layout", "tp_size", "pp_size",
                      "groups")
    assert {k: a.fields[k] for k in before_weights} == {k: b.fields[k] for k in before_weights}
    assert a.fields["weights"] != b.fields["weights"] and a.fingerprint != b.fingerprint
    stored_b = prompt_ids(CHUNK + 40, 4960)
    before = all_keys(sec.cluster)
    _ok(_post(sec.B.url, stored_b, max_tokens=1))
    wait_saved(sec.cluster, before, 1)
    body = _ok(_post(sec.direct, stored_b))
    assert "store" not in plan_sources(body) and toks(body) == baseline.tokens(stored_b, MAX_TOKENS)
    stored_p = prompt_ids(CHUNK + 40, 4961)  # the control: P's chunk is D's to load
    before = all_keys(sec.cluster)
    _ok(_post(sec.P.url, stored_p, max_tokens=1))
    wait_saved(sec.cluster, before, 1)
    q = stored_p[:CHUNK] + prompt_ids(40, 4963)  # shares exactly the stored chunk
    body = _ok(_post(sec.direct, q, {"kv_source": "store"}))
    assert plan_sources(body)[0] == "store"
    assert toks(body) == baseline.tokens(q, MAX_TOKENS, cached_prefix=CHUNK, writers=[stored_p])
    # P2P pairing B -> D through a router.
    prompt = prompt_ids(100, 4962)
    refused, protocol = _p2p(sec.B, "rejected", "fingerprint"), _p2p(sec.D, "failures", "protocol")
    body = _ok(_post(sec.cross, prompt, {"kv_source": "p2p"}))
    assert toks(body) == baseline.tokens(prompt, MAX_TOKENS)
    assert wait_metric(lambda: _p2p(sec.B, "rejected", "fingerprint"), lambda v: v > refused, 10) == refused + 1
    assert _p2p(sec.D, "failures", "protocol") == protocol + 1
    assert wait_for(lambda: _nothing_held(sec.B), 10)


def test_a_repeated_transfer_id_leaves_no_hold_behind(sec, baseline):
    """Two prefill requests under one transfer id (a client reaching P): the second is not held,
    the first is pulled by the decode that names it, nothing stays held."""
    first, second = prompt_ids(100, 4970), prompt_ids(100, 4971)
    dup = _p2p(sec.P, "holds", "duplicate")
    for p in (first, second):
        _ok(_post(sec.P.url, p, {"do_remote_decode": True, "transfer_id": "xfer-dup"}, max_tokens=1))
    assert wait_metric(lambda: _p2p(sec.P, "holds", "duplicate"), lambda v: v > dup, 10) == dup + 1
    pulls = _p2p(sec.D, "pulls", "ok")
    body = _ok(_post(sec.D.url, first, _evil("xfer-dup", sec.boot, sec.query()["engine_id"])))
    assert toks(body) == baseline.tokens(first, MAX_TOKENS)
    assert wait_metric(lambda: _p2p(sec.D, "pulls", "ok"), lambda v: v > pulls, 10) == pulls + 1
    assert wait_for(lambda: _nothing_held(sec.P), 10)


def test_bogus_registrations_leave_the_prefill_as_it_registered(sec, baseline):
    from p2p import bootstrap

    before = requests.get(sec.boot + "/query", timeout=5).json()
    engine = before["0"]["engine_id"]
    refused = _p2p(sec.P, "rejected", "register")
    for p in (RegisterPayload(engine, -1, 0, 0, "tcp://127.0.0.1:1"), RegisterPayload(engine, 0, 1, 0, "tcp://127.0.0.1:1"),
              RegisterPayload("evil", 0, 0, 0, "tcp://127.0.0.1:1")):
        with pytest.raises(bootstrap.BootstrapError, match="HTTP 400"):
            bootstrap.register(sec.boot, p, 2, wait_s=0)
    r = requests.post(sec.boot + "/register", data="{}", headers={"Content-Type": "text/plain"}, timeout=5)
    assert r.status_code == 415
    assert requests.get(sec.boot + "/query", timeout=5).json() == before
    prompt = prompt_ids(100, 4980)
    assert toks(_ok(_post(sec.pd, prompt, P2P))) == baseline.tokens(prompt, MAX_TOKENS)
    # Counted by the worker that runs the bootstrap server: on /metrics after P's next steps.
    assert wait_metric(lambda: _p2p(sec.P, "rejected", "register"), lambda v: v >= refused + 4, 10) >= refused + 4


def test_a_side_channel_flood_leaves_handoffs_working(sec, baseline):
    """10^5 pulls of unknown transfers with wait_s=inf on P's real side channel: it keeps at
    most its bound of waiting pulls (every pull past it pushes out the oldest), and once it
    has read them the next handoff through the router is a real pull. (While it reads them,
    a real pull waits behind them: in an engine's worker process P reads about 1,000 a
    second, against 25,000 in a process of its own; docs/deploy.md, "Trust model".)"""
    from p2p.holds import MAX_WAITING

    n = 100_000
    overload = _p2p(sec.P, "rejected", "overload")
    want = overload + n - MAX_WAITING
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sec.query()["worker_addr"]["0"]["0"])

    def stepped() -> float:
        # Counters reach /metrics with P's steps: a one-token request now and then makes some.
        _post(sec.P.url, prompt_ids(8, 4991), max_tokens=1)
        return _p2p(sec.P, "rejected", "overload")

    # Open until P has read every message: closed earlier, it takes what is still in flight
    # (tens of thousands of messages on loopback) with it.
    try:
        for i in range(n):
            sock.send(encode(PullRequest(f"flood-{i}", "d", 0, 1, 0, 1, float("inf"))))
        assert wait_metric(stepped, lambda v: v >= want, 180) == want
    finally:
        sock.close(0)
    prompt = prompt_ids(100, 4990)
    pulls = _p2p(sec.D, "pulls", "ok")
    assert toks(_ok(_post(sec.pd, prompt, P2P))) == baseline.tokens(prompt, MAX_TOKENS)
    assert wait_metric(lambda: _p2p(sec.D, "pulls", "ok"), lambda v: v > pulls, 10) == pulls + 1


def test_a_prefill_restarted_between_two_requests_hands_off_again(sec, baseline):
    """P restarts (another engine id, the same ports): the router forgets the old id at its
    failed health check, the second request is a real handoff, and no hold expires. A decode
    handed the stale id anyway (sent to D directly) fails at the bootstrap, recomputes, and
    releases the hold the new P opened for that transfer."""
    first = prompt_ids(100, 5000)
    assert toks(_ok(_post(sec.pd, first, P2P))) == baseline.tokens(first, MAX_TOKENS)
    old_id = sec.query()["engine_id"]
    sec.P.stop()
    with mock.patch("tests.harness.free_port", lambda host="127.0.0.1": sec.P.port):
        sec.P = Engine("sec-P", 0, kv_config=sec.p_kv)
    start_engines(sec.P)
    assert sec.query()["engine_id"] != old_id
    assert wait_for(lambda: requests.get(sec.pd + "/health", timeout=5).json()["instances"][sec.P.url]["healthy"],
                    30)
    second = prompt_ids(100, 5001)
    pulls = _p2p(sec.D, "pulls", "ok")
    assert toks(_ok(_post(sec.pd, second, P2P))) == baseline.tokens(second, MAX_TOKENS)
    assert wait_metric(lambda: _p2p(sec.D, "pulls", "ok"), lambda v: v > pulls, 10) == pulls + 1
    # The stale engine id, straight at D, for a transfer the new P holds.
    third = prompt_ids(100, 5002)
    _ok(_post(sec.P.url, third, {"do_remote_decode": True, "transfer_id": "xfer-stale"}, max_tokens=1))
    body = _ok(_post(sec.D.url, third, _evil("xfer-stale", sec.boot, old_id)))
    assert toks(body) == baseline.tokens(third, MAX_TOKENS)
    assert wait_for(lambda: _nothing_held(sec.P), 15)
    assert _p2p(sec.P, "holds", "expired") == 0
