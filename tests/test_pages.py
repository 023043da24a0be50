"""The device-agnostic paths of the CUDA branch, with CPU tensors standing in for device ones:
page copies through torch (``kvcore.pages``, the store tier's partial-chunk load) and memory
registered at the KV tensors' own device (``cuda:N`` of the worker, not always ``cuda:0``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvcore.errors import ConfigError
from kvcore.geometry import KVGeometry, MemRange
from kvcore.pages import PageViews, kv_device, synchronize
from kvcore.platform import CudaPlatform, Platform
from tests.test_kvcore import LAYOUTS, NUM_BLOCKS, vllm_kv_caches

pytestmark = pytest.mark.unit


def flash_layout_kv() -> dict[str, torch.Tensor]:
    """FlashAttention's ``[2, num_blocks, block_size, heads, dim]``: two regions (K, V) per layer."""
    buf = torch.empty(2, 2, NUM_BLOCKS, 16, 2, 32, dtype=torch.bfloat16)
    buf.view(torch.int16).random_()
    return {f"layer{i}": buf[i].view(torch.int16) for i in range(2)}


def canonical_object(geo: KVGeometry, blocks: list[int]) -> torch.Tensor:
    """The bytes a stored chunk of ``blocks`` holds (region-major, then block order)."""
    return torch.frombuffer(bytearray(b"".join(ctypes.string_at(a, n) for a, n in geo.ranges(blocks))),
                            dtype=torch.uint8)


def memmove_partial(geo: KVGeometry, obj: torch.Tensor, chunk_blocks: int, first: int, dst: list[int]) -> None:
    """The former partial-chunk copy (host pointers only), kept as the reference."""
    off = 0
    for r in geo.regions:
        for j, bid in enumerate(dst):
            ctypes.memmove(r.base + bid * r.block_stride, obj.data_ptr() + off + (first + j) * r.page_bytes,
                           r.page_bytes)
        off += chunk_blocks * r.page_bytes


def torch_partial(views: PageViews, geo: KVGeometry, obj: torch.Tensor, chunk_blocks: int, first: int,
                  dst: list[int]) -> None:
    """What ``StoreWorker._load_partial`` does with the staging buffer."""
    off, k = 0, len(dst)
    for i, r in enumerate(geo.regions):
        lo = off + first * r.page_bytes
        views.write(i, dst, obj[lo:lo + k * r.page_bytes].view(k, r.page_bytes))
        off += chunk_blocks * r.page_bytes
    views.wait()


CASES = [pytest.param(lay, outer, id=f"{lay}-{'outer' if outer else 'inner'}") for lay, outer in LAYOUTS]


@pytest.mark.parametrize("layout,block_outer", CASES + [pytest.param("flash", False, id="flash")])
@pytest.mark.parametrize("first,dst", [(1, [9, 2, 3]), (2, [5, 6]), (3, [11]), (0, [7, 1, 10, 4])])
def test_partial_chunk_copy_matches_the_pointer_copy(layout, block_outer, first, dst):
    kv = flash_layout_kv() if layout == "flash" else vllm_kv_caches(layout, block_outer)
    geo = KVGeometry.from_kv_caches(kv, NUM_BLOCKS)
    chunk_blocks = 4
    obj = canonical_object(geo, [8, 9, 10, 11][:chunk_blocks])  # a stored chunk of 4 blocks
    twin = {n: t.clone() for n, t in kv.items()}
    # The same copy with the old pointer loop into an identical copy of the KV.
    twin_geo = KVGeometry.from_kv_caches(twin, NUM_BLOCKS)
    memmove_partial(twin_geo, obj, chunk_blocks, first, dst)
    views = PageViews(kv, geo)
    torch_partial(views, geo, obj, chunk_blocks, first, dst)
    for name in kv:
        assert torch.equal(kv[name], twin[name]), name  # every byte, copied pages and the rest


@pytest.mark.parametrize("layout,block_outer", CASES + [pytest.param("flash", False, id="flash")])
@pytest.mark.parametrize("pad", [pytest.param(4096, id="aligned-slots"), pytest.param(1, id="odd-slots")])
def test_batched_copy_from_staging_slots_matches_the_pointer_copy(layout, block_outer, pad):
    """What ``StoreWorker._get_staged`` does: two whole objects in staging slots, their pages
    into scattered blocks with one write per region (8-byte words where slots are aligned,
    bytes where an odd slot size forbids it), against the pointer copy."""
    kv = flash_layout_kv() if layout == "flash" else vllm_kv_caches(layout, block_outer)
    geo = KVGeometry.from_kv_caches(kv, NUM_BLOCKS)
    chunk_blocks = 4
    objs = [canonical_object(geo, ids) for ids in ([8, 9, 10, 11], [0, 1, 2, 3])]
    slot = objs[0].numel() + (pad if pad == 1 else -objs[0].numel() % pad)
    stage = torch.zeros(2 * slot, dtype=torch.uint8)
    for s, obj in enumerate(objs):
        stage[s * slot:s * slot + obj.numel()] = obj
    dst = [[7, 1, 10, 4], [2, 11, 5, 0]]  # all < NUM_BLOCKS: the pointer copy checks nothing
    twin = {n: t.clone() for n, t in kv.items()}
    twin_geo = KVGeometry.from_kv_caches(twin, NUM_BLOCKS)
    for obj, ids in zip(objs, dst):
        memmove_partial(twin_geo, obj, chunk_blocks, 0, ids)
    views = PageViews(kv, geo)
    off = 0
    for i, r in enumerate(geo.regions):
        views.write(i, dst[0] + dst[1], stage.as_strided((2, chunk_blocks, r.page_bytes), (slot, r.page_bytes, 1), off))
        off += chunk_blocks * r.page_bytes
    views.wait()
    for name in kv:
        assert torch.equal(kv[name], twin[name]), name


