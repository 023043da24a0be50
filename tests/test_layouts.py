"""Parallel layouts in the store tier, without a vLLM engine: what each pipeline stage and
TP rank saves and looks up (keys; a real Mooncake store), and that an engine of another
TP or PP layout never reads them. Hybrid KV caches: ``tests/test_layouts_hybrid.py``.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from mcstore.config import load_config
from mcstore.keys import EngineMeta, KeySpace, fingerprint, vllm_sha256_block_hashes
from tests.harness import model_dir
from tests.test_store_unit import FIELDS, TOKENS

CHUNK, BS, BLOCKS = 64, 32, 64


def _request(rid: str, tokens: list[int], ks: KeySpace | None = None):
    """A scheduler's view of a request; with ``ks`` of a vLLM-hashed key space, the block hashes
    vLLM would have given it (``mcstore.keys.vllm_sha256_block_hashes``, held to vLLM's own
    hasher in ``tests/test_store_unit.py``)."""
    hashes = vllm_sha256_block_hashes(tokens, ks.block_hashes) if ks is not None and ks.block_hashes else []
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_tokens=len(tokens), block_hashes=hashes, cache_salt=None, lora_request=None,
                           mm_features=None)


class _Store:
    """Stands in for the scheduler's store client: ``batch_is_exist`` over a set of keys."""

    available = True

    def __init__(self, present=()):
        self.present = set(present)
        self.asked: list[list[str]] = []

    def exists(self, keys):
        self.asked.append(list(keys))
        return [1 if k in self.present else -704 for k in keys]

    def close(self):
        pass


def _scheduler(ks: KeySpace, client):
    from mcstore.scheduler import StoreScheduler

    # Blocking lookups: these tests are about which keys a lookup asks and what the answers mean,
    # the same for the non-blocking lookup (tests/test_store_unit.py covers when it answers).
    return StoreScheduler(load_config({"master": "h:1", "chunk_tokens": CHUNK, "lookup_blocking": True}, env={}), ks,
                          BS, load=True, save=False, client=client)


# -- keys of every TP and PP layout ---------------------------------------------------------------


@pytest.mark.unit
def test_single_stage_keys_are_unchanged():
    """pp_size 1, mctier's own token chain: byte for byte the keys of key version 4
    (``mcstore.keys.KEY_VERSION``, which a change of key bytes must bump; version 1 digested
    tokens as int64, version 3 took the default key space's links from vLLM's block hashes,
    version 4 made every link ``H(fingerprint, the chain's hash of the chunk's last block)``)."""
    import hashlib

    from mcstore.keys import chain, seed

    ks = KeySpace(fingerprint(FIELDS), CHUNK, 2)
    assert ks.pp_size == 1 and ks.parts == 2
    assert ks.all_rank_keys(ks.links(TOKENS)[:2]) == [
        "mct/b3f154eabec4211e/722a8b96530c20634d0499665478dcfd86c5083e2474b8e03d16fc66b39678e9/tp0",
        "mct/b3f154eabec4211e/722a8b96530c20634d0499665478dcfd86c5083e2474b8e03d16fc66b39678e9/tp1",
        "mct/b3f154eabec4211e/099deaa441d0227bc9cf62ba88b631bf5befdbd3638f19479d4c3ad984dc5496/tp0",
        "mct/b3f154eabec4211e/099deaa441d0227bc9cf62ba88b631bf5befdbd3638f19479d4c3ad984dc5496/tp1",
    ]
    blocks = chain(seed(ks.fp), TOKENS, CHUNK)  # no block_tokens: one block hash per chunk
    assert ks.links(TOKENS) == [f"{ks.prefix}/{hashlib.sha256(ks.fp.encode() + h).hexdigest()}" for h in blocks]
    assert ks.stage(0).key("L", 1) == "L/tp1"


