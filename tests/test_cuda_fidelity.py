"""The CPU fidelity checks of both tiers, on GPU engines: for the day a GPU machine runs them.

The CUDA path is experimental (README): reviewed on paper and unit-tested with CPU tensors
standing in (``tests/test_pages.py``), never run on a GPU. This module is what running it
means: ``TieredConnector`` prefill (P) and decode (D) engines on the GPU, a real
mooncake_master and store server, ``mctier proxy``, and a no-connector reference engine on
the GPU too; greedy token ids compared with the reference computing the same split (as in
``tests/test_dtype_fidelity.py``, ``tests/test_store_e2e.py``, ``tests/test_p2p_e2e.py``):

* a store hit across engines (KV saved from and loaded into device memory);
* a store hit whose first chunk is partly in D's own prefix cache: the partial-chunk copy
  from host staging into device pages (``kvcore.pages``; a host ``memmove`` before);
* a P2P handoff through the proxy;
* a negative control (stored bytes replaced by noise change the tokens);
* with two GPUs, the same with tensor parallel 2, where rank 1's KV is on ``cuda:1`` and
  must be registered there (it was always ``cuda:0`` before).

Needs the ``cuda`` extra (vLLM and Mooncake built with CUDA). Without a CUDA device the
whole module is skipped, and ``pytest -ra`` prints why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no GPU; "
                "these GPU-engine fidelity checks run on a machine with a GPU and the 'cuda' extra",
                allow_module_level=True)

from kvcore.procs import free_port  # noqa: E402
from tests.conftest import Baseline  # noqa: E402
from tests.harness import (  # noqa: E402
    BLOCK,
    Engine,
    cached_tokens,
    kv_bytes_per_token,
    model_dir,
    prompt_ids,
    start_engines,
    start_proxy,
)
from tests.store_util import all_keys, raw_client  # noqa: E402
from tests.support import CHUNK, counter, plan_sources, tiered, toks, wait_for  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.e2e]

DTYPE = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
PREFIX = 2 * CHUNK
MEM = "0.2"  # three engines (P, D, reference) share a GPU; the tiny model needs little


def gpu_engine(name: str, gpus: str, kv_config: dict | None = None, tp: int = 1, dev_mode: bool = False) -> Engine:
    """A ``mctier serve`` engine on the GPUs ``gpus`` (CUDA_VISIBLE_DEVICES), not the CPU platform."""
    extra = ["--gpu-memory-utilization", MEM] + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
    return Engine(name, 0, kv_config=kv_config, model=model_dir("tiny"), extra_args=extra, dtype=DTYPE,
                  dev_mode=dev_mode, env={"VLLM_TARGET_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": gpus})


class GpuDep:
    """P and D (``TieredConnector``) on ``gpus`` with tensor parallel ``tp``, and the proxy."""

    def __init__(self, cluster, name: str, gpus: str, tp: int = 1):
        self.cluster = cluster
        self.boot_port = free_port()
        self.boot = f"http://127.0.0.1:{self.boot_port}"
        self.P = gpu_engine(f"{name}-P", gpus, tiered("kv_producer", cluster.master_addr, self.boot_port,
                                                      abort_timeout_s=300.0), tp)
        self.D = gpu_engine(f"{name}-D", gpus, tiered("kv_consumer", cluster.master_addr, free_port(),
                                                      transfer_timeout_s=30.0), tp)
        self.proxy = None
        try:
            start_engines(self.P, self.D)
            self.proxy, self.url = start_proxy(f"{name}-proxy", f"{self.P.url}@{self.boot}", self.D.url, 120)
        except BaseException:
            self.stop()
            raise

    def complete(self, prompt, max_tokens: int = 8, **kv) -> dict:
        import requests

        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **({"kv_transfer_params": kv} if kv else {})}
        r = requests.post(self.url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for e in (self.P, self.D):
            e.stop()


@pytest.fixture(scope="module")
def ref():
    """The no-connector reference, on the GPU as well (a CPU reference computes other bits)."""
    b = Baseline(dtype=DTYPE)
    b._engine = start_engines(gpu_engine("cuda-ref", "0", dev_mode=True))[0]
    yield b
    b.close()


@pytest.fixture(scope="module")
def dep(store_cluster, ref):
    d = GpuDep(store_cluster, "cuda", "0")
    yield d
    d.stop()


def _save(e: Engine, p) -> None:
    saved = counter(e, "store_saved_tokens")
    e.complete(p, 1)  # straight to the prefill instance: it computes p and saves its full chunks
    want = len(p) // CHUNK * CHUNK
    assert wait_for(lambda: counter(e, "store_saved_tokens") >= saved + want, 60), "prefix not saved"


def test_engines_run_on_the_gpu(dep):
    for e in (dep.P, dep.D):
        log = e.proc.log_path.read_text()
        assert "cuda" in log.lower() and f"dtype=torch.{DTYPE}" in log, e.name


def test_store_hit_across_engines(dep, ref):
    p = prompt_ids(PREFIX + 88, 8001)
    q = p[:PREFIX] + prompt_ids(100, 8002)
    _save(dep.P, p)
    loaded = counter(dep.D, "store_loaded_bytes")
    r = dep.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    assert plan_sources(r) == ["store", "recompute"]
    assert cached_tokens(r) == PREFIX
    assert counter(dep.D, "store_loaded_bytes") - loaded == PREFIX * kv_bytes_per_token(dep.D.model, DTYPE)
    assert toks(r) == ref.tokens(q, 8, cached_prefix=PREFIX, writers=[p])


def test_store_hit_with_the_head_chunk_partly_cached(dep, ref):
    """D holds blocks 0-1 of the prefix itself, so chunk 0 is loaded from block 2 on: fetched
    whole into host staging and its pages copied into GPU blocks (the path that used
    ``memmove`` on device pointers). P and the reference make the same passes (w, then p),
    so every byte of the expected KV has one origin."""
    p = prompt_ids(PREFIX + 88, 8101)
    w = p[:2 * BLOCK] + prompt_ids(40, 8102)  # shares exactly two blocks with p
    q = p[:PREFIX] + prompt_ids(100, 8103)
    dep.P.complete(w, 1)
    _save(dep.P, p)
    dep.D.complete(w, 1)  # D caches blocks 0-1 of p (no full chunk: nothing to load or save)
    loaded = counter(dep.D, "store_loaded_bytes")
    r = dep.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    assert "store" in plan_sources(r)
    assert cached_tokens(r) == PREFIX
    assert counter(dep.D, "store_loaded_bytes") - loaded == (PREFIX - 2 * BLOCK) * kv_bytes_per_token(
        dep.D.model, DTYPE)
    assert toks(r) == ref.tokens(q, 8, cached_prefix=PREFIX, writers=[w, p])


def test_p2p_handoff(dep, ref):
    # N = 32k + 1: D loads [0, N-1) and computes the last token; the reference repeats that split.
    n = 20 * BLOCK + 1
    prompt = prompt_ids(n, 8201)
    pulled = counter(dep.D, "p2p_bytes", kind="pulled")
    r = dep.complete(prompt, 8, kv_source="p2p")
    assert plan_sources(r) == ["p2p", "recompute"]
    assert counter(dep.D, "p2p_bytes", kind="pulled") - pulled == (n - 1) * kv_bytes_per_token(dep.D.model, DTYPE)
    assert toks(r) == ref.tokens(prompt, 8, cached_prefix=n - 1, writers=[prompt])


def test_negative_control_noise_changes_tokens(dep, ref):
    """Stored bytes replaced by noise give other tokens: the checks above can fail on a GPU."""
    p = prompt_ids(PREFIX + 88, 8301)
    q = p[:PREFIX] + prompt_ids(100, 8302)
    before = all_keys(dep.cluster)
    _save(dep.P, p)
    new = sorted(all_keys(dep.cluster) - before)
    assert len(new) == PREFIX // CHUNK, new
    raw = raw_client(dep.cluster.master_addr)
    try:
        rng = np.random.default_rng(0)
        for key in new:
            size = raw.get_size(key)
            assert size > 0, key
            assert raw.upsert(key, (rng.standard_normal(size // 4) * 3).astype(np.float32).tobytes()) == 0
    finally:
        raw.close()
    r = dep.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    assert cached_tokens(r) == PREFIX
    assert toks(r) != ref.tokens(q, 8, cached_prefix=PREFIX, writers=[p])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel 2 needs two CUDA devices")
def test_tensor_parallel_2_registers_each_rank_on_its_own_gpu(store_cluster, dep):
    """TP 2 on both sides: rank 1's KV is on cuda:1, and registered as cuda:0 (as before) a
    GPUDirect read would address the wrong GPU. A handoff and a store hit match a no-connector
    TP-2 reference (TP changes the arithmetic, so the TP-1 reference does not apply)."""
    dep.stop()  # room on GPU 0 for the TP-2 engines (the module fixture's stop() is then a no-op)
    ref2 = Baseline(dtype=DTYPE)
    tp = None
    try:
        ref2._engine = start_engines(gpu_engine("cuda-ref-tp2", "0,1", tp=2, dev_mode=True))[0]
        tp = GpuDep(store_cluster, "cuda-tp2", "0,1", tp=2)
        n = 12 * BLOCK + 1
        prompt = prompt_ids(n, 8401)
        pulled = counter(tp.D, "p2p_bytes", kind="pulled")
        r = tp.complete(prompt, 8, kv_source="p2p")
        assert plan_sources(r) == ["p2p", "recompute"]
        # Both ranks' halves of every page arrived.
        assert counter(tp.D, "p2p_bytes", kind="pulled") - pulled == (n - 1) * kv_bytes_per_token(tp.D.model, DTYPE)
        assert toks(r) == ref2.tokens(prompt, 8, cached_prefix=n - 1, writers=[prompt])
        p = prompt_ids(PREFIX + 88, 8402)
        q = p[:PREFIX] + prompt_ids(100, 8403)
        _save(tp.P, p)
        r = tp.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
        assert plan_sources(r) == ["store", "recompute"] and cached_tokens(r) == PREFIX
        assert toks(r) == ref2.tokens(q, 8, cached_prefix=PREFIX, writers=[p])
    finally:
        if tp is not None:
            tp.stop()
        ref2.close()