def test_views_write_into_the_kv_cache_itself_and_check_their_input():
    kv = vllm_kv_caches("LBHNC", True)
    geo = KVGeometry.from_kv_caches(kv, NUM_BLOCKS)
    views = PageViews(kv, geo)
    assert views.device == torch.device("cpu") and len(views.views) == len(geo.regions)
    for v, r in zip(views.views, geo.regions):
        assert v.dtype == torch.uint8 and tuple(v.shape) == (NUM_BLOCKS, r.page_bytes)
        assert v[3].data_ptr() == r.base + 3 * r.block_stride  # a view, not a copy
    page = geo.regions[0].page_bytes
    ones = torch.full((2, page), 0xAB, dtype=torch.uint8)
    views.write(0, [5, 6], ones)
    assert ctypes.string_at(geo.regions[0].base + 5 * geo.regions[0].block_stride, page) == b"\xab" * page
    with pytest.raises(ValueError, match="source"):
        views.write(0, [5, 6, 7], ones)
    with pytest.raises(ValueError, match="outside"):
        views.write(0, [NUM_BLOCKS, 1], ones)  # a slice past the end would otherwise copy nothing


def test_kv_device_is_one_device():
    assert kv_device({"a": torch.empty(2), "b": torch.empty(3)}) == torch.device("cpu")
    with pytest.raises(ConfigError, match="several devices"):
        kv_device({"a": torch.empty(2), "b": torch.empty(3, device="meta")})


def test_synchronize_waits_on_the_devices_current_stream(monkeypatch):
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waited.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    synchronize(torch.device("cpu"))
    assert waited == []  # CPU copies are complete when copy_ returns
    synchronize(torch.device("cuda", 2))
    assert waited == [torch.device("cuda", 2)]


def test_memory_location_is_the_workers_own_gpu(monkeypatch):
    cuda = CudaPlatform()
    assert cuda.memory_location(torch.device("cuda", 3)) == "cuda:3"
    assert cuda.memory_location(1) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)  # vLLM sets it to the local rank
    assert cuda.memory_location(None) == "cuda:5"
    assert cuda.memory_location(torch.device("cuda")) == "cuda:5"
    assert Platform().memory_location(torch.device("cpu")) == "cpu:0"


def test_transfer_engine_registers_at_the_kv_device(monkeypatch):
    from p2p import transfer

    class FakeTE:
        def __init__(self):
            self.calls = []

        def register_memory(self, addr, size, loc):
            self.calls.append((addr, size, loc))
            return 0

    h = object.__new__(transfer.TransferEngineHandle)
    h.te, h._registered = FakeTE(), []
    monkeypatch.setattr(transfer.platform, "current", lambda: CudaPlatform())
    h.register([MemRange(0x1000, 64), MemRange(0x2000, 64)], torch.device("cuda", 1))
    assert [c[2] for c in h.te.calls] == ["cuda:1", "cuda:1"]


def test_p2p_worker_registers_its_kv_on_the_kv_device(monkeypatch):
    """The worker passes its KV tensors' device to the Transfer Engine (before: always index 0)."""
    from p2p import worker as p2p_worker
    from p2p.config import load_config

    seen = {}

    class FakeHandle:
        addr = "127.0.0.1:1"

        def __init__(self, *a, **kw):
            pass

        def register(self, buffers, device=None):
            seen["device"] = device

    monkeypatch.setattr(p2p_worker, "TransferEngineHandle", FakeHandle)
    # No vLLM process group here: one rank, one stage.
    monkeypatch.setattr(p2p_worker, "parallel_ranks", lambda cfg: (0, 0, 1, 0))
    monkeypatch.setattr(p2p_worker, "pp_stages", lambda *a, **kw: 1, raising=False)
    kv = vllm_kv_caches("LBHNC", False)
    w = p2p_worker.P2PWorker(None, load_config({}, "kv_consumer", env={}), "eng", None, "neither")
    w.register_kv_caches(kv)
    assert seen["device"] == torch.device("cpu") == next(iter(kv.values())).device
