"""Engines that only wait (for KV, or for pulls of held blocks) with TP/PP > 1 on CPU:
vLLM's shared-memory queue readers sleep instead of busy-waiting once shortened
(``kvcore.shmspin``, measured in CPU seconds on a real ``MessageQueue``), and the P2P tier
paces the steps that compute nothing (``p2p.connector.IDLE_STEP_S``) on such engines only.
The store tier paces them on every engine: 20 ms with TP/PP > 1 on CPU, 2 ms on one rank
(``mcstore.config.IDLE_STEP_MS_ONE_RANK``; its effect on a load: ``bench.store_phases``).
The end-to-end effect: ``tests/test_tp2_p2p_e2e.py``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.harness import model_dir

pytestmark = pytest.mark.unit


def _reader_cpu_seconds(wait_s: float, shorten: bool) -> float:
    """CPU seconds a reader of a real vLLM MessageQueue spends waiting ``wait_s`` for a
    message that never comes."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from kvcore import shmspin

    writer = MessageQueue(n_reader=1, n_local_reader=1)
    handle = writer.export_handle()
    box: dict = {}

    def read():
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        if shorten:
            box["n"] = shmspin.shorten()
        t0 = time.thread_time()
        try:
            reader.dequeue(timeout=wait_s)
        except TimeoutError:
            pass
        box["cpu"] = time.thread_time() - t0

    t = threading.Thread(target=read)
    t.start()
    writer.wait_until_ready()
    t.join(timeout=wait_s + 30)
    assert not t.is_alive()
    if shorten:
        assert box["n"] >= 1
    return box["cpu"]


def test_load_spin_cuts_the_busy_wait_only_while_a_load_is_in_flight():
    """``kvcore.shmspin.LoadSpin`` on a real vLLM MessageQueue reader: vLLM's busy-wait until a
    load begins, 1 ms while one is in flight, vLLM's again once every load ended or passed its
    deadline (a load never reported back cannot keep it short)."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from kvcore import shmspin

    writer = MessageQueue(n_reader=1, n_local_reader=1)
    box: dict = {}

    def attach():
        box["reader"] = MessageQueue.create_from_handle(writer.export_handle(), 0)
        box["reader"].wait_until_ready()

    t = threading.Thread(target=attach)
    t.start()
    writer.wait_until_ready()
    t.join(timeout=30)
    cond = box["reader"]._spin_condition
    vllm_s = cond.busy_loop_s
    assert vllm_s > shmspin.LOADING_BUSY_LOOP_S
    spin = shmspin.LoadSpin()
    now = time.monotonic()
    spin.end(["x"], now)  # nothing in flight: nothing changes
    assert cond.busy_loop_s == vllm_s and not spin.short
    spin.begin(["a", "b"], now + 10)
    assert cond.busy_loop_s == shmspin.LOADING_BUSY_LOOP_S and spin.short
    spin.end({"a"}, now)
    assert cond.busy_loop_s == shmspin.LOADING_BUSY_LOOP_S  # b still loading
    spin.end({"b"}, now)
    assert cond.busy_loop_s == vllm_s and not spin.short
    spin.begin(["c"], now + 1)
    spin.end(set(), now + 2)  # c never reported, past its deadline
    assert cond.busy_loop_s == vllm_s and not spin.short


def test_shortened_shm_reader_sleeps_instead_of_spinning():
    spinning = _reader_cpu_seconds(0.6, shorten=False)
    sleeping = _reader_cpu_seconds(0.6, shorten=True)
    # vLLM's reader busy-waits for a second after its last read (less CPU than wall time
    # only when another process shares the core); the shortened one sleeps on its socket.
    assert spinning > 0.15 and sleeping < min(0.05, spinning / 5), (spinning, sleeping)


def test_p2p_scheduler_pauses_only_steps_that_compute_nothing_and_start_no_pull():
    from p2p.config import load_config
    from p2p.scheduler import P2PScheduler

    vc = SimpleNamespace(cache_config=SimpleNamespace(block_size=32))
    s = P2PScheduler(vc, load_config({}, "kv_consumer"), "kv_consumer", idle_step_s=0.05)
    t0 = time.monotonic()
    s.build_connector_meta(idle=False)
    busy = time.monotonic() - t0
    t0 = time.monotonic()
    s.build_connector_meta(idle=True)
    idle = time.monotonic() - t0
    assert busy < 0.01 and 0.05 <= idle < 0.5, (busy, idle)
    s._meta.recvs.append(object())  # a pull this step starts (its spec is not read here)
    t0 = time.monotonic()
    meta = s.build_connector_meta(idle=True)
    starting = time.monotonic() - t0
    assert len(meta.recvs) == 1 and starting < 0.01, starting


@pytest.mark.parametrize("tp", [1, 2])
def test_idle_steps_are_paced_on_tp2_cpu_engines_only(tp):
    from kvcore.vllm_glue import KVConnectorRole
    from kvcore.vllm_layout import engine_vllm_config
    from p2p.connector import IDLE_STEP_S, P2PConnector

    kv = {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer"}
    vc = engine_vllm_config(str(model_dir("tiny")), kv, block_size=32, dtype="bfloat16", tensor_parallel_size=tp)
    c = P2PConnector(vc, KVConnectorRole.SCHEDULER)
    assert c.scheduler.idle_step_s == (IDLE_STEP_S if tp > 1 else 0.0)


_STORE_PAUSE_CHILD = """
import json, os, sys, time
from types import SimpleNamespace
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvcore.vllm_glue import KVConnectorRole
from kvcore.vllm_layout import engine_vllm_config
from mcstore.connector import StoreConnector

