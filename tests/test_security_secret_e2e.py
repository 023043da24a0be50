"""A deployment with the shared secret (issue 49), on real engines: a P2P prefill (core 0) and
decode (core 1) instance, both ``mctier serve`` with ``secret_file`` (so the API servers run
``p2p.guard.TransferGuard``), and a router with ``--secret-file``. The router's own handoffs
are signed and work; everything else that names transfer fields is refused with a 4xx saying
why, counted, and touches no block: the victim's tokens equal the no-connector baseline's."""

from __future__ import annotations

import time

import pytest
import requests
import zmq

from kvcore import trust
from p2p import bootstrap
from p2p.protocol import PullReply, PullRequest, RegisterPayload, Status, decode_to_decode, encode
from tests.harness import Engine, cached_tokens, free_port, prompt_ids, start_engines, start_proxy
from tests.hostile import Hostile
from tests.support import counter, toks, wait_for, wait_metric

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
SECRET = "a-deployment-secret-for-the-tests"


class Signed:
    def __init__(self, secret_file: str, baseline):
        self.boot_port = free_port()
        self.boot = f"http://127.0.0.1:{self.boot_port}"
        common = {"secret_file": secret_file, "peer_silence_timeout_s": 3, "bootstrap_timeout_s": 2}
        self.P = Engine("sig-P", 0, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"bootstrap_port": self.boot_port, "abort_timeout_s": 60, **common}})
        self.D = Engine("sig-D", 1, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"transfer_timeout_s": 20, **common}})
        self.proxy = None
        try:
            baseline.tokens(prompt_ids(40, 5100), 1)
            start_engines(self.P, self.D)
            self.proxy, self.url = start_proxy("sig-proxy", f"{self.P.url}@{self.boot}", self.D.url, 120, wait_s=90,
                                               extra=["--secret-file", secret_file])
        except BaseException:
            self.stop()
            raise

    def stop(self):
        if self.proxy is not None:
            self.proxy.stop(grace=5)
        self.P.stop()
        self.D.stop()


@pytest.fixture(scope="module")
def sig(tmp_path_factory, baseline):
    f = tmp_path_factory.mktemp("secret") / "secret"
    f.write_text(SECRET + "\n")
    s = Signed(str(f), baseline)
    yield s
    s.stop()


def _body(prompt, kv=None, **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def _post(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=120)


def _refused(e: Engine, kind: str) -> float:
    return e.metric("vllm:mctier_api_refused_total", kind=kind)


def _decode_params(sig, tid: str, boot: str | None = None) -> dict:
    engine = requests.get(sig.boot + "/query", timeout=5).json()["0"]["engine_id"]
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": boot or sig.boot,
            "remote_engine_id": engine, "transfer_id": tid}


def test_the_routers_signed_handoff_is_a_real_pull(sig, baseline):
    prompt = prompt_ids(100, 5110)
    pulls = counter(sig.D, "p2p_pulls", kind="ok")
    r = _post(sig.url, _body(prompt))
    assert r.status_code == 200, r.text
    assert toks(r.json()) == baseline.tokens(prompt, MAX_TOKENS)
    assert wait_metric(lambda: counter(sig.D, "p2p_pulls", kind="ok"), lambda v: v > pulls, 10) == pulls + 1
    assert wait_for(lambda: counter(sig.P, "p2p_holds", kind="released") >= 1, 10)


