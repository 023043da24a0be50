"""Operator tools against a real Mooncake master and store server, without vLLM engines:
the metadata engines and the store server publish, the admin address found from the master,
a lookup that still answers when the admin API does not, `warmup --server` picking the
key space a live engine published (the engine faked by its `/v1/models`), and `inspect` /
`warmup` from the model name alone: the key space found among the published ones, several
for one model listed with the flag that picks one, an unknown model named as such. The
key spaces are published through the connector's own publish path; tests/test_tools.py
does the same against a real engine. Plus the CLI's one registration table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest
import requests

from kvcore.errors import ConfigError
from kvcore.procs import Proc, free_port
from mcstore.client import StoreClient
from mcstore.config import load_config
from mcstore.keys import KEY_VERSION, MASTER_INFO_KEY, EngineMeta, KeySpace, MasterInfo, engine_meta, meta_key
from mcstore.publish import publish
from mcstore.server import CLIENT_ENV
from mcstore.tools.engine import add_engine_args, engine_settings, query_from_args
from mcstore.tools.inspect import Inspector
from mcstore.tools.inspect_cli import render
from mcstore.tools.published import AmbiguousKeySpace, KeySpaceQuery, ServerModel, find_meta, meta_for_server
from tests.harness import LOGS
from tests.store_util import raw_client

CHUNK = 64
ROOT = Path(__file__).resolve().parents[1]


def _meta(fp_seed: str, model: str, block_size: int = 32) -> EngineMeta:
    fp = (fp_seed * 64)[:64]
    return EngineMeta(fingerprint=fp, chunk_tokens=CHUNK, tp_size=1, model=model,
                      fields={"model": model, "groups": [{"block_size": block_size}]})


def _publish(master: str, meta: EngineMeta) -> None:
    cfg = load_config({"master": master, "chunk_tokens": CHUNK}, env={})
    t = publish(cfg, meta_key(meta.key_space()), msgspec.json.encode(meta))
    t.join(30)
    assert not t.is_alive()


class _FakeServer:
    """Answers /v1/models like a vLLM OpenAI server serving ``root`` as ``name``."""

    def __init__(self, name: str, root: str):
        card = json.dumps({"object": "list", "data": [{"id": name, "root": root, "object": "model"}]}).encode()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = card if self.path == "/v1/models" else b""
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.integration
def test_store_server_publishes_the_admin_address(store_cluster):
    client = StoreClient.for_tool(store_cluster.master_addr, "test")
    try:
        info = client.read(MASTER_INFO_KEY, MasterInfo)
        assert info is not None and info.admin == f"http://127.0.0.1:{store_cluster.metrics_port}"
        assert client.admin().url == info.admin
    finally:
        client.close()
    # Without --admin, the inspector finds it from the master it was given.
    insp = Inspector(store_cluster.master_addr)
    try:
        assert insp.admin.url == info.admin and insp.health()["admin"] is True
        assert MASTER_INFO_KEY in insp.admin.all_keys()
    finally:
        insp.close()


@pytest.mark.integration
def test_published_engine_meta_names_the_model_in_summary(store_cluster):
    meta = _meta("a1", "/models/published-a")
    _publish(store_cluster.master_addr, meta)
    insp = Inspector(store_cluster.master_addr)
    try:
        rows = {f.fingerprint: f for f in insp.summary().fingerprints}
        assert rows[meta.fingerprint[:16]].model == "/models/published-a"
        assert rows[meta.fingerprint[:16]].chunk_tokens == CHUNK
        assert insp.key_space(meta.fingerprint[:16]).fp == meta.fingerprint
    finally:
        insp.close()


@pytest.mark.integration
def test_lookup_without_admin_api_answers_from_the_store(store_cluster):
    meta = _meta("b2", "/models/lookup-b")
    ks: KeySpace = meta.key_space()
    tokens = list(range(3 * CHUNK + 10))
    keys = ks.all_rank_keys(ks.links(tokens))
    raw = raw_client(store_cluster.master_addr)
    try:
        for k in keys[:2]:
            assert raw.put(k, b"x" * 1000) == 0
    finally:
        raw.close()
    good = Inspector(store_cluster.master_addr, meta=meta)
    blind = Inspector(store_cluster.master_addr, admin="http://127.0.0.1:1", meta=meta)
    try:
        a, b = good.lookup(tokens), blind.lookup(tokens)
        assert a.hit_tokens == b.hit_tokens == 2 * CHUNK
        assert [c.tier for c in a.chunks] == ["memory", "memory", "missing"] and a.note is None
        assert [c.tier for c in b.chunks] == ["unknown", "unknown", "missing"] and "unknown" in b.note
    finally:
        good.close()
        blind.close()


@pytest.mark.integration
def test_warmup_finds_the_key_space_a_live_engine_published(store_cluster):
    mine, other = _meta("c3", "/models/served-c"), _meta("d4", "/models/other-d")
    for m in (mine, other):
        _publish(store_cluster.master_addr, m)
    client = StoreClient.for_tool(store_cluster.master_addr, "test")
    server = _FakeServer("served", "/models/served-c")
    try:
        sm = ServerModel(server.url)
        assert (sm.name, sm.root) == ("served", "/models/served-c")
        assert meta_for_server(sm, client, client.admin()).fingerprint == mine.fingerprint
        assert meta_for_server(sm, client, client.admin(), fingerprint=other.fingerprint[:16]) == other
        # Two engines of the same model with different settings: the tool asks which one.
        _publish(store_cluster.master_addr, _meta("e5", "/models/served-c", block_size=16))
        with pytest.raises(ConfigError, match="--fingerprint"):
            meta_for_server(sm, client, client.admin())
        sm.block_size = 32  # what the server's vllm:cache_config_info would say
        assert meta_for_server(sm, client, client.admin()).fingerprint == mine.fingerprint
        with pytest.raises(ConfigError, match="no published key space"):
            meta_for_server(ServerModel(_FakeServer("x", "/models/never").url), client, client.admin())
    finally:
        server.close()
        client.close()


@pytest.mark.unit
def test_engines_publish_their_key_version_and_older_metadata_reads_as_unknown():
    ks = KeySpace("ab" * 32, CHUNK)
    meta = engine_meta(ks, "mct", "/models/m", {"model": "/models/m"})
    assert meta.key_version == KEY_VERSION and not meta.foreign()
    # What engines published before the field: decodes, version unknown, not foreign.
    old = msgspec.json.decode(b'{"fingerprint": "%s", "chunk_tokens": 64, "tp_size": 1}' % (b"ab" * 32),
                              type=EngineMeta)
    assert old.key_version is None and not old.foreign()
    assert msgspec.structs.replace(old, key_version="mctier-store-v1").foreign()


@pytest.mark.integration
def test_key_spaces_of_another_key_version_are_named_and_never_picked(store_cluster):
    """After an upgrade the store holds the key spaces of engines that ran before it: the
    summary names their key version, warmup and the router pick this version's, and a
    lookup or warmup on another version's says so instead of reading every chunk as missing."""
    model = "/models/upgraded-f"
    before = _meta("f6", model)  # published before the field: version unknown
    old = msgspec.structs.replace(_meta("a7", model), key_version="mctier-store-v1")
    now = msgspec.structs.replace(_meta("b8", model), key_version=KEY_VERSION)
    only_old = msgspec.structs.replace(_meta("c9", "/models/only-old-g"), key_version="mctier-store-v1")
    for m in (before, old, now, only_old):
        _publish(store_cluster.master_addr, m)
    client = StoreClient.for_tool(store_cluster.master_addr, "test")
    servers = [_FakeServer("upgraded", model), _FakeServer("only-old", "/models/only-old-g")]
    insp = Inspector(store_cluster.master_addr)
    try:
        sm = ServerModel(servers[0].url)
        # Three of the model, same block size: the one of this key version, not "pick one".
        assert meta_for_server(sm, client, client.admin()).fingerprint == now.fingerprint
        with pytest.raises(ConfigError, match="key version mctier-store-v1"):
            meta_for_server(sm, client, client.admin(), fingerprint=old.fingerprint[:16])
        with pytest.raises(ConfigError, match="published by another mctier"):
            meta_for_server(ServerModel(servers[1].url), client, client.admin())
        rows = {f.fingerprint: f for f in insp.summary().fingerprints}
        assert rows[before.fingerprint[:16]].key_version is None
        assert rows[old.fingerprint[:16]].key_version == "mctier-store-v1"
        assert rows[now.fingerprint[:16]].key_version == KEY_VERSION
        text = render(insp.summary())
        note = next(line for line in text.splitlines() if "of another mctier key version" in line)
        assert old.fingerprint[:16] in note and only_old.fingerprint[:16] in note
        assert now.fingerprint[:16] not in note and before.fingerprint[:16] not in note
        with pytest.raises(ValueError, match="key version mctier-store-v1"):
            insp.lookup(list(range(3 * CHUNK)), fingerprint=old.fingerprint[:16])
        assert insp.lookup(list(range(3 * CHUNK)), fingerprint=now.fingerprint[:16]).hit_tokens == 0
    finally:
        insp.close()
        for s in servers:
            s.close()
        client.close()


