"""The CPU / CUDA seam. Everything device-specific that the tiers need is here.

On CPU the forward pass has finished writing KV when a connector hook runs, and
the transfer engine addresses host memory. On CUDA the KV is written by kernels
on a stream: a save must wait for them, and memory is registered with its GPU
location so RDMA can use GPUDirect. The CUDA branch is reviewed on paper only
(no GPU on the CI machines).
"""

from __future__ import annotations

import functools


class Platform:
    name = "cpu"
    device_type = "cpu"

    def memory_location(self, device_index: int = 0) -> str:
        """Location string for ``TransferEngine.register_memory``."""
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

    def memory_location(self, device_index: int = 0) -> str:
        return f"cuda:{device_index}"

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
