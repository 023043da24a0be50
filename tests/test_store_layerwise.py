"""Layer-wise store loads (mcstore.layerwise): the offset arithmetic (unit), and the worker's
layer-wise path against a real mooncake_master and store server, no vLLM engine
(integration): Mooncake's ranged get in a get session, the bytes layer by layer, a corrupted
layer caught by the checksum, an object of another size refused."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from kvcore.geometry import KVGeometry, Region
from mcstore.config import load_config
from mcstore.keys import KeySpace, fingerprint
from mcstore.layerwise import layer_spans, region_offsets, span_pieces
from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata
from mcstore.server import CLIENT_ENV
from mcstore.worker import StoreWorker
from tests.store_util import raw_client
from tests.support import wait_for

LAYERS, BLOCKS, BS, CHUNK = 4, 64, 32, 64  # 2 blocks per chunk


def _regions(n_layers: int, halves: int = 1, page: int = 100, stride: int = 100) -> list[Region]:
    return [Region(f"l{i}", 10_000 * (i * halves + h), stride, page) for i in range(n_layers) for h in range(halves)]


# -- unit: the arithmetic -----------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("layers,halves,groups,want", [
    (4, 1, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (4, 1, 2, [(0, 2), (2, 4)]),
    (5, 1, 2, [(0, 2), (2, 5)]),
    (2, 1, 8, [(0, 1), (1, 2)]),  # fewer layers than groups
    (3, 2, 2, [(0, 2), (2, 6)]),  # K and V regions of a layer stay together
    (3, 1, 1, [(0, 3)]),
])
def test_layer_spans(layers, halves, groups, want):
    assert layer_spans(_regions(layers, halves), groups) == want


@pytest.mark.unit
def test_layer_spans_refuse_a_layer_split_in_two():
    r = _regions(2)
    with pytest.raises(ValueError):
        layer_spans([r[0], r[1], r[0]], 2)


@pytest.mark.unit
@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("block_ids", [[5, 6, 7, 8], [9, 3, 4, 20], [1, 2, 10, 11]])
def test_span_pieces_are_the_object_in_order(halves, block_ids):
    """The pieces of all groups, in order, tile the object's pages exactly (offsets contiguous
    from 0 to its size) and go where KVGeometry.ranges puts the pages (the same ranges)."""
    kv = torch.zeros(3 * halves, 32, 4, 8, dtype=torch.float32)  # layer(-half), block, page
    geo = KVGeometry.from_kv_caches({f"l{i}": kv[i * halves:(i + 1) * halves].squeeze(0) if halves == 1
                                     else kv[i * halves:(i + 1) * halves] for i in range(3)}, 32)
    pre = region_offsets(geo.regions)
    assert pre == [i * geo.regions[0].page_bytes for i in range(len(geo.regions))]
    pieces = [span_pieces(geo.regions, pre, block_ids, s) for s in layer_spans(geo.regions, 2)]
    addrs = [a for p in pieces for a in p[0]]
    sizes = [s for p in pieces for s in p[1]]
    offs = [o for p in pieces for o in p[2]]
    assert offs[0] == 0 and all(o + s == nxt for o, s, nxt in zip(offs, sizes, offs[1:]))
    assert offs[-1] + sizes[-1] == geo.nbytes(len(block_ids))
    assert [(a, s) for a, s in zip(addrs, sizes)] == [tuple(r) for r in geo.ranges(block_ids)]


@pytest.mark.unit
def test_span_pieces_of_a_strided_region_are_one_per_block():
    """A region whose pages are not adjacent (stride > page) gets one piece per block, at the
    object offsets of consecutive pages."""
    regions = [Region("a", 0, 300, 100), Region("b", 100_000, 300, 100)]
    pre = region_offsets(regions)
    addrs, sizes, offs = span_pieces(regions, pre, [4, 5], (1, 2))
    assert addrs == [100_000 + 4 * 300, 100_000 + 5 * 300]
    assert sizes == [100, 100] and offs == [2 * 100, 2 * 100 + 100]


# -- integration: the worker against a real master ---------------------------------------

_until = functools.partial(wait_for, step=0.02, what="the condition")


@pytest.fixture
def _client_env(monkeypatch):
    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)


def _worker(master: str, **extra) -> tuple[StoreWorker, torch.Tensor]:
    cfg = load_config({"master": master, "chunk_tokens": CHUNK, "layerwise_load": True,
                       "layerwise_load_groups": 2, **extra}, env={})
    w = StoreWorker(cfg, KeySpace(fingerprint({"t": "layerwise", **extra}), CHUNK), BS, BLOCKS, 0,
                    load=True, save=True)
    buf = torch.empty(LAYERS, BLOCKS, 2, BS, 16, dtype=torch.float32)
    w.register_kv_caches({f"layer{i}": buf[i] for i in range(LAYERS)})
    return w, buf


def _save(w: StoreWorker, links: list[str], blocks: list[list[int]]) -> None:
    w.wait_for_save(StoreMetadata(saves=[SaveJob("s", [ChunkIO(lk, i, b) for i, (lk, b) in
                                                       enumerate(zip(links, blocks))])]))
    _until(lambda: (w.get_finished({"s"})[0] or set()) == {"s"})


def _sync_load(w: StoreWorker, rid: str, chunks: list[ChunkIO], waited: list[str]) -> set[int]:
    """One step's synchronous load: start, the forward's per-layer waits, the step's results."""
    w.start_load_kv(StoreMetadata(loads=[LoadJob(rid, chunks, timeout_s=10, sync=True)]))
    assert w._unit is not None  # layer-wise: start_load_kv returned without waiting for the load
    for name in waited:
        w.wait_layer(name)
    _, recving = w.get_finished(set())
    assert not recving  # a synchronous load is never reported finished-receiving
    return w.get_block_ids_with_load_errors()