@pytest.mark.unit
def test_stages_and_ranks_never_share_an_object():
    ks = KeySpace(fingerprint({**FIELDS, "tp_size": 2, "pp_size": 2}), CHUNK, 2, pp_size=2)
    links = ks.links(TOKENS)
    # What each worker (stage s, TP rank r) saves and loads: its own key space, its own rank.
    own = {(s, r): {ks.stage(s).key(link, r) for link in links} for s in (0, 1) for r in (0, 1)}
    for a in own:
        for b in own:
            assert a == b or not own[a] & own[b], (a, b)
    everything = ks.all_rank_keys(links)
    assert len(everything) == 4 * len(links) == len(set(everything)) and ks.parts == 4
    assert set(everything) == set().union(*own.values())
    # Chunk-major, as the scheduler slices it: chunk i's parts are [4i, 4i+4).
    assert everything[:4] == [f"{links[0]}/pp0tp0", f"{links[0]}/pp0tp1", f"{links[0]}/pp1tp0", f"{links[0]}/pp1tp1"]
    with pytest.raises(ValueError, match="stage 2 outside pp_size 2"):
        ks.stage(2)


@pytest.mark.unit
def test_lookup_hit_needs_every_rank_of_every_stage():
    ks = KeySpace(fingerprint({**FIELDS, "tp_size": 2, "pp_size": 2}), CHUNK, 2, pp_size=2)
    links = ks.links(TOKENS)  # 5 chunks; the prompt has 333 tokens
    parts = [ks.stage(s).key(link, r) for link in links for s in (0, 1) for r in (0, 1)]
    # Chunks 0-2 stored by every worker except stage 1, rank 1 for chunk 2: two chunks hit.
    store = _Store(set(parts[:12]) - {ks.stage(1).key(links[2], 1)})
    assert _scheduler(ks, store).lookup(_request("a", TOKENS)) == 2 * CHUNK
    assert len(store.asked) == 1 and len(store.asked[0]) == 20  # one batch_is_exist, every part
    # Stage 0 complete everywhere, stage 1 nowhere: no hit at all.
    stage0 = {ks.stage(0).key(link, r) for link in links for r in (0, 1)}
    assert _scheduler(ks, _Store(stage0)).lookup(_request("b", TOKENS)) == 0
    # Everything: every chunk, capped so the engine computes the last token.
    assert _scheduler(ks, _Store(parts)).lookup(_request("c", TOKENS)) == 5 * CHUNK
    # A single-stage reader over the very same fingerprint still finds nothing: other key names.
    single = KeySpace(ks.fp, CHUNK, 2)
    assert _scheduler(single, _Store(parts)).lookup(_request("d", TOKENS)) == 0


@pytest.mark.unit
def test_published_meta_carries_the_stages():
    import msgspec

    from mcstore.keys import engine_meta
    from mcstore.tools.inspect import parse_key

    ks = KeySpace(fingerprint(FIELDS), CHUNK, 2, pp_size=3)
    meta = msgspec.json.decode(msgspec.json.encode(engine_meta(ks, "mct", "m", {})), type=EngineMeta)
    assert meta.pp_size == 3 and meta.key_space().parts == 6
    assert meta.key_space().all_rank_keys(["x"]) == ks.all_rank_keys(["x"])
    # Metadata published before stages existed reads as one stage.
    old = b'{"fingerprint":"%s","chunk_tokens":64,"tp_size":1}' % ks.fp.encode()
    assert msgspec.json.decode(old, type=EngineMeta).key_space().all_rank_keys(["x"]) == ["x/tp0"]
    link = ks.links(TOKENS)[0]
    for key in (f"{link}/tp0", f"{link}/pp2tp1"):
        assert parse_key(key) == ("mct", ks.fp[:16], link.split("/")[-1])
    assert parse_key(f"{link}/pp2") is None


