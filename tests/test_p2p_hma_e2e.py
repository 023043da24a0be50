"""The P2P handoff with vLLM's hybrid allocator on (``P2PConnector`` declares ``SupportsHMA``),
real prefill (core 0) and decode (core 1) engines and the real ``mctier proxy``, for both
sliding-window test models: ``tiny-swa`` (a sliding group and a full group) and ``tiny-swa-all``
(one sliding group of both layers). The handoff moves each group at its own block ids, a
sliding group's window only (``p2p.groups``): the bytes pulled are exactly that, and the greedy
ids are a no-connector engine's (hybrid allocator on too) for the same one-pass prefill.
Negative control: the sliding group's bytes corrupted in transit (the decode's
``debug_corrupt_received_kv`` limited to that group) change the tokens. The same handoff with
the composite declaring ``SupportsHMA`` (``TieredHMAConnector``, store and P2P tiers) as
the decode, for ``tiny-swa``.
"""

from __future__ import annotations

import pytest
import requests

from kvcore.procs import free_port
from tests.harness import (
    BLOCK,
    Engine,
    cached_tokens,
    model_dir,
    page_bytes,
    prompt_ids,
    reference_tokens,
    start_engines,
    start_proxy,
)
from tests.support import wait_metric

pytestmark = pytest.mark.e2e

PREFIX = 512  # far beyond the 64-token window
MAX_TOKENS = 8
WINDOW = 64
# (sliding group, layers of each group) with the hybrid allocator on (tests/test_layouts_hybrid.py)
LAYOUT = {"tiny-swa": (0, {0: 1, 1: 1}), "tiny-swa-all": (0, {0: 2})}


def _decode_kv(connector: str, p2p: dict, master: str | None) -> dict:
    if connector == "p2p":
        return {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": p2p}
    # The plan is forced to the prefill instance (default_source): the test is about the handoff.
    return {"kv_connector": "TieredHMAConnector", "kv_connector_module_path": "multi", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                "store": {"master": master, "chunk_tokens": 128}, "p2p": p2p, "default_source": "p2p"}}


# The decode connectors tried per model: a model's decodes share its prefill and reference.
CONNECTORS = {"tiny-swa": ("p2p", "tiered"), "tiny-swa-all": ("p2p",)}


