"""KV events (``vllm.distributed.kv_events``) as vLLM's own block pool builds them, for the
tiers that announce what they store (:mod:`mcstore.events`). vLLM is imported inside the
functions: this module loads without it."""

from __future__ import annotations


def kv_events_enabled(vllm_config) -> bool:
    """Whether the engine publishes KV events (``--kv-events-config`` with events on)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def block_stored_event(request, first_block: int, end_block: int, block_size: int, medium: str, group: int = 0):
    """vLLM's ``BlockStored`` for the request's hash blocks ``[first_block, end_block)``: their
    hashes in vLLM's external form, the parent's, the token ids, each block's extra keys (LoRA,
    multimodal, cache salt), in the shape ``vllm.v1.core.block_pool`` gives the engine's own
    events; None when the request's block hashes do not cover those blocks."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

    hashes = getattr(request, "block_hashes", None) or []
    if end_block > len(hashes) or first_block >= end_block:
        return None
    extra, mm = [], 0
    for b in range(first_block, end_block):
        keys, mm = generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, mm)
        extra.append(keys)
    lora = getattr(request, "lora_request", None)
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[first_block:end_block]],
        parent_block_hash=maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None,
        token_ids=list(request.all_token_ids[first_block * block_size:end_block * block_size]),
        block_size=block_size, lora_id=lora.adapter_id if lora else None, medium=medium,
        lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra), group_idx=group,
        session_id=getattr(request, "session_id", None))


def block_removed_event(block_hashes: list, medium: str, group: int = 0):
    """vLLM's ``BlockRemoved`` of blocks named by their external hashes (as in a ``BlockStored``)."""
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(block_hashes), medium=medium, group_idx=group)
