"""Where an engine's CPU goes with and without a connector (not a test): per arm of
``bench.no_reuse`` (``--arms plain,null,p2p``), one engine on core 1, its threads' CPU while
idle and under ``vllm bench serve`` (the no-reuse workload), from ``/proc/PID/task/*/stat``, and
with ``--spy`` a py-spy profile of its API server, EngineCore and Worker (``ARM-ROLE.txt``,
collapsed stacks; ``--nonblocking``, so samples are wall time of non-idle threads).

    .venv/bin/python -m bench.engine_profile --arms plain,null,p2p,p2p,null,plain [--spy] [--prompts 32]

Prints per process the CPU milliseconds per request of each thread that used any. One run, no
repetition statistics: for ratios use ``bench.no_reuse``.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import no_reuse as nr  # noqa: E402
from bench.client import complete, ids  # noqa: E402
from bench.common import model_dir, output_dir  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402


def thread_cpu(pid: int, waited: dict[tuple, float] | None = None) -> dict[tuple, float]:
    """CPU seconds so far of every thread of ``pid`` and its descendants, keyed by
    (pid, process name, tid, thread name); with ``waited``, each thread's seconds so far spent
    runnable but waiting for a core go there (``/proc/.../schedstat``: run ns, wait ns, timeslices)."""
    import psutil

    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            name = p.name()
            tasks = list(Path(f"/proc/{p.pid}/task").iterdir())
        except (psutil.Error, OSError):
            continue
        for t in tasks:
            try:
                st = (t / "stat").read_text()
            except OSError:
                continue
            f = st[st.rindex(")") + 2:].split()
            key = (p.pid, name, int(t.name), st[st.index("(") + 1:st.rindex(")")])
            out[key] = (int(f[11]) + int(f[12])) / tick
            try:
                run_ns, wait_ns, _ = map(int, (t / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            out[key] = run_ns / 1e9  # ns, finer than stat's ticks
            if waited is not None:
                waited[key] = wait_ns / 1e9
    return out


def used(a: dict, b: dict, floor_s: float = 0.005) -> list[tuple[float, tuple]]:
    return sorted(((b[k] - a.get(k, 0.0), k) for k in b if b[k] - a.get(k, 0.0) > floor_s), reverse=True)


def spy(pid: int, role: str, arm: str, out: Path) -> subprocess.Popen:
    py_spy = Path(sys.executable).parent / "py-spy"
    return subprocess.Popen(["taskset", "-c", "0", str(py_spy), "record", "-p", str(pid), "-r", "200", "-d", "120",
                             "--nonblocking", "--format", "raw", "-t", "-o", str(out / f"{arm}-{role}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    import psutil

    ap = argparse.ArgumentParser(prog="python -m bench.engine_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="plain,null,p2p")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle measurement before the load")
    ap.add_argument("--spy", action="store_true")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:JSON",
                    help="as bench.no_reuse's: NAME runs ARM (store, tiered) with JSON added to its store config")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_profile"))
    a = ap.parse_args(argv)
    bindir = Path(sys.executable).parent
    if a.spy and not (bindir / "py-spy").exists():
        ap.error(f"--spy runs {bindir / 'py-spy'}, not installed: {bindir / 'pip'} install py-spy")
    for v in a.variant:
        nr.add_variant(v)
    out = output_dir(a.out)
    model = model_dir("tiny")
    dep = Deployment(out / "logs")
    load = argparse.Namespace(input_len=256, output_len=64, prompts=a.prompts, concurrency=4)
    try:
        master = "-"
        if {"store", "tiered", *nr.VARIANTS} & set(a.arms.split(",")):  # as bench.no_reuse: one master and store server
            dep.cluster = StoreCluster(out / "logs" / "store", segment_size=1 << 30).start()
            master = dep.cluster.master_addr
        for i, arm in enumerate(a.arms.split(",")):
            url, proc = dep.engine(f"{arm}-{i}", model, nr.ENGINE_CORE, nr.kv_config(arm, master, f"ep{i}"))
            dep.wait_http(url, proc)
            complete(url, ids(256, random.Random(i)), max_tokens=4)
            time.sleep(1.5)
            t0 = thread_cpu(proc.popen.pid)
            time.sleep(a.idle)
            t1 = thread_cpu(proc.popen.pid)
            print(f"== {arm} idle {a.idle:.1f} s, threads that used CPU: "
                  + (", ".join(f"{k[1]}/{k[3]} {d * 1e3:.0f} ms" for d, k in used(t0, t1)) or "none"))
            spies = []
            if a.spy:
                root = psutil.Process(proc.popen.pid)
                for p in [root, *root.children(recursive=True)]:
                    role = ("api" if p.pid == root.pid else "core" if "EngineCore" in p.name()
                            else "worker" if "Worker" in p.name() else None)
                    if role:
                        spies.append(spy(p.pid, role, f"{arm}-{i}", out))
                time.sleep(1)
            w2, w3 = {}, {}
            t2 = thread_cpu(proc.popen.pid, w2)
            row = nr.bench_serve(url, str(model), out, f"{arm}-{i}", 7 + i, load)
            t3 = thread_cpu(proc.popen.pid, w3)
            print(f"== {arm} under load: TPOT {row['mean_tpot_ms']:.2f} ms, p99 TTFT {row['p99_ttft_ms']:.1f} ms, "
                  f"{row['output_throughput']:.0f} tok/s")
            by_proc: dict[str, list] = {}
            for d, k in used(t2, t3):
                by_proc.setdefault(k[1], []).append((d, k))
            for name, rows in by_proc.items():
                print(f"   {name}: {sum(d for d, _ in rows) * 1e3 / a.prompts:.1f} ms/request; "
                      + ", ".join(f"{k[3]} {d * 1e3 / a.prompts:.2f}" for d, k in rows[:8]))
                waits = sorted(((w3.get(k, 0.0) - w2.get(k, 0.0), k) for _, k in rows), reverse=True)
                print(f"   {name} waited for the core: " + ", ".join(
                    f"{k[3]} {d * 1e3 / a.prompts:.2f}" for d, k in waits[:4]) + " ms/request")
            for s in spies:
                s.send_signal(2)  # py-spy writes its profile on SIGINT
                s.wait(timeout=60)
            dep.stop([proc])
    finally:
        dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
