"""What each connector costs when nothing is reused: vLLM's own client (``vllm bench serve
--dataset-name random``) against one engine on one core, without a connector and with each
of ours, side by side in one run (not a test).

    .venv/bin/python -m bench.no_reuse [--quick] [--rounds 3] [--prompts 64] [--out DIR]
    .venv/bin/python -m bench.no_reuse --keep-up --rounds 10 --arms plain,plain2,store,p2p,tiered
    MCTIER_SIMULATE_CPU=avx2 .venv/bin/python -m bench.no_reuse      (the slow CPU class)

Arms (``--arms``), each one engine pinned to core 1 (``tiny`` model, block size 32), started
fresh for its run and stopped after it; the client runs on core 0 (with ``--reserve-core`` each
engine's processes may use both cores and only its forward is bound to core 1, vLLM's layout
with a core reserved for the rest: a tier's I/O threads go there where its ``io_cpus`` is auto,
the P2P tier's default; the store tier's is ``none``: ``--variant 'store-auto=store:{"io_cpus": "auto"}'``):

- ``plain``: no connector.
- ``store``: ``StoreConnector``, ``kv_both`` (looks up, saves every full chunk of every prompt).
- ``p2p``: ``P2PConnector``, ``kv_consumer``, no request asks for a remote prefill.
- ``tiered``: ``TieredConnector``, ``kv_consumer`` (store and P2P tiers; the store only looks up).

Two floors, not in the default arms: ``null`` (``bench.nullconn.NullConnector``, a connector
whose hooks do nothing: what vLLM's own per-step connector path costs) and ``plain2`` (a second
plain engine: the run's noise, as a ratio to ``plain``).

One Mooncake master and store server serve every arm (started once, beside the client). Each
round runs every arm once, the order rotated by one per round; the table gives per arm the
median over rounds of TTFT p50/p90/p99, mean TPOT and output throughput, and each connector's
ratio to ``plain`` (the median over rounds of the per-round ratio, with its range), against the
issue's bounds: TPOT within 1.05x, p99 TTFT and throughput within 1.1x; beside them vLLM's
own split of a request's time to first token (mean queued and prefill ms, from the engine's
``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds``). Each run is
``--random-input-len 256 --random-output-len 64 --max-concurrency 4 --ignore-eos``, with its
own seed per arm and round and its own store namespace (``key_prefix``), after one untimed
warm-up request. vLLM's random prompts are runs of consecutive token ids from a random start:
on the test model's 2,048-token vocabulary two of 64 prompts often start alike, which every arm
(plain too) finds in its own prefix cache; the store never holds another run's prompts (the
table's store hits say how many its own lookups found). Writes ``no_reuse.json``
and ``no_reuse.md`` to ``--out`` (default ``bench/results/no_reuse/``). Everything started is
stopped at the end, also on failure and Ctrl-C. Exit status 1 if a run failed.

``--keep-up``: every arm's engine is started once, before the first round, and all stay up
together (each on core 1; an idle engine waits on its queue), so a round costs its runs only
and ten rounds cost what three do without it. Before each run the arm's engine is reset with
vLLM's dev-mode ``POST /reset_prefix_cache?reset_external=true`` (its prefix cache; a store
arm's connector, with ``reset_removes_objects``, also removes every object of its key space
from the store), so a run finds neither an earlier round's prompts nor their chunks; each arm
has one namespace for all its rounds. An engine's own layout then stays the same across rounds:
``plain2`` measures how far two engines differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import complete, ids, reset_prefix_cache  # noqa: E402
from bench.common import commit, engine_cpus, machine, model_dir, output_dir, rotated, term_as_interrupt  # noqa: E402
from bench.engine_metrics import REQUEST_TIMES, request_sums, series_delta  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment, metrics  # noqa: E402

ARMS = ("plain", "store", "p2p", "tiered")
BEFORE = "-before"  # an arm run from --before's tree
ENGINE_CORE, CLIENT_CORE = 1, 0
BENCH_TIMEOUT_S = 900
METRICS = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "output_throughput")
# The bounds: each connector / plain.
BOUNDS = {"mean_tpot_ms": 1.05, "p99_ttft_ms": 1.1, "output_throughput": 1 / 1.1}


# --variant NAME=ARM:JSON: NAME runs ARM with JSON added to its store config; a "kv_role" key in
# JSON sets the arm's kv_role instead (kv_consumer: the store arm without its saves), and a
# "connector" key's object is merged into its kv_connector_extra_config ({"store": null}: the
# tiered arm with its P2P tier only).
VARIANTS: dict[str, tuple[str, dict, str | None, dict]] = {}


def add_variant(spec: str) -> str:
    """Register ``--variant NAME=ARM:JSON``; returns NAME."""
    name, _, rest = spec.partition("=")
    base, _, extra = rest.partition(":")
    if not name or base not in ("store", "tiered"):
        raise SystemExit(f"--variant {spec!r}: NAME=ARM:JSON with ARM store or tiered")
    extra = json.loads(extra or "{}")
    VARIANTS[name] = (base, extra, extra.pop("kv_role", None), extra.pop("connector", {}))
    return name


def kv_config(arm: str, master: str, namespace: str = "mct", reset_removes: bool = False) -> dict | None:
    """``namespace``: the store's key prefix of this run (see run_arm); ``reset_removes``: a
    reset of the engine's cache removes its key space's objects from the store (``--keep-up``)."""
    arm, extra, role, top = VARIANTS.get(arm, (arm.removesuffix(BEFORE), {}, None, {}))
    store = {"master": master, "chunk_tokens": 256, "key_prefix": namespace, **extra}
    if reset_removes:
        store["reset_removes_objects"] = True
    base = {"kv_load_failure_policy": "recompute"}
    if arm in ("plain", "plain2"):  # plain2: a second plain engine, the run's noise floor (A/A)
        return None
    if arm == "null":
        return {**base, "kv_connector": "NullConnector", "kv_connector_module_path": "bench.nullconn",
                "kv_role": "kv_both"}
    if arm == "store":
        return {**base, "kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": role or "kv_both",
                "kv_connector_extra_config": {**store, **top}}
    if arm == "p2p":
        return {**base, "kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"bootstrap_port": free_port()}}
    if arm == "tiered":
        return {**base, "kv_connector": "TieredConnector", "kv_connector_module_path": "multi",
                "kv_role": role or "kv_consumer",
                "kv_connector_extra_config": {"store": store, "p2p": {"bootstrap_port": free_port()}, **top}}
    raise ValueError(f"unknown arm {arm!r} (known: {', '.join(ARMS)})")


def bench_serve(url: str, model: str, runs: Path, name: str, seed: int, a: argparse.Namespace) -> dict:
    argv = ["taskset", "-c", str(CLIENT_CORE), str(Path(sys.executable).parent / "vllm"), "bench", "serve",
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", "demo",
            "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(a.prompts),
            "--max-concurrency", str(a.concurrency), "--request-rate", "inf", "--seed", str(seed), "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-result", "--save-detailed", "--result-dir", str(runs),
            "--result-filename", f"{name}.json"]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    (runs / f"{name}.json").unlink(missing_ok=True)
    with open(runs / f"{name}.log", "w") as log:
        p = subprocess.run(argv, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S,
                           env={**os.environ, **env}, start_new_session=True)
    if p.returncode != 0 or not (runs / f"{name}.json").exists():
        tail = "\n".join((runs / f"{name}.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve exited {p.returncode}:\n{tail}")
    d = json.loads((runs / f"{name}.json").read_text())
    if d.get("completed") != a.prompts:
        raise RuntimeError(f"{name}: {d.get('completed')} of {a.prompts} requests completed")
    ttfts = [x * 1e3 for x in d.get("ttfts", [])]
    slowest = sorted(range(len(ttfts)), key=lambda i: -ttfts[i])[:3]
    return {k: d[k] for k in METRICS} | {"completed": d["completed"], "command": argv,
                                         "slowest_ttft_ms": [(i, round(ttfts[i], 1)) for i in slowest]}


def cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of an engine's processes by role: its API server (the
    process started), EngineCore (the scheduler) and Worker (the forward), from ``/proc``."""
    import psutil

    out: dict[str, float] = {}
    root = psutil.Process(root_pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            name = p.name() + " " + " ".join(p.cmdline()[:3])
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = ("api" if p.pid == root_pid else "engine_core" if "EngineCore" in name
                else "worker" if "Worker" in name else "other")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def start_arm(dep: Deployment, arm: str, master: str, model: str, name: str, namespace: str, a):
    """``arm``'s engine, up and warmed by one untimed request: its (url, proc)."""
    url, proc = dep.engine(name, model, ENGINE_CORE, kv_config(arm, master, namespace, reset_removes=a.keep_up),
                           cwd=a.before if arm.endswith(BEFORE) else None,
                           env={"VLLM_SERVER_DEV_MODE": "1"} if a.keep_up else None,
                           **engine_cpus(a.reserve_core))
    dep.wait_http(url, proc)
    complete(url, ids(a.input_len, random.Random(f"warm-{name}")), max_tokens=4)  # untimed
    return url, proc


def run_arm(dep: Deployment, arm: str, master: str, model: str, runs: Path, rnd: int, a, kept=None) -> dict:
    """One run of ``arm`` in round ``rnd``: on a fresh engine, or on ``kept`` (url, proc), the
    engine ``--keep-up`` started, reset first."""
    name = f"{arm}-r{rnd}"
    if kept is None:
        # A store namespace of its own per run: vLLM's random prompts are runs of consecutive token ids
        # (vllm.benchmarks.datasets.RandomDataset), on a 2,048-token vocabulary a prompt often starts
        # where an earlier one did; in a shared namespace a run hit what earlier runs stored.
        url, proc = start_arm(dep, arm, master, model, name, f"nr{rnd}{arm.replace('-', '')}", a)
    else:
        url, proc = kept
        reset_prefix_cache(url, external=True)  # neither the prefix cache nor the store holds a prompt
    try:
        time.sleep(1.2)  # bench.common.QUIET_S: the warm-up's spin of vLLM's queues has ended
        # A seed of its own per arm and round (with a shared seed, the tiered arm of a round hit
        # what the store arm had saved and loaded instead of computing).
        cpu0, rs0 = cpu_seconds(proc.popen.pid), request_sums(url)
        row = bench_serve(url, model, runs, name, 1000 + 100 * rnd + a.arm_list.index(arm), a)
        cpu1, rs1 = cpu_seconds(proc.popen.pid), request_sums(url)
        # vLLM's split of a request's TTFT: queued (arrival until first scheduled, where a store
        # lookup defers it) and prefill (scheduled until the first token), mean ms per request.
        row["vllm_request_ms"] = {key: 1e3 * series_delta(rs1, rs0, f"{n}_sum") / n_
                                  for n, key in REQUEST_TIMES.items()
                                  if (n_ := series_delta(rs1, rs0, f"{n}_count")) > 0}
        # CPU milliseconds per request by process: steadier than latencies on a shared host.
        row["cpu_ms_per_request"] = {k: (cpu1[k] - cpu0.get(k, 0.0)) * 1e3 / a.prompts for k in cpu1}
        counters = {f"{k[0].removeprefix('vllm:mctier_')}{':' + k[1] if k[1] else ''}": v
                    for k, v in metrics(url).items() if k[0].endswith("_total") and v}
        if kept is not None:  # the engine's counters since it started: this run's are the difference
            before = a.counters.setdefault(arm, {})
            row["mctier_counters"] = {k: v - before.get(k, 0) for k, v in counters.items() if v - before.get(k, 0)}
            a.counters[arm] = counters
        else:
            row["mctier_counters"] = counters
        return row
    finally:
        if kept is None:
            dep.stop([proc])


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per arm: medians over rounds; per connector: per-round ratios to plain (same round)."""
    out = {}
    plain = results.get("plain", [])
    for arm, rows in results.items():
        ok = [r for r in rows if r is not None]
        if not ok:
            continue
        s = {"median": {k: statistics.median(r[k] for r in ok) for k in METRICS}, "rounds": len(ok),
             # Must be 0: a hit would make it a reuse workload.
             "store_hits": sum(r.get("mctier_counters", {}).get("store_lookups_total:hit", 0) for r in ok),
             "cpu_ms_per_request": {k: statistics.median(r["cpu_ms_per_request"].get(k, 0.0) for r in ok)
                                    for k in ok[0].get("cpu_ms_per_request", {})},
             "vllm_request_ms": {k: statistics.median(r["vllm_request_ms"][k] for r in ok)
                                 for k in REQUEST_TIMES.values() if all(k in r.get("vllm_request_ms", {}) for r in ok)}}
        if arm != "plain" and plain:
            ratios = {k: [r[k] / p[k] for r, p in zip(rows, plain) if r is not None and p is not None and p[k]]
                      for k in METRICS}
            s["ratio"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()
                          if v}
            s["within_bounds"] = {k: (s["ratio"][k]["median"] <= b if b >= 1 else s["ratio"][k]["median"] >= b)
                                  for k, b in BOUNDS.items() if k in s["ratio"]}
        out[arm] = s
    return out


def render(summary: dict, info: dict) -> str:
    head = ("| arm | TTFT p50 ms | p90 | p99 | TPOT ms | tok/s | TPOT / plain | p99 TTFT / plain | "
            "throughput / plain | vLLM's mean queued / prefill ms | CPU ms per request: API server / EngineCore / "
            "Worker | store hits |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for arm, s in summary.items():
        m = s["median"]
        cells = [arm, f"{m['p50_ttft_ms']:.1f}", f"{m['p90_ttft_ms']:.1f}", f"{m['p99_ttft_ms']:.1f}",
                 f"{m['mean_tpot_ms']:.2f}", f"{m['output_throughput']:.0f}"]
        for k in ("mean_tpot_ms", "p99_ttft_ms", "output_throughput"):
            r = s.get("ratio", {}).get(k)
            cells.append("-" if r is None else
                         f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
                         f"{'' if s['within_bounds'][k] else ' **over**'}")
        v = s.get("vllm_request_ms", {})
        cells.append(" / ".join(f"{v[k]:.1f}" if k in v else "-" for k in REQUEST_TIMES.values()))
        cpu = s.get("cpu_ms_per_request", {})
        cells.append(" / ".join(f"{cpu.get(k, 0):.1f}" for k in ("api", "engine_core", "worker")))
        cells.append(f"{s['store_hits']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    m = info["machine"]
    lines.append("")
    lines.append(f"{info['date']}, {m['cpu']} ({', '.join(m['isa']) or 'no bf16/AVX-512 flags'}; engines "
                 f"{m['dtype']}{', simulated ' + m['simulated_cpu'] if m['simulated_cpu'] else ''}), commit "
                 f"{info['commit']}, {info['rounds']} rounds of {info['prompts']} prompts, load average at start "
                 f"{m['loadavg_start']:.2f}. Ratios: median over rounds of the per-round ratio (range).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.no_reuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 16 prompts")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--model", default="tiny", help="built-in preset (tiny, small) or a model directory")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "no_reuse"))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:JSON",
                    help="one more arm NAME: ARM (store or tiered) with JSON added to its store config, e.g. "
                         "store-nowait=store:'{\"lookup_wait_ms\": 0}'; in JSON, \"kv_role\" sets the arm's role "
                         "and \"connector\" merges into its kv_connector_extra_config (tiered:'{\"connector\": "
                         "{\"store\": null}}': no store tier)")
    ap.add_argument("--reserve-core", action="store_true",
                    help="every arm's engine started on both cores with its forward (OpenMP) on core 1, as vLLM "
                         "lays out an engine with reserved cores: its other processes and a tier's I/O threads "
                         "where its io_cpus is auto share core 0 with the client")
    ap.add_argument("--keep-up", action="store_true",
                    help="start every arm's engine once and keep all up together, each reset (its prefix cache "
                         "and its store objects) before every run: rounds cost their runs only")
    ap.add_argument("--before", metavar="DIR",
                    help="also run each connector arm from DIR (an export of an earlier commit: `git archive`), "
                         "as ARM-before, side by side with this tree's")
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.prompts = a.prompts or (16 if a.quick else 64)
    arms = [x for x in a.arms.split(",") if x]
    for v in a.variant:
        name = add_variant(v)
        if name not in arms:  # also named in --arms: run once (a second run would hit the first's saves)
            arms.append(name)
    if a.before:
        a.before = str(Path(a.before).resolve())
        arms += [x + BEFORE for x in arms if x in ARMS and x != "plain"]
    a.arm_list = arms
    a.counters = {}  # --keep-up: each arm's engine counters at the end of its last run
    for arm in arms:
        kv_config(arm, "-")  # an unknown arm fails before anything starts
    term_as_interrupt()
    model = model_dir(a.model)
    out = output_dir(a.out)
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    info = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "before": a.before, "machine": machine(model),
            "rounds": a.rounds,
            "prompts": a.prompts, "arms": arms, "input_len": a.input_len, "output_len": a.output_len,
            "concurrency": a.concurrency, "quick": a.quick, "reserve_core": a.reserve_core, "keep_up": a.keep_up}
    dep = Deployment(out / "logs")
    results: dict[str, list] = {arm: [] for arm in arms}
    errors: dict[str, str] = {}
    try:
        master = ""
        if any(VARIANTS.get(arm, (arm.removesuffix(BEFORE),))[0] in ("store", "tiered") for arm in arms):
            dep.cluster = StoreCluster(out / "logs" / "store", segment_size=1 << 30).start()
            master = dep.cluster.master_addr
        kept = {arm: start_arm(dep, arm, master, model, arm, f"nr{arm.replace('-', '')}", a)
                for arm in (arms if a.keep_up else [])}
        for rnd in range(a.rounds):
            for arm in rotated(arms, rnd):
                try:
                    row = run_arm(dep, arm, master, model, runs, rnd, a, kept.get(arm))
                except Exception as e:  # noqa: BLE001 - the others' figures still stand
                    errors[f"{arm}-r{rnd}"] = f"{type(e).__name__}: {e}"[:3000]
                    print(f"[no_reuse] {arm} round {rnd} FAILED: {errors[f'{arm}-r{rnd}']}", file=sys.stderr, flush=True)
                    row = None
                results[arm].append(row)
                if row is not None:
                    print(f"[no_reuse] round {rnd} {arm}: " + ", ".join(f"{k} {row[k]:.2f}" for k in METRICS), flush=True)
    except KeyboardInterrupt:
        errors["interrupted"] = "KeyboardInterrupt"
    finally:
        dep.stop()
    summary = summarize(results)
    table = render(summary, info)
    print(table)
    (out / "no_reuse.md").write_text(table + "\n")
    (out / "no_reuse.json").write_text(json.dumps({**info, "results": results, "summary": summary,
                                                   "errors": errors, "pids": dep.started}, indent=1))
    print(f"[no_reuse] wrote {out / 'no_reuse.json'} and {out / 'no_reuse.md'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
