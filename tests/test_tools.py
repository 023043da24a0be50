"""Operator tools against real components: warmup (server and offline engines, idempotence,
pinning under eviction pressure), the inspection API through its three faces (Python, CLI,
HTTP) on a store with known contents, and both tools from the master and the model name (or
the engine's URL) alone, reading the rest from what the engine published when it started.

One served engine (no local prefix cache, so any reuse is the store's), one offline engine
started by warmup, the session baseline for token-id checks, one `mctier inspect serve`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import msgspec
import pytest
import requests

from kvcore.platform import engine_dtype
from kvcore.procs import Proc, free_port
from mcstore.server import CLIENT_ENV, StoreCluster
from mcstore.tools.engine import Renderer, derive_meta
from mcstore.tools.inspect import Inspector
from mcstore.tools.warmup import OfflineRunner, Prefix, ServerRunner, split_text, warmup
from multi.cli.deploy import engine_env
from tests.harness import LOGS, ROOT, Engine, cached_tokens, kv_bytes_per_token, model_dir, prompt_ids
from tests.store_util import raw_client, store_kv
from tests.support import wait_for

pytestmark = pytest.mark.e2e

CHUNK = 64
BLOCK = 32


def stored(t) -> int:
    """The tokens of a prefix the engine stores (key version 4): its full blocks, in whole
    chunks and, past them, the part object of its tail."""
    return len(t) // BLOCK * BLOCK


CHUNK_BYTES = CHUNK * kv_bytes_per_token(model_dir("tiny"))  # 64 tokens of KV, every layer
TOKEN = "s3cret-token"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu tool system prompt document").split()


def paragraph(seed: int, words: int = 160) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def cli(*args: str, timeout: float = 180, input: str | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multi.cli", *args], capture_output=True, text=True, input=input,
                          timeout=timeout, cwd=str(ROOT), env={**__import__("os").environ, **CLIENT_ENV, **(env or {})})


@pytest.fixture(scope="module")
def env(baseline):
    # A generous client TTL: on a starved CPU a 2 s TTL let the master declare the store server
    # dead and drop its whole segment mid-module. Nothing here needs fast death detection.
    cluster = StoreCluster(LOGS, segment_size=16 << 20,
                           extra_flags=["--default_kv_lease_ttl=500", "--client_ttl=20"]).start()
    procs = []
    try:
        kv = store_kv(cluster.master_addr)
        model = str(model_dir("tiny"))
        engine = Engine("tools-engine", core=1, kv_config=kv, extra_args=["--no-enable-prefix-caching"])
        procs.append(engine)
        admin = f"http://127.0.0.1:{cluster.metrics_port}"
        http_port = free_port()
        server = Proc("tools-inspect", [
            sys.executable, "-m", "multi.cli", "inspect", "serve", "--master", cluster.master_addr,
            "--admin", admin, "--model", model, "--kv-config", json.dumps(kv), "--block-size", "32",
            "--dtype", engine_dtype(),
            "--port", str(http_port), "--token", TOKEN, "--engine", engine.url,
        ], LOGS / f"tools-inspect-{http_port}.log", env=engine_env(0),
            cwd=str(ROOT))
        procs.append(server)
        baseline.start()  # the baseline engine (if not up yet) boots meanwhile
        meta = derive_meta(model, kv, block_size=32, dtype=engine_dtype())  # while the engine boots
        baseline.tokens(prompt_ids(80, 0), 1)
        engine.wait_ready()
        server.wait_port(http_port, 240)
        renderer = Renderer(model)
        insp = Inspector(cluster.master_addr, admin, meta, renderer, engine.url)
        yield SimpleNamespace(cluster=cluster, kv=kv, model=model, engine=engine, admin=admin, meta=meta,
                              renderer=renderer, insp=insp, http=f"http://127.0.0.1:{http_port}",
                              # stored: token lists whose full chunks are in the store
                              stored=[], obj_bytes=None, messages=None)
        insp.close()
    finally:
        for p in reversed(procs):
            p.stop()
        cluster.stop()


def engine_keys(env) -> set[str]:
    mine = f"mct/{env.meta.fingerprint[:16]}/"
    return {k for k in env.insp.admin.all_keys() if k.startswith(mine) and not k.endswith("/meta")}


def expected_links(env) -> set[str]:
    ks = env.meta.key_space()
    return {link.rsplit("/", 1)[1] for toks in env.stored for link in ks.links(toks)}


def test_split_text_rules():
    assert split_text("a\nb\n\nc\n") == ["a\nb", "c"]
    assert split_text("a\nb\nc\n") == ["a", "b", "c"]
    assert split_text("\n\na\n\n\n b \n") == ["a", " b "]


def test_store_config_in_every_connector_shape(tmp_path):
    from kvcore.errors import ConfigError
    from mcstore.tools.engine import read_kv_config, store_extra

    extra = {"master": "127.0.0.1:1", "chunk_tokens": 64}
    plain = store_kv("127.0.0.1:1")
    assert store_extra(plain) == extra
    assert store_extra({"kv_connector": "TieredConnector",
                        "kv_connector_extra_config": {"store": extra, "p2p": {}}}) == extra
    assert store_extra({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p"}, plain]}}) == extra
    with pytest.raises(ConfigError, match="no store tier"):
        store_extra({"kv_connector": "TieredConnector", "kv_connector_extra_config": {"p2p": {}}})
    f = tmp_path / "kv.json"
    f.write_text(json.dumps(plain))
    assert read_kv_config(str(f)) == read_kv_config(json.dumps(plain)) == plain
    with pytest.raises(ConfigError):
        read_kv_config(str(tmp_path / "missing.json"))


def test_tool_fingerprint_equals_engine(env):
    """The key space derived from the engine's settings is the one the running engine saves under."""
    prompt = prompt_ids(3 * CHUNK + 20, 501)
    env.engine.complete(prompt, max_tokens=1)
    env.stored.append(prompt)
    wait_for(lambda: len(engine_keys(env)) >= 3, 20.0, what="the engine's saves")
    assert {k.split("/")[1] for k in engine_keys(env)} == {env.meta.fingerprint[:16]}
    lk = env.insp.lookup(prompt)
    assert lk.hit_tokens == 3 * CHUNK and lk.loadable_tokens == 3 * CHUNK
    assert [c.present for c in lk.chunks] == [True, True, True]
    # One object per chunk: its pages, plus whatever small trailer the tier's object format adds.
    env.obj_bytes = lk.chunks[0].bytes
    assert CHUNK_BYTES <= env.obj_bytes <= CHUNK_BYTES + 64
    assert all(c.tier == "memory" and c.bytes == env.obj_bytes for c in lk.chunks)
    # A different prompt, and the same prompt under a cache_salt, are misses.
    assert env.insp.lookup(prompt_ids(3 * CHUNK, 502)).hit_tokens == 0
    assert env.insp.lookup(prompt, cache_salt="other-tenant").hit_tokens == 0