@pytest.mark.unit
def test_cli_registers_every_command_one_way():
    from multi.cli import COMMANDS, build_parser, main

    parser, commands = build_parser()
    assert len(COMMANDS) == len(commands)
    assert set(commands) == {"serve", "master", "store-server", "proxy", "demo", "warmup", "inspect", "model", "cpu"}
    assert {n for n, p in commands.items() if p.get_default("raw")} == {"serve", "proxy"}
    assert all(callable(p.get_default("func")) for n, p in commands.items() if n != "inspect")  # inspect: per op
    with pytest.raises(SystemExit):
        main(["bench"])  # the benchmarks are `python -m bench.suite`, not part of the product
    assert main(["warmup", "prefixes.txt"]) == 2  # offline mode needs the engine settings


@pytest.mark.unit
def test_one_replicate_config_with_tool_overrides():
    from mooncake.store import SoftPinAction

    from mcstore.client import replicate_config

    cfg = load_config({"master": "h:1", "replicas": 2, "hard_pin": True}, env={})
    rc = replicate_config(cfg, hard_pin=False, soft_pin=True, soft_pin_ttl_ms=5000)
    assert rc.replica_num == 2 and not rc.with_hard_pin and rc.soft_pin_action == SoftPinAction.ENABLE
    assert rc.soft_pin_ttl_ms == 5000
    assert replicate_config(replicas=3).replica_num == 3
    with pytest.raises(TypeError):
        replicate_config(pin="hard")


