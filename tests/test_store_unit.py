"""Store tier units: keys (determinism across processes, isolation, fingerprint
sensitivity), configuration errors, and load planning."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvcore.errors import ConfigError
from mcstore.config import load_config
from mcstore.keys import KeySpace, fingerprint

pytestmark = pytest.mark.unit

FIELDS = {"model": "/m/tiny", "revision": None, "dtype": "torch.bfloat16", "cache_dtype": "auto",
          "platform": "cpu", "kv_cache_layout": "LBHNC", "tp_size": 1, "pp_size": 1,
          "groups": [{"spec": "FullAttentionSpec", "block_size": 32, "num_kv_heads": 2, "head_size": 64,
                      "head_size_v": 64, "dtype": "torch.bfloat16", "page_size_bytes": 16384,
                      "num_layers": 2}],
          "chunk_tokens": 64}
TOKENS = list(range(7, 7 + 64 * 5 + 13))


def _ks(fields=FIELDS, tp=1) -> KeySpace:
    return KeySpace(fingerprint(fields), 64, tp)


def test_links_cover_full_chunks_only_and_chain():
    ks = _ks()
    links = ks.links(TOKENS)
    assert len(links) == 5 and len(set(links)) == 5
    # A shared prefix shares exactly the chunks before the first difference.
    other = TOKENS[:200] + [1] + TOKENS[201:]
    assert ks.links(other)[:3] == links[:3]
    assert not set(ks.links(other)[3:]) & set(links)


def test_chain_digests_each_chunk_as_its_messagepack_array_of_shortest_ints():
    """The key bytes, spelt out by hand from the MessagePack spec (not by msgspec): the array
    header (0x90 | n up to 15 items, else 0xdc + 2 bytes big-endian), then 0x00-0x7f as one
    byte, 128-255 as 0xcc + 1 byte, up to 65535 as 0xcd + 2 bytes big-endian, up to 2**32-1
    as 0xce + 4 bytes. A change here must bump KEY_VERSION."""
    import hashlib

    from mcstore.keys import chain

    tokens = [5, 200, 40_000, 151_000, 9, 1, 127, 128]

    def enc(ts):
        out = bytes([0x90 | len(ts)]) if len(ts) < 16 else b"\xdc" + len(ts).to_bytes(2, "big")
        for t in ts:
            out += (bytes([t]) if t < 128 else b"\xcc" + t.to_bytes(1, "big") if t < 256
                    else b"\xcd" + t.to_bytes(2, "big") if t < 65536 else b"\xce" + t.to_bytes(4, "big"))
        return out

    first = hashlib.sha256(b"seed" + enc(tokens[:4])).digest()
    second = hashlib.sha256(first + enc(tokens[4:])).digest()
    assert chain(b"seed", tokens, 4) == [first, second]
    assert chain(b"seed", tokens + [3, 4, 5], 4) == [first, second]  # a partial chunk has no link
    # The default chunk, 256 ids up to a 200K vocabulary: every int width, the 16-bit array header.
    big = [(i * 7919) % 200_000 for i in range(253)] + [0, 127, 200]
    assert chain(b"seed", big, 256) == [hashlib.sha256(b"seed" + enc(big)).digest()]


def test_chain_takes_numpy_ids_and_tuples_as_the_same_ints():
    import numpy as np

    from mcstore.keys import chain

    assert chain(b"s", np.arange(7, 7 + 128, dtype=np.int64), 64) == chain(b"s", list(range(7, 7 + 128)), 64)
    assert chain(b"s", tuple(range(64)), 64) == chain(b"s", list(range(64)), 64)


_CHILD = r"""
import json, sys
from mcstore.keys import KeySpace, fingerprint
fields, tokens = json.loads(sys.stdin.read())
print(json.dumps(KeySpace(fingerprint(fields), 64, 1).links(tokens, cache_salt="s", lora="l", mm_hashes=["h"])))
"""


def test_keys_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("0", "12345", "random"):
        r = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([FIELDS, TOKENS]),
                           capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""},
                           timeout=60, check=True)
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] == _ks().links(TOKENS, cache_salt="s", lora="l", mm_hashes=["h"])


@pytest.mark.parametrize("kw", [
    {"cache_salt": "alice"}, {"cache_salt": "bob"}, {"cache_salt": ""}, {"lora": "adapter"},
    {"mm_hashes": ["img1"]}, {"mm_hashes": ["img1", "img2"]},
])
def test_isolation_keys_never_share_an_object(kw):
    ks = _ks()
    plain = set(ks.links(TOKENS))
    isolated = ks.links(TOKENS, **kw)
    assert not plain & set(isolated)
    assert ks.links(TOKENS, **kw) == isolated  # and stay deterministic


def test_salts_are_not_confusable():
    ks = _ks()
    assert not set(ks.links(TOKENS, cache_salt="a", lora="b")) & set(ks.links(TOKENS, cache_salt="ab"))
    assert not set(ks.links(TOKENS, cache_salt="a")) & set(ks.links(TOKENS, lora="a"))


@pytest.mark.parametrize("path,value", [
    (("model",), "/m/other"), (("dtype",), "torch.float16"), (("kv_cache_layout",), "NHD"),
    (("tp_size",), 2), (("chunk_tokens",), 128), (("groups", 0, "block_size"), 16),
    (("groups", 0, "num_layers"), 4), (("groups", 0, "num_kv_heads"), 4),
    (("groups", 0, "head_size"), 128), (("platform",), "cuda"),
])
def test_fingerprint_sensitive_to_every_field(path, value):
    changed = json.loads(json.dumps(FIELDS))
    node = changed
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    assert fingerprint(changed) != fingerprint(FIELDS)
    assert not set(_ks(changed).links(TOKENS)) & set(_ks().links(TOKENS))


def test_tp_ranks_get_their_own_objects():
    ks = _ks(tp=2)
    links = ks.links(TOKENS)
    keys = ks.all_rank_keys(links)
    assert len(keys) == 2 * len(links) and len(set(keys)) == len(keys)
    assert keys[0].endswith("/tp0") and keys[1].endswith("/tp1")


# -- configuration --------------------------------------------------------------------------


def test_config_defaults_and_sizes():
    cfg = load_config({"master": "10.0.0.1:50051", "local_buffer_size": "32MB"}, env={})
    assert cfg.chunk_tokens == 256 and cfg.global_segment_size == 0
    assert cfg.local_buffer_size == 32 << 20 and cfg.replicas == 1 and not cfg.hard_pin


def test_load_thread_nice_is_10_on_cpu_and_0_elsewhere_unless_set():
    assert load_config({"master": "h:1"}, env={}).load_nice("cpu") == 10
    assert load_config({"master": "h:1", "load_thread_nice": 19}, env={}).load_nice("cpu") == 19
    assert load_config({"master": "h:1"}, env={}).load_nice("cuda") == 0
    assert load_config({"master": "h:1", "load_thread_nice": 5}, env={}).load_nice("cuda") == 5
    assert load_config({"master": "h:1", "load_thread_nice": 0}, env={}).load_nice("cpu") == 0


def test_save_thread_nice_defaults_to_the_cpu_constant_and_0_elsewhere_unless_set():
    from mcstore.config import SAVE_THREAD_NICE_CPU

    assert load_config({"master": "h:1"}, env={}).save_nice("cpu") == SAVE_THREAD_NICE_CPU
    assert load_config({"master": "h:1"}, env={}).save_nice("cuda") == 0
    assert load_config({"master": "h:1", "save_thread_nice": 7}, env={}).save_nice("cpu") == 7
    assert load_config({"master": "h:1", "save_thread_nice": 0}, env={}).save_nice("cpu") == 0



def test_idle_step_pause_by_engine_ranks_unless_set():
    from kvcore import shmspin
    from mcstore.config import IDLE_STEP_MS_ONE_RANK

    default = load_config({"master": "h:1"}, env={})
    assert default.idle_step_s(multi_rank_cpu=False) == IDLE_STEP_MS_ONE_RANK / 1e3 == 0.002
    assert default.idle_step_s(multi_rank_cpu=True) == shmspin.IDLE_STEP_S
    never = load_config({"master": "h:1", "idle_step_ms": 0}, env={})
    assert never.idle_step_s(False) == never.idle_step_s(True) == 0.0
    assert load_config({"master": "h:1", "idle_step_ms": 7.5}, env={}).idle_step_s(True) == 0.0075


@pytest.mark.parametrize("extra,needle", [
    ({"master": "h:1", "chunk_tokns": 64}, "chunk_tokns"),
    ({}, "no master address"),
    ({"master": "nohostport"}, "HOST:PORT"),
    ({"master": "h:1", "chunk_tokens": 0}, "chunk_tokens"),
    ({"master": "h:1", "replicas": "two"}, "replicas"),
    ({"master": "h:1", "global_segment_size": "lots"}, "global_segment_size: not a size"),
    ({"master": "h:1", "load_staging_size": "big"}, "load_staging_size: not a size"),
    ({"master": "h:1", "enable_ssd_offload": True}, "ssd_offload_path"),
    ({"master": "h:1", "master_server_address": "h:2"}, "not both"),
    ({"master": "http://h:1"}, r"HOST:PORT or etcd://HOST:PORT\[;HOST:PORT...\]"),
    ({"master": "etcd://"}, "empty etcd endpoint"),
    ({"master": "etcd://h:1;"}, "empty etcd endpoint"),
    ({"master": "etcd://h"}, "etcd endpoint 'h' of master"),
    ({"master": "etcd://h:1,g:2"}, "with ';'"),
    ({"master": "h:1", "stage_above_ranges_per_region": -1}, r"stage_above_ranges_per_region must be >= 0 \(0 = never\)"),
    ({"master": "h:1", "idle_step_ms": -1}, r"idle_step_ms must be within \[0, 1000\]"),
    ({"master": "h:1", "load_thread_nice": 20}, r"load_thread_nice must be within \[0, 19\]"),
    ({"master": "h:1", "save_thread_nice": -1}, r"save_thread_nice must be within \[0, 19\]"),
    ({"master": "h:99999"}, "HOST:PORT"),
])
def test_config_errors_are_clear(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(extra, env={})


def test_master_plain_and_ha_forms():
    plain = load_config({"master": " 10.0.0.1:50051 "}, env={})
    assert plain.master == "10.0.0.1:50051" and plain.master_host_port == ("10.0.0.1", 50051)
    assert plain.ha_etcd_endpoints is None
    ha = load_config({"master": "etcd://127.0.0.2:2379;127.0.0.3:2379"}, env={})
    assert ha.ha_etcd_endpoints == ["127.0.0.2:2379", "127.0.0.3:2379"]
    assert load_config({"master": "etcd://127.0.0.2:2379"}, env={}).ha_etcd_endpoints == ["127.0.0.2:2379"]
    with pytest.raises(ConfigError, match="HA entry"):
        ha.master_host_port


def test_chunk_must_be_multiple_of_block():
    cfg = load_config({"master": "h:1", "chunk_tokens": 48}, env={})
    with pytest.raises(ConfigError, match="multiple of the vLLM block size 32"):
        cfg.check_block_size(32)


def test_mooncake_config_path(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "127.0.0.1:5555", "protocol": "TCP",
                                "global_segment_size": "1GB", "local_buffer_size": 1048576,
                                "device_name": "", "tenant_id": "default"}))
    cfg = load_config({"chunk_tokens": 64}, env={"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.master == "127.0.0.1:5555" and cfg.protocol == "tcp"
    assert cfg.global_segment_size == 1 << 30 and cfg.chunk_tokens == 64
    # The connector's own keys win over the file.
    assert load_config({"master": "h:9"}, env={"MOONCAKE_CONFIG_PATH": str(path)}).master == "h:9"
    path.write_text(json.dumps({"master_server_address": "h:1", "bogus": 1}))
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        load_config({}, env={"MOONCAKE_CONFIG_PATH": str(path)})
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH"):
        load_config({}, env={"MOONCAKE_CONFIG_PATH": str(tmp_path / "missing.json")})


# -- load planning (scheduler side, no store needed) -------------------------------------------


def _sched():
    from mcstore.scheduler import StoreScheduler

    cfg = load_config({"master": "h:1", "chunk_tokens": 64}, env={})
    return StoreScheduler(cfg, _ks(), 32, load=False, save=True)


def _request(n=64 * 5 + 13, rid="r1"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS[:n], num_prompt_tokens=n,
                           num_computed_tokens=0, cache_salt=None, lora_request=None, mm_features=None)


def test_plan_load_maps_chunks_and_partial_heads():
    s = _sched()
    req = _request()
    blocks = list(range(100, 111))
    s.plan_load(req, 96, 319, blocks)  # local hit ends inside chunk 1; hit capped inside chunk 4
    (job,) = s._loads
    assert [(c.index, c.first, c.block_ids) for c in job.chunks] == [
        (1, 1, [103]), (2, 0, [104, 105]), (3, 0, [106, 107]), (4, 0, [108, 109])]
    with pytest.raises(ValueError):
        s.plan_load(req, 0, 64 * 6, list(range(20)))  # beyond the stored chunks
    with pytest.raises(ValueError):
        s.plan_load(req, 10, 64, blocks)  # not block aligned


def test_save_plan_new_full_prompt_chunks_only():
    s = _sched()
    req = _request()
    s.get_num_new_matched_tokens(req, 0)

    class KVM:
        def get_block_ids(self, rid):
            return (list(range(1, 12)),)

    s.bind_kv_cache_manager(KVM())
    out = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"r1": 150}, scheduled_new_reqs=[])
    (job,) = s.build_connector_meta(out).saves
    assert [(c.index, c.block_ids) for c in job.chunks] == [(0, [1, 2]), (1, [3, 4])]
    req.num_computed_tokens = 150
    out.num_scheduled_tokens = {"r1": req.num_prompt_tokens - 150}
    (job,) = s.build_connector_meta(out).saves
    assert [c.index for c in job.chunks] == [2, 3, 4]
    req.num_computed_tokens = req.num_prompt_tokens
    out.num_scheduled_tokens = {"r1": 1}  # decode: nothing new
    assert s.build_connector_meta(out).saves == []
    assert s.request_finished(req, [])[0] is True  # blocks held until the saves finish


class _AllStored:
    """The scheduler's store client, answering that every key exists (what the master would
    for a stored prompt; the decision under test is the scheduler's own)."""

    available = True

    def exists(self, keys):
        return [1] * len(keys)

    def close(self):
        pass


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _step(*new_rids):
    return SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={},
                           scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new_rids])


