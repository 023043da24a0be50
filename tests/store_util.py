"""Helpers for the store tier's tests: connector configs and a raw Mooncake client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import requests

from mcstore.server import CLIENT_ENV


def store_kv(master: str, role: str = "kv_both", **extra) -> dict:
    return {
        "kv_connector": "StoreConnector",
        "kv_connector_module_path": "mcstore",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"master": master, "chunk_tokens": 64, **extra},
    }


def multi_kv(master: str, example_dir: str, **extra) -> dict:
    """vLLM's stock MultiConnector with the store tier first and ExampleConnector second."""
    child = store_kv(master, **extra)
    child.pop("kv_load_failure_policy")
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [
            child,
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": example_dir}},
        ]},
    }


def raw_client(master: str):
    """A pure Mooncake client in the test process (no segment)."""
    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"raw client setup failed: {rc}")
    return s


def master_metric(cluster, name: str) -> float:
    """A sample of the master's Prometheus text (its ``--metrics_port``), 0 when absent; e.g.
    ``master_batch_get_replica_list_requests_total``, counted when a client's batch get asks
    the master for replicas, which is when the master grants that read's lease."""
    r = requests.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5)
    r.raise_for_status()
    for line in r.text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return 0.0


def wait_saved(cluster, before: set[str], want: int, timeout: float = 20) -> set[str]:
    """The store keys new since ``before`` once there are ``want`` of them (saves are
    asynchronous); AssertionError after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = all_keys(cluster) - before
        if len(new) >= want:
            return new
        time.sleep(0.2)
    raise AssertionError(f"saved {len(all_keys(cluster) - before)} of {want} objects")


def _is_dir_key(k: str) -> bool:
    return k.split("/")[2:3] == ["d"]  # mct/<fp16>/d/... (mcstore.keys.KeySpace.dir_key)


def all_keys(cluster) -> set[str]:
    """Our keys in the store but directory entries (``mct/<fp16>/d/...``, ``mcstore.keys``): the
    objects of stored KV (whole chunks, part objects) and the published metadata."""
    return {k for k in every_key(cluster) if k.startswith("mct/") and not _is_dir_key(k)}


def dir_keys(cluster) -> set[str]:
    """The directory entries in the store (``mct/<fp16>/d/...``, ``mcstore.keys``)."""
    return {k for k in every_key(cluster) if k.startswith("mct/") and _is_dir_key(k)}


def every_key(cluster) -> set[str]:
    """Every key the master lists."""
    r = requests.get(f"http://127.0.0.1:{cluster.metrics_port}/get_all_keys", timeout=5)
    r.raise_for_status()
    return set(r.text.split())


def kill_mid_put(master: str, keys: list[str], sizes: list[int], timeout: float = 30) -> None:
    """A child process starts put sessions (PutStart) for ``keys`` and is SIGKILLed before PutEnd."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", {master!r}) == 0
        rcs = s.batch_put_session_start({keys!r}, {sizes!r})
        print("STARTED", rcs, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **CLIENT_ENV}, start_new_session=True)
    try:
        line = p.stdout.readline()
        if not line.startswith("STARTED"):
            raise RuntimeError(f"put-session child did not start: {line!r}")
        rcs = json.loads(line.split(" ", 1)[1])
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"batch_put_session_start failed: {rcs}")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=timeout)