def test_engine_publishes_its_key_space_and_warmup_needs_only_its_url(env, tmp_path):
    """The engine's connector published its key space at start (before any warmup), so
    `inspect summary` names its model and `mctier warmup --server URL FILE` needs nothing
    else (the master given here is the test's, not the default one)."""
    published = env.insp.read_meta(env.meta.fingerprint[:16])
    assert published is not None, "the engine did not publish its metadata at start"
    assert (published.fingerprint, published.chunk_tokens, published.model) == (
        env.meta.fingerprint, CHUNK, env.model)
    rows = {f.fingerprint: f for f in env.insp.summary().fingerprints}
    assert rows[env.meta.fingerprint[:16]].model == env.model
    paras = [paragraph(40), paragraph(41)]
    f = tmp_path / "prefixes.txt"
    f.write_text("\n\n".join(paras) + "\n")
    r = cli("warmup", str(f), "--server", env.engine.url, "--master", env.cluster.master_addr, "--json",
            "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["fingerprint"] == env.meta.fingerprint[:16] and rep["failed"] == 0
    toks = [env.renderer.text(p) for p in paras]
    assert [p["hit_tokens"] for p in rep["prefixes"]] == [stored(t) for t in toks]
    env.stored.extend(toks)
    # The admin API found from the master (the store server published it), no --admin.
    out = cli("inspect", "lookup", "--master", env.cluster.master_addr, "--fingerprint", env.meta.fingerprint[:16],
              "--tokens", "-", "--json", timeout=120, input=json.dumps(toks[0]))
    assert out.returncode == 0, out.stderr[-2000:]
    lk = json.loads(out.stdout)
    assert lk["hit_tokens"] == stored(toks[0]) and {c["tier"] for c in lk["chunks"]} == {"memory"}


def test_warmup_server_cli_stores_verifies_and_is_idempotent(env, baseline, tmp_path):
    paras = [paragraph(10 + i) for i in range(3)]
    f = tmp_path / "prefixes.txt"
    # The last paragraph is shorter than one chunk: it cannot be stored, so the run fails (exit 1).
    f.write_text("\n\n".join(paras) + "\n\ntiny\n")
    r = cli("warmup", str(f), "--server", env.engine.url, "--model", env.model, "--dtype", engine_dtype(),
            "--kv-config", json.dumps(env.kv),
            "--block-size", "32", "--json", "--no-progress")
    assert r.returncode == 1, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["failed"] == 1 and rep["prefixes"][-1]["status"] == "failed"
    assert "shorter than one 64-token chunk" in rep["prefixes"].pop()["error"]
    toks = [env.renderer.text(p) for p in paras]
    assert [p["tokens"] for p in rep["prefixes"]] == [len(t) for t in toks]
    for p, t in zip(rep["prefixes"], toks):
        n = len(t) // CHUNK
        assert n >= 2, "test paragraphs must span several chunks"
        assert (p["status"], p["chunks"], p["present_before"], p["stored"], p["hit_tokens"]) == (
            "ok", n, 0, n, stored(t))
    env.stored.extend(toks)
    assert rep["fingerprint"] == env.meta.fingerprint[:16]

    # The first real request that shares the prefix loads it from the store, with the right tokens.
    prompt = toks[0] + prompt_ids(20, 7)
    loaded0 = env.engine.metric("vllm:mctier_store_loaded_tokens_total")
    resp = env.engine.complete(prompt, 8)
    env.stored.append(prompt)
    assert env.engine.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 >= (len(toks[0]) // CHUNK) * CHUNK
    # The no-connector reference computes the same split (see tests/harness.reference_tokens).
    assert resp["choices"][0]["token_ids"] == baseline.tokens(prompt, 8, cached_prefix=cached_tokens(resp))

    # Second run: nothing to compute, nothing new stored, no request reaches the engine.
    prompts0 = env.engine.metric("vllm:prompt_tokens_total")
    prefixes = [Prefix(f"p{i}", t) for i, t in enumerate(toks)]
    rep2 = warmup(prefixes, env.meta, env.cluster.master_addr, ServerRunner(env.engine.url), progress=False)
    assert rep2.failed == 0
    assert [(p.status, p.stored, p.present_before) for p in rep2.prefixes] == [
        ("present", 0, len(t) // CHUNK) for t in toks]
    assert env.engine.metric("vllm:prompt_tokens_total") == prompts0


def test_warmup_wrong_fingerprint_fails(env):
    """A wrong engine setting gives another fingerprint: the saves do not verify."""
    prefix = Prefix("mismatch", prompt_ids(2 * CHUNK, 77))
    wrong = derive_meta(env.model, {**env.kv, "kv_connector_extra_config": {
        **env.kv["kv_connector_extra_config"], "model_id": "some-other-model"}}, block_size=32)
    rep = warmup([prefix], wrong, env.cluster.master_addr, ServerRunner(env.engine.url), verify_timeout=3,
                 progress=False)
    assert rep.failed == 1 and "fingerprint" in rep.prefixes[0].error
    env.stored.append(prefix.tokens)  # the engine saved it under its own fingerprint


def test_warmup_offline_jsonl(env, baseline, tmp_path):
    messages = [{"role": "system", "content": paragraph(30)}, {"role": "user", "content": "hello"}]
    f = tmp_path / "prefixes.jsonl"
    f.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"prompt": paragraph(31)}) + "\n")
    from mcstore.tools.warmup import read_prefixes

    prefixes = read_prefixes(str(f), env.renderer)
    runner = OfflineRunner(env.model, env.kv, block_size=32, dtype=engine_dtype(), kv_cache_dtype="auto", tp=1,
                           max_model_len=None, log=str(LOGS / "tools-offline-warmup.log"),
                           env=engine_env(0))
    rep = warmup(prefixes, env.meta, env.cluster.master_addr, runner, progress=False)
    assert rep.mode == "offline" and rep.failed == 0, msgspec.to_builtins(rep)
    assert all(p.status == "ok" and p.stored == p.chunks >= 2 for p in rep.prefixes)
    assert runner.proc is None  # the offline engine is gone
    env.stored.extend(p.tokens for p in prefixes)
    chat = env.renderer.messages(messages, add_generation_prompt=False)
    assert chat == prefixes[0].tokens
    env.messages = messages
    # The served engine (another process, same settings) loads what the offline engine computed.
    prompt = chat + prompt_ids(10, 8)
    loaded0 = env.engine.metric("vllm:mctier_store_loaded_tokens_total")
    resp = env.engine.complete(prompt, 8)
    env.stored.append(prompt)
    assert env.engine.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 >= (len(chat) // CHUNK) * CHUNK
    assert resp["choices"][0]["token_ids"] == baseline.tokens(prompt, 8, cached_prefix=cached_tokens(resp))


def test_tools_from_the_model_name_alone(env, baseline, tmp_path):
    """The engine published its key space when it started, so `warmup --model M` (an offline
    engine started with the published settings), `inspect lookup` (text, with the tokenizer of
    the model the engine loaded), `keys` and `summary` need only the master and the model
    name, or the engine's URL: no --kv-config, no engine flags, no fingerprint. The store also
    holds the key space of another model_id over the same model path (the wrong-fingerprint
    test's): the model name picks the one whose identity it is."""
    master, fp16 = env.cluster.master_addr, env.meta.fingerprint[:16]
    para = paragraph(50)
    f = tmp_path / "prefixes.txt"
    f.write_text(para + "\n")
    r = cli("warmup", str(f), "--master", master, "--model", env.model, "--json", "--no-progress",
            "--engine-log", str(LOGS / "tools-offline-by-name.log"), env=engine_env(0), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    toks = env.renderer.text(para)
    n = len(toks) // CHUNK
    assert n >= 2, "the test paragraph must span several chunks"
    assert (rep["mode"], rep["fingerprint"], rep["failed"]) == ("offline", fp16, 0)
    assert [(p["status"], p["stored"], p["hit_tokens"]) for p in rep["prefixes"]] == [("ok", n, stored(toks))]
    env.stored.append(toks)

    for named in (["--model", env.model], ["--engine", env.engine.url]):
        out = cli("inspect", "lookup", "--master", master, *named, "--prompt", para, "--json")
        assert out.returncode == 0, (named, out.stderr[-2000:])
        lk = json.loads(out.stdout)
        assert (lk["fingerprint"], lk["prompt_tokens"], lk["hit_tokens"]) == (fp16, len(toks), stored(toks)), named

    out = cli("inspect", "keys", "--master", master, "--model", env.model, "--limit", "100000", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    listed = json.loads(out.stdout)
    keys = {k["key"] for k in listed["keys"]}
    assert listed["prefix"] == f"mct/{fp16}/" and not listed["truncated"]
    ks = env.meta.key_space()
    assert f"mct/{fp16}/meta" in keys and set(ks.all_rank_keys(ks.links(toks))) <= keys

    bystander = "4" * 16  # objects of another key space: in the store's summary, not in the model's
    store = raw_client(master)
    try:
        assert store.put(f"mct/{bystander}/{0:064x}/tp0", b"b" * 512) == 0
    finally:
        store.close()
    try:
        out = cli("inspect", "summary", "--master", master, "--model", env.model, "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        rows = {r["fingerprint"]: r for r in json.loads(out.stdout)["fingerprints"]}
        assert fp16 in rows and bystander not in rows
        assert rows[fp16]["model"] == env.model and rows[fp16]["chunks"] >= n
        assert bystander in {r.fingerprint for r in env.insp.summary().fingerprints}
    finally:
        env.insp.remove(bystander)

    # The served engine loads what the offline engine stored, with the right tokens.
    prompt = toks + prompt_ids(12, 9)
    loaded0 = env.engine.metric("vllm:mctier_store_loaded_tokens_total")
    resp = env.engine.complete(prompt, 8)
    env.stored.append(prompt)
    assert env.engine.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 >= n * CHUNK
    assert resp["choices"][0]["token_ids"] == baseline.tokens(prompt, 8, cached_prefix=cached_tokens(resp))


# -- inspection: three faces over one implementation -----------------------------------------------


def face_call(env, face: str, op: str, **kw) -> dict:
    if face == "python":
        insp = env.insp
        if op == "lookup":
            out = insp.lookup(kw["tokens"], fingerprint=kw.get("fingerprint"))
        elif op == "remove":
            out = insp.remove(kw["fingerprint"])
        else:
            out = getattr(insp, op)(**kw)
        return msgspec.to_builtins(out)
    if face == "http":
        if op == "lookup":
            r = requests.post(env.http + "/lookup", json=kw, timeout=30)
        elif op == "remove":
            r = requests.delete(f"{env.http}/fingerprints/{kw['fingerprint']}", timeout=30,
                                headers={"Authorization": f"Bearer {TOKEN}"})
        else:
            r = requests.get(f"{env.http}/{op}", params=kw, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()
    common = ["--master", env.cluster.master_addr, "--admin", env.admin, "--json"]
    extra = []
    if op == "lookup":
        path = LOGS / f"tools-tokens-{random.randrange(1 << 30)}.json"
        path.write_text(json.dumps(kw["tokens"]))
        extra = ["--tokens", str(path), "--fingerprint", kw["fingerprint"]]
    elif op == "keys":
        extra = ["--prefix", kw["prefix"]]
    elif op == "remove":
        extra = ["--fingerprint", kw["fingerprint"]]
    elif op == "stats":
        extra = ["--engine", env.engine.url]
    r = cli("inspect", op, *common, *extra, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("face", ["python", "cli", "http"])
def test_inspection_faces(env, face):
    fp = {"python": "1" * 64, "cli": "2" * 64, "http": "3" * 64}[face]
    store = raw_client(env.cluster.master_addr)
    try:
        fake = [f"mct/{fp[:16]}/{i:064x}/tp0" for i in range(3)]
        for k in fake:
            assert store.put(k, b"z" * 4096) == 0
        assert store.put(f"foreign/{face}", b"q" * 100) == 0
    finally:
        store.close()
    want = expected_links(env)
    assert want, "earlier tests stored prompts"

    summ = face_call(env, face, "summary")
    rows = {r["fingerprint"]: r for r in summ["fingerprints"]}
    mine = rows[env.meta.fingerprint[:16]]
    # Besides whole chunks, the saved tails (part objects) and a directory entry per saved object.
    parts, dirs = mine["parts"], mine["directories"]
    assert mine["chunks"] == mine["objects"] - parts["objects"] - dirs["objects"] == len(want)
    assert mine["bytes"] - parts["bytes"] - dirs["bytes"] == len(want) * env.obj_bytes
    assert mine["bytes"] == mine["memory"]["bytes"]
    assert parts["objects"] >= 1 and dirs["objects"] >= len(want) // 2
    assert mine["disk"]["objects"] == 0
    assert mine["chunk_tokens"] == CHUNK and mine["model"] == env.model  # from the published metadata object
    assert (rows[fp[:16]]["objects"], rows[fp[:16]]["bytes"]) == (3, 3 * 4096)
    assert summ["other_keys"] >= 1 and summ["keys"] == len(env.insp.admin.all_keys())
    assert summ["segments"] and summ["segments"][0]["capacity_bytes"] == 16 << 20

    # A stored prompt plus an unseen tail: present chunks first, then misses.
    toks = env.stored[1] + prompt_ids(2 * CHUNK, 900)
    lk = face_call(env, face, "lookup", tokens=toks, fingerprint=env.meta.fingerprint[:16])
    n = len(env.stored[1]) // CHUNK
    assert lk["prompt_tokens"] == len(toks) and lk["hit_tokens"] == stored(env.stored[1])
    assert [c["present"] for c in lk["chunks"]] == [True] * n + [False] * (len(toks) // CHUNK - n)
    assert [c["tier"] for c in lk["chunks"][:n]] == ["memory"] * n
    assert [(c["start"], c["end"]) for c in lk["chunks"][:2]] == [(0, CHUNK), (CHUNK, 2 * CHUNK)]

    keys = face_call(env, face, "keys", prefix=f"mct/{fp[:16]}/")
    assert sorted(k["key"] for k in keys["keys"]) == fake and keys["total"] == 3
    assert all(k["bytes"] == 4096 and k["tiers"] == ["memory"] for k in keys["keys"])

    st = face_call(env, face, "stats")
    assert st["master"]["master_key_count"] == len(env.insp.admin.all_keys())
    assert st["engine"]["vllm:mctier_store_saved_tokens_total"] >= len(env.stored[0]) // CHUNK * CHUNK

    rm = face_call(env, face, "remove", fingerprint=fp[:16])
    assert (rm["matched"], rm["removed"], rm["busy"]) == (3, 3, 0)
    assert fp[:16] not in {r["fingerprint"] for r in face_call(env, face, "summary")["fingerprints"]}
    # The engine's objects were not touched.
    assert expected_links(env) <= {k.split("/")[2] for k in engine_keys(env)}


def test_http_refuses_and_rejects(env):
    url = env.http
    assert requests.get(url + "/health", timeout=10).json()["master"] is True
    assert "/lookup" in requests.get(url + "/openapi.json", timeout=10).json()["paths"]
    target = f"{url}/fingerprints/{env.meta.fingerprint[:16]}"
    assert requests.delete(target, timeout=10).status_code == 401
    assert requests.delete(target, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert requests.delete(target, headers={"Authorization": TOKEN}, timeout=10).status_code == 401
    assert env.insp.lookup(env.stored[0]).hit_tokens > 0, "a refused delete removed nothing"
    bad = [
        ("post", "/lookup", {"json": {}}),
        ("post", "/lookup", {"json": {"tokens": [1, -2]}}),
        ("post", "/lookup", {"json": {"tokens": "abc"}}),
        ("post", "/lookup", {"json": {"tokens": [1], "prompt": "x"}}),
        ("post", "/lookup", {"json": {"tokens": [1], "fingerprint": "nothex"}}),
        ("post", "/lookup", {"json": {"tokens": [1], "unknown": 1}}),
        ("post", "/lookup", {"json": {"messages": "not a list"}}),
        ("post", "/lookup", {"json": {"messages": [{"role": "user"}, 5]}}),
        ("post", "/lookup", {"data": b"{broken", "headers": {"content-type": "application/json"}}),
        ("post", "/lookup", {"data": b"[1,2]", "headers": {"content-type": "application/json"}}),
        ("get", "/keys?limit=-5", {}),
        ("get", "/keys?limit=many", {}),
        ("delete", "/fingerprints/xyz", {"headers": {"Authorization": f"Bearer {TOKEN}"}}),
        ("delete", "/fingerprints/" + "a" * 16 + "?timeout=-1", {"headers": {"Authorization": f"Bearer {TOKEN}"}}),
    ]
    for method, path, kw in bad:
        r = getattr(requests, method)(url + path, timeout=30, **kw)
        assert 400 <= r.status_code < 500, (method, path, kw, r.status_code, r.text)
    r = requests.post(url + "/lookup", json={"tokens": [1, 2], "fingerprint": "f" * 16}, timeout=30)
    assert r.status_code == 404  # no metadata for that fingerprint
    # Text and chat prompts through the server's tokenizer.
    text = paragraph(10)
    r = requests.post(url + "/lookup", json={"prompt": text}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt_tokens"] == len(env.renderer.text(text))
    assert r.json()["hit_tokens"] == stored(env.renderer.text(text))
    # Chat messages rendered with the model's template (as warmed by the offline test): HTTP and CLI.
    chat = env.renderer.messages(env.messages, add_generation_prompt=False)
    r = requests.post(url + "/lookup", json={"messages": env.messages, "add_generation_prompt": False}, timeout=30)
    assert r.status_code == 200 and r.json()["hit_tokens"] == stored(chat) > 0
    f = LOGS / "tools-messages.json"
    f.write_text(json.dumps(env.messages))
    out = cli("inspect", "lookup", "--master", env.cluster.master_addr, "--admin", env.admin, "--model", env.model,
              "--fingerprint", env.meta.fingerprint[:16], "--messages", str(f), "--no-generation-prompt", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["hit_tokens"] == stored(chat)


def test_warmup_replicas(env):
    """--replicas 2 re-writes the chunks with two copies; a second segment joins for it."""
    from mooncake.store import MooncakeDistributedStore

    second = MooncakeDistributedStore()
    assert second.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", env.cluster.master_addr) == 0
    try:
        p = Prefix("replicated", prompt_ids(2 * CHUNK, 620))
        rep = warmup([p], env.meta, env.cluster.master_addr, ServerRunner(env.engine.url), replicas=2,
                     lease_wait_s=5, progress=False)
        assert rep.failed == 0 and rep.prefixes[0].pinned == 2, msgspec.to_builtins(rep)
        for link in env.meta.key_space().links(p.tokens):
            listing = env.insp.keys(prefix=link + "/")
            assert [(k.replicas, k.tiers) for k in listing.keys] == [(2, ["memory"])]
    finally:
        second.close()  # its replicas go with it; one copy of each chunk stays


def test_warmup_pins_survive_eviction_pressure(env, baseline):
    """Last in the module: fills the 16 MiB pool far beyond capacity."""
    pinned = Prefix("pinned", prompt_ids(4 * CHUNK, 610))
    soft = Prefix("soft", prompt_ids(2 * CHUNK, 611))
    control = Prefix("control", prompt_ids(4 * CHUNK, 612))
    runner = ServerRunner(env.engine.url)
    soft0 = env.insp.stats().master["master_soft_pin_key_count"]
    rep = warmup([pinned], env.meta, env.cluster.master_addr, runner, pin="hard", lease_wait_s=5, progress=False)
    assert rep.failed == 0 and rep.prefixes[0].pinned == 4, msgspec.to_builtins(rep)
    rep = warmup([soft], env.meta, env.cluster.master_addr, runner, pin="soft", pin_ttl_ms=600000,
                 lease_wait_s=5, progress=False)
    assert rep.failed == 0 and rep.prefixes[0].pinned == 2
    assert env.insp.stats().master["master_soft_pin_key_count"] - soft0 == 2
    rep = warmup([control], env.meta, env.cluster.master_addr, runner, progress=False)
    assert rep.failed == 0 and rep.prefixes[0].pinned == 0

    # Pressure: three times the 16 MiB pool in other objects (puts retry while eviction catches up).
    import numpy as np

    t0 = time.monotonic()
    store = raw_client(env.cluster.master_addr)
    buf = np.full(1 << 20, 7, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    written, rcs = 0, {}
    try:
        for i in range(48):
            deadline = time.monotonic() + 1.0
            while True:
                rc = store.put_from(f"filler/{i}", buf.ctypes.data, buf.nbytes)
                if rc != -200 or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            written += rc == 0
            rcs[rc] = rcs.get(rc, 0) + 1
    finally:
        store.unregister_buffer(buf.ctypes.data)
        store.close()
    with open(LOGS / "tools-store-trace.log", "a") as f:
        f.write(f"eviction fill: {written} MiB written in {time.monotonic() - t0:.1f}s, put results {rcs}\n")
    assert written >= 32, rcs
    assert env.insp.lookup(pinned.tokens).hit_tokens == 4 * CHUNK  # hard-pinned: all there
    assert env.insp.lookup(control.tokens).hit_tokens < 4 * CHUNK  # unpinned: pressure was real
    # The pinned prefix still serves a real request, with the right tokens.
    prompt = pinned.tokens + prompt_ids(16, 613)
    loaded0 = env.engine.metric("vllm:mctier_store_loaded_tokens_total")
    resp = env.engine.complete(prompt, 8)
    assert env.engine.metric("vllm:mctier_store_loaded_tokens_total") - loaded0 >= 4 * CHUNK
    assert resp["choices"][0]["token_ids"] == baseline.tokens(prompt, 8, cached_prefix=cached_tokens(resp))



@pytest.fixture(autouse=True)
def _trace_store(request):
    """Store contents after each test, for post-mortems (LOGS/tools-store-trace.log)."""
    yield
    if "env" not in request.fixturenames:
        return
    env = request.getfixturevalue("env")
    try:
        line = (f"{len(env.insp.admin.all_keys())} keys, {len(engine_keys(env))} engine objects "
                f"(expected at least {len(expected_links(env))} before the eviction test), {env.insp.admin.segments()}")
    except Exception as e:  # noqa: BLE001 - a trace must not fail a test
        line = f"trace failed: {e}"
    with open(LOGS / "tools-store-trace.log", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {request.node.name}: {line}\n")