def _looked_up(s, *reqs):
    """A step in which vLLM asks about ``reqs`` for the first time: each is answered "ask again
    later" (the lookup is non-blocking); the step's end sends all their lookups as one batch; once
    answered, the scheduler answers the next step's questions from them."""
    before = s.lookups.batches
    for r in reqs:
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    s.build_connector_meta(_step())
    deadline = time.monotonic() + 10
    while not all(s._reqs[r.request_id].pending.done for r in reqs):
        assert time.monotonic() < deadline, "lookups not answered"
        time.sleep(0.001)
    assert s.lookups.batches == before + 1  # one batch for the step's lookups


def test_loads_within_sync_load_max_per_step_are_synchronous_and_others_in_the_background():
    from mcstore.scheduler import StoreScheduler

    # No wait for the lookups (lookup_wait_ms 0): they answer at the next step.
    cfg = load_config({"master": "h:1", "chunk_tokens": 64, "sync_load_max": "6MB", "lookup_wait_ms": 0}, env={})
    s = StoreScheduler(cfg, _ks(), 32, load=True, save=False, client=_AllStored(), block_bytes=1 << 20)
    a, b, c, d = (_request(64 * 3 + 5, rid) for rid in "abcd")  # 3 stored chunks: 6 blocks, 6 MiB
    e = _request(64 * 4 + 5, "e")
    f = _request(64 * 3 + 5, "f")
    _looked_up(s, a, b, c, d, e, f)
    assert s.get_num_new_matched_tokens(a, 0) == (192, False)  # 6 MiB: within this step's 6
    s.update_state_after_alloc(a, _blocks(range(7)), 192)
    assert s.get_num_new_matched_tokens(b, 0) == (192, True)  # the step's 6 MiB are taken
    s.update_state_after_alloc(b, _blocks(range(10, 17)), 192)
    meta = s.build_connector_meta(_step("a"))
    assert [(j.req_id, j.sync) for j in meta.loads] == [("a", True), ("b", False)]
    # A new step, but b still loads in the background: c waits behind it on the worker's one
    # load thread, so it goes to the background too.
    assert s.get_num_new_matched_tokens(c, 0) == (192, True)
    s.build_connector_meta(_step())
    s.build_connector_meta(_step("b"))  # b's load ended: vLLM scheduled it
    assert s.get_num_new_matched_tokens(d, 0) == (192, False)
    s.build_connector_meta(_step())
    # Past the limit alone: in the background. Aborted while loading: no longer waited for.
    assert s.get_num_new_matched_tokens(e, 0) == (256, True)
    s.update_state_after_alloc(e, _blocks(range(20, 29)), 256)
    s.request_finished(e, [])
    assert s.get_num_new_matched_tokens(f, 64) == (128, False)  # 4 MiB


