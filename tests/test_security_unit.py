"""Trust at the boundaries, piece by piece (issue 49): signatures, what the router forwards,
the API server's middleware, the scheduler's own refusal, KV identity, object checksums, the
wait for a transfer past its bound. Pure Python: no Mooncake, no engine."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from types import SimpleNamespace

import pytest

from kvcore import trust

pytestmark = pytest.mark.unit

SECRET = b"s" * 32


# ------------------------------------------------------------------ the secret and signatures


def test_the_secret_comes_from_a_file_then_the_environment_and_is_checked(tmp_path):
    f = tmp_path / "secret"
    f.write_text("  file-secret-of-enough-bytes\n")
    assert trust.load_secret(str(f), env={}) == b"file-secret-of-enough-bytes"
    assert trust.load_secret(None, env={trust.SECRET_FILE_ENV: str(f), trust.SECRET_ENV: "x" * 20}) == \
        b"file-secret-of-enough-bytes"
    assert trust.load_secret(None, env={trust.SECRET_ENV: "env-secret-long-enough"}) == b"env-secret-long-enough"
    assert trust.load_secret(None, env={}) is None
    with pytest.raises(trust.SecretError, match="at least 16 bytes"):
        trust.load_secret(None, env={trust.SECRET_ENV: "short"})
    with pytest.raises(trust.SecretError, match="No such file"):
        trust.load_secret(str(tmp_path / "missing"), env={})


def _decode_params(bootstrap="http://127.0.0.1:8998", tid="xfer-1"):
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": bootstrap,
            "remote_engine_id": "eng", "transfer_id": tid}


def test_signed_transfer_parameters_verify_and_every_tampering_is_refused():
    body = {"model": "m", "prompt": [1, 2, 3]}
    digest = trust.body_digest(body)
    signed = trust.sign_params(SECRET, {**_decode_params(), "kv_source": "p2p"}, digest)
    trust.verify_params(SECRET, signed, digest)
    trust.verify_params(SECRET, json.loads(json.dumps(signed)), digest)  # survives JSON
    cases = {
        "bad_signature": {**signed, "remote_bootstrap_addr": "http://evil:1"},
        "body_mismatch": signed,  # checked against another body below
        "unsigned": _decode_params(),
        "malformed": {**signed, trust.SIG_KEY: 12},
        "expired": trust.sign_params(SECRET, _decode_params(), digest, now=time.time() - 3600),
    }
    for kind, params in cases.items():
        other = trust.body_digest({"model": "m", "prompt": [9]}) if kind == "body_mismatch" else digest
        with pytest.raises(trust.Refused) as e:
            trust.verify_params(SECRET, params, other)
        assert e.value.kind == kind, (kind, e.value)
    with pytest.raises(trust.Refused) as e:
        trust.verify_params(b"t" * 32, signed, digest)
    assert e.value.kind == "bad_signature"
    # A key added after signing is a transfer field the signature does not cover.
    with pytest.raises(trust.Refused):
        trust.verify_params(SECRET, {**signed, "remote_host": "evil"}, digest)
    # What a client may set needs no signature, and is not covered by one.
    trust.verify_params(SECRET, {"kv_source": "store", "ttft_slo_s": 2}, digest)
    trust.verify_params(SECRET, {**signed, "kv_source": "recompute"}, digest)


def test_the_router_forwards_only_what_a_client_may_set_on_both_routes():
    from p2p.proxy import decode_body, direct_body, prefill_body

    evil = {**_decode_params("http://attacker:1"), "do_remote_decode": True, "kv_source": "p2p", "ttft_slo_s": 1,
            "remote_host": "attacker", trust.SIG_KEY: "00"}
    body = {"model": "m", "prompt": [1, 2], "kv_transfer_params": evil}
    assert direct_body(body)["kv_transfer_params"] == {"kv_source": "p2p", "ttft_slo_s": 1}
    assert "kv_transfer_params" not in direct_body({"model": "m", "kv_transfer_params": {"transfer_id": "x"}})
    d = decode_body(body, evil, "http://p:8998", "eng-P", "xfer-r")["kv_transfer_params"]
    assert d == {"kv_source": "p2p", "ttft_slo_s": 1, "do_remote_decode": False, "do_remote_prefill": True,
                 "remote_bootstrap_addr": "http://p:8998", "remote_engine_id": "eng-P", "transfer_id": "xfer-r"}
    p = prefill_body(body, "xfer-r")["kv_transfer_params"]
    assert p == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-r"}


def test_side_channel_messages_and_registrations_are_signed_and_checked():
    from p2p.protocol import (
        PullDone,
        PullReply,
        PullRequest,
        RegisterPayload,
        Status,
        decode_to_decode,
        decode_to_prefill,
        encode,
        refusal,
        registration_refusal,
        sign,
        sign_registration,
    )

    for msg, decode in ((PullRequest("t", "r", 0, 1, 0, 2, 5.0, "fp"), decode_to_prefill),
                        (PullDone("t", "r", True), decode_to_prefill),
                        (PullReply(Status.READY, "t", te_addr="h:1", block_ids=[1, 2]), decode_to_decode)):
        signed = decode(encode(sign(msg, SECRET)))
        assert refusal(signed, SECRET) is None and refusal(signed, None) is None
        assert refusal(msg, SECRET) == "unsigned"
        assert refusal(signed, b"t" * 32) == "bad_signature"
        forged = decode(encode(signed).replace(b"\xa1t", b"\xa1u"))  # another transfer id, same MAC
        assert forged.transfer_id == "u" and refusal(forged, SECRET) == "bad_signature"
    stale = sign(PullDone("t", "r", True), SECRET)
    assert refusal(stale, SECRET, max_age_s=-1) == "expired"
    p = RegisterPayload("eng", 0, 0, 0, "tcp://127.0.0.1:5")
    assert json.dumps(__import__("msgspec").to_builtins(p)) == \
        '{"engine_id": "eng", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:5"}'  # vLLM's shape
    sp = sign_registration(p, SECRET)
    assert registration_refusal(sp, SECRET) is None and registration_refusal(p, SECRET) == "unsigned"
    assert registration_refusal(__import__("msgspec").structs.replace(sp, tp_rank=1), SECRET) == "bad_signature"


# ------------------------------------------------------------------ the API server's middleware


class _App:
    """The ASGI app behind the middleware: records what reached it."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        msg = await receive()
        self.bodies.append(msg["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(guard, body: bytes, method: str = "POST") -> tuple[int, dict]:
    sent = []
    chunks = [body[:5], body[5:]]

    async def receive():
        data = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": data, "more_body": bool(chunks)}

    async def send(m):
        sent.append(m)

    asyncio.run(guard({"type": "http", "method": method, "path": "/v1/completions"}, receive, send))
    status = sent[0]["status"]
    return status, (json.loads(sent[1]["body"]) if status != 200 else {})


def test_the_api_middleware_refuses_unsigned_or_replayed_transfer_parameters_with_a_4xx(monkeypatch):
    from prometheus_client import REGISTRY

    from p2p.guard import TransferGuard

    app = _App()
    guard = TransferGuard(app, secret=SECRET)

    def refused(kind: str) -> float:
        return REGISTRY.get_sample_value("vllm:mctier_api_refused_total", {"kind": kind}) or 0.0

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
    signed = {**body, "kv_transfer_params": trust.sign_params(SECRET, _decode_params(), trust.body_digest(body))}
    plain = json.dumps({**body, "kv_transfer_params": {"kv_source": "store"}}).encode()
    assert _call(guard, plain)[0] == 200 and app.bodies[-1] == plain  # passed on byte for byte
    assert _call(guard, json.dumps(signed).encode())[0] == 200
    before = {k: refused(k) for k in ("unsigned", "body_mismatch", "xargs")}
    status, err = _call(guard, json.dumps({**body, "kv_transfer_params": _decode_params()}).encode())
    assert status == 403 and err["error"]["param"] == "unsigned" and "not signed" in err["error"]["message"]
    replayed = {**signed, "prompt": [7, 7, 7]}  # the router's signature, another prompt
    assert _call(guard, json.dumps(replayed).encode())[1]["error"]["param"] == "body_mismatch"
    # Hidden from a substring search: a \u escape in the key, and UTF-16 (json.loads reads both).
    escaped = json.dumps({**body, "kv_transfer_params": _decode_params()}).replace("kv_transfer_params",
                                                                                  "kv_transfer_param\\u0073")
    assert _call(guard, escaped.encode())[0] == 403
    assert _call(guard, json.dumps({**body, "kv_transfer_params": _decode_params()}).encode("utf-16"))[0] == 403
    assert _call(guard, json.dumps({**body, "vllm_xargs": {"kv_transfer_params": _decode_params()}}).encode())[0] == 400
    assert refused("unsigned") == before["unsigned"] + 3 and refused("body_mismatch") == before["body_mismatch"] + 1
    assert refused("xargs") == before["xargs"] + 1
    n = len(app.bodies)
    assert _call(guard, b"not json")[0] == 200 and _call(guard, b"", "GET")[0] == 200  # vLLM answers these
    assert len(app.bodies) == n + 2
    # Without a secret it checks nothing.
    monkeypatch.delenv(trust.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    assert _call(TransferGuard(_App()), json.dumps({"kv_transfer_params": _decode_params()}).encode())[0] == 200


def test_mctier_serve_installs_the_middleware_when_a_secret_is_configured(tmp_path):
    from p2p.guard import GUARD, serve_args

    f = tmp_path / "s"
    f.write_text("x" * 20)
    ktc = json.dumps({"kv_connector": "TieredConnector", "kv_connector_extra_config": {"p2p": {"secret_file": str(f)}}})
    env: dict = {}
    assert serve_args(["M", "--kv-transfer-config", ktc], env)[-2:] == ["--middleware", GUARD]
    assert env[trust.SECRET_FILE_ENV] == str(f)
    assert serve_args(["M", "--middleware", GUARD], {trust.SECRET_ENV: "y" * 20}).count(GUARD) == 1
    assert serve_args(["M"], {}) == ["M"]
    with pytest.raises(SystemExit, match="at least 16"):
        serve_args(["M"], {trust.SECRET_ENV: "short"})


# ------------------------------------------------------------------ the scheduler's own refusal


def _sched(role: str, secret: bytes | None, monkeypatch):
    from p2p.config import load_config
    from p2p.scheduler import P2PScheduler

    monkeypatch.delenv(trust.SECRET_FILE_ENV, raising=False)
    if secret is None:
        monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(trust.SECRET_ENV, secret.decode())
    return P2PScheduler(SimpleNamespace(cache_config=SimpleNamespace(block_size=32)), load_config({}), role)


def _req(rid: str, params: dict, finished: bool = True):
    status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED" if finished else "FINISHED_ABORTED")
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100)), kv_transfer_params=params,
                           status=status)


