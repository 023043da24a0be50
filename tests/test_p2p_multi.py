"""The P2P tier as a child of vLLM's stock MultiConnector (both roles), real engines:
the handoff still reproduces the baseline's tokens, telemetry goes through
MultiConnector's Prometheus wrapper without tripping it, and a failed handoff still
recomputes."""

from __future__ import annotations

import pytest
import requests

from kvcore.procs import free_port
from tests.harness import BLOCK, Engine, cached_tokens, prompt_ids

pytestmark = pytest.mark.e2e


def _multi(role: str, extra: dict, **top) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": role, **top,
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": role,
                 "kv_connector_extra_config": extra}]}}


@pytest.fixture(scope="module")
def pair(baseline):
    boot_port = free_port()
    P = Engine("p2p-multi-P", 0, kv_config=_multi("kv_producer", {"bootstrap_port": boot_port}))
    D = Engine("p2p-multi-D", 1, kv_config=_multi("kv_consumer", {"transfer_timeout_s": 20, "bootstrap_timeout_s": 2},
                                                  kv_load_failure_policy="recompute"))
    try:
        baseline.tokens(prompt_ids(300, 21), 8)
        P.wait_ready()
        D.wait_ready()
        yield P, D, f"http://127.0.0.1:{boot_port}"
    finally:
        P.stop()
        D.stop()


def test_handoff_under_multiconnector(pair, baseline):
    P, D, boot = pair
    eid = requests.get(boot + "/query", timeout=5).json()["0"]["engine_id"]
    for i, n in enumerate((300, 1000)):
        prompt = prompt_ids(n, 21 + i)
        tid = f"xfer-multi-{i}"
        P.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        out = D.complete(prompt, 8, kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid,
                                                        "remote_engine_id": eid, "remote_bootstrap_addr": boot})
        assert out["choices"][0]["token_ids"] == baseline.tokens(prompt, 8)
        assert cached_tokens(out) >= (n // BLOCK) * BLOCK
    # Our counters reach /metrics through MultiConnector's prom wrapper (no assertion crash).
    import time

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and D.metric("vllm:mctier_p2p_pulls_total", kind="ok") < 2:
        time.sleep(0.3)
    assert D.metric("vllm:mctier_p2p_pulls_total", kind="ok") == 2
    assert P.metric("vllm:mctier_p2p_holds_total", kind="released") == 2
    assert P.proc.alive() and D.proc.alive()


def test_failed_handoff_recomputes_under_multiconnector(pair, baseline):
    P, D, boot = pair
    prompt = prompt_ids(300, 29)
    out = D.complete(prompt, 8, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "xfer-none",
                                                    "remote_engine_id": "nobody",
                                                    "remote_bootstrap_addr": f"127.0.0.1:{free_port()}"})
    assert out["choices"][0]["token_ids"] == baseline.tokens(prompt, 8)
    assert D.proc.alive()