kv, model, tp = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)])
vc = engine_vllm_config(model, kv, block_size=32, dtype="bfloat16", tensor_parallel_size=tp)
c = StoreConnector(vc, KVConnectorRole.SCHEDULER, kcc)

def took(tokens):
    out = SimpleNamespace(total_num_scheduled_tokens=tokens, preempted_req_ids=None, num_scheduled_tokens={},
                          scheduled_new_reqs=[])
    t0 = time.monotonic()
    c.build_connector_meta(out)
    return time.monotonic() - t0

def starting_a_load():
    from mcstore.protocol import LoadJob
    c._sched._loads.append(LoadJob("req-0", [], 20.0))  # as plan_load leaves it for this step
    return took(0)

# The fastest of several calls: a scheduling hiccup on a busy CI host only lengthens a call.
print(json.dumps({"pause_s": c._idle_step_s, "busy": min(took(64) for _ in range(5)),
                  "idle": min(took(0) for _ in range(3)), "starting": min(starting_a_load() for _ in range(3))}),
      flush=True)
# Exits without closing the Mooncake client: closing it in a process that built a vLLM config
# this way crashed in the Go runtime's signal forwarding (seen only here, not in engines).
os._exit(0)
"""


@pytest.mark.parametrize("tp,extra,want_s", [(1, {}, 0.002), (2, {}, 0.02), (1, {"idle_step_ms": 0}, 0.0),
                                             (1, {"idle_step_ms": 30}, 0.03)])
def test_store_connector_pauses_only_steps_that_compute_nothing_and_start_no_load(store_cluster, tp, extra, want_s):
    """A real StoreConnector (scheduler side, against a real master), in a child process:
    a step that computes nothing pauses, unless it starts a load."""
    import json
    import subprocess
    import sys

    from tests.harness import ROOT
    from tests.store_util import store_kv

    kv = store_kv(store_cluster.master_addr, **extra)
    r = subprocess.run([sys.executable, "-c", _STORE_PAUSE_CHILD, json.dumps(kv), str(model_dir("tiny")), str(tp)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pause_s"] == want_s
    assert got["busy"] < 0.01 and want_s <= got["idle"] < want_s + 0.2, got
    assert got["starting"] < 0.01, got