def test_a_composites_sync_grant_lasts_one_step_and_makes_the_planned_load_synchronous():
    """``reserve_sync`` (the composite's question) takes from the same per-step budget as the
    tier's own hook; the load planned in that step is synchronous, and a grant not used before
    the step's metadata is built is gone: a later plan_load runs in the background."""
    from mcstore.scheduler import StoreScheduler

    # A step waits up to 100 ms for the (in-process) lookups: a busy host's thread switch is no answer here.
    cfg = load_config({"master": "h:1", "chunk_tokens": 64, "sync_load_max": "6MB", "lookup_wait_ms": 100}, env={})
    s = StoreScheduler(cfg, _ks(), 32, load=True, save=False, client=_AllStored(), block_bytes=1 << 20)
    a, b = (_request(64 * 3 + 5, rid) for rid in "ab")
    assert s.lookup(a) == s.lookup(b) == 192
    assert s.reserve_sync(a, 0, 192) is True
    assert s.reserve_sync(b, 0, 192) is False  # the step's 6 MiB are taken
    s.plan_load(a, 0, 192, list(range(7)))
    meta = s.build_connector_meta(_step("a"))
    assert [(j.req_id, j.sync) for j in meta.loads] == [("a", True)]
    assert s.reserve_sync(b, 0, 192) is True
    s.build_connector_meta(_step())  # b was not scheduled in that step
    s.plan_load(b, 0, 192, list(range(10, 17)))
    assert [(j.req_id, j.sync) for j in s.build_connector_meta(_step("b")).loads] == [("b", False)]
    assert s.reserve_sync(_request(64 * 3 + 5, "c"), 0, 0) is False  # nothing to load