def test_the_connector_refuses_unsigned_parameters_by_itself_and_counts_once(monkeypatch):
    """Defence in depth (a plain `vllm serve` without the middleware): with a secret the decode
    side computes unsigned, forged or replayed requests itself; the prefill side holds nothing."""
    d = _sched("kv_consumer", SECRET, monkeypatch)
    digest = "any"  # the connector cannot see the body; the middleware checks it
    good = trust.sign_params(SECRET, _decode_params(tid="xfer-good"), digest)
    assert d.lookup(_req("ok", dict(good))) == 100
    for rid, params in (("u", _decode_params()), ("f", {**good, "remote_engine_id": "other"}),
                        ("file", trust.sign_params(SECRET, _decode_params("file:///etc/passwd"), digest))):
        for _ in range(3):  # asked again after a preemption: counted and logged once
            assert d.lookup(_req(rid, dict(params))) == 0
    d.plan_load(_req("ok", dict(good)), 0, 100, list(range(4)))
    assert d.lookup(_req("again", dict(good))) == 0  # the same transfer once more: a replay
    c = d.stats.data["counters"]
    assert (c["refused:unsigned"], c["refused:bad_signature"], c["failures:invalid_params"], c["refused:replayed"]) \
        == (1, 1, 1, 1)
    p = _sched("kv_producer", SECRET, monkeypatch)
    unsigned = {"do_remote_decode": True, "transfer_id": "xfer-pin"}
    assert p.request_finished(_req("pin", unsigned), [1, 2, 3]) == (False, None)
    assert p.request_finished(_req("long", {"do_remote_decode": True, "transfer_id": "x" * 300}), [1]) == (False, None)
    signed = trust.sign_params(SECRET, unsigned, digest)
    assert p.request_finished(_req("held", signed), [1, 2, 3, 4]) == (True, None)
    assert [h[0] for h in p.build_connector_meta().holds] == ["held"]
    # Without a secret, well-formed parameters are taken as before, but never a file:// URL.
    n = _sched("kv_consumer", None, monkeypatch)
    assert n.lookup(_req("a", _decode_params(tid="t1"))) == 100
    assert n.lookup(_req("b", _decode_params("file:///x", tid="t2"))) == 0


