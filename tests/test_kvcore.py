"""kvcore: page geometry against KV tensors allocated by vLLM's own CPU allocator, config, errors."""

from __future__ import annotations

import ctypes

import msgspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcore.config import load, parse_size
from kvcore.errors import (
    CODES,
    ConfigError,
    LeaseExpired,
    MooncakeError,
    NoSpace,
    ObjectNotFound,
    check,
    error_for,
    first_error,
    is_leased,
    is_missing,
    is_no_space,
    is_not_found,
    is_rpc_down,
)
from kvcore.geometry import KVGeometry, block_runs

pytestmark = pytest.mark.unit

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]
NUM_BLOCKS = 12


def vllm_kv_caches(layout_name: str, block_outer: bool) -> dict[str, torch.Tensor]:
    """KV tensors exactly as vLLM's worker allocates them (``allocate_kv_cache``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    page, n = spec.page_size_bytes, len(LAYERS)
    layer_stride, block_stride = (page, page * n) if block_outer else (page * NUM_BLOCKS, page)
    cfg = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS * n, layers=LAYERS,
                                        layer_stride=layer_stride, block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )
    kv = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[layout_name])
    for t in kv.values():
        t.view(torch.int16).random_()
    # Random bit patterns include NaNs; compare pages as integers.
    return {name: t.view(torch.int16) for name, t in kv.items()}


LAYOUTS = [(lay, outer) for lay in ("LBHNC", "LBNHC", "BLHNC", "BLNHC") for outer in (False, True)]
block_lists = st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=6, unique=True)


def copy_image(src_ranges, dst_ranges) -> None:
    """Scatter the concatenated bytes of ``src_ranges`` into ``dst_ranges`` (like a store get)."""
    image = b"".join(ctypes.string_at(a, n) for a, n in src_ranges)
    off = 0
    for a, n in dst_ranges:
        ctypes.memmove(a, image[off : off + n], n)
        off += n
    assert off == len(image)


@pytest.mark.parametrize("layout,block_outer", LAYOUTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_ranges_round_trip_pages(layout, block_outer, data):
    kv = vllm_kv_caches(layout, block_outer)
    geo = KVGeometry.from_kv_caches(kv, NUM_BLOCKS)
    src = data.draw(block_lists)
    dst = data.draw(st.lists(st.sampled_from([b for b in range(1, NUM_BLOCKS) if b not in src]),
                             min_size=len(src), max_size=len(src), unique=True)) if len(src) < NUM_BLOCKS // 2 else None
    if dst is None:
        return
    before = {name: t[src].clone() for name, t in kv.items()}
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    others = {name: t[untouched].clone() for name, t in kv.items()}
    src_r, dst_r = geo.ranges(src), geo.ranges(dst)
    assert sum(n for _, n in src_r) == geo.nbytes(len(src)) == sum(n for _, n in dst_r)
    copy_image(src_r, dst_r)
    for name, t in kv.items():
        assert torch.equal(t[dst], before[name]), name
        assert torch.equal(t[untouched], others[name]), f"{name}: bytes outside the destination changed"


@pytest.mark.parametrize("layout,block_outer", LAYOUTS)
def test_adjacent_blocks_coalesce_only_when_dense(layout, block_outer):
    geo = KVGeometry.from_kv_caches(vllm_kv_caches(layout, block_outer), NUM_BLOCKS)
    ranges = geo.ranges([3, 4, 5, 9])
    assert len(geo.regions) == len(LAYERS)
    expected = 2 * len(LAYERS) if not block_outer else 4 * len(LAYERS)
    assert len(ranges) == expected
    assert len(geo.buffers) == 1  # all layers are views of one allocation


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pair_ranges_moves_each_block_to_its_peer(data):
    local = vllm_kv_caches("LBHNC", False)
    remote = vllm_kv_caches("LBHNC", False)
    lg, rg = KVGeometry.from_kv_caches(local, NUM_BLOCKS), KVGeometry.from_kv_caches(remote, NUM_BLOCKS)
    lb = data.draw(block_lists)
    rb = data.draw(st.permutations(range(1, NUM_BLOCKS)))[: len(lb)]
    src, dst, lens = lg.pair_ranges(lb, rg.regions, rb)
    for s, d, n in zip(src, dst, lens):
        ctypes.memmove(d, s, n)
    for name in LAYERS:
        assert torch.equal(remote[name][list(rb)], local[name][lb])
    # Each descriptor is one run consecutive on both sides.
    pairs_runs = sum(1 for i in range(len(lb)) if i == 0 or lb[i] != lb[i - 1] + 1 or rb[i] != rb[i - 1] + 1)
    assert len(lens) == pairs_runs * len(LAYERS)


def test_geometry_rejects_bad_input():
    kv = vllm_kv_caches("LBHNC", False)
    geo = KVGeometry.from_kv_caches(kv, NUM_BLOCKS)
    with pytest.raises(ValueError):
        geo.ranges([NUM_BLOCKS])
    with pytest.raises(ValueError):
        geo.ranges([-1])
    with pytest.raises(ConfigError):
        KVGeometry.from_kv_caches(kv, NUM_BLOCKS + 1)
    with pytest.raises(ConfigError):
        KVGeometry.from_kv_caches({})
    with pytest.raises(ValueError):
        geo.pair_ranges([1, 2], geo.regions, [3])
    with pytest.raises(ValueError):
        geo.pair_ranges([1], geo.regions[:1], [3])


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(4, 3), (9, 2), (2, 1)]


class Sample(msgspec.Struct, forbid_unknown_fields=True):
    master: str = "127.0.0.1:50051"
    chunk_tokens: int = 256
    pin: bool = False


def test_config_load_and_errors():
    assert load(Sample, None, "x") == Sample()
    assert load(Sample, {"chunk_tokens": 64}, "x").chunk_tokens == 64
    with pytest.raises(ConfigError, match="chunk_tokn.*known keys: chunk_tokens, master, pin"):
        load(Sample, {"chunk_tokn": 64}, "StoreConnector kv_connector_extra_config")
    with pytest.raises(ConfigError, match="Expected `int`"):
        load(Sample, {"chunk_tokens": "lots"}, "x")
    with pytest.raises(ConfigError, match="x:"):
        load(Sample, {"pin": [1]}, "x")


@pytest.mark.parametrize("text,value", [(1024, 1024), ("512MB", 512 << 20), ("4 GiB", 4 << 30),
                                        ("1g", 1 << 30), ("64k", 64 << 10), ("0", 0)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "-1", "1.5.3GB", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_status_codes_become_typed_errors():
    assert check(0, "put") == 0 and check(4096, "get_into") == 4096
    with pytest.raises(ObjectNotFound) as e:
        check(-704, "get_into", "key k")
    assert e.value.code == -704 and e.value.cause == "not_found" and "key k" in str(e.value)
    with pytest.raises(NoSpace):
        check(-200, "put")
    assert isinstance(first_error([0, 0, -707], "batch_get"), LeaseExpired)
    assert first_error([0, 12], "batch_get") is None
    unknown = first_error([-12345], "op")
    assert type(unknown) is MooncakeError and unknown.code == -12345


def test_status_code_table_and_predicates():
    import kvcore.errors as errors

    assert len({row.code for row in CODES}) == len(CODES)
    for row in CODES:  # one class per row, importable by its name, raised for its code
        cls = getattr(errors, row.cls)
        e = error_for(row.code, "op")
        assert type(e) is cls and issubclass(cls, MooncakeError)
        assert (e.code, e.name, e.cause) == (row.code, row.name, row.cause)
        assert (is_missing(row.code), is_rpc_down(row.code)) == (row.missing, row.rpc_down) == (is_missing(e),
                                                                                                is_rpc_down(e))
    assert [row.code for row in CODES if row.missing] == [-703, -704, -707]
    assert [row.code for row in CODES if row.rpc_down] == [-1, -900, -901]
    for ok in (0, 1, 4096):
        assert not (is_missing(ok) or is_rpc_down(ok) or is_no_space(ok) or is_not_found(ok) or is_leased(ok))
    assert is_no_space(-200) and is_not_found(-704) and is_leased(-706) and not is_not_found(-707)
    assert not (is_missing(-12345) or is_rpc_down(-12345)) and error_for(-12345, "op").cause == "error"


AMX_CPUINFO = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
               "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n")
AVX512_NO_BF16_CPUINFO = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: fpu avx2 avx512f avx512bw\n"
AVX2_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: fpu sse2 avx2 fma f16c\n"


def test_dtype_rule_by_cpu_class_and_overrides(monkeypatch):
    from kvcore.platform import cpu_flags, cpu_model, dtype_args, engine_dtype

    monkeypatch.delenv("MCTIER_DTYPE", raising=False)
    monkeypatch.delenv("MCTIER_SIMULATE_CPU", raising=False)
    assert engine_dtype(cpu_flags(AMX_CPUINFO)) == "bfloat16"
    assert engine_dtype(cpu_flags(AVX512_NO_BF16_CPUINFO)) == "float32"  # AVX-512 alone has no bf16 dot
    assert engine_dtype(cpu_flags(AVX2_CPUINFO)) == "float32"
    assert cpu_model(AVX2_CPUINFO) == "AMD EPYC 7B13 64-Core Processor"
    # An explicit dtype wins over the rule, on either class.
    assert engine_dtype(cpu_flags(AMX_CPUINFO), explicit="float32") == "float32"
    assert engine_dtype(cpu_flags(AVX2_CPUINFO), explicit="bfloat16") == "bfloat16"
    monkeypatch.setenv("MCTIER_DTYPE", "bfloat16")
    assert engine_dtype(cpu_flags(AVX2_CPUINFO)) == "bfloat16"
    assert dtype_args([]) == ["--dtype", "bfloat16"]
    # A --dtype already on an engine's command line is left alone.
    assert dtype_args(["--dtype", "float16"]) == [] and dtype_args(["--dtype=float32"]) == []
    monkeypatch.setenv("MCTIER_DTYPE", "fp8")
    with pytest.raises(ValueError, match="fp8"):
        engine_dtype(cpu_flags(AMX_CPUINFO))


def test_avx2_simulation_hides_avx512_and_amx(monkeypatch):
    from pathlib import Path

    from kvcore.platform import cpu_flags, engine_dtype, engine_env

    monkeypatch.delenv("MCTIER_DTYPE", raising=False)
    monkeypatch.setenv("MCTIER_SIMULATE_CPU", "avx2")
    flags = cpu_flags(AMX_CPUINFO)
    assert "avx2" in flags and not any(f.startswith(("avx512", "amx")) for f in flags)
    assert engine_dtype(flags) == "float32"
    env = engine_env(1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "sitecustomize.py").is_file()
    # Its own inductor cache, never the native engines' kernels.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/ind")
    assert engine_env(1)["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/ind-simavx2"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert engine_env(1)["TORCHINDUCTOR_CACHE_DIR"].endswith("-simavx2")
    monkeypatch.setenv("MCTIER_SIMULATE_CPU", "avx512")
    with pytest.raises(ValueError, match="avx2"):
        cpu_flags(AMX_CPUINFO)
    monkeypatch.delenv("MCTIER_SIMULATE_CPU")
    assert "ATEN_CPU_CAPABILITY" not in engine_env(0) and "TORCHINDUCTOR_CACHE_DIR" not in engine_env(0)


@pytest.mark.unit
def test_degrade_watch_logs_one_rate_limited_error(caplog):
    import logging

    from kvcore.log import DegradeWatch

    now = [0.0]
    log = logging.getLogger("test.degrade")
    w = DegradeWatch(log, "P2P handoffs", window=10, min_failed=3, ratio=0.5, every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="test.degrade"):
        assert not any(w.record(None) for _ in range(10))  # all good
        assert [w.record("bootstrap") for _ in range(3)] == [False, False, False]  # 3 of 10: under half
        assert [w.record("bootstrap") for _ in range(2)] == [False, True]  # 5 of 10: logged once
        assert not w.record("timeout")  # within the minute: rate-limited
        now[0] = 61.0
        assert w.record("timeout")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 == w.errors
    assert "bootstrap x5" in errors[0] and "fell back to recomputation" in errors[0]


def test_free_port_is_outside_the_kernels_ephemeral_range_bindable_and_not_repeated(monkeypatch):
    """A port the kernel hands out (bind to port 0) can be taken by the next outgoing
    connection before a child binds it; free_port picks below that range instead, and takes
    the kernel's pick only when the room below is under 1,000 ports."""
    import socket

    from kvcore import procs

    monkeypatch.setattr(procs, "_ephemeral_low", lambda: 32768)
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(procs._PICK_FROM <= p < 32768 for p in ports), ports
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out
    monkeypatch.setattr(procs, "_ephemeral_low", lambda: procs._PICK_FROM + 500)
    assert procs.free_port() >= procs._PICK_FROM + 500  # the kernel's pick, from its own range
