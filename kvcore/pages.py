"""Page copies that work wherever the KV lives (host memory or a GPU).

:class:`KVGeometry` describes pages by address, which is all the Transfer Engine and
the store need: they move bytes between registered memory themselves. A copy this
process makes on its own (the store tier's staged loads: whole objects land in a host
staging buffer, then the wanted pages go to their blocks) must not use those
addresses with ``memmove``: on CUDA they are device pointers, and a host ``memmove``
into them crashes the worker. So each region of pages gets a ``uint8`` tensor view on
the KV tensors' own device, and copies go through ``Tensor.copy_``, which picks a host
memcpy or a host-to-device copy by itself.

The same code runs on CPU and on CUDA (CPU tensors stand in for device ones in the unit
tests; the CUDA path, a host-to-device copy of the source then the same indexed write, is
not run here: experimental). :meth:`PageViews.write` says what a copy costs on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvcore.errors import ConfigError
from kvcore.geometry import KVGeometry, block_runs


def kv_device(kv_caches: Mapping):
    """The ``torch.device`` every KV tensor is on (one device per worker, or an error)."""
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1:
        raise ConfigError(f"KV tensors on several devices {sorted(map(str, devices))}: one worker, one device")
    return devices.pop()


def synchronize(device) -> None:
    """Return once copies this thread queued on ``device`` have landed (nothing to wait for on CPU)."""
    if device.type == "cuda":
        import torch

        # This thread's current stream on that device: where copy_ queued the copies.
        torch.cuda.current_stream(device).synchronize()


class PageViews:
    """Per region of ``geo``, a ``[num_blocks, page_bytes]`` uint8 view of its pages, on the
    device of the KV tensors (a view: writes land in the KV cache itself)."""

    def __init__(self, kv_caches: Mapping, geo: KVGeometry):
        import torch

        self.device = kv_device(kv_caches)
        self.geo = geo
        self.views = []
        for r in geo.regions:
            st = kv_caches[r.layer].untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
            self.views.append(flat.as_strided((geo.num_blocks, r.page_bytes), (r.block_stride, 1),
                                              r.base - st.data_ptr()))
        # Host to GPU: queue the copies and wait once per batch (wait()); the host buffer
        # must stay unchanged until then. On CPU the flag changes nothing.
        self._non_blocking = self.device.type != "cpu"

    def write(self, region: int, block_ids: Sequence[int], src) -> None:
        """Pages ``block_ids[j]`` of ``region`` := row ``j`` of ``src`` (``src``: ``[..., page_bytes]``
        uint8 on any device, any strides, ``len(block_ids)`` rows in row-major order of its
        leading dimensions). Call :meth:`wait` before the pages are used or ``src`` is reused.

        One run of consecutive blocks is one ``copy_``. Scattered blocks are one indexed
        write for the whole ``src``, through views of 8-byte elements where the strides allow:
        a ``copy_`` per run pays torch's per-call cost per page, and a uint8 indexed write
        copies byte by byte, each 4 to 5 times slower (docs/benchmarks/store-phases.md)."""
        self.geo.check_blocks(block_ids)  # a slice past the end would not fail by itself
        dst = self.views[region]
        if src.dim() < 2 or src.shape[-1] != dst.shape[1] or math.prod(src.shape[:-1]) != len(block_ids):
            raise ValueError(f"source {tuple(src.shape)} for {len(block_ids)} pages of {dst.shape[1]} bytes")
        runs = block_runs(block_ids)
        if len(runs) == 1 and src.dim() == 2:
            first, n = runs[0]
            dst[first:first + n].copy_(src, non_blocking=self._non_blocking)
            return
        if src.device != self.device:
            src = src.to(self.device, non_blocking=self._non_blocking)
        idx = _index(block_ids, self.device).view(tuple(src.shape[:-1]))
        dst, src = _widest(dst, src)
        dst.index_put_((idx,), src)

    def wait(self) -> None:
        synchronize(self.device)


def _index(values: Sequence[int], device):
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


def _widest(dst, src):
    """``dst`` and ``src`` viewed as the widest integer type both their layouts allow (every
    stride but the last, the offset and the row a multiple of its size), else as they are."""
    import torch

    for dt in (torch.int64, torch.int32, torch.int16):
        size = dt.itemsize
        if all(t.stride(-1) == 1 and t.shape[-1] % size == 0 and t.storage_offset() % size == 0
               and all(st % size == 0 for st in t.stride()[:-1]) for t in (dst, src)):
            return dst.view(dt), src.view(dt)
    return dst, src