def test_the_schedulers_tables_keyed_by_outside_ids_are_bounded(monkeypatch):
    from p2p import scheduler

    d = _sched("kv_consumer", None, monkeypatch)
    for i in range(scheduler._LOGGED + 500):
        d.lookup(_req(f"r{i}", _decode_params("file:///x", tid=f"t{i}")))
    assert len(d._invalid_logged) == scheduler._LOGGED


# ------------------------------------------------------------------ identity and checksums


def test_the_weights_digest_tells_checkpoints_apart_but_not_their_paths(tmp_path):
    import torch
    from safetensors.torch import save_file

    from kvcore.identity import config_digest, weights_digest

    a, b, copy = tmp_path / "a", tmp_path / "b", tmp_path / "elsewhere" / "a"
    for d, seed in ((a, 0), (b, 1)):
        d.mkdir(parents=True)
        torch.manual_seed(seed)
        save_file({"layer.weight": torch.randn(64, 64), "layer.bias": torch.randn(64)}, d / "model.safetensors")
    shutil.copytree(a, copy)
    assert weights_digest(a) == weights_digest(copy) != weights_digest(b)
    assert weights_digest(tmp_path / "nowhere") is None and weights_digest("org/model-on-the-hub") is None
    cfg = {"hidden_size": 8, "_name_or_path": "/x", "transformers_version": "4"}
    assert config_digest(cfg) == config_digest({**cfg, "_name_or_path": "/y", "transformers_version": "5"})
    assert config_digest(cfg) != config_digest({**cfg, "rope_theta": 1e6})