class _Group:
    """Per model: a prefill (dev mode: its prefix cache is emptied before another decode's
    tests), a no-connector reference and, per decode connector, a decode (corrupting the
    sliding group's received bytes while its flag file exists) behind a proxy of its own, all
    with the hybrid allocator on. All of a model's engines start at once."""

    def __init__(self, preset: str, master: str | None, tmp_path_factory):
        sliding, _ = LAYOUT[preset]
        model = model_dir(preset)
        boot = free_port()
        self.p = Engine(f"hma-p2p-P-{preset}", 0, model=model, dev_mode=True, kv_config={
            "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"bootstrap_port": boot, "abort_timeout_s": 300}})
        self.ref = Engine(f"hma-p2p-ref-{preset}", 0, model=model, dev_mode=True, pinned=False)
        self.d, self.flag, self.url, self.proxies, self.used = {}, {}, {}, [], set()
        for connector in CONNECTORS[preset]:
            self.flag[connector] = tmp_path_factory.mktemp(f"hma-{preset}-{connector}") / "corrupt-now"
            self.d[connector] = Engine(f"hma-{connector}-D-{preset}", 1, model=model, kv_config=_decode_kv(
                connector, {"transfer_timeout_s": 30, "debug_corrupt_received_kv": str(self.flag[connector]),
                            "debug_corrupt_kv_groups": [sliding]}, master))
        try:
            start_engines(self.p, self.ref, *self.d.values())
            for connector, d in self.d.items():
                proxy, self.url[connector] = start_proxy(f"hma-proxy-{preset}-{connector}",
                                                         f"{self.p.url}@http://127.0.0.1:{boot}", d.url, 120, wait_s=90)
                self.proxies.append(proxy)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for proxy in self.proxies:
            proxy.stop(grace=5)
        for e in (self.p, *self.d.values(), self.ref):
            e.stop()


@pytest.fixture(scope="module")
def groups():
    """Each model's group, started on first use; another model's is stopped first."""
    started: dict[str, _Group] = {}

    def get(preset: str, master: str | None, tmp_path_factory) -> _Group:
        for other in [k for k in started if k != preset]:
            started.pop(other).stop()
        if preset not in started:
            started[preset] = _Group(preset, master, tmp_path_factory)
        return started[preset]

    yield get
    for g in started.values():
        g.stop()


@pytest.fixture(scope="module", params=[("tiny-swa", "p2p"), ("tiny-swa", "tiered"), ("tiny-swa-all", "p2p")],
                ids=lambda p: "-".join(p))
def hma_pd(request, groups, tmp_path_factory):
    """Per model and decode connector: the prefill (its prefix cache empty, as if fresh), the
    decode, the reference, the proxy to that decode and the decode's flag file."""
    preset, connector = request.param
    master = request.getfixturevalue("store_cluster").master_addr if "tiered" in CONNECTORS[preset] else None
    g = groups(preset, master, tmp_path_factory)
    if g.used:  # another decode's tests ran on this prefill: the same prompts must be computed again
        g.p.reset_prefix_cache()
    g.used.add(connector)
    yield preset, connector, g.p, g.d[connector], g.ref, g.url[connector], g.flag[connector]


def _handoff(url: str, prompt: list[int]) -> dict:
    r = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_hybrid_handoff_matches_reference_window_only(hma_pd):
    """Each group pulled at its own block ids: the full group's every prompt block, the sliding
    group's blocks from the window of the prompt's end on only; the tokens are the reference's."""
    preset, connector, p, d, ref, url, _ = hma_pd
    sliding, layers = LAYOUT[preset]
    prompt = prompt_ids(PREFIX + 1, 91 if preset == "tiny-swa" else 92)
    before = d.metric("vllm:mctier_p2p_bytes_total", kind="pulled")
    body = _handoff(url, prompt)
    assert cached_tokens(body) >= PREFIX
    # The prefill computed the prompt in one pass; the decode recomputes its last token against
    # the pulled KV: the reference is that one pass.
    assert body["choices"][0]["token_ids"] == reference_tokens(ref, prompt, MAX_TOKENS)
    # The P2P tier alone loads the whole prompt (vLLM then recomputes its last token); the
    # composite's plan all but the last token, which the decode computes.
    n = len(prompt) if connector == "p2p" else len(prompt) - 1
    total = -(-n // BLOCK)
    kept = total - max(0, n - WINDOW + 1) // BLOCK  # vLLM's first kept block of the window
    assert (kept, total) == ((3, 17) if connector == "p2p" else (2, 16))  # a sliding group's 3 of 17
    want = sum((kept if g == sliding else total) * k for g, k in layers.items()) * page_bytes(d)
    pulled = wait_metric(lambda: d.metric("vllm:mctier_p2p_bytes_total", kind="pulled") - before,
                         lambda v: v >= want, 10)
    assert pulled == want
    assert d.metric("vllm:mctier_p2p_pulls_total", kind="ok") >= 1
    # 543 tokens: the last token's window starts in block 14, a block before first_kept(543) = 15
    # (n - window + 1 = 480 is a multiple of the block size). Pulled, or refused by the prefill and
    # recomputed (a composite's plan): the reference's tokens either way.
    edge = prompt_ids(543, 95 if preset == "tiny-swa" else 96)
    assert _handoff(url, edge)["choices"][0]["token_ids"] == reference_tokens(ref, edge, MAX_TOKENS)


def test_hybrid_handoff_negative_control_corrupted_sliding_group(hma_pd):
    """The sliding group's pulled bytes corrupted (the full group's intact): the decode uses them,
    and the tokens are no longer the reference's."""
    preset, _, p, d, ref, url, flag = hma_pd
    prompt = prompt_ids(PREFIX + 1, 93 if preset == "tiny-swa" else 94)
    want = reference_tokens(ref, prompt, MAX_TOKENS)
    flag.write_text("on")
    try:
        body = _handoff(url, prompt)
    finally:
        flag.unlink()
    assert cached_tokens(body) >= PREFIX
    assert body["choices"][0]["token_ids"] != want
    assert d.metric("vllm:mctier_p2p_failures_total", kind="layout") == 0
