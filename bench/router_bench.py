"""The KV-aware router's benchmark: ``mctier proxy --policy kv`` against every fixed policy
(round-robin, least-outstanding, direct, handoff) on the same deployment, P/D and plain
engines, measured by vLLM's own client (``vllm bench serve``), side by side in one run, plus
vLLM's client through the router over a 1P1D pair against one plain engine (not a test).

    .venv/bin/python -m bench.router_bench [--quick] [--policies kv,...] [--workloads ...] [--deployments ...] [--out DIR]

``make bench`` runs it. Deployments, one after the other on the same two cores (``small``
model, block size 32, every engine's prefix cache cut to ``Scale.cache_blocks`` blocks with
``--num-gpu-blocks-override`` so that the prefix workload's prefixes are ~1.5x what one
engine holds):

- A, P/D: a Mooncake master + store server, prefill P (core 0) and decode D (core 1), both
  with ``TieredConnector``; routers ``--policy kv``, ``round-robin``, ``least-outstanding``,
  ``direct``, ``handoff``, each with the store view (``--store``);
- B, plain: two engines without a connector, one per core; routers ``kv``, ``round-robin``,
  ``least-outstanding``, ``direct``;
- S, the issue's comparison (``tiny`` model, default cache): ``vllm bench serve
  --dataset-name prefix_repetition`` (1,024-token prefixes, 64-token suffixes, 4 prefixes,
  16 output tokens, concurrency 4) against one plain engine (core 1), the same engine behind
  ``mctier proxy --plain`` (the router's own share), and through ``mctier proxy`` over a
  ``TieredConnector`` 1P1D pair (core 0, core 1) with each policy; all three up together, in
  ``--serve-rounds`` rounds (default 3; ``--quick`` 1), each arm once a round in rotated order,
  every ratio against the same round's plain engine and the verdict on the median of rounds.

Workloads: :mod:`bench.router_workloads` (prefix, multi-turn chat, short prompts, no reuse,
a scaled window of Mooncake's conversation trace; ``--quick``: prefix only, fewer prompts),
and admission: the prefix workload open loop at twice the throughput the kv router reached
on A unthrottled, kv router without and with ``--ttft-slo T`` (T: ``--ttft-slo``, else the
larger of the p90 TTFT of that unthrottled run and 1.25x its median TTFT of prompts nothing
held, at least 0.5 s), ``--goodput``.

``--rounds N`` runs every workload and policy of A and B N times, in rounds, each round
starting one policy later; each policy's figures are then the median over rounds, and kv's
ratio to a fixed policy the median of the per-round ratios (kv and that policy in the same
round, minutes apart).

Every router is its own ``mctier proxy`` process started fresh for its run, with the start-up
probe (``--probe-timeout 60``, the fixed policies too, so their estimates mean the same) and
a decision log, from which each row gets the median predicted / actual TTFT after the first
``Scale.settle`` requests (:func:`bench.router_workloads.estimates`). Every run uses its own
``--seed`` (its own prefixes and conversations; the trace is the same for all); engines and
the store are not reset between runs. Not timed: each engine (and the P -> D pair) serves
once after start, each router once before its run. Routers and the client run unpinned.
Writes ``router.json``, ``router.md``, ``router.png`` and each run's raw result (``runs/``)
to ``--out`` (default ``bench/results/router/``), prints the tables and the verdicts against
the issue's targets. Everything started is stopped at the end, also on failure and Ctrl-C.
Exit status 1 if a run failed or a request failed other than with a 429 from admission.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, model_dir, output_dir, rotated, run_deployments, start_engines, start_router, term_as_interrupt  # noqa: E402
from bench.router_report import plot, render_markdown, render_table, router_view, summarize  # noqa: E402
from bench.router_workloads import FULL, OUTPUT, QUICK, SUFFIX, WORKLOADS, admission_target, dataset_args, estimates, serve_args  # noqa: E402
from kvcore.procs import Proc, free_port  # noqa: E402
from mcstore.server import StoreCluster, client_env  # noqa: E402
from multi.cli.deploy import Deployment, tiered_config  # noqa: E402

BLOCK = 32
CONCURRENCY = 4             # closed loop: two requests in flight per core
MODEL_NAME = "demo"         # Deployment.engine's --served-model-name
BENCH_TIMEOUT_S = 1200      # one `vllm bench serve` run
POLICIES = {"pd": ("kv", "round-robin", "least-outstanding", "direct", "handoff"),
            "plain": ("kv", "round-robin", "least-outstanding", "direct")}
FIXED = ("round-robin", "least-outstanding", "direct", "handoff")


def bench_serve(url: str, name: str, runs: Path, model: str, seed: int, data: list[str], *,
                rate: float | None = None, goodput_ms: float | None = None, env: dict[str, str] | None = None) -> dict:
    """One ``vllm bench serve`` run through ``url``; its saved result (detailed), plus its
    command line under ``"command"``. ``env`` adds to the client's environment."""
    argv = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", model, *data, "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--save-result", "--save-detailed", "--result-dir", str(runs),
            "--result-filename", f"{name}.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm",
            # The deployment was warmed and checked before; bench serve's own test request
            # would otherwise warm this run's first prefix.
            "--ready-check-timeout-sec", "0"]
    argv += ["--request-rate", str(rate)] if rate else ["--request-rate", "inf", "--max-concurrency", str(CONCURRENCY)]
    if goodput_ms:
        argv += ["--goodput", f"ttft:{goodput_ms:.0f}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    (runs / f"{name}.json").unlink(missing_ok=True)
    with open(runs / f"{name}.log", "w") as log:
        p = subprocess.run(argv, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, env=env,
                           timeout=BENCH_TIMEOUT_S, start_new_session=True)
    if p.returncode != 0 or not (runs / f"{name}.json").exists():
        tail = "\n".join((runs / f"{name}.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve exited {p.returncode}:\n{tail}")
    return {**json.loads((runs / f"{name}.json").read_text()), "command": argv}


class Bench:
    def __init__(self, a: argparse.Namespace, model: str, out: Path, tiny: str | None = None):
        self.a, self.model, self.tiny, self.out = a, model, tiny or model, out
        self.sc = QUICK if a.quick else FULL
        self.runs = out / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.dep = Deployment(out / "logs")
        self.rows: list[dict] = []
        self.serve_rows: list[dict] = []
        self.n = 0
        # Every engine's flags: the small prefix cache.
        self.extra = ["--num-gpu-blocks-override", str(self.sc.cache_blocks), "--max-model-len",
                      str(self.sc.max_model_len)]

    # ---- processes
    def start_engines(self, specs: list[tuple[str, int, dict | None]], model: str | None = None,
                      extra: list[str] | None = None) -> list[str]:
        """Engines started together (name, core, kv config): their URLs."""
        return [url for url, _ in start_engines(self.dep, model or self.model, specs,
                                                self.extra if extra is None else extra)]

    def router(self, name: str, args: list[str], model: str | None = None) -> tuple[str, Proc]:
        # The router hashes text prompts with the served model's tokenizer; the store view's
        # Mooncake client binds loopback, as the engines' do. The probe for every policy.
        return start_router(self.dep, name, ["--connect-timeout", "5", "--probe-timeout", "60", *args,
                                             "--tokenizer", model or self.model],
                            env={**client_env("127.0.0.1"), "VLLM_HOST_IP": "127.0.0.1"}, timeout=120)

    def warm(self, url: str, tag: str) -> None:
        """One text request with a prompt no run shares: an engine's or a P -> D pair's first
        request sets things up (Transfer Engine handshake), a router's its tokenizer and store
        client, which would otherwise land in the first timed requests' TTFT."""
        rng = random.Random(f"warm-{tag}")
        prompt = f"warm-up {tag} " + " ".join(str(rng.randrange(10**6)) for _ in range(60))
        r = requests.post(url + "/v1/completions", timeout=300, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()

    # ---- one row
    def run(self, workload: str, deployment: str, policy: str, router_args: list[str], *,
            slo: float | None = None, admission: bool = False, rate: float | None = None,
            rows: list[dict] | None = None, model: str | None = None, data: list[str] | None = None,
            round_: int | None = None) -> dict:
        self.n += 1
        seed = self.a.seed + 1000 * self.n  # a fresh dataset per run: no run warms the next
        name = f"{self.n:02d}-{workload}-{deployment}-{policy}" + ("-slo" if admission else "")
        row = {"workload": workload, "deployment": deployment, "policy": policy, "admission": admission,
               "slo_s": slo, "rate": rate, "seed": seed, "name": name}
        if round_ is not None:
            row["round"] = round_
        n0 = len(self.dep.procs)
        log = self.runs / f"{name}.decisions.jsonl"
        log.unlink(missing_ok=True)
        try:
            url, _ = self.router(name, router_args + ["--decision-log", str(log)]
                                 + (["--ttft-slo", f"{slo:.3f}"] if admission else []), model)
            self.warm(url, name)
            skip = len(log.read_text().splitlines()) if log.exists() else 0
            if data is None:
                data = dataset_args(workload, self.sc, model or self.model, seed, self.runs, name)
            timed = workload == "trace"
            res = bench_serve(url, name, self.runs, model or self.model, seed, data,
                              rate=float("inf") if timed else rate, goodput_ms=slo * 1e3 if slo else None,
                              env={"PYTHONHASHSEED": str(seed)} if timed else None)
            row.update(summarize(res, slo))
            time.sleep(0.5)  # the router writes a streamed answer's record just after its last chunk
            row["estimates"] = estimates(log, skip, self.sc.settle, policy)
            try:  # the router's own view of the run (its warm-up request included)
                m = requests.get(url + "/metrics", timeout=5)
                if m.status_code == 200:
                    (self.runs / f"{name}.router-metrics.txt").write_text(m.text)
                    row["router_view"] = router_view(m.text)
            except (requests.RequestException, ValueError):
                pass
            self.save_engine_metrics(name, router_args)
            e = row["estimates"]
            print(f"[router] {name}: {row['completed']}/{row['requests']} ok ({row['rejected_429']} rejected), "
                  f"TTFT mean {row['mean_ttft_ms']:.0f} ms p90 {row['p90_ttft_ms']:.0f} ms, "
                  f"{row['request_throughput']:.2f} req/s; predicted/actual "
                  f"{e.get('ratio_after') or float('nan'):.2f} after {e.get('settle')}", flush=True)
        except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
            print(f"[router] {name} FAILED: {row['error']}", flush=True)
        finally:
            self.dep.stop(self.dep.procs[n0:])
        (self.rows if rows is None else rows).append(row)
        return row

    def save_engine_metrics(self, name: str, router_args: list[str]) -> None:
        """Each engine's /metrics after a run (``{name}.engine-metrics.txt``, one section per
        engine): its connector's lookups, loads and steps, to read beside the router's."""
        urls = [a.split("@")[0] for a in router_args if a.startswith("http")]
        parts = []
        for u in urls:
            try:
                parts.append(f"# engine {u}\n" + requests.get(u + "/metrics", timeout=5).text)
            except requests.RequestException as e:
                parts.append(f"# engine {u}: {e!r}\n")
        (self.runs / f"{name}.engine-metrics.txt").write_text("".join(parts))

    # ---- deployments
    def policies(self, deployment: str) -> list[str]:
        return [p for p in POLICIES[deployment] if not self.a.policies or p in self.a.policies]

    def workloads(self) -> list[str]:
        return [w for w in self.sc.workloads if not self.a.workloads or w in self.a.workloads]

    def pd_pair(self, model: str, extra: list[str], tag: str) -> tuple[str, str, str]:
        """A store, P (core 0) and D (core 1) with TieredConnector, one handoff done: the
        prefill spec, D's URL and the master."""
        self.dep.cluster = StoreCluster(log_dir=self.out / "logs", segment_size=4 << 30).start()
        master = self.dep.cluster.master_addr
        b = free_port()
        p, d = self.start_engines([(f"{tag}-prefill", 0, tiered_config("kv_producer", master, b)),
                                   (f"{tag}-decode", 1, tiered_config("kv_consumer", master, free_port()))],
                                  model, extra)
        spec = f"{p}@http://127.0.0.1:{b}"
        n0 = len(self.dep.procs)
        try:  # P -> D hands off once before timing (the kv policy may serve a request whole on D)
            self.warm(self.router(f"warm-{tag}", ["--prefill", spec, "--decode", d, "--policy", "handoff"],
                                  model)[0], tag)
        finally:
            self.dep.stop(self.dep.procs[n0:])
        return spec, d, master

    def deployment_pd(self) -> None:
        print("[router] A: master + store server, prefill P (core 0), decode D (core 1)", flush=True)
        spec, d, master = self.pd_pair(self.model, self.extra, "pd")
        base = ["--prefill", spec, "--decode", d, "--store", master]
        self.each_policy("pd", lambda pol: base + ["--policy", pol])
        if not self.a.workloads or "admission" in self.a.workloads:
            self.admission(base + ["--policy", "kv"])

    def admission(self, kv_args: list[str]) -> None:
        ref = next((r for r in self.rows if r["workload"] == "prefix" and r["deployment"] == "pd"
                    and r.get("request_throughput") and r["policy"] == "kv"), None) or next(
            (r for r in self.rows if r["workload"] == "prefix" and r.get("request_throughput")), None)
        if ref is None:
            print("[router] admission: no unthrottled prefix run measured; skipped", flush=True)
            for adm in (False, True):
                self.rows.append({"workload": "admission", "deployment": "pd", "policy": "kv", "admission": adm,
                                  "skipped": "no unthrottled prefix run to size the rate from"})
            return
        rate = 2.0 * ref["request_throughput"]
        slo = self.a.ttft_slo or admission_target(ref["p90_ttft_ms"] / 1e3, (ref.get("estimates") or {}).get("cold_ttft_s"))
        print(f"[router] admission: {rate:.2f} req/s (2x the {ref['policy']} router's "
              f"{ref['request_throughput']:.2f}), TTFT target {slo:.2f} s", flush=True)
        self.run("admission", "pd", "kv", kv_args, slo=slo, rate=rate)
        self.run("admission", "pd", "kv", kv_args, slo=slo, admission=True, rate=rate)

    def deployment_plain(self) -> None:
        print("[router] B: two plain engines, core 0 and core 1", flush=True)
        urls = self.start_engines([("plain-0", 0, None), ("plain-1", 1, None)])
        for i, u in enumerate(urls):
            self.warm(u, f"plain-{i}")
        self.each_policy("plain", lambda pol: ["--plain", *urls, "--policy", pol])

    def each_policy(self, deployment: str, args) -> None:
        """Every workload with every policy, ``--rounds`` times: a round runs each workload's
        policies one after the other, starting one policy later each round, so that a drift
        of the host reaches every policy alike (docs/benchmarks/router.md: one run per policy
        could not tell kv from round-robin where both placed alike)."""
        pols = self.policies(deployment)
        for r in range(self.a.rounds if pols else 0):
            for w in self.workloads():
                for pol in rotated(pols, r):
                    self.run(w, deployment, pol, args(pol), round_=r)

    def deployment_serve(self) -> None:
        """S: the issue's comparison on the tiny model (module docstring), in rounds."""
        if self.a.workloads and "serve" not in self.a.workloads:
            return
        print("[router] S: tiny model, one plain engine (core 1) and a TieredConnector 1P1D pair (core 0, core 1), "
              f"{self.a.serve_rounds} rounds", flush=True)
        data = serve_args(self.sc.serve_prompts)
        extra = ["--max-model-len", "4096"]
        [url] = self.start_engines([("serve-plain", 1, None)], self.tiny, extra)
        self.warm(url, "serve-plain")
        spec, d, master = self.pd_pair(self.tiny, extra, "serve")
        # All up together (an idle engine takes no CPU); the arms' order rotates by round, so a
        # drift of the host over the run reaches every arm alike: each round's ratios are taken
        # against that round's plain engine (docs/benchmarks/router.md: the reference moved
        # 25-48 ms between runs one after the other).
        arms = [("engine", "none", None), ("plain", "kv", ["--plain", url, "--policy", "kv"])] + [
            ("pd", pol, ["--prefill", spec, "--decode", d, "--store", master, "--policy", pol])
            for pol in self.policies("pd")]
        for r in range(self.a.serve_rounds):
            for dep, pol, args in rotated(arms, r):
                if args is None:
                    self.serve_engine(url, data, r)
                else:
                    # Each run its own seed, so its own four prefixes, cold at its start.
                    self.run("serve", dep, pol, args, rows=self.serve_rows, model=self.tiny, data=data, round_=r)

    def serve_engine(self, url: str, data: list[str], r: int) -> None:
        """One run of vLLM's client straight to the plain engine: the round's reference."""
        self.n += 1
        name = f"{self.n:02d}-serve-engine"
        seed = self.a.seed + 1000 * self.n
        row = {"workload": "serve", "deployment": "engine", "policy": "none", "name": name, "seed": seed, "round": r}
        try:
            row.update(summarize(bench_serve(url, name, self.runs, self.tiny, seed, data), None))
            print(f"[router] {name}: TTFT mean {row['mean_ttft_ms']:.0f} ms p90 {row['p90_ttft_ms']:.0f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
            print(f"[router] {name} FAILED: {row['error']}", flush=True)
        self.serve_rows.append(row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="prefix workload, the admission pair and the serve "
                                                         "comparison, few prompts")
    ap.add_argument("--model", default="small", help="built-in preset (as bench/suite.py: small) or a model directory")
    ap.add_argument("--serve-model", default="tiny", help="the model of the comparison against one plain engine")
    ap.add_argument("--workloads", type=lambda v: v.split(","),
                    help=f"some of {','.join(WORKLOADS)},admission,serve")
    ap.add_argument("--policies", type=lambda v: v.split(","),
                    help="some of kv,round-robin,least-outstanding,direct,handoff (default all; plain has no handoff)")
    ap.add_argument("--ttft-slo", type=float,
                    help="admission target in seconds (default: bench.router_workloads.admission_target)")
    ap.add_argument("--deployments", type=lambda v: v.split(","),
                    help="some of pd,plain,serve (default all): re-measure only the deployments a change touches")
    ap.add_argument("--serve-rounds", type=int, default=None,
                    help="rounds of the comparison against one plain engine, each arm once a round in rotated "
                         "order (default 3, --quick 1)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every workload and policy on the P/D and plain deployments, in rounds, the "
                         "policies' order rotated each round; the tables and verdicts take the median over "
                         "rounds (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router"))
    a = ap.parse_args(argv)
    a.serve_rounds = (1 if a.quick else 3) if a.serve_rounds is None else a.serve_rounds
    if a.serve_rounds < 1 or a.rounds < 1:
        ap.error("--rounds and --serve-rounds: at least 1")
    known = set(POLICIES["pd"])
    if a.policies and not set(a.policies) <= known:
        ap.error(f"--policies: unknown {sorted(set(a.policies) - known)}; known: {sorted(known)}")
    if a.deployments and not set(a.deployments) <= {"pd", "plain", "serve"}:
        ap.error(f"--deployments: unknown {sorted(set(a.deployments) - {'pd', 'plain', 'serve'})}; known: pd,plain,serve")

    from kvcore.platform import engine_dtype, kv_bytes_per_token

    out = output_dir(a.out)
    model, tiny = model_dir(a.model), model_dir(a.serve_model)
    dtype, b = engine_dtype(), Bench(a, model, out, tiny)
    sc, per_token = b.sc, kv_bytes_per_token(model, dtype)
    cap = sc.cache_blocks * BLOCK
    working = sc.num_prefixes * (sc.prefix_len + SUFFIX)
    result = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": a.model,
              "serve_model": a.serve_model, "serve_rounds": a.serve_rounds, "rounds": a.rounds, "quick": a.quick,
              "scale": asdict(sc), "concurrency": CONCURRENCY,
              "output_tokens": OUTPUT, "fixed": list(FIXED),
              "cache": {"blocks_per_engine": sc.cache_blocks, "max_model_len": sc.max_model_len,
                        "tokens_per_engine": cap, "kv_bytes_per_token": per_token,
                        "bytes_per_engine": cap * per_token, "dtype": dtype,
                        "prefix_working_set_tokens": working, "working_set_over_one_engine": working / cap}}
    print(f"[router] prefix cache {sc.cache_blocks} blocks = {cap} tokens = {cap * per_token / 2**20:.0f} MiB "
          "per engine "
          f"({per_token} B/token, {dtype}); prefix working set {working} tokens = {working / cap:.2f}x one engine",
          flush=True)

    term_as_interrupt()
    t0 = time.monotonic()
    parts = {"pd": b.deployment_pd, "plain": b.deployment_plain, "serve": b.deployment_serve}
    errors = run_deployments(b.dep, {k: v for k, v in parts.items() if not a.deployments or k in a.deployments},
                             "router")
    if errors:
        result["error"] = "; ".join(f"deployment {k}: {v}" for k, v in errors.items())
    result.update(rows=b.rows, serve_rows=b.serve_rows, seconds=round(time.monotonic() - t0),
                  pids=sorted(set(b.dep.started)))
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    (out / "router.json").write_text(json.dumps(result, indent=1))
    (out / "router.md").write_text(render_markdown(result))
    plot(result, out / "router.png")
    print("\n" + render_table(result))
    print(f"\n[router] wrote {out / 'router.json'}, {out / 'router.md'}, {out / 'router.png'} ({result['seconds']} s)")
    bad = result.get("error") or any(r.get("error") or r.get("other_failures") or
                                     (r.get("rejected_429") and not r.get("admission")) for r in b.rows + b.serve_rows)
    return 130 if "interrupted" in errors else 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
