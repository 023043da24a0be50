"""How slow bf16 is on this CPU against float32, natively and with the AVX2 paths forced.

    .venv/bin/python bench/cpu_class.py [--core N]

One core, a 2048x1024 by 1024x1024 linear (the shape of one projection of the small
model over a 2K-token prompt), the median of 5 after a warm-up, in a child process per
setting: as the CPU is, with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, and
with the whole simulation that engines get under ``MCTIER_SIMULATE_CPU=avx2``
(:func:`kvcore.platform.engine_env`). The ratio bf16/float32 is what the dtype rule in
:mod:`kvcore.platform` is about. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_CHILD = r"""
import json, statistics, time, torch
torch.set_num_threads(1)
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for name in ("bfloat16", "float32"):
    dt = getattr(torch, name)
    x, w = torch.randn(2048, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
    torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); torch.nn.functional.linear(x, w); ts.append(time.perf_counter() - t)
    out[name] = statistics.median(ts) * 1e3
print(json.dumps(out))
"""


def measure(env: dict[str, str], core: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from kvcore.platform import cpu_summary, engine_env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    cpu = cpu_summary()
    print(f"{cpu['cpu']} ({', '.join(cpu['isa'])}): engines here run {cpu['dtype']}")
    os.environ.pop("MCTIER_SIMULATE_CPU", None)
    settings = {"native": {}, "ATEN/oneDNN forced to AVX2": {"ATEN_CPU_CAPABILITY": "avx2",
                                                             "ONEDNN_MAX_CPU_ISA": "AVX2"}}
    os.environ["MCTIER_SIMULATE_CPU"] = "avx2"
    settings["MCTIER_SIMULATE_CPU=avx2"] = engine_env()
    del os.environ["MCTIER_SIMULATE_CPU"]
    print(f"{'setting':<28} {'torch ISA':>9} {'bf16 ms':>8} {'fp32 ms':>8} {'bf16/fp32':>9}")
    for name, env in settings.items():
        m = measure(env, a.core)
        print(f"{name:<28} {m['capability']:>9} {m['bfloat16']:>8.1f} {m['float32']:>8.1f} "
              f"{m['bfloat16'] / m['float32']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