@pytest.mark.unit
def test_pipeline_parallel_warns_once_per_process(monkeypatch, caplog):
    from kvcore import vllm_glue

    monkeypatch.setattr(vllm_glue, "_PP_WARNED", False)
    log = logging.getLogger("test.layouts")

    def cfg(pp):
        return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp))

    with caplog.at_level(logging.WARNING, logger="test.layouts"):
        vllm_glue.warn_pipeline_parallel(cfg(1), "mcstore StoreConnector", log)
        assert not caplog.records
        vllm_glue.warn_pipeline_parallel(cfg(2), "multi TieredConnector", log)
        vllm_glue.warn_pipeline_parallel(cfg(2), "mcstore StoreConnector", log)  # the composite's tier
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "multi TieredConnector: pipeline_parallel_size=2 is untested end to end" in msg
    assert "CPU backend fails a PP engine's first request" in msg


# -- the layouts vLLM computes for real engine settings (no engine) ---------------------------------


def _store_kv() -> dict:
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
            "kv_connector_extra_config": {"master": "127.0.0.1:1", "chunk_tokens": CHUNK}}


@pytest.fixture(scope="module")
def metas():
    """The key space of the tiny model at TP1, TP2, PP2 and TP2xPP2, as the connector derives it."""
    from mcstore.tools.engine import derive_meta

    model = str(model_dir("tiny"))
    return {(tp, pp): derive_meta(model, _store_kv(), block_size=BS, dtype="bfloat16", tensor_parallel_size=tp,
                                  pipeline_parallel_size=pp)
            for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))}


@pytest.mark.unit
def test_other_layouts_never_read_each_others_objects(metas):
    assert len({m.fingerprint for m in metas.values()}) == 4
    for (tp, pp), m in metas.items():
        assert (m.tp_size, m.pp_size) == (tp, pp) and (m.fields["tp_size"], m.fields["pp_size"]) == (tp, pp)
    # One stage: the fields as before stages existed (no split, the group's layer count).
    one = metas[1, 1].fields
    assert "pp_layers" not in one and one["groups"][0]["num_layers"] == 2 and "sliding_window" not in one["groups"][0]
    # Stages: the split instead of a per-process layer count (a worker's config lists its own
    # stage's layers, the scheduler's stage 0's), so every process of the engine agrees.
    for pp2 in (metas[1, 2], metas[2, 2]):
        assert pp2.fields["pp_layers"] == [[0, 1], [1, 2]] and pp2.fields["groups"][0]["num_layers"] is None
    keys = {layout: set(m.key_space().all_rank_keys(m.key_space().links(TOKENS))) for layout, m in metas.items()}
    for a in keys:
        for b in keys:
            assert a == b or not keys[a] & keys[b], (a, b)
    # What a reader of each layout asks for is a miss on what every other layout wrote.
    for reader, m in metas.items():
        written = set().union(*(k for layout, k in keys.items() if layout != reader))
        assert _scheduler(m.key_space(), _Store(written)).lookup(_request(f"r{reader}", TOKENS, m.key_space())) == 0
    # ... and its own layout's objects are what it finds (the lookup is not simply blind).
    for reader, m in metas.items():
        assert m.key_space().block_hashes is not None  # vLLM's sha256 hashes: the default key space
        hit = _scheduler(m.key_space(), _Store(keys[reader])).lookup(_request(f"s{reader}", TOKENS, m.key_space()))
        assert hit == len(TOKENS) // CHUNK * CHUNK


# -- stages on a real store ---------------------------------------------------------------------------


