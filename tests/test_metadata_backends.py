"""Mooncake's ``mooncake.json`` for both tiers, and the Transfer Engine metadata backends.

Unit: vLLM V0's file (the seed's two variants, on loopback "hosts") and Mooncake Store's
keys load for the store and the P2P tier with the right values; extra_config keys win;
unknown keys and impossible metadata combinations are clear errors.

Integration (no vLLM engine): both tiers on real Mooncake with a real HTTP metadata server
(mooncake_master's embedded one) and a real etcd: the P2P tier's own code path (Transfer
Engine handles, side channel, puller, bootstrap server) moves KV pages, and a store client
built from a ``StoreConfig`` puts into and gets from a segment another process owns. Each
checks that the segments were really registered in that metadata server.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests

from kvcore.errors import ConfigError
from kvcore.mooncake_json import KNOWN_KEYS, MooncakeJson, metadata_conn_string
from mcstore.config import load_config as store_config
from p2p.config import load_config as p2p_config

# The seed's files (Mooncake's vllm-integration v0.2), prefill on 127.0.0.2, decode and etcd on 127.0.0.3.
SEED_RDMA = {"prefill_url": "127.0.0.2:13003", "decode_url": "127.0.0.3:13003",
             "metadata_server": "127.0.0.3:2379", "metadata_backend": "etcd",
             "protocol": "rdma", "device_name": "erdma_0"}
SEED_TCP = {**SEED_RDMA, "protocol": "tcp", "device_name": ""}
SEED_STORE = {**SEED_TCP, "global_segment_size": "4GB", "local_buffer_size": "512MB",
              "master_server_address": "127.0.0.3:50051"}


def _file(tmp_path, content: dict) -> dict[str, str]:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(content))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


# ---------------------------------------------------------------- unit: mooncake.json


@pytest.mark.unit
@pytest.mark.parametrize("seed", [SEED_RDMA, SEED_TCP], ids=["rdma", "tcp"])
def test_v0_seed_file_loads_for_both_tiers(tmp_path, seed):
    env = _file(tmp_path, seed)
    p = p2p_config({}, "kv_producer", env)
    d = p2p_config({}, "kv_consumer", env)
    assert (p.te_hostname, d.te_hostname) == ("127.0.0.2", "127.0.0.3")
    assert p2p_config({}, "kv_both", env).te_hostname == "127.0.0.2"
    for c in (p, d):
        assert (c.protocol, c.device_name, c.metadata_server) == (seed["protocol"], seed["device_name"],
                                                                  "etcd://127.0.0.3:2379")
    # The V0 file has no master: the store tier takes the rest and needs its master from extra_config.
    with pytest.raises(ConfigError, match="no master address"):
        store_config({}, env)
    s = store_config({"master": "127.0.0.1:50051"}, env)
    assert (s.protocol, s.device_name, s.metadata_server) == (seed["protocol"], seed["device_name"],
                                                              "etcd://127.0.0.3:2379")


@pytest.mark.unit
def test_store_variant_loads_for_both_tiers(tmp_path):
    env = _file(tmp_path, SEED_STORE)
    s = store_config({}, env)
    assert s.master == "127.0.0.3:50051" and s.master_host_port == ("127.0.0.3", 50051)
    assert (s.global_segment_size, s.local_buffer_size) == (4 << 30, 512 << 20)
    assert s.metadata_server == "etcd://127.0.0.3:2379" and s.protocol == "tcp"
    d = p2p_config({}, "kv_consumer", env)  # the store keys are not the P2P tier's
    assert (d.te_hostname, d.metadata_server) == ("127.0.0.3", "etcd://127.0.0.3:2379")
    # Mooncake Store's own generation: local_hostname names the P2P engine's host too.
    env = _file(tmp_path, {"local_hostname": "127.0.0.4:12345", "metadata_server": "http://127.0.0.3:8080/metadata",
                           "master_server_address": "127.0.0.3:50051", "global_segment_size": 3355443200,
                           "local_buffer_size": "1gb", "protocol": "TCP", "device_name": "", "tenant_id": "default",
                           "enable_ssd_offload": "false", "enable_client_http_server": False, "client_http_port": 9300})
    s = store_config({}, env)
    assert (s.local_hostname, s.local_buffer_size, s.enable_ssd_offload) == ("127.0.0.4:12345", 1 << 30, False)
    c = p2p_config({}, "kv_producer", env)
    assert (c.te_hostname, c.metadata_server, c.protocol) == ("127.0.0.4", "http://127.0.0.3:8080/metadata", "tcp")


@pytest.mark.unit
def test_example_file_loads_for_both_tiers_on_loopback():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "mooncake.json"
    env = {"MOONCAKE_CONFIG_PATH": str(path)}
    s = store_config({}, env)
    assert (s.master, s.metadata_server, s.global_segment_size) == ("127.0.0.1:50051", "etcd://127.0.0.1:2379", 0)
    for role in ("kv_producer", "kv_consumer"):
        assert p2p_config({}, role, env).te_hostname == "127.0.0.1"
    hosts = [v.rpartition(":")[0] for k, v in json.loads(path.read_text()).items() if k.endswith(("_url", "_server",
                                                                                                  "_address"))]
    assert hosts and set(hosts) == {"127.0.0.1"}


@pytest.mark.unit
def test_extra_config_wins_over_the_file(tmp_path):
    env = _file(tmp_path, SEED_STORE)
    p = p2p_config({"te_hostname": "127.0.0.9", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                    "device_name": "x"}, "kv_producer", env)
    assert (p.te_hostname, p.metadata_server, p.protocol, p.device_name) == ("127.0.0.9", "P2PHANDSHAKE", "tcp", "x")
    assert p2p_config({"mooncake_protocol": "tcp"}, "kv_producer", _file(tmp_path, SEED_RDMA)).protocol == "tcp"
    env = _file(tmp_path, SEED_STORE)
    s = store_config({"master": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata",
                      "global_segment_size": 0, "protocol": "rdma"}, env)
    assert (s.master, s.metadata_server, s.global_segment_size, s.protocol) == (
        "127.0.0.1:1", "http://127.0.0.1:2/metadata", 0, "rdma")
    assert store_config({"master_server_address": "127.0.0.1:7"}, env).master == "127.0.0.1:7"
    # Without a role the P2P tier takes no URL from the file.
    assert p2p_config({}, None, env).te_hostname == "127.0.0.1"


@pytest.mark.unit
def test_unknown_key_and_bad_values_name_the_key_and_the_file(tmp_path):
    env = _file(tmp_path, {**SEED_TCP, "prefill_ulr": "127.0.0.2:1"})
    for load in (lambda: store_config({"master": "h:1"}, env), lambda: p2p_config({}, "kv_producer", env)):
        with pytest.raises(ConfigError) as e:
            load()
        msg = str(e.value)
        assert "unknown key 'prefill_ulr'" in msg and env["MOONCAKE_CONFIG_PATH"] in msg
        assert "known keys: " in msg and "prefill_url" in msg and "master_server_address" in msg
    for bad, needle in [({"prefill_url": "127.0.0.2"}, "prefill_url must be HOST:PORT"),
                        ({"global_segment_size": "lots"}, "global_segment_size: not a size"),
                        ({"protocol": 3}, r"\$.protocol"),
                        ({"metadata_backend": "etcd"}, "without metadata_server"),
                        ({"metadata_server": "127.0.0.3:6379", "metadata_backend": "redis"}, "no redis plugin"),
                        ({"metadata_server": "http://127.0.0.3:8080", "metadata_backend": "etcd"}, "contradicts")]:
        env = _file(tmp_path, bad)
        with pytest.raises(ConfigError, match=needle) as e:
            p2p_config({}, "kv_producer", env)
        assert env["MOONCAKE_CONFIG_PATH"] in str(e.value)


@pytest.mark.unit
def test_every_file_key_is_taken_or_ignored_by_each_tier():
    import mcstore.config as sc
    import p2p.config as pc

    store = {*sc._MOONCAKE_JSON_KEYS, "metadata_server", "metadata_backend", *sc._MOONCAKE_JSON_IGNORED}
    assert store == set(KNOWN_KEYS)
    for k in KNOWN_KEYS:  # each tier's docstring says what it does with every key
        assert k in sc.__doc__ and k in pc.__doc__, k
    assert set(pc._MOONCAKE_JSON_KEYS) <= set(KNOWN_KEYS)


@pytest.mark.unit
@pytest.mark.parametrize("server,backend,conn", [
    (None, None, "P2PHANDSHAKE"),
    ("", None, "P2PHANDSHAKE"),
    ("p2phandshake", None, "P2PHANDSHAKE"),
    ("127.0.0.3:2379", None, "etcd://127.0.0.3:2379"),  # Mooncake's default backend
    ("127.0.0.3:2379", "etcd", "etcd://127.0.0.3:2379"),
    ("127.0.0.3:2379", "ETCD", "etcd://127.0.0.3:2379"),
    ("etcd://127.0.0.3:2379", None, "etcd://127.0.0.3:2379"),
    ("etcd://127.0.0.3:2379,127.0.0.4:2379", "etcd", "etcd://127.0.0.3:2379,127.0.0.4:2379"),
    ("etcd://127.0.0.3:2379;127.0.0.4:2379", None, "etcd://127.0.0.3:2379,127.0.0.4:2379"),
    ("127.0.0.3:8080", "http", "http://127.0.0.3:8080/metadata"),
    ("http://127.0.0.3:8080", None, "http://127.0.0.3:8080/metadata"),
    ("http://127.0.0.3:8080/metadata", "http", "http://127.0.0.3:8080/metadata"),
    ("HTTP://127.0.0.3:8080/kv/meta", None, "http://127.0.0.3:8080/kv/meta"),
])
def test_metadata_connection_string(server, backend, conn):
    assert metadata_conn_string(server, backend) == conn


@pytest.mark.unit
@pytest.mark.parametrize("server,backend,needle", [
    ("redis://127.0.0.3:6379", None, "no redis plugin"),
    ("127.0.0.3:6379", "redis", "no redis plugin"),
    ("P2PHANDSHAKE", "etcd", "metadata_backend 'etcd' given"),
    ("etcd://127.0.0.3:2379", "http", "contradicts"),
    ("zk://127.0.0.3:2181", None, "unknown backend 'zk'"),
    ("127.0.0.3:2379", "consul", "unknown backend 'consul'"),
    ("etcd://127.0.0.3", None, "HOST:PORT"),
    ("etcd://127.0.0.3:2379,", None, "empty etcd endpoint"),
    ("http://127.0.0.3/metadata", None, "HOST:PORT"),
])
def test_metadata_combinations_mooncake_cannot_use_are_refused(server, backend, needle):
    with pytest.raises(ConfigError, match=needle):
        metadata_conn_string(server, backend)
    with pytest.raises(ConfigError, match=needle):
        MooncakeJson(metadata_server=server, metadata_backend=backend).check()


@pytest.mark.unit
def test_both_tiers_check_their_metadata_server_key():
    assert store_config({"master": "h:1", "metadata_server": "127.0.0.3:2379"}, env={}).metadata_server == \
        "etcd://127.0.0.3:2379"
    assert p2p_config({"metadata_server": "http://127.0.0.3:1"}, env={}).metadata_server == \
        "http://127.0.0.3:1/metadata"
    assert p2p_config({}, env={}).metadata_server == "P2PHANDSHAKE"
    with pytest.raises(ConfigError, match="mcstore: .*no redis plugin"):
        store_config({"master": "h:1", "metadata_server": "redis://127.0.0.3:6379"}, env={})
    with pytest.raises(ConfigError, match="p2p: .*no redis plugin"):
        p2p_config({"metadata_server": "redis://127.0.0.3:6379"}, env={})
    with pytest.raises(ConfigError, match="te_hostname must be a host without a port"):
        p2p_config({"te_hostname": "127.0.0.1:13003"}, env={})
    assert p2p_config({"te_hostname": "::1"}, env={}).te_hostname == "::1"


@pytest.mark.unit
def test_transfer_engine_handle_refuses_redis_before_mooncake_sees_it():
    from p2p.transfer import TransferEngineHandle

    # Mooncake 0.3.13 would abort the whole process on this string (no redis plugin).
    with pytest.raises(ConfigError, match="no redis plugin"):
        TransferEngineHandle("127.0.0.1", "tcp", "", "redis://127.0.0.1:6379")


# ---------------------------------------------------------------- integration: real metadata servers


def _registered(conn: str, key: str) -> bool:
    """Whether ``key`` (e.g. "mooncake/ram/<segment>") is stored in the metadata server ``conn``."""
    if conn.startswith("http://"):
        return requests.get(conn, params={"key": key}, timeout=5).status_code == 200
    ep = conn[len("etcd://"):].split(",")[0]
    r = requests.post(f"http://{ep}/v3/kv/range", json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)
    return int(r.json().get("count", 0)) == 1


@pytest.fixture(scope="module", params=["http", "etcd"])
def backend(request):
    """``(metadata connection string, master address)``: a master (for the store test), with
    its embedded HTTP metadata server, or a real etcd beside it."""
    from kvcore.procs import free_port
    from mcstore.server import StoreCluster
    from tests.harness import LOGS

    etcd = None
    cluster = StoreCluster(LOGS, http_port=free_port() if request.param == "http" else 0, store_server=False)
    cluster.start()
    try:
        if request.param == "http":
            conn = cluster.addrs().http_metadata
        else:
            from tests.hosts import Etcd

            etcd = Etcd("127.0.0.1")
            conn = f"etcd://{etcd.endpoint}"
        yield metadata_conn_string(conn), cluster.master_addr
    finally:
        if etcd is not None:
            etcd.stop()
        cluster.stop()


@pytest.mark.integration
def test_p2p_handoff_through_a_metadata_server(backend, monkeypatch):
    from kvcore.metrics import TierStats
    from p2p import bootstrap
    from p2p.holds import SideChannel
    from p2p.protocol import RegisterPayload
    from p2p.puller import Puller
    from tests.support import wait_for
    from tests.test_p2p_unit import Side, _job

    conn, _ = backend
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    prod, cons = Side(seed=1, metadata_server=conn), Side(seed=2, metadata_server=conn)
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"  # te_hostname, advertised to peers
    # Named through the metadata server (not HOST:RPC_PORT), one name per engine.
    for e in (prod.engine, cons.engine):
        assert e.addr.startswith("127.0.0.1:") and e.addr != f"127.0.0.1:{e.te.get_rpc_port()}"
        assert _registered(conn, f"mooncake/ram/{e.addr}"), e.addr
    assert prod.engine.addr != cons.engine.addr
    boot = bootstrap.BootstrapServer("127.0.0.1", 0).start()
    lock = threading.Lock()
    pstats, dstats = TierStats(), TierStats()
    side = SideChannel(prod.geo.regions, prod.engine.addr, pstats, lock, abort_timeout_s=10.0, te_metadata=conn)
    puller = Puller(cons.geo, cons.engine, dstats, lock, bootstrap_timeout_s=2, peer_silence_timeout_s=2)
    p2p_side = None
    try:
        bootstrap.register(boot.url, RegisterPayload("eng-P", 0, 0, 0, side.addr), timeout=5)
        p_blocks, d_blocks = [5, 6, 7, 20, 21, 9], [30, 31, 32, 40]
        side.add_hold("p-req-1", "xfer-1", p_blocks)
        puller.submit(_job(boot, "xfer-1", 2, d_blocks))
        res = wait_for(puller.take_results, 15, 0.02, what="the pull")
        assert [(r.ok, r.cause, r.detail) for r in res] == [(True, "", "")]
        for d, p in zip(d_blocks, p_blocks[2:]):
            assert (cons.buf[:, d] == prod.buf[:, p]).all()
        assert wait_for(side.take_finished, 10, 0.02, what="the release") == {"p-req-1"}
        # A decode engine without the metadata server cannot open that name: a prompt, clear failure.
        p2p_side = Side(seed=3)
        other = Puller(p2p_side.geo, p2p_side.engine, dstats, lock, bootstrap_timeout_s=2, peer_silence_timeout_s=2)
        side.add_hold("p-req-2", "xfer-2", [1, 2])
        t0 = time.monotonic()
        other.submit(_job(boot, "xfer-2", 0, [3, 4]))
        r = wait_for(other.take_results, 15, 0.02, what="the mismatched pull")[0]
        other.close()
        del other
        assert (r.ok, r.cause) == (False, "protocol") and "same metadata_server" in r.detail, r
        assert time.monotonic() - t0 < 5
        assert wait_for(side.take_finished, 10, 0.02, what="the failed pull's release") == {"p-req-2"}
    finally:
        puller.close()
        side.close()
        boot.stop()
        # Engines unregister from the metadata server when collected: before it stops.
        del prod, cons, p2p_side, puller, e
        gc.collect()


@pytest.mark.integration
def test_unreachable_metadata_server_is_a_clear_start_up_error(monkeypatch):
    from kvcore.procs import free_port
    from p2p.transfer import TransferEngineHandle

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="is the metadata server up and reachable"):
        TransferEngineHandle("127.0.0.1", "tcp", "", f"127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match="is the metadata server up and reachable"):
        TransferEngineHandle("127.0.0.1", "tcp", "", f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 15  # etcd's client gives up after 5 s


OWNER = r"""
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], 64 << 20, 16 << 20, "tcp", "", sys.argv[2])
print(rc, s.get_hostname(), flush=True)
sys.stdin.readline()
s.close()
"""


@pytest.mark.integration
def test_store_client_through_a_metadata_server(backend, monkeypatch):
    """A segment owner (as the store server, but with ``conn`` as its metadata) and a pure
    client built from a StoreConfig: every byte the client puts lands in the owner's segment,
    which the client reaches by the name the metadata server holds."""
    import torch

    from mcstore.client import StoreClient
    from mcstore.server import CLIENT_ENV

    conn, master = backend
    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, conn, master], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **CLIENT_ENV})
    client = None
    try:
        rc, owner_name = owner.stdout.readline().split()
        assert rc == "0" and owner_name.startswith("127.0.0.1:"), (rc, owner_name)
        assert _registered(conn, f"mooncake/ram/{owner_name}")
        cfg = store_config({"master": master, "metadata_server": conn, "connect_timeout_s": 5}, env={})
        client = StoreClient(cfg, "mdtest", segment=False)
        assert client.store.get_hostname() != owner_name
        data = os.urandom(300_000)
        key = f"mct/md/{time.time_ns()}"
        assert client.upsert(key, data) == 0
        assert client.get(key) == data
        # The tier's zero-copy path: registered buffers in and out.
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        for t in (src, dst):
            client.register(t.data_ptr(), t.numel())
        keys = [key + "/a", key + "/b"]
        half = src.numel() // 2
        rcs = client.put_from(keys, [[src.data_ptr()], [src.data_ptr() + half]], [[half], [half]])
        assert list(rcs) == [0, 0], rcs
        got = client.get_into(keys, [[dst.data_ptr()], [dst.data_ptr() + half]], [[half], [half]])
        assert list(got) == [half, half], got
        assert torch.equal(src, dst)
        for t in (src, dst):
            client.unregister(t.data_ptr())
    finally:
        if client is not None:
            client.close()
        owner.stdin.write("\n")
        owner.stdin.flush()
        try:
            owner.wait(timeout=20)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait(timeout=10)
