"""An engine's ``VllmConfig`` and KV cache layout from its arguments, without starting it.

What the store tools (``mcstore.tools``) derive an engine's key space from when no engine
published one: vLLM reads the model's config (no weights) and lays the KV cache out as the
engine core would for stage 0. The running engine's side is :mod:`kvcore.vllm_glue`.
"""

from __future__ import annotations

from kvcore.vllm_glue import install_version_alias


def engine_vllm_config(model: str, kv_transfer_config: dict, *, block_size: int | None = None, dtype: str = "auto",
                       kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       prefix_caching_hash_algo: str = "sha256"):
    """The ``VllmConfig`` vLLM builds from these engine arguments (reads the model's config, no weights)."""
    install_version_alias()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        prefix_caching_hash_algo=prefix_caching_hash_algo,
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size, enforce_eager=True,
        distributed_executor_backend="mp" if tensor_parallel_size * pipeline_parallel_size > 1 else None,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config),
    )
    return args.create_engine_config()


def engine_kv_cache_layout(vllm_config):
    """The parts of the engine's ``KVCacheConfig`` that
    :func:`kvcore.vllm_glue.kv_fingerprint_fields` and
    :func:`kvcore.vllm_glue.require_full_attention` read (``kv_cache_groups``,
    ``kv_cache_layout``), computed as the engine core does for stage 0: the platform's default
    attention backend customizes each decoder layer's spec (full attention, or vLLM's own
    ``Attention.get_kv_cache_spec`` for a sliding-window layer: ``layer_types`` /
    ``sliding_window`` as vLLM's Llama reads them), ``get_kv_cache_groups`` groups them
    (promoting sliding windows to full attention when the hybrid allocator is off),
    ``resolve_kv_cache_layout`` picks the layout. MLA, Mamba and chunked-local models are
    refused (:class:`kvcore.errors.ConfigError`)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from kvcore.errors import ConfigError

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if model.use_mla or getattr(model, "is_hybrid", False) or getattr(model, "attention_chunk_size", None):
        raise ConfigError("only full-attention and sliding-window decoder models are laid out without an "
                          "engine; use the fingerprint a running engine published instead")
    with set_current_vllm_config(vllm_config):
        backends = get_current_attn_backends(vllm_config)
    backend = backends[0]
    dtype = STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype] if cache.cache_dtype != "auto" else model.dtype
    try:  # the worker's helper (vLLM 0.32); older releases only have the backend's classmethod
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:
        def customize_attention_spec(b, spec):
            return b.customize_spec(spec)
    full = customize_attention_spec(backend, FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
    ))
    hf = model.hf_text_config
    types = getattr(hf, "layer_types", None)

    def layer_spec(i: int):
        window = hf.sliding_window if types and types[i] == "sliding_attention" else None
        window = window if window is not None else cache.sliding_window  # every layer slides
        if window is None:
            return full
        # vLLM's own method on a stand-in layer: it picks the sliding-window block size.
        layer = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype=cache.cache_dtype,
                                sliding_window=window, attn_backend=backend, num_kv_heads=full.num_kv_heads,
                                head_size=full.head_size, head_size_v=full.head_size_v, kv_cache_torch_dtype=dtype)
        return customize_attention_spec(backend, Attention.get_kv_cache_spec(layer, vllm_config))

    start, _ = model.get_layers_start_end_indices(parallel)
    n_layers = model.get_num_layers_by_block_type(parallel, "attention")
    specs = {f"model.layers.{i}.self_attn.attn": layer_spec(i) for i in range(start, start + n_layers)}
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    groups = get_kv_cache_groups(vllm_config, specs)  # may promote specs in place: after the layout
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=layout.name)