def test_sync_load_max_defaults_by_platform_and_names_itself_when_bad():
    cfg = load_config({"master": "h:1"}, env={})
    assert cfg.sync_load_bytes("cpu") == 32 << 20 and cfg.sync_load_bytes("cuda") == 0
    assert load_config({"master": "h:1", "sync_load_max": 0}, env={}).sync_load_bytes("cpu") == 0
    assert load_config({"master": "h:1", "sync_load_max": "1GB"}, env={}).sync_load_bytes("cuda") == 1 << 30
    with pytest.raises(ConfigError, match="sync_load_max"):
        load_config({"master": "h:1", "sync_load_max": "lots"}, env={})


@pytest.mark.parametrize("name", ["store-only.json", "store-multiconnector.json"])
def test_example_configs_are_valid(name):
    from pathlib import Path

    from vllm.config import KVTransferConfig

    data = json.loads((Path(__file__).resolve().parent.parent / "examples" / name).read_text())
    KVTransferConfig(**data)
    stores = [data] if data["kv_connector"] == "StoreConnector" else [
        c for c in data["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "StoreConnector"]
    assert stores and all(s["kv_connector_module_path"] == "mcstore" for s in stores)
    for s in stores:
        load_config(s["kv_connector_extra_config"], env={})


def test_replicate_config_from_settings():
    from mooncake.store import SoftPinAction

    from mcstore.client import replicate_config

    rc = replicate_config(load_config({"master": "h:1"}, env={}))
    assert rc.replica_num == 1 and not rc.with_hard_pin and rc.soft_pin_action != SoftPinAction.ENABLE
    rc = replicate_config(load_config({"master": "h:1", "replicas": 2, "soft_pin": True, "soft_pin_ttl_ms": 60000,
                                       "hard_pin": True, "preferred_segment": "10.0.0.2:12345"}, env={}))
    assert rc.replica_num == 2 and rc.with_hard_pin and rc.soft_pin_action == SoftPinAction.ENABLE
    assert rc.soft_pin_ttl_ms == 60000 and rc.preferred_segment == "10.0.0.2:12345"


def test_batch_calls_hold_at_most_the_range_cap():
    """Chunks go to Mooncake in calls of at most MAX_RANGES_PER_CALL buffer ranges (a trailer
    is one more per chunk), in order, none lost; a chunk over the cap goes alone."""
    from mcstore.loads import MAX_RANGES_PER_CALL, ranged_batches

    cap = MAX_RANGES_PER_CALL
    chunks = [12] * 3 + [96] * 40 + [cap + 5] + [1]
    for trailer in (False, True):
        calls = ranged_batches([n + trailer for n in chunks])
        assert [j for c in calls for j in c] == list(range(len(chunks)))
        per_call = [sum(chunks[j] + trailer for j in c) for c in calls]
        assert all(n <= cap for c, n in zip(calls, per_call) if len(c) > 1)
        assert [len(c) for c in calls if any(chunks[j] > cap for j in c)] == [1]
        # Each call is full: the next chunk would not have fitted.
        for c, nxt in zip(calls, calls[1:]):
            assert sum(chunks[j] + trailer for j in c) + chunks[nxt[0]] + trailer > cap
    assert ranged_batches([]) == []


# -- links from vLLM's block hashes (key version 3) ----------------------------------------------

def _vllm_request(tokens, salt=None):
    """A real vLLM Request hashed by vLLM's own block hasher (sha256), NONE_HASH from its seed."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(32, sha256))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("seed_env", [None, "1234"])
def test_tools_reproduce_vllms_own_sha256_block_hashes(monkeypatch, salt, seed_env):
    """The tools' reimplementation gives the bytes vLLM's hasher gives a real Request, with and
    without a cache salt and PYTHONHASHSEED; a changed token changes that block's hash onward."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    from mcstore.keys import VllmBlockHashes, vllm_sha256_block_hashes

    if seed_env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed_env)
    scheme = VllmBlockHashes(algo="sha256", seed=resolve_none_hash_seed(sha256), block_size=32)
    tokens = list(range(1000, 1000 + 32 * 9 + 5))
    theirs = _vllm_request(tokens, salt).block_hashes
    ours = vllm_sha256_block_hashes(tokens, scheme, salt)
    assert len(ours) == 9 and [bytes(h) for h in theirs] == ours
    changed = tokens[:100] + [7] + tokens[101:]
    other = vllm_sha256_block_hashes(changed, scheme, salt)
    assert other[:3] == ours[:3] and not set(other[3:]) & set(ours)


def _vllm_ks(fields=FIELDS) -> KeySpace:
    from mcstore.keys import VllmBlockHashes

    return KeySpace(fingerprint({**fields, "block_hashes": "sha256"}), 64, 1,
                    block_hashes=VllmBlockHashes(algo="sha256", seed="vllm-none-hash", block_size=32))


def test_links_from_an_engines_block_hashes_equal_the_tools_links_from_tokens(monkeypatch):
    """The scheduler's path (vLLM's hashes of a real Request) and the tools' path (token ids)
    name the same objects, one per full chunk of the prompt only; salts and fingerprints
    separate key spaces; LoRA and multimodal prompts are refused by the tools' path."""
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # _vllm_ks's seed is vLLM's default

    assert DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    ks = _vllm_ks()
    req = _vllm_request(TOKENS)
    links = ks.links_from_block_hashes(req.block_hashes, len(TOKENS))
    assert len(links) == 5 and links == ks.links(TOKENS)
    assert ks.links_from_block_hashes(req.block_hashes, 64 * 3 + 10) == links[:3]
    assert ks.links_from_block_hashes(req.block_hashes[:5], len(TOKENS)) == links[:2]  # hashes run short
    # Chunk i's link: H(fingerprint, the hash of its last 32-token block), two blocks a chunk.
    assert links == [f"{ks.prefix}/{hashlib.sha256(ks.fp.encode() + h).hexdigest()}" for h in req.block_hashes[1:10:2]]
    assert not set(ks.links(TOKENS, cache_salt="s")) & set(links)
    assert not set(_vllm_ks({**FIELDS, "tp_size": 2}).links(TOKENS)) & set(links)
    assert not set(_ks().links(TOKENS)) & set(links)  # our own chain's key space is another
    for kw in ({"lora": "adapter"}, {"mm_hashes": ["img"]}):
        with pytest.raises(ValueError, match="vLLM's block hashes"):
            ks.links(TOKENS, **kw)


def test_scheduler_takes_links_from_the_requests_block_hashes_and_none_from_mismatched_ones(monkeypatch):
    from mcstore.scheduler import StoreScheduler

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # _vllm_ks's seed is vLLM's default

    ks = _vllm_ks()
    sched = StoreScheduler(load_config({"master": "127.0.0.1:1"}), ks, 32, load=False, save=False)
    req = _vllm_request(TOKENS)
    assert sched._state(req).links == ks.links(TOKENS)
    odd = SimpleNamespace(request_id="odd", block_hashes=req.block_hashes[:4], num_tokens=len(TOKENS),
                          num_prompt_tokens=len(TOKENS))
    assert sched._state(odd).links == []


# -- KV events (scheduler side; the engine's own stream: tests/test_store_events_e2e.py) --------


def _event_request(rid, n_blocks, bs=32, salt=None):
    from mcstore.keys import VllmBlockHashes, vllm_sha256_block_hashes

    tokens = TOKENS[:n_blocks * bs]
    hashes = vllm_sha256_block_hashes(tokens, VllmBlockHashes(algo="sha256", seed="s", block_size=bs), salt)
    return SimpleNamespace(request_id=rid, block_hashes=hashes, all_token_ids=tokens, lora_request=None,
                           mm_features=[], cache_salt=salt, prompt_embeds=None, session_id=None)


def test_a_chunk_is_announced_once_every_part_confirmed_and_removed_only_if_announced():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from mcstore.events import StoreEvents, StoreWorkerMeta

    ev = StoreEvents(parts=2, block_size=32, chunk_blocks=2)  # TP 2, chunks of 64 tokens
    req = _event_request("r", 6, salt="tenant")
    for c in range(3):
        ev.planned("r", f"link{c}", c, req)
    ev.worker_news(StoreWorkerMeta(stored=[("link0", 0), ("link1", 0)]))
    assert ev.take() == []  # one rank of two: not visible yet
    ev.worker_news(StoreWorkerMeta(stored=[("link0", 1), ("link0", 1)]).aggregate(StoreWorkerMeta(gone=["link9"])))
    (stored,) = ev.take()
    assert isinstance(stored, BlockStored) and stored.medium == "mooncake" and stored.group_idx == 0
    # vLLM's external form of its block hashes (as its own events give them: ints by default).
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:2]]
    assert stored.parent_block_hash is None
    assert stored.token_ids == TOKENS[:64] and stored.block_size == 32
    assert stored.extra_keys == [("tenant",), None]  # the cache salt keys the first block, as vLLM's own
    ev.request_done("r")  # its saves ended: link1 (one part) and link2 were not all written
    ev.worker_news(StoreWorkerMeta(stored=[("link1", 1), ("link2", 0), ("link2", 1)]))
    assert ev.take() == []
    ev.gone("link1")  # never announced: nothing to remove
    ev.gone("link0")
    (removed,) = ev.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    ev.gone("link0")
    assert ev.take() == []  # removed once