@pytest.mark.integration
def test_each_stage_saves_and_loads_only_its_own_layers(store_cluster, monkeypatch):
    """Two stage workers (a layer each, different bytes) save the same chunks; the scheduler
    hits only the chunks both stages stored, and each stage loads back its own bytes."""
    import torch

    from mcstore.client import StoreClient
    from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata
    from mcstore.server import CLIENT_ENV
    from mcstore.worker import StoreWorker
    from tests.store_util import all_keys
    from tests.test_store_integration import _finish_load, _until

    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_config({"master": store_cluster.master_addr, "chunk_tokens": CHUNK}, env={})
    ks = KeySpace(fingerprint({"t": "layouts", "run": time.monotonic_ns()}), CHUNK, 1, pp_size=2)
    tokens = TOKENS[:3 * CHUNK + 1]
    links = ks.links(tokens)
    src = [[1, 2], [3, 4], [5, 6]]
    workers, bufs = [], []
    sched = None
    try:
        for stage in (0, 1):
            buf = torch.empty(BLOCKS, 2, BS, 128, dtype=torch.bfloat16).normal_()
            w = StoreWorker(cfg, ks.stage(stage), BS, BLOCKS, 0, load=True, save=True)
            w.register_kv_caches({f"model.layers.{stage}.self_attn.attn": buf})
            workers.append(w)
            bufs.append(buf)
        assert not torch.equal(bufs[0][1], bufs[1][1])

        def save(stage, chunks, rid):
            workers[stage].wait_for_save(StoreMetadata(saves=[SaveJob(rid, [ChunkIO(links[c], c, src[c])
                                                                            for c in chunks])]))
            _until(lambda: (workers[stage].get_finished({rid})[0] or set()) == {rid})

        save(0, [0, 1, 2], "s0")
        save(1, [0, 1], "s1")
        sched = _scheduler(ks, StoreClient(cfg, "scheduler", segment=False))
        assert sched.lookup(_request("a", tokens)) == 2 * CHUNK  # stage 1 lacks chunk 2
        save(1, [2], "s1b")
        assert sched.lookup(_request("b", tokens)) == 3 * CHUNK
        prefix = ks.prefix + "/"
        assert {k for k in all_keys(store_cluster) if k.startswith(prefix)} == {
            f"{link}/pp{s}tp0" for link in links for s in (0, 1)}
        # A single-stage reader over the same fingerprint: nothing (other key names).
        single = _scheduler(KeySpace(ks.fp, CHUNK, 1), sched.client)
        assert single.lookup(_request("c", tokens)) == 0
        # Each stage loads the three chunks into other blocks: its own bytes, not the other stage's.
        dst = [[20, 21], [22, 23], [24, 25]]
        for stage in (0, 1):
            workers[stage].start_load_kv(StoreMetadata(loads=[LoadJob(
                f"l{stage}", [ChunkIO(links[c], c, dst[c]) for c in range(3)], timeout_s=10)]))
            assert _finish_load(workers[stage], f"l{stage}") == set()
            mine, other = bufs[stage], bufs[1 - stage]
            for s, d in zip(sum(src, []), sum(dst, [])):
                assert torch.equal(mine[d], mine[s]) and not torch.equal(mine[d], other[s]), (stage, s, d)
    finally:
        if sched is not None and sched.client is not None:
            sched.client.close()
        for w in workers:
            w.close()


# -- the P2P tier: stage s pulls from stage s ----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("prefill_stages,decode_stages", [(2, 1), (1, 2), (3, 2)])
def test_p2p_handoff_needs_the_same_stages_on_both_sides(prefill_stages, decode_stages):
    """Each decode stage pulls its own layers from the prefill worker of the same stage (the
    bootstrap's ``worker_addr[tp][pp]``); a prefill split into other stages fails the pull as
    ``protocol`` (the request is recomputed) instead of reading another stage's layers."""
    import threading

    from p2p.metrics import P2PStats
    from p2p.protocol import EngineEntry
    from p2p.puller import Puller, PullJob

    puller = Puller(None, None, P2PStats(), threading.Lock(), pp_rank=decode_stages - 1, pp_size=decode_stages)
    try:
        stages = {s: f"tcp://127.0.0.1:{1 + s}" for s in range(prefill_stages)}
        puller._entries["http://boot", "eng"] = EngineEntry("eng", {0: stages})
        res = puller.pull(PullJob("r", "t", "http://boot", "eng", 0, [1, 2], time.monotonic() + 5))
        assert not res.ok and res.cause == "protocol"
        assert res.detail == f"prefill has {prefill_stages} pipeline stages, decode has {decode_stages}"
    finally:
        puller.close()
