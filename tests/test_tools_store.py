"""Operator tools against a real Mooncake master and store server, without vLLM engines:
the metadata engines and the store server publish, the admin address found from the master,
a lookup that still answers when the admin API does not, and `warmup --server` picking the
key space a live engine published (the engine faked by its `/v1/models`). Plus the CLI's one
registration table."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from kvcore.errors import ConfigError
from mcstore.client import StoreClient, publish
from mcstore.config import load_config
from mcstore.keys import KEY_VERSION, MASTER_INFO_KEY, EngineMeta, KeySpace, MasterInfo, engine_meta, meta_key
from mcstore.tools.engine import ServerModel, meta_for_server
from mcstore.tools.inspect import Inspector
from mcstore.tools.inspect_cli import render
from tests.store_util import raw_client

CHUNK = 64


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
    old = msgspec.json.decode(b'{"fingerprint": "%s", "chunk_tokens": 64, "tp_size": 1}' % (b"ab" * 32), type=EngineMeta)
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