def test_the_object_checksum_covers_the_objects_key():
    import ctypes

    from mcstore.objects import TRAILER, pack_trailer, trailer, trailer_ok

    pages = bytes(range(256)) * 16
    buf = ctypes.create_string_buffer(pages + trailer(pages, "mct/k1/tp0"))
    addr = ctypes.addressof(buf)
    assert trailer(pages, "mct/k1/tp0") == pack_trailer([addr], [len(pages)], "mct/k1/tp0")
    assert trailer_ok(addr + len(pages), [addr], [len(pages)], "mct/k1/tp0")
    assert not trailer_ok(addr + len(pages), [addr], [len(pages)], "mct/k2/tp0")  # a valid object, moved
    assert len(trailer(b"", "")) == TRAILER.size


def test_a_transfer_past_its_bound_is_waited_for_until_mooncake_ends_it():
    """FAKE (a Mooncake batch that never ends cannot be made on demand): a status function that
    says "pending" until 0.3 s past the bound. The wait returns only once the batch ended."""
    from p2p.transfer import _wait_terminal

    t0 = time.monotonic()
    bound, ends = t0 + 0.1, t0 + 0.4
    failed, late = _wait_terminal(lambda bid: 1 if time.monotonic() >= ends else 0, [7], bound)
    assert failed == 0 and time.monotonic() >= ends and late >= 0.29
    failed, late = _wait_terminal(lambda bid: -1, [1, 2], time.monotonic() + 5)
    assert (failed, late) == (2, 0.0)
