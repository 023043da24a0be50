"""Layer-wise store loads against whole ones, and where the CPU time of a hit goes (not a test).

    .venv/bin/python -m bench.layerwise_load [--prefix 32768] [--reps 3] [--groups 4] [--reserve-core]

A Mooncake master and store server on loopback and, on the ``small`` model: a writer W
(``StoreConnector``, ``kv_producer``) on core 0, and three ``kv_consumer`` readers on core 1
in dev mode: ``whole`` (the defaults: a 32K hit, 256 MB, loads in the background while its
request waits), ``sync`` (``sync_load_max`` 1 GB: the same load inside the step, before the
forward pass) and ``layerwise`` (``layerwise_load``: inside the step, layer group by layer
group under the forward pass). Per repetition W computes and saves a fresh prompt of
``--prefix`` tokens plus a few; each reader in turn (order rotating, its prefix cache emptied,
the others quiet) serves that prefix plus one new block from the store (the timed hit), then
the same prefix plus another new block from its own prefix cache (the floor on its core).
The greedy ids of every hit are checked against W's own prefix-cache hit of the same prompt.

Around each hit the CPU time of every thread of the reader's processes and of the store
server is read from ``/proc`` (``utime + stime``, by thread name: the store worker's I/O
threads are named ``mcstore-load`` / ``mcstore-save``; the others keep their process's name),
with the cores each may run on (``main``: a process's main thread; the worker's runs the
forward pass): whether the transfer's CPU work could overlap the forward. ``--reserve-core``:
every engine started on both cores with only its forward bound, the writer's too, to core 1
(:func:`bench.common.engine_cpus`, :func:`bench.common.forward_core`: vLLM's layout with a
reserved core), and the readers get ``io_cpus: auto``, which puts their I/O threads (the
store tier's, Mooncake's) on core 0, as a deployment with a core for the connector may
(replaces moving them from outside, the former ``--io-core``).
Writes ``layerwise_load.json`` and ``layerwise_load.md`` to ``--out`` (default
``bench/results/layerwise_load``); exit status 1 if any token differed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.client import ids, reset_prefix_cache, stream  # noqa: E402
from bench.common import (  # noqa: E402
    QUIET_S,
    RESERVE_CORE_HELP,
    Checker,
    commit,
    engine_cpus,
    forward_core,
    long_context_args,
    machine,
    model_dir,
    output_dir,
    rotated,
    start_engines,
    term_as_interrupt,
)
from bench.engine_metrics import get, moved, scrape  # noqa: E402
from bench.store_divergence import StoreWatch  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

CHUNK, BLOCK, SUFFIX, MAX_TOKENS = 256, 32, 32, 4
ARMS = {"whole": {}, "sync": {"sync_load_max": "1GB"}, "layerwise": {"layerwise_load": True}}
TICK = os.sysconf("SC_CLK_TCK")
LAYOUTS = {False: "pinned whole to one core each (the I/O threads on the engine's core)",
           True: "started on every core, every forward bound to core 1 (--reserve-core: the readers' I/O threads on core 0)"}


def store_config(master: str, role: str, **extra) -> dict:
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, "chunk_tokens": CHUNK, **extra}}


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float, str]]:
    """(pid, tid) -> (thread name, CPU seconds so far, the cores it may run on) of every thread
    of ``pids``; threads that ended meanwhile are left out."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                cpus = next(ln.split()[1] for ln in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
                            if ln.startswith("Cpus_allowed_list"))
            except (OSError, StopIteration):
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")] + (" main" if int(tid) == pid else "")
            f = stat[stat.rindex(")") + 2:].split()
            out[(pid, int(tid))] = (name, (int(f[11]) + int(f[12])) / TICK, cpus)
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per thread name (and cores) between two :func:`thread_cpu` readings."""
    out: Counter[str] = Counter()
    for k, (name, t, cpus) in after.items():
        d = t - before.get(k, (name, 0.0, cpus))[1]
        if d > 0:
            out[f"{name} [cpus {cpus}]"] += d
    return {k: round(v, 3) for k, v in out.most_common()}


def tree(pid: int) -> list[int]:
    import psutil

    p = psutil.Process(pid)
    return [p.pid] + [c.pid for c in p.children(recursive=True)]


def run(a: argparse.Namespace) -> int:
    out = output_dir(a.out)
    model = model_dir("small")
    rng = random.Random(a.seed)
    check = Checker()
    dep = Deployment(out / "logs")
    long = long_context_args(a.prefix + 2 * CHUNK + SUFFIX)
    reps: list[dict] = []
    watch = None
    term_as_interrupt()
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=a.segment_gb << 30).start()
        master = dep.cluster.master_addr
        arms = {k: dict(v, **({"layerwise_load_groups": a.groups} if "layerwise_load" in v else {}),
                        **({"io_cpus": "auto"} if a.reserve_core else {}))  # the readers' I/O on core 0
                for k, v in ARMS.items()}
        cpus = engine_cpus(a.reserve_core)
        specs = [("lw-writer", forward_core(0, a.reserve_core), store_config(master, "kv_producer"), cpus)]
        specs += [(f"lw-{k}", 1, store_config(master, "kv_consumer", **v), {"env": {"VLLM_SERVER_DEV_MODE": "1"}, **cpus})
                  for k, v in arms.items()]
        started = start_engines(dep, model, specs, extra=long)
        w_url = started[0][0]
        readers = {k: (url, proc.pid) for k, (url, proc) in zip(arms, started[1:])}
        server_pids = [p.pid for p in (dep.cluster.server, dep.cluster.master) if p is not None]
        watch = StoreWatch(dep.cluster)
        for rep in range(a.reps + 1):  # the first is a warm-up, not in the figures
            p = ids(a.prefix + rng.randrange(1, CHUNK), rng)
            stream(w_url, p, 1)
            watch.wait_stored(p)
            q, q_own = p[:a.prefix] + ids(SUFFIX, rng), p[:a.prefix] + ids(SUFFIX, rng)
            res: dict = {"rep": rep}
            for who in rotated(list(arms), rep):
                url, pid = readers[who]
                reset_prefix_cache(url)
                time.sleep(QUIET_S)
                m0, pids = scrape(url), tree(pid) + server_pids
                c0 = thread_cpu(pids)
                got = stream(url, q, MAX_TOKENS)
                c1 = thread_cpu(pids)
                time.sleep(QUIET_S)
                own = stream(url, q_own, MAX_TOKENS)
                d = moved(scrape(url), m0)
                res[who] = {"ttft_s": got.ttft, "cached": got.cached, "floor_s": own.ttft, "floor_cached": own.cached,
                            "tokens": got.token_ids, "cpu": cpu_delta(c0, c1),
                            "loaded_bytes": get(d, "vllm:mctier_store_loaded_bytes_total"),
                            "layer_wait_s": get(d, "vllm:mctier_store_phase_seconds_sum", phase="load_layer_wait"),
                            "load_s": get(d, "vllm:mctier_store_load_seconds_sum")}
                print(f"[layerwise_load] rep {rep} {who}: hit {got.ttft * 1e3:.0f} ms (cached {got.cached}), "
                      f"floor {own.ttft * 1e3:.0f} ms, cpu {res[who]['cpu']}", flush=True)
            time.sleep(QUIET_S)
            ref = stream(w_url, q, MAX_TOKENS)
            for who in arms:
                check.same("layerwise_load", f"{who} hit vs the writer's prefix-cache hit", len(q),
                           res[who].pop("tokens"), ref.token_ids)
            if rep:
                reps.append(res)
    finally:
        if watch is not None:
            watch.close()
        dep.stop()
    rows = {who: summarise([r[who] for r in reps]) for who in ARMS if reps}
    result = {"machine": machine(model), "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
              "prefix": a.prefix, "reps": a.reps, "groups": a.groups, "reserve_core": a.reserve_core,
              "commit": commit(), "rows": rows, "per_rep": reps}
    (out / "layerwise_load.md").write_text(table(result))
    print("\n" + table(result))
    return check.write(out / "layerwise_load.json", result, "layerwise_load")


def summarise(xs: list[dict]) -> dict:
    med = lambda k: statistics.median(x[k] for x in xs)  # noqa: E731
    cpu: Counter[str] = Counter()
    for x in xs:
        cpu.update(x["cpu"])
    return {"ttft_ms": med("ttft_s") * 1e3, "floor_ms": med("floor_s") * 1e3,
            "ratio": statistics.median(x["ttft_s"] / x["floor_s"] for x in xs), "cached": med("cached"),
            "load_ms": med("load_s") * 1e3, "layer_wait_ms": med("layer_wait_s") * 1e3,
            "loaded_mb": med("loaded_bytes") / 1e6, "cpu_s": {k: round(v / len(xs), 3) for k, v in cpu.most_common(8)}}


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"Run {result['date']}, {m['cpu']} ({m['isa']}; engines in {m['dtype']}), {m['cores']} cores, "
             f"small model, prefix {result['prefix']} tokens, {result['reps']} repetitions (medians), "
             f"{result['groups']} layer groups, commit {result.get('commit', '-')}, engines "
             f"{LAYOUTS[bool(result.get('reserve_core'))]}.",
             "",
             "| reader | hit ms | floor ms | hit /floor | cached | load ms | forward waited ms | MB loaded |",
             "|---|---|---|---|---|---|---|---|"]
    for who, r in result["rows"].items():
        lines.append(f"| {who} | {r['ttft_ms']:.0f} | {r['floor_ms']:.0f} | {r['ratio']:.2f} | {r['cached']:.0f} | "
                     f"{r['load_ms']:.0f} | {r['layer_wait_ms']:.0f} | {r['loaded_mb']:.0f} |")
    lines += ["", "CPU seconds per hit by thread (mean; reader's processes and the store server):", ""]
    for who, r in result["rows"].items():
        lines.append(f"- {who}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=32768, help="tokens of the stored prefix (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    ap.add_argument("--groups", type=int, default=4, help="layerwise_load_groups of the layer-wise reader")
    ap.add_argument("--segment-gb", type=int, default=4, help="the store server's segment, GiB")
    ap.add_argument("--reserve-core", action="store_true", help=RESERVE_CORE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "layerwise_load"))
    a = ap.parse_args(argv)
    if a.prefix % CHUNK or a.prefix < CHUNK:
        raise SystemExit(f"--prefix must be a positive multiple of {CHUNK}")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
