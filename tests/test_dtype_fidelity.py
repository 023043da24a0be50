"""Both tiers in the dtype this machine does NOT choose by default (float32 on a CPU with
native bf16, bf16 on an AVX2-only one), so every CPU class exercises both dtypes: a
store hit across engines and a P2P handoff, each against a no-connector engine of the
same dtype, plus a negative control in that dtype.

The deployment is the fault suite's (``TieredConnector`` prefill and decode instances,
the proxy, a master and store server), started in the other dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.platform import engine_dtype
from tests.conftest import Baseline
from tests.harness import BLOCK, cached_tokens, kv_bytes_per_token, prompt_ids
from tests.store_util import raw_client
from tests.support import CHUNK, Dep, counter, fault_cluster, plan_sources, toks, wait_for

pytestmark = pytest.mark.e2e

OTHER = "float32" if engine_dtype() == "bfloat16" else "bfloat16"
PREFIX = 2 * CHUNK


@pytest.fixture(scope="module")
def cluster():
    yield from fault_cluster()


@pytest.fixture(scope="module")
def ref():
    b = Baseline(dtype=OTHER)
    yield b
    b.close()


@pytest.fixture(scope="module")
def dep(cluster, ref):
    d = Dep(cluster, ref, name=f"dtype-{OTHER}", dtype=OTHER)
    yield d
    d.stop()


def test_engines_run_the_other_dtype(dep):
    assert OTHER != engine_dtype()
    for e in (dep.P, dep.D):
        assert ["--dtype", OTHER] == e.proc.argv[e.proc.argv.index("--dtype"):][:2]
        assert f"dtype=torch.{OTHER}" in e.proc.log_path.read_text()


def _save(dep, p) -> None:
    saved = counter(dep.P, "store_saved_tokens")
    dep.P.complete(p, 1)  # straight to the prefill instance: it computes p and saves its chunks
    assert wait_for(lambda: counter(dep.P, "store_saved_tokens") >= saved + PREFIX, 60)


def test_store_hit_across_engines(dep, ref):
    p = prompt_ids(PREFIX + 88, 7001)
    q = p[:PREFIX] + prompt_ids(100, 7002)
    _save(dep, p)
    loaded = counter(dep.D, "store_loaded_bytes")
    r = dep.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    assert plan_sources(r) == ["store", "recompute"]
    assert cached_tokens(r) == PREFIX
    # KV bytes follow the dtype: float32 moves twice what bf16 does.
    assert counter(dep.D, "store_loaded_bytes") - loaded == PREFIX * kv_bytes_per_token(dep.model, OTHER)
    assert toks(r) == ref.tokens(q, 8, cached_prefix=PREFIX, writers=[p])


def test_p2p_handoff(dep, ref):
    # N = 32k + 1: the decode instance loads [0, N-1) and computes the last token, and the
    # reference repeats exactly that split (the prompt twice; the second run has N-1 cached).
    n = 20 * BLOCK + 1
    prompt = prompt_ids(n, 7101)
    pulled = counter(dep.D, "p2p_bytes", kind="pulled")
    r = dep.complete(prompt, 8, kv_source="p2p")
    assert plan_sources(r) == ["p2p", "recompute"]
    assert counter(dep.D, "p2p_bytes", kind="pulled") - pulled == (n - 1) * kv_bytes_per_token(dep.model, OTHER)
    assert toks(r) == ref.tokens(prompt, 8, cached_prefix=n - 1, writers=[prompt])


def test_negative_control_noise_changes_tokens(dep, ref):
    """The same store hit with every stored byte replaced by noise gives other tokens: the
    checks above can fail in this dtype too."""
    p = prompt_ids(PREFIX + 88, 7201)
    q = p[:PREFIX] + prompt_ids(100, 7202)
    _save(dep, p)
    raw = raw_client(dep.cluster.master_addr)
    try:
        rng = np.random.default_rng(0)
        for key in dep.keys(p)[:PREFIX // CHUNK]:
            size = raw.get_size(key)
            assert size > 0, key
            assert raw.upsert(key, (rng.standard_normal(size // 4) * 3).astype(np.float32).tobytes()) == 0
    finally:
        raw.close()
    r = dep.D.complete(q, 8, kv_transfer_params={"kv_source": "store"})
    assert cached_tokens(r) == PREFIX
    assert toks(r) != ref.tokens(q, 8, cached_prefix=PREFIX, writers=[p])
