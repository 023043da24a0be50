"""A model's KV cache groups as a tier that declares vLLM's ``SupportsHMA`` moves them.

With vLLM's hybrid allocator on, each KV cache group has its own block table (one block id
list per group in ``KVCacheBlocks.get_block_ids()``): a full-attention group keeps a page for
every token; a sliding-window group of window ``w`` keeps, once ``n`` tokens are computed, only
its blocks from ``max(0, n - w + 1 - extra) // block_size`` on (vLLM's
``SlidingWindowManager.get_num_skipped_tokens``, ``extra`` its ``extra_retained_tokens``), and
the blocks before are freed and replaced by the null block (id 0). So a hit that ends at token
``n`` needs of a sliding group only its blocks ``[first_kept(n), ceil(n / block_size))``: the
last ``tail_blocks`` blocks before ``n``.

:func:`kv_groups` classifies an engine's groups and refuses (:class:`kvcore.errors.ConfigError`)
what no tier can move: Mamba/SSM state (per-request state, not a page per token block),
chunked-local attention (its pages of earlier chunks are freed; no test model here exercises
it), and any spec the tiers do not know. The store tier, the P2P tier and ``TieredHMAConnector``
declare ``SupportsHMA``; ``TieredConnector`` does not and keeps
:func:`kvcore.vllm_glue.require_full_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.errors import ConfigError

NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block: the first block the pool hands out)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers, block size, and sliding window (None: full attention)."""

    index: int
    layers: tuple[str, ...]
    block_size: int
    window: int | None = None
    extra: int = 0  # vLLM's extra_retained_tokens of a sliding group

    def first_kept(self, tokens: int) -> int:
        """The first block vLLM keeps of this group once ``tokens`` tokens are computed."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.extra) // self.block_size

    def tail_blocks(self) -> int | None:
        """Blocks a sliding group keeps before a block boundary (None: every block)."""
        if self.window is None:
            return None
        return -(-(self.window - 1 + self.extra) // self.block_size)


def spec_kind(spec) -> tuple[str, int | None, int, str | None]:
    """``(description, window, extra, why it is refused or None)`` of one group's spec, for a
    tier that serves groups (a sliding group is accepted: ``window`` says its window). The
    tiers without ``SupportsHMA`` refuse windows too (:func:`kvcore.vllm_glue.require_full_attention`)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = [spec_kind(s) for s in spec.kv_cache_specs.values()]
        bad = next((why for *_, why in inner if why), None)
        windows = {(w, x) for _, w, x, _ in inner}
        if bad is None and len(windows) > 1:
            bad = "its layers have different sliding windows"
        w, x = next(iter(windows)) if windows else (None, 0)
        return f"{name} of {sorted({d for d, *_ in inner})}", w, x, bad
    if isinstance(spec, MambaSpec):
        return name, None, 0, "Mamba/SSM state is per-request state, not one page per token block"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (f"{name} (chunk {spec.attention_chunk_size} tokens)", None, 0,
                "chunked-local attention frees the pages of earlier chunks (not supported: untested)")
    if type(spec) is SlidingWindowSpec:
        return (f"{name} (window {spec.sliding_window} tokens)", spec.sliding_window,
                spec.extra_retained_tokens, None)
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        # With the hybrid allocator off, vLLM promotes a mixed model's sliding layers to full
        # attention: a page for every token, the window only limits what attention reads.
        window = spec.sliding_window or spec.attention_chunk_size
        return (f"{name} (layers with a {window}-token window included)" if window else name), None, 0, None
    # Exact types only: a subclass (R-SWA, sink attention) may keep other pages than these.
    return name, None, 0, "not an attention spec the tiers know the kept pages of"


def kv_groups(vllm_config, kv_cache_config, who: str) -> list[KVGroup]:
    """The engine's KV cache groups, or :class:`ConfigError` naming the group no tier can move."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [spec_kind(g.kv_cache_spec) for g in groups]
    why = next((w for *_, w in kinds if w), None) if kinds else "no KV cache group at all"
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if why is None and len(sizes) > 1:
        why = f"groups of different block sizes {sorted(sizes)}"
    if why is not None:
        model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
        listed = "; ".join(f"group {i}: {d}, {len(g.layer_names)} layer(s)"
                           for i, (g, (d, *_)) in enumerate(zip(groups, kinds)))
        raise ConfigError(f"{who}: model {model!r} has a KV cache layout this connector cannot save or load "
                          f"({listed or 'none'}): {why}. Serve this model without mctier's connectors")
    return [KVGroup(i, tuple(g.layer_names), g.kv_cache_spec.block_size, w, x)
            for i, (g, (_, w, x, _)) in enumerate(zip(groups, kinds))]


def named(groups: list[KVGroup]) -> bool:
    """Whether store keys name the group: any layout but a single full-attention group (whose
    keys stay those of engines before groups were served)."""
    return len(groups) > 1 or any(g.window is not None for g in groups)