# -- from the model name alone -------------------------------------------------------------------


def _cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multi.cli", *args], capture_output=True, text=True, input=input,
                          timeout=120, cwd=str(ROOT), env={**os.environ, **CLIENT_ENV})


def _current(fp_seed: str, model: str, block_size: int = 32, **kw) -> EngineMeta:
    return msgspec.structs.replace(_meta(fp_seed, model, block_size), key_version=KEY_VERSION, **kw)


@pytest.mark.unit
def test_engine_flags_are_settings_with_kv_config_and_filters_without():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--key-prefix", default="mct")
    bare = p.parse_args(["--model", "/models/m"])
    assert engine_settings(bare) == dict(block_size=None, dtype="auto", kv_cache_dtype="auto", tensor_parallel_size=1,
                                         pipeline_parallel_size=1, prefix_caching_hash_algo="sha256")  # vLLM's
    assert query_from_args(bare) == KeySpaceQuery(model="/models/m")  # nothing said but the model
    narrowed = p.parse_args(["--model", "/models/m", "-tp", "2", "--block-size", "16", "--dtype", "float32",
                             "--chunk-tokens", "128", "--fingerprint", "ab" * 8])
    assert query_from_args(narrowed) == KeySpaceQuery(model="/models/m", tp_size=2, block_size=16, dtype="float32",
                                                      chunk_tokens=128, fingerprint="ab" * 8)
    assert query_from_args(narrowed, fingerprint=False).fingerprint is None
    assert engine_settings(narrowed)["tensor_parallel_size"] == 2
    derived = p.parse_args(["--model", "/models/m", "--kv-config", "{}"])
    assert query_from_args(derived).model is None  # --model with --kv-config: the settings, not a name to look up