def test_unsigned_forged_replayed_and_stale_parameters_get_a_4xx_and_touch_nothing(sig, baseline):
    """Straight at the engines: every request carrying transfer fields the router did not sign
    for this very body, now, is answered 4xx naming why, counted, and never reaches the
    connector (no pull, no hold); a victim later gets the baseline's tokens."""
    attacker = Hostile("record")
    secret = SECRET.encode()
    try:
        prompt = prompt_ids(64, 5120) + prompt_ids(40, 5121)
        body = _body(prompt)
        signed = trust.sign_params(secret, _decode_params(sig, "xfer-sig"), trust.body_digest(body))
        cases = [  # (engine, body, status, kind)
            (sig.D, _body(prompt, _decode_params(sig, "xfer-u", attacker.url)), 403, "unsigned"),
            (sig.D, _body(prompt, {**signed, "remote_bootstrap_addr": attacker.url}), 403, "bad_signature"),
            (sig.D, _body(prompt_ids(104, 5122), signed), 403, "body_mismatch"),  # replayed onto another prompt
            (sig.D, _body(prompt, trust.sign_params(secret, _decode_params(sig, "xfer-old"), trust.body_digest(body),
                                                    now=time.time() - 600)), 403, "expired"),
            (sig.D, _body(prompt, vllm_xargs={"kv_transfer_params": _decode_params(sig, "xfer-x")}), 400, "xargs"),
            (sig.P, _body(prompt, {"do_remote_decode": True, "transfer_id": "xfer-pin"}, max_tokens=1), 403,
             "unsigned"),
        ]
        before = {(e.name, k): _refused(e, k) for e, _, _, k in cases}
        pulls, holds = counter(sig.D, "p2p_pulls", kind="ok"), counter(sig.P, "p2p_holds", kind="opened")
        for e, b, status, kind in cases:
            r = _post(e.url, b)
            assert r.status_code == status, (kind, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == kind and "refused" in err["message"], err
        for e, _, _, kind in cases:
            n = sum(1 for e2, _, _, k in cases if e2 is e and k == kind)
            assert _refused(e, kind) == before[(e.name, kind)] + n, (e.name, kind)
        assert attacker.hits == []
        assert counter(sig.D, "p2p_pulls", kind="ok") == pulls and counter(sig.P, "p2p_holds", kind="opened") == holds
        # The signed parameters for this body (as the router would send them) pass; no prefill
        # holds xfer-sig, so the pull waits and fails, and the request is computed locally.
        r = _post(sig.D.url, {**body, "kv_transfer_params": signed})
        assert r.status_code == 200 and toks(r.json()) == baseline.tokens(prompt, MAX_TOKENS)
        victim = prompt[:64] + prompt_ids(30, 5123)  # its head is in D's prefix cache, from that request
        r = _post(sig.D.url, _body(victim))
        assert r.status_code == 200 and cached_tokens(r.json()) == 64
        assert toks(r.json()) == baseline.tokens(victim, MAX_TOKENS, cached_prefix=64, writers=[prompt])
    finally:
        attacker.close()


def test_unsigned_registrations_and_side_channel_messages_are_refused(sig, baseline):
    q = requests.get(sig.boot + "/query", timeout=5).json()
    engine, addr = q["0"]["engine_id"], q["0"]["worker_addr"]["0"]["0"]
    with pytest.raises(bootstrap.BootstrapError, match="HTTP 403"):
        bootstrap.register(sig.boot, RegisterPayload(engine, 0, 0, 0, "tcp://127.0.0.1:1"), 2, wait_s=0)
    assert requests.get(sig.boot + "/query", timeout=5).json() == q
    rejected = counter(sig.P, "p2p_rejected", kind="unsigned")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send(encode(PullRequest("xfer-nosig", "d", 0, 1, 0, 0)))  # an unsigned release
        assert sock.poll(5000)
        reply = decode_to_decode(sock.recv())
        assert isinstance(reply, PullReply) and reply.status == Status.ERROR and "unsigned" in reply.error
    finally:
        sock.close(0)
    prompt = prompt_ids(100, 5130)  # a handoff: P steps, and its counters reach /metrics
    r = _post(sig.url, _body(prompt))
    assert r.status_code == 200 and toks(r.json()) == baseline.tokens(prompt, MAX_TOKENS)
    assert wait_metric(lambda: counter(sig.P, "p2p_rejected", kind="unsigned"), lambda v: v > rejected, 10) \
        == rejected + 1
