"""The CPU / CUDA seam. Everything device-specific that the tiers need is here.

On CPU the forward pass has finished writing KV when a connector hook runs, and
the transfer engine addresses host memory. On CUDA the KV is written by kernels
on a stream: a save must wait for them, and memory is registered with the location
of the GPU it is on (``cuda:N`` of the worker's own device, not always ``cuda:0``)
so RDMA can use GPUDirect. Copies the tiers make themselves go through
:mod:`kvcore.pages` (torch copies, never ``memmove`` on device pointers). The CUDA
branch is experimental: reviewed on paper and unit-tested with CPU tensors standing
in, never run on a GPU (none on the CI machines; ``tests/test_cuda_fidelity.py``
waits for one).

CPU classes, and the one rule for the dtype of the engines this project starts
(demo, tests, benchmarks, example scripts): ``bfloat16`` where the CPU has native
bf16 arithmetic (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``), ``float32``
otherwise, because without it every bf16 matmul takes torch's AVX2 fallback, several
times slower than float32 (docs/benchmarks/cpu-classes.md). An explicit dtype
(``--dtype`` on a command line, or ``MCTIER_DTYPE``) always wins.

``MCTIER_SIMULATE_CPU=avx2`` makes an AVX-512/AMX machine behave as an AVX2-only one
for everything this project starts: the rule above sees no native bf16, and engines
get ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and a ``sitecustomize``
(:mod:`kvcore.simcpu`) that makes torch's ISA probes answer "no AVX-512, no AMX", so
vLLM loads its AVX2 kernel library and bf16 linears fall back as on an AVX2-only CPU.
The environment variables alone are not enough: vLLM would still load its AMX
kernels and its AMX attention dies on a SIGILL without oneDNN having asked the kernel
for AMX state. Simulated engines also get their own torch inductor cache
(``TORCHINDUCTOR_CACHE_DIR``, the usual one with ``-simavx2`` appended): torch reused
kernels its native engines compiled, and vLLM's compiled vocabulary mask of a TP 2 engine
then gave out-of-range token ids (``IndexError`` in the embedding on the first request;
with a fresh cache the same engine answers). A real AVX2 machine never mixes the two.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
SIMULATE_ENV = "MCTIER_SIMULATE_CPU"
DTYPE_ENV = "MCTIER_DTYPE"
DTYPES = ("bfloat16", "float32", "float16")
# What an AVX2-only x86 CPU lacks of the flags that choose kernels.
_NOT_ON_AVX2 = ("avx512", "amx")

# The environment of every vLLM engine this project starts: no usage reports, no hub,
# loopback, the CPU platform, a 1 GiB KV cache.
ENGINE_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def simulated_isa() -> str | None:
    """``"avx2"`` when ``MCTIER_SIMULATE_CPU`` asks for it, else None (a bad value is an error)."""
    value = os.environ.get(SIMULATE_ENV, "").strip().lower()
    if not value:
        return None
    if value != "avx2":
        raise ValueError(f"{SIMULATE_ENV}={value!r}: the only CPU class that can be simulated is 'avx2'")
    return value


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags, as the simulation (if any) presents them."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    flags = frozenset(line.partition(":")[2].split())
    if simulated_isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_NOT_ON_AVX2))
    return flags


def cpu_model(cpuinfo: str | None = None) -> str:
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return line.partition(":")[2].strip() or "unknown CPU"


def engine_dtype(flags: frozenset[str] | None = None, explicit: str | None = None) -> str:
    """The dtype for an engine: ``explicit`` (or ``MCTIER_DTYPE``) if given, else bf16 on
    CPUs with native bf16, float32 on the others."""
    choice = explicit or os.environ.get(DTYPE_ENV) or None
    if choice:
        if choice not in DTYPES:
            raise ValueError(f"dtype {choice!r} is not one of {DTYPES}")
        return choice
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in NATIVE_BF16_FLAGS) else "float32"


def kv_bytes_per_token(model: str | os.PathLike, dtype: str | None = None) -> int:
    """KV bytes one token takes in an engine of the model directory ``model`` in ``dtype``
    (default: :func:`engine_dtype`): K and V, every layer, every KV head, from its
    ``config.json``. ``OSError``/``KeyError`` when the directory or a field is missing."""
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[engine_dtype(explicit=dtype)]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size


def dtype_args(argv: list[str]) -> list[str]:
    """``["--dtype", engine_dtype()]`` unless ``argv`` already names a dtype."""
    if any(a == "--dtype" or a.startswith("--dtype=") for a in argv):
        return []
    return ["--dtype", engine_dtype()]


def cpu_summary() -> dict:
    """What benchmark headers, the demo and model stamps record about the CPU class."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags], "dtype": engine_dtype(flags),
            "simulated": simulated_isa()}


def engine_env(core: int | None = None) -> dict[str, str]:
    """Environment for a vLLM engine pinned to ``core`` (all of ``ENGINE_ENV``, plus the
    AVX2 simulation when it is on)."""
    env = dict(ENGINE_ENV)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if simulated_isa() == "avx2":
        sim = str(Path(__file__).resolve().parent / "simcpu")
        env["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache_dir() + "-simavx2"
        env.update({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", SIMULATE_ENV: "avx2",
                    "PYTHONPATH": os.pathsep.join(p for p in (sim, os.environ.get("PYTHONPATH", "")) if p)})
    return env


def _inductor_cache_dir() -> str:
    """torch inductor's cache directory for this process's engines: ``TORCHINDUCTOR_CACHE_DIR``
    or torch's default, ``<tmp>/torchinductor_<user>``."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


class Platform:
    name = "cpu"
    device_type = "cpu"

    def memory_location(self, device=None) -> str:
        """Location string for ``TransferEngine.register_memory`` of memory on ``device``
        (a ``torch.device``, an index, or None for this process's current device)."""
        return "cpu:0"

    def kv_ready_fence(self):
        """An object whose ``wait()`` returns once KV written so far is readable."""
        return _NoFence()

    def prepare_worker(self) -> None:
        """Per-process setup a KV-loading connector needs before the first forward.

        On AMX CPUs the kernel only lets a process run AMX tile instructions after it
        asked for them (arch_prctl XCOMP_PERM). vLLM's CPU attention picks its AMX path
        for bf16 / block 32, but the permission is requested lazily by other kernels; an
        engine whose first forward attends over loaded KV (1 new token, long context)
        died with SIGILL. Asking up front is idempotent and harmless.
        """
        try:
            import torch

            if torch.cpu._is_amx_tile_supported():
                torch.cpu._init_amx()
        except (ImportError, AttributeError, RuntimeError):
            pass


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    def memory_location(self, device=None) -> str:
        # Each TP rank's worker owns one GPU (its local rank), set as the current device;
        # its KV must be registered there, or GPUDirect RDMA would address the wrong GPU.
        index = getattr(device, "index", device)
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return f"cuda:{index}"

    def prepare_worker(self) -> None:
        return None

    def kv_ready_fence(self):
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event  # Event.wait() would make a stream wait; synchronize() blocks the host.


class _NoFence:
    def wait(self) -> None:
        return None

    synchronize = wait


@functools.cache
def current() -> Platform:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return Platform()
    return CudaPlatform() if current_platform.device_type == "cuda" else Platform()


def wait_fence(fence) -> None:
    # CUDA events block the host with synchronize(); our CPU fence offers the same name.
    fence.synchronize()