@pytest.mark.integration
@pytest.mark.parametrize("verify", [False, True])
def test_layerwise_load_moves_every_layer(store_cluster, _client_env, verify):
    w, buf = _worker(store_cluster.master_addr, verify_checksums=verify)
    try:
        buf.normal_()
        links = [f"mct/lw/{verify}-{i}-{time.monotonic_ns()}" for i in range(3)]
        _save(w, links, [[1, 2], [5, 6], [9, 3]])
        layers = [f"layer{i}" for i in range(LAYERS)]
        errors = _sync_load(w, "l", [ChunkIO(links[0], 0, [20, 21]), ChunkIO(links[1], 1, [30, 40]),
                                     ChunkIO(links[2], 2, [50, 51])], layers)
        assert errors == set()
        for s, d in [(1, 20), (2, 21), (5, 30), (6, 40), (9, 50), (3, 51)]:
            assert torch.equal(buf[:, s], buf[:, d]), (s, d)
        data = w.take_stats().data
        assert data["counters"]["loaded_tokens"] == 6 * BS
        assert len(data["ops"]["phase:load_layer_first"]) == 1 and len(data["ops"]["phase:load_layer_wait"]) == 1
        # A step whose forward skipped a layer's wait: recomputed, and layer-wise loads end.
        buf[:, 60:62].zero_()
        errors = _sync_load(w, "m", [ChunkIO(links[0], 0, [60, 61])], layers[:-1])
        assert errors == {60, 61}
        assert not w._layerwise(LoadJob("x", [ChunkIO(links[0], 0, [60, 61])], timeout_s=10, sync=True))
    finally:
        w.close()


@pytest.mark.integration
def test_layerwise_load_catches_one_corrupted_layer_and_a_wrong_size(store_cluster, _client_env):
    """Layer 3's bytes of chunk 1 flipped in the store: the checksum fails chunk 1 (and 2 after
    it); chunk 0 is kept. Without checksums an object longer than ours is refused by size."""
    w, buf = _worker(store_cluster.master_addr, verify_checksums=True)
    w2, _ = _worker(store_cluster.master_addr)
    raw = raw_client(store_cluster.master_addr)
    try:
        buf.normal_()
        links = [f"mct/lw/c-{i}-{time.monotonic_ns()}" for i in range(3)]
        _save(w, links, [[1, 2], [3, 4], [5, 6]])
        key = w.keys.key(links[1], 0)
        data = bytearray(raw.get(key))
        page = buf[0, 0].numel() * 4
        at = 2 * 3 * page + 100  # object: 2 blocks per layer, layer 3 starts at 2 * 3 pages
        data[at:at + 8] = bytes(8 - i for i in range(8))
        assert raw.upsert(key, bytes(data)) == 0
        errors = _sync_load(w, "c", [ChunkIO(lk, i, [20 + 2 * i, 21 + 2 * i]) for i, lk in enumerate(links)],
                            [f"layer{i}" for i in range(LAYERS)])
        assert errors == {22, 23, 24, 25}
        assert w.take_stats().data["counters"]["failures:load_checksum"] == 1
        big = f"mct/lw/big-{time.monotonic_ns()}"
        assert raw.put(w2.keys.key(big, 0), b"\x01" * (2 * LAYERS * page + 4096)) == 0
        errors = _sync_load(w2, "b", [ChunkIO(big, 0, [40, 41])], [f"layer{i}" for i in range(LAYERS)])
        assert errors == {40, 41}
        assert w2.take_stats().data["counters"]["failures:load_size_mismatch"] == 1
    finally:
        raw.close()
        w.close()
        w2.close()


@pytest.mark.integration
def test_layerwise_load_whose_booking_fails_still_ends_the_step_with_every_block_failed(store_cluster, _client_env,
                                                                                      monkeypatch):
    w, buf = _worker(store_cluster.master_addr)
    try:
        buf.normal_()
        link = f"mct/lw/book-{time.monotonic_ns()}"
        _save(w, [link], [[1, 2]])

        def broken(*a, **k):
            raise RuntimeError("bookkeeping broke")

        monkeypatch.setattr(w, "_book_load", broken)
        t0 = time.monotonic()
        errors = _sync_load(w, "b", [ChunkIO(link, 0, [20, 21])], [f"layer{i}" for i in range(LAYERS)])
        assert errors == {20, 21}  # recomputed, and the step did not wait for the unit's deadline
        assert time.monotonic() - t0 < 5
    finally:
        w.close()
