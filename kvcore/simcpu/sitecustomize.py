"""Loaded by Python at start-up in engines started with ``MCTIER_SIMULATE_CPU=avx2``
(``kvcore.platform.engine_env`` puts this directory on ``PYTHONPATH``).

torch answers vLLM's ISA probes from the CPU itself, whatever ``ATEN_CPU_CAPABILITY``
says; vLLM picks its kernel library and attention path from them. Answering "no
AVX-512, no AMX" makes vLLM load ``_C_AVX2`` and take the paths an AVX2-only CPU takes.
This is a simulation for measuring and testing, never used otherwise.
"""

import os

if os.environ.get("MCTIER_SIMULATE_CPU", "").lower() == "avx2":
    try:
        import torch

        for _name in dir(torch.cpu):
            if _name.startswith(("_is_avx512", "_is_amx", "_is_vnni")):
                setattr(torch.cpu, _name, lambda: False)
    except ImportError:
        pass
