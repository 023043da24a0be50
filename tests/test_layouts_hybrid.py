"""Hybrid KV caches, without a vLLM engine: the tiers' shared start-up check
(``kvcore.vllm_glue.require_full_attention``) on vLLM's own spec classes, and on the layouts
vLLM computes for the sliding-window test models (``multi.cli.models``: ``tiny-swa`` interleaves
sliding and full layers, ``tiny-swa-all`` slides on every layer) under each connector, as
its engine core would (``kvcore.vllm_layout.engine_kv_cache_layout``). The same models in real
engines: ``tests/test_layouts_e2e.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcore.errors import ConfigError
from kvcore.tier import Tier
from tests.harness import model_dir

pytestmark = pytest.mark.unit

CHUNK, BS, BLOCKS = 64, 32, 64


def _spec(kind: str):
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    kw = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return {
        "full": lambda: FullAttentionSpec(**kw),
        # What vLLM makes of a mixed model's sliding layers with the hybrid allocator off.
        "full+window": lambda: FullAttentionSpec(**kw, sliding_window=64),
        "full+chunk": lambda: FullAttentionSpec(**kw, attention_chunk_size=128),
        "mla": lambda: MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        "uniform-full": lambda: UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
            "a": FullAttentionSpec(**kw), "b": FullAttentionSpec(**{**kw, "num_kv_heads": 4})}),
        "sliding": lambda: SlidingWindowSpec(**kw, sliding_window=64),
        "chunked": lambda: ChunkedLocalAttentionSpec(**kw, attention_chunk_size=128),
        "mamba": lambda: MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,)),
        "rswa": lambda: RSWASpec(**kw, rswa_window=16),
        "uniform-sliding": lambda: UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
            "a": SlidingWindowSpec(**kw, sliding_window=64), "b": SlidingWindowSpec(**kw, sliding_window=64)}),
    }[kind]()


def _layout(*kinds: str):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], _spec(k)) for i, k in enumerate(kinds)])


_VC = SimpleNamespace(model_config=SimpleNamespace(model="/m/hybrid"))


@pytest.mark.parametrize("kind", ["full", "full+window", "full+chunk", "mla", "uniform-full"])
def test_a_page_for_every_token_is_accepted(kind):
    from kvcore.vllm_glue import require_full_attention

    require_full_attention(_VC, _layout(kind), "mcstore StoreConnector")


@pytest.mark.parametrize("kinds,needles", [
    (("sliding",), ["SlidingWindowSpec (window 64 tokens)", "behind the window", "--disable-sliding-window"]),
    (("chunked",), ["ChunkedLocalAttentionSpec (chunk 128 tokens)", "earlier chunks"]),
    (("mamba",), ["MambaSpec", "per-request state"]),
    (("rswa",), ["RSWASpec", "not an attention spec the tiers know"]),
    (("uniform-sliding",), ["UniformTypeKVCacheSpecs", "behind the window"]),
    (("full", "sliding"), ["2 KV cache groups", "group 0: FullAttentionSpec", "group 1: SlidingWindowSpec",
                           "only the first group's blocks"]),
    (("full", "mamba"), ["2 KV cache groups", "group 1: MambaSpec"]),
    ((), ["no KV cache group"]),
])
def test_partial_layouts_are_refused_with_the_reason(kinds, needles):
    from kvcore.vllm_glue import require_full_attention

    with pytest.raises(ConfigError) as e:
        require_full_attention(_VC, _layout(*kinds), "p2p P2PConnector")
    msg = str(e.value)
    assert msg.startswith("p2p P2PConnector: model '/m/hybrid' has a KV cache layout this connector cannot")
    for needle in needles:
        assert needle in msg, (needle, msg)


CONNECTORS = {
    "store": {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
              "kv_connector_extra_config": {"master": "127.0.0.1:1", "chunk_tokens": CHUNK}},
    "p2p": {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_both",
            "kv_connector_extra_config": {}},
    "tiered": {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": "kv_both",
               "kv_connector_extra_config": {"store": {"master": "127.0.0.1:1", "chunk_tokens": CHUNK}, "p2p": {}}},
    "tiered-hma": {"kv_connector": "TieredHMAConnector", "kv_connector_module_path": "multi", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"store": {"master": "127.0.0.1:1", "chunk_tokens": CHUNK},
                                                 "p2p": {}}},
}
WHO = {"store": "mcstore StoreConnector", "p2p": "p2p P2PConnector", "tiered": "multi TieredConnector",
       "tiered-hma": "multi TieredHMAConnector"}


@pytest.fixture(scope="module")
def swa():
    """``(VllmConfig, the engine's KV cache groups)`` of each sliding-window model under each
    connector, computed by vLLM's code as its engine core would (no engine)."""
    from kvcore.vllm_layout import engine_kv_cache_layout, engine_vllm_config

    out = {}
    for preset in ("tiny-swa", "tiny-swa-all"):
        model = str(model_dir(preset))
        for name, kv in CONNECTORS.items():
            vc = engine_vllm_config(model, kv, block_size=BS, dtype="bfloat16")
            out[preset, name] = vc, engine_kv_cache_layout(vc)
    return out


@pytest.mark.parametrize("connector", ["tiered"])
def test_interleaved_sliding_window_model_keeps_every_page(swa, connector):
    """``tiny-swa``: ``TieredConnector`` lacks SupportsHMA, so vLLM turns its hybrid
    allocator off and promotes the sliding layer to full attention: one group, a page for every
    token of both layers (the window only limits what attention reads). Accepted: the tiers move
    whole pages."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvcore.vllm_glue import require_full_attention
    from kvcore.vllm_layout import engine_kv_cache_layout, engine_vllm_config

    vc, layout = swa["tiny-swa", connector]
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is True
    (group,) = layout.kv_cache_groups
    assert len(group.layer_names) == 2 and type(group.kv_cache_spec) is FullAttentionSpec
    assert group.kv_cache_spec.sliding_window == 64
    require_full_attention(vc, layout, WHO[connector])
    # With the hybrid allocator on (vLLM's choice without a connector) the same model has two
    # groups, and the sliding one frees pages behind the window: that the check would refuse.
    hma = engine_vllm_config(str(model_dir("tiny-swa")), CONNECTORS[connector], block_size=BS, dtype="bfloat16")
    hma.scheduler_config.disable_hybrid_kv_cache_manager = False
    kinds = [type(g.kv_cache_spec).__name__ for g in engine_kv_cache_layout(hma).kv_cache_groups]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        require_full_attention(hma, engine_kv_cache_layout(hma), WHO[connector])


def test_the_p2p_tier_keeps_the_hybrid_allocator_and_serves_every_group(swa):
    """``P2PConnector`` declares SupportsHMA: vLLM keeps its hybrid allocator on, and the connector
    takes both sliding-window layouts (the handoff moves each group at its own
    block ids: ``p2p.groups``). With the allocator off by the operator's choice ``tiny-swa-all``
    still has its one sliding group, also served."""
    from kvcore.vllm_glue import KVConnectorRole, SupportsHMA
    from kvcore.vllm_layout import engine_kv_cache_layout, engine_vllm_config
    from p2p.connector import P2PConnector

    assert issubclass(P2PConnector, SupportsHMA)
    want = {"tiny-swa": [(1, 64), (1, None)], "tiny-swa-all": [(2, 64)]}
    for preset, groups in want.items():
        vc, layout = swa[preset, "p2p"]
        assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
        # (The worker role reads its groups in the same constructor; it needs vLLM's TP group.)
        c = P2PConnector(vc, KVConnectorRole.SCHEDULER, layout)
        assert [(len(g.layers), g.window) for g in c.groups] == groups
        assert c.scheduler.groups == c.groups
        assert c.get_loaded_kv_cache_group_ids(None) == tuple(range(len(groups)))
    off = engine_vllm_config(str(model_dir("tiny-swa-all")), CONNECTORS["p2p"], block_size=BS, dtype="bfloat16")
    off.scheduler_config.disable_hybrid_kv_cache_manager = True
    c = P2PConnector(off, KVConnectorRole.SCHEDULER, engine_kv_cache_layout(off))
    assert [(len(g.layers), g.window) for g in c.groups] == [(2, 64)]


@pytest.mark.parametrize("kinds,needles", [
    (("full", "mamba"), ["group 1: MambaSpec", "Mamba/SSM state"]),
    (("chunked",), ["ChunkedLocalAttentionSpec (chunk 128 tokens)", "earlier chunks"]),
])
def test_layouts_the_p2p_tier_refuses_are_named(kinds, needles):
    """What stays unsupported with SupportsHMA (Mamba/SSM state, chunked-local attention) is
    refused by name when the P2P connector is built, before it touches Mooncake."""
    from kvcore.vllm_glue import KVConnectorRole
    from kvcore.vllm_layout import engine_vllm_config
    from p2p.connector import P2PConnector

    vc = engine_vllm_config(str(model_dir("tiny")), CONNECTORS["p2p"], block_size=BS, dtype="bfloat16")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as e:
            P2PConnector(vc, role, _layout(*kinds))
        msg = str(e.value)
        assert msg.startswith("p2p P2PConnector: model ") and "cannot save or load" in msg, msg
        for needle in needles:
            assert needle in msg, (needle, msg)


def test_the_hma_composite_keeps_the_hybrid_allocator_and_refuses_a_tier_without_it(swa):
    """``TieredHMAConnector`` declares SupportsHMA (its built-in tiers both do): vLLM keeps its
    hybrid allocator on (``TieredConnector`` does not). A grouped layout with a configured tier
    that does not declare it is refused by name, before any tier is built."""
    import copy

    from kvcore.vllm_glue import KVConnectorRole, SupportsHMA
    from multi.connector import TieredConnector, TieredHMAConnector

    assert issubclass(TieredHMAConnector, SupportsHMA) and not issubclass(TieredConnector, SupportsHMA)
    for preset in ("tiny-swa", "tiny-swa-all"):
        vc, layout = swa[preset, "tiered-hma"]
        assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
        vc = copy.copy(vc)
        vc.kv_transfer_config = copy.deepcopy(vc.kv_transfer_config)
        vc.kv_transfer_config.kv_connector_extra_config["tiers"] = [
            {"name": "plain", "connector": "tests.test_layouts_hybrid:PlainTier"}]
        with pytest.raises(ConfigError) as e:
            TieredHMAConnector(vc, KVConnectorRole.SCHEDULER, layout)
        msg = str(e.value)
        assert msg.startswith(f"multi TieredHMAConnector: model '{model_dir(preset)}' has KV cache groups"), msg
        assert "['plain'] do not declare SupportsHMA" in msg and "--disable-hybrid-kv-cache-manager" in msg


class PlainTier(Tier):
    """A tier connector class that does not declare SupportsHMA (never built: the composite
    refuses it first)."""


def test_interleaved_window_is_part_of_the_fingerprint(swa):
    from kvcore.vllm_glue import kv_fingerprint_fields

    vc, layout = swa["tiny-swa", "store"]
    assert kv_fingerprint_fields(vc, layout)["groups"][0]["sliding_window"] == 64


@pytest.mark.parametrize("connector", ["tiered"])
def test_every_layer_sliding_model_is_refused_at_construction(swa, connector):
    """``tiny-swa-all``: every layer slides, so the specs are uniform and vLLM keeps one
    SlidingWindowSpec group even with the hybrid allocator off; its pages behind the window are
    freed (null blocks in the block table). The connectors without SupportsHMA refuse it in both
    roles, before they touch Mooncake."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvcore.vllm_glue import KVConnectorRole
    from mcstore.connector import StoreConnector
    from multi.connector import TieredConnector
    from p2p.connector import P2PConnector

    vc, layout = swa["tiny-swa-all", connector]
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is True
    (group,) = layout.kv_cache_groups
    assert type(group.kv_cache_spec) is SlidingWindowSpec and group.kv_cache_spec.sliding_window == 64
    cls = {"store": StoreConnector, "p2p": P2PConnector, "tiered": TieredConnector}[connector]
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as e:
            cls(vc, role, layout)
        msg = str(e.value)
        assert msg.startswith(f"{WHO[connector]}: model '{model_dir('tiny-swa-all')}'"), msg
        assert "SlidingWindowSpec (window 64 tokens)" in msg and "--disable-sliding-window" in msg


def test_the_store_tier_keeps_the_hybrid_allocator_and_serves_every_group(swa):
    """The store tier declares SupportsHMA: vLLM keeps its hybrid allocator on. ``tiny-swa`` then
    has a sliding group and a full one, ``tiny-swa-all`` one sliding group of both layers; the
    store tier serves both (``kvcore.kvgroups.kv_groups``), with the windows vLLM frees behind."""
    from kvcore.kvgroups import kv_groups, named

    vc, layout = swa["tiny-swa", "store"]
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = kv_groups(vc, layout, WHO["store"])
    assert [(len(g.layers), g.window) for g in groups] == [(1, 64), (1, None)] and named(groups)
    vc, layout = swa["tiny-swa-all", "store"]
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    (group,) = kv_groups(vc, layout, WHO["store"])
    assert len(group.layers) == 2 and group.window == 64 and group.tail_blocks() == 2


@pytest.mark.parametrize("kinds,windows", [
    (("full",), [None]), (("full+window",), [None]), (("sliding",), [64]), (("uniform-sliding",), [64]),
    (("sliding", "full"), [64, None]), (("uniform-full", "sliding"), [None, 64]), (("mla",), [None]),
])
def test_groups_the_store_tier_serves(kinds, windows):
    from kvcore.kvgroups import kv_groups

    groups = kv_groups(_VC, _layout(*kinds), "mcstore StoreConnector")
    assert [g.window for g in groups] == windows and [g.index for g in groups] == list(range(len(kinds)))


@pytest.mark.parametrize("kinds,needles", [
    (("mamba",), ["group 0: MambaSpec", "Mamba/SSM state"]),
    (("full", "mamba"), ["group 1: MambaSpec", "Mamba/SSM state"]),
    (("chunked",), ["ChunkedLocalAttentionSpec (chunk 128 tokens)", "earlier chunks"]),
    (("rswa",), ["RSWASpec", "not an attention spec the tiers know"]),
    ((), ["no KV cache group"]),
])
def test_groups_the_store_tier_refuses_are_named(kinds, needles):
    from kvcore.kvgroups import kv_groups

    with pytest.raises(ConfigError) as e:
        kv_groups(_VC, _layout(*kinds), "mcstore StoreConnector")
    msg = str(e.value)
    assert msg.startswith("mcstore StoreConnector: model '/m/hybrid' has a KV cache layout this connector cannot")
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_sliding_window_test_models_say_so_in_their_config():
    import json

    from multi.cli.models import describe

    interleaved, every = model_dir("tiny-swa"), model_dir("tiny-swa-all")
    c = json.loads((interleaved / "config.json").read_text())
    assert c["sliding_window"] == 64 and c["layer_types"] == ["sliding_attention", "full_attention"]
    c = json.loads((every / "config.json").read_text())
    assert c["sliding_window"] == 64 and c.get("layer_types") is None
    assert describe(interleaved).endswith("64-token sliding window (1 full-attention layer in 2)")
    assert describe(every).endswith("64-token sliding window (every layer)")


def test_the_tools_derive_a_hybrid_engines_group_keys():
    """``mctier`` tools derive an engine's key space from its settings (no engine): for the
    hybrid layouts the store tier serves, the same group-named keys the engine's connector uses."""
    from mcstore.tools.engine import derive_meta

    for preset, groups in (("tiny-swa", 2), ("tiny-swa-all", 1)):
        meta = derive_meta(str(model_dir(preset)), CONNECTORS["store"], block_size=BS, dtype="bfloat16")
        ks = meta.key_space()
        assert meta.groups == ks.groups == groups and not meta.partial_hits
        assert ks.all_rank_keys(["L"]) == [f"L/g{g}tp0" for g in range(groups)]
        assert [g.get("sliding_window") for g in meta.fields["groups"]] == [64, None][:groups]
