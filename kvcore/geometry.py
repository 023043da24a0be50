"""KV page geometry: which bytes hold block ``b`` of every layer.

Derived from the tensors vLLM hands ``register_kv_caches`` (shape and strides),
never from an assumed layout. A *region* is one run of equally spaced pages: the
CPU backend has one region per layer (``[num_blocks, H, 2*bs, D]`` pages), a
FlashAttention layout ``[2, num_blocks, ...]`` has two (K and V). Both tiers move
whole pages and coalesce adjacent block ids into one memory range.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from kvcore.errors import ConfigError


class MemRange(NamedTuple):
    addr: int
    size: int


class Region(msgspec.Struct, frozen=True):
    """Pages of one layer (or one K/V half of it): page ``b`` is at ``base + b*block_stride``."""

    layer: str
    base: int
    block_stride: int
    page_bytes: int


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_id, count)]`` for runs of consecutive ids, in the given order."""
    runs: list[tuple[int, int]] = []
    for bid in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == bid:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((bid, 1))
    return runs


def _regions_of(name: str, t, num_blocks: int) -> list[Region]:
    shape, strides, item = tuple(t.shape), tuple(t.stride()), t.element_size()
    try:
        dim = shape.index(num_blocks)
    except ValueError:
        raise ConfigError(
            f"KV tensor {name} {shape} has no dimension of num_blocks={num_blocks}"
        ) from None
    inner_shape, inner_strides = shape[dim + 1 :], strides[dim + 1 :]
    elems = math.prod(inner_shape)
    extent = sum((n - 1) * s for n, s in zip(inner_shape, inner_strides)) + 1
    if extent != elems:
        # The page is not one dense byte run (e.g. a head-interleaved layout).
        raise ConfigError(
            f"KV tensor {name} shape {shape} strides {strides}: a block is not contiguous"
        )
    page = elems * item
    block_stride = strides[dim] * item
    if block_stride < page:
        raise ConfigError(f"KV tensor {name}: blocks overlap (stride {block_stride} < page {page})")
    base = t.data_ptr()
    regions = []
    for outer in itertools.product(*(range(n) for n in shape[:dim])):
        off = sum(i * s for i, s in zip(outer, strides[:dim])) * item
        regions.append(Region(name, base + off, block_stride, page))
    return regions


class KVGeometry:
    """Page geometry of all registered KV layers of one worker."""

    def __init__(self, regions: list[Region], num_blocks: int, buffers: list[MemRange]):
        if not regions:
            raise ConfigError("no KV cache regions registered")
        self.regions = regions
        self.num_blocks = num_blocks
        self.buffers = buffers
        self.block_bytes = sum(r.page_bytes for r in regions)

    @classmethod
    def from_kv_caches(cls, kv_caches: dict, num_blocks: int | None = None) -> KVGeometry:
        if not kv_caches:
            raise ConfigError("register_kv_caches received no KV tensors")
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        regions: list[Region] = []
        storages: dict[int, int] = {}
        for name, t in kv_caches.items():
            regions.extend(_regions_of(name, t, num_blocks))
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        buffers = [MemRange(p, n) for p, n in sorted(storages.items())]
        return cls(regions, num_blocks, buffers)

    def check_blocks(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b!r} outside [0, {self.num_blocks})")

    def ranges(self, block_ids: Sequence[int]) -> list[MemRange]:
        """Memory ranges of ``block_ids`` in canonical order (region-major, then the
        given block order), adjacent pages merged. The concatenation of these ranges
        is the byte image of those blocks, identical whatever the block ids were."""
        self.check_blocks(block_ids)
        out: list[MemRange] = []
        for r in self.regions:
            dense = r.block_stride == r.page_bytes
            for first, count in block_runs(block_ids) if dense else ((b, 1) for b in block_ids):
                out.append(MemRange(r.base + first * r.block_stride, count * r.page_bytes))
        return out

    def nbytes(self, n_blocks: int) -> int:
        return n_blocks * self.block_bytes

    def pair_ranges(
        self, local_blocks: Sequence[int], remote: Sequence[Region], remote_blocks: Sequence[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """(local addrs, remote addrs, lengths) moving ``local_blocks[i]`` <-> ``remote_blocks[i]``.

        Runs that are consecutive on both sides become one descriptor."""
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks vs {len(remote_blocks)} remote")
        if not self.compatible(remote):
            raise ValueError("remote KV layout differs from the local one")
        self.check_blocks(local_blocks)
        src, dst, lens = [], [], []
        pairs = list(zip(local_blocks, remote_blocks))
        for lr, rr in zip(self.regions, remote):
            dense = lr.block_stride == lr.page_bytes and rr.block_stride == rr.page_bytes
            i = 0
            while i < len(pairs):
                j = i + 1
                while (
                    dense
                    and j < len(pairs)
                    and pairs[j][0] == pairs[j - 1][0] + 1
                    and pairs[j][1] == pairs[j - 1][1] + 1
                ):
                    j += 1
                src.append(lr.base + pairs[i][0] * lr.block_stride)
                dst.append(rr.base + pairs[i][1] * rr.block_stride)
                lens.append((j - i) * lr.page_bytes)
                i = j
        return src, dst, lens

    def compatible(self, remote: Sequence[Region]) -> bool:
        """Same layers in the same order with the same page size."""
        return len(remote) == len(self.regions) and all(
            a.layer == b.layer and a.page_bytes == b.page_bytes
            for a, b in zip(self.regions, remote)
        )