@pytest.mark.integration
def test_inspect_by_model_name_alone(store_cluster):
    """`inspect lookup / keys / summary / remove --model M`: no fingerprint, no --kv-config."""
    master, model = store_cluster.master_addr, "/models/named-h"
    meta, bystander = _current("1a", model), _current("2b", "/models/bystander-j")
    for m in (meta, bystander):
        _publish(master, m)
    ks = meta.key_space()
    tokens = list(range(1000, 1000 + 3 * CHUNK + 5))
    keys = ks.all_rank_keys(ks.links(tokens))
    other = bystander.key_space()
    raw = raw_client(master)
    try:
        for k in keys[:2] + other.all_rank_keys(other.links(tokens)):
            assert raw.put(k, b"x" * 1000) == 0
    finally:
        raw.close()
    insp = Inspector(master, query=KeySpaceQuery(model=model))
    try:
        lk = insp.lookup(tokens)
        assert (lk.fingerprint, lk.hit_tokens) == (meta.fingerprint[:16], 2 * CHUNK)
    finally:
        insp.close()

    r = _cli("inspect", "lookup", "--master", master, "--model", model, "--tokens", "-", "--json",
             input=json.dumps(tokens))
    assert r.returncode == 0, r.stderr[-2000:]
    lk = json.loads(r.stdout)
    assert (lk["fingerprint"], lk["hit_tokens"]) == (meta.fingerprint[:16], 2 * CHUNK)
    assert [c["tier"] for c in lk["chunks"]] == ["memory", "memory", "missing"]

    r = _cli("inspect", "keys", "--master", master, "--model", model, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(k["key"] for k in json.loads(r.stdout)["keys"]) == sorted(keys[:2] + [meta_key(ks)])

    r = _cli("inspect", "summary", "--master", master, "--model", model, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["fingerprints"]
    assert [(f["fingerprint"], f["model"], f["chunks"]) for f in rows] == [(meta.fingerprint[:16], model, 2)]
    r = _cli("inspect", "summary", "--master", master, "--json")  # unnamed: every key space
    assert {meta.fingerprint[:16], bystander.fingerprint[:16]} <= {f["fingerprint"] for f in
                                                                  json.loads(r.stdout)["fingerprints"]}

    r = _cli("inspect", "remove", "--master", master, "--model", model, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (json.loads(r.stdout)["fingerprint"], json.loads(r.stdout)["removed"]) == (meta.fingerprint[:16], 3)
    # Its metadata went with it: the model is no longer published; the bystander was not touched.
    r = _cli("inspect", "lookup", "--master", master, "--model", model, "--tokens", "-", input=json.dumps(tokens))
    assert r.returncode == 2 and f"no published key space for model {model!r}" in r.stderr
    insp = Inspector(master, query=KeySpaceQuery(model="/models/bystander-j"))
    try:
        assert insp.lookup(tokens).hit_tokens == 3 * CHUNK
    finally:
        insp.close()


@pytest.mark.integration
def test_several_key_spaces_of_one_model_are_listed_with_the_flag_that_picks_one(store_cluster):
    master, model = store_cluster.master_addr, "/models/twin-k"
    tp1, tp2, bs16 = _current("3c", model), _current("4d", model, tp_size=2), _current("5e", model, block_size=16)
    old = msgspec.structs.replace(_meta("6f", model), key_version="mctier-store-v1")  # never a candidate
    for m in (tp1, tp2, bs16, old):
        _publish(master, m)
    for args in (["inspect", "lookup", "--tokens", "-"], ["warmup", "-"]):  # warmup: before any engine starts
        r = _cli(*args, "--master", master, "--model", model, input="[1, 2, 3]")
        assert r.returncode == 2, (args, r.stderr[-2000:])
        err = r.stderr
        assert f"model {model!r} matches 3 published key spaces" in err, err
        line = {m.fingerprint: next(ln for ln in err.splitlines() if m.fingerprint[:16] in ln)
                for m in (tp1, tp2, bs16)}
        assert "tp 1," in line[tp1.fingerprint] and "block 32," in line[tp1.fingerprint]
        assert "tp 2," in line[tp2.fingerprint] and "block 32," in line[tp2.fingerprint]
        assert "tp 1," in line[bs16.fingerprint] and "block 16," in line[bs16.fingerprint]
        assert old.fingerprint[:16] not in err
        assert "they differ in tp, block;" in err and "--fingerprint" in err
        assert "--tensor-parallel-size" in err and "--block-size" in err
    # One flag, or two, or the fingerprint picks one.
    r = _cli("inspect", "lookup", "--master", master, "--model", model, "-tp", "2", "--tokens", "-", "--json",
             input=json.dumps(list(range(2 * CHUNK))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["fingerprint"] == tp2.fingerprint[:16]
    client = StoreClient.for_tool(master, "test")
    try:
        admin = client.admin()

        def pick(**kw) -> EngineMeta:
            return find_meta(client, admin, KeySpaceQuery(model=model, **kw))

        assert pick(block_size=16) == bs16
        assert pick(tp_size=1, block_size=32) == tp1
        assert pick(fingerprint=tp1.fingerprint[:16]) == tp1
        with pytest.raises(AmbiguousKeySpace) as e:  # tp 1 leaves two, told apart by the block size
            pick(tp_size=1)
        assert tp2.fingerprint[:16] not in str(e.value) and "they differ in block;" in str(e.value)
        with pytest.raises(ConfigError, match="none of the key spaces published for model '/models/twin-k' has "
                                              "--tensor-parallel-size 4"):
            pick(tp_size=4)
    finally:
        client.close()


@pytest.mark.integration
def test_an_unknown_model_is_named_with_what_was_published(store_cluster):
    master = store_cluster.master_addr
    _publish(master, _current("7a", "/models/known-l"))
    for args in (["inspect", "lookup", "--tokens", "-"], ["inspect", "keys"], ["warmup", "-"]):
        r = _cli(*args, "--master", master, "--model", "/models/never-published", input="[1, 2, 3]")
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert "no published key space for model '/models/never-published'" in r.stderr
        assert "/models/known-l" in r.stderr  # what was published, to compare with


@pytest.mark.integration
def test_inspect_serve_by_model_name(store_cluster):
    """`inspect serve --model M`: /lookup's default key space is the model's published one,
    read on the first request; several for the model answer 409 with the list, and a request's
    fingerprint picks one."""
    master = store_cluster.master_addr
    one, twin, twin_tp2 = (_current("8b", "/models/served-m"), _current("9c", "/models/twin-n"),
                           _current("ad", "/models/twin-n", tp_size=2))
    for m in (one, twin, twin_tp2):
        _publish(master, m)
    tokens = list(range(500, 500 + 2 * CHUNK + 3))
    ks = one.key_space()
    raw = raw_client(master)
    try:
        for k in ks.all_rank_keys(ks.links(tokens)):
            assert raw.put(k, b"y" * 700) == 0
    finally:
        raw.close()
    servers, urls = [], {}
    try:
        for model in ("/models/served-m", "/models/twin-n"):
            port = free_port()
            servers.append(Proc(f"tools-serve-{port}", [sys.executable, "-m", "multi.cli", "inspect", "serve",
                                                        "--master", master, "--model", model, "--port", str(port)],
                                LOGS / f"tools-serve-{port}.log", env=CLIENT_ENV, cwd=str(ROOT)))
            urls[model] = f"http://127.0.0.1:{port}"
        for p, url in zip(servers, urls.values()):
            p.wait_port(int(url.rsplit(":", 1)[1]), 60)
        r = requests.post(urls["/models/served-m"] + "/lookup", json={"tokens": tokens}, timeout=30)
        assert r.status_code == 200, r.text
        assert (r.json()["fingerprint"], r.json()["hit_tokens"]) == (one.fingerprint[:16], 2 * CHUNK)
        r = requests.post(urls["/models/twin-n"] + "/lookup", json={"tokens": tokens}, timeout=30)
        assert r.status_code == 409, r.text
        assert twin.fingerprint[:16] in r.json()["detail"] and twin_tp2.fingerprint[:16] in r.json()["detail"]
        r = requests.post(urls["/models/twin-n"] + "/lookup", timeout=30,
                          json={"tokens": tokens, "fingerprint": twin_tp2.fingerprint[:16]})
        assert r.status_code == 200 and r.json()["fingerprint"] == twin_tp2.fingerprint[:16], r.text
    finally:
        for p in servers:
            p.stop()
