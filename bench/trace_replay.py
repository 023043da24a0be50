"""A scaled window of Mooncake's conversation trace replayed through the real stack by vLLM's
own client (``vllm bench serve --dataset-name timed_trace``): a tiered 1P1D deployment
behind the KV-aware router against two plain engines, plus this machine's speeds for a
simulator (a benchmark, not a test).

    .venv/bin/python -m bench.trace_replay [--quick] [--out DIR] [--ttft-slo S] [--sample 80 ...]

Trace: ``bench.trace`` keeps one in ``--sample`` sharing groups of the conversation trace and
scales it (``--len-factor 8 --out-factor 8 --time-factor 0.1``: 145 requests over 350 s,
64-token blocks, mean input ~1,560 tokens, output ~47; ``--quick``: the first 30 at
``--time-factor 0.05``, 35 s). A prompt longer than the model's positions (``small``: 8,192)
loses its tail (3 of the 145). The client sends each request at its timestamp, token ids
drawn per block from the block's hash id with Python's ``hash()``: it runs with a fixed
``PYTHONHASHSEED``, so both deployments get the same prompts.

Deployments, one after the other on the same two cores (``small`` model, eager, block 32,
``--max-num-batched-tokens 2048``: vLLM's CPU default, explicit because the fit uses it):

- B, plain: two engines without a connector (core 0, core 1) behind
  ``mctier proxy --plain U1 U2 --policy round-robin``; the speeds are measured on engine 0
  directly before the replay.
- A, tiered: a Mooncake master + store server (``--store-gib`` of DRAM), prefill P (core 0)
  and decode D (core 1) with ``TieredConnector``, behind ``mctier proxy --policy kv --store``.

Not timed: one text request per engine (in A one P -> D handoff, which warms both) and one
through the replay's router. Prefix caches keep their default size (``VLLM_CPU_KVCACHE_SPACE``
1 GiB: 87K tokens) unless ``--cache-blocks`` cuts them.

Per deployment: TTFT and TPOT p50/p90/p99 (vLLM's, over successful requests), SLO attainment
(requests with TTFT <= ``--ttft-slo`` among all requests; a failure is a miss), failures, the
router's routes, and prompt tokens by source from each engine's ``/metrics`` after minus
before the replay. Per engine e: P_e = ``vllm:prompt_tokens``, H_e = ``vllm:prefix_cache_hits``
(the local prefix cache, with its ``queries``), S_e = ``vllm:mctier_store_loaded_tokens``,
Q_e = ``vllm:mctier_p2p_bytes{kind=pulled}`` / KV bytes per token, and recomputed
R = sum over e of (P_e - H_e - S_e - Q_e). These are engine tokens: in A a handed-off prompt
counts on P (hit or computed) and again on D (pulled, its last token computed), so R is what
the deployment computed and ``recomputed_share`` = R / the client's prompt tokens. Q_e counts
whole blocks (a partial last block as 32 tokens); each engine's ``vllm:prompt_tokens_by_source``
is kept as a cross-check (its ``local_compute`` sums to R up to that rounding).

Speeds (``speeds.json``). ``prefill``: least squares on the TTFT of max_tokens=1 streams of
fresh random prompts (128 to 3072 tokens, no hit) and of prefix + suffix after the prefix
was sent: t = step_s * ceil(n / 2048) + token_s * n + attn_s * n * (c + n / 2) for n new
tokens after c cached (a step per 2048-token chunk; the chunks' attention sums to the same
term). ``decode``: TPOT of b = 1, 2, 4, 8 streams started together (256-token prompts, 64
tokens): step_s + per_seq_s * b. The first pass of each is untimed (new shapes are slower).
Both on plain engine 0, and again on the tiered decode engine (``tiered``: its connector's
own cost per step), and the prefill fit on the tiered prefill engine too
(``tiered.prefill_instance``: it saves every prompt to the store, on its own core).
``store`` and ``p2p``: from A's histograms over its replay (sums over both engines),
GB/s (1e9 B/s) = bytes / seconds in the transfer phases (store: ``load_transfer``,
``load_staging``, ``load_copy``; P2P: ``transfer``) and latency_s = the rest per load (store:
queue and recheck; P2P: ``query`` + ``ack``; ``wait_s``, the side channel's wait for P's
READY, holds P's prefill: the router sends both requests at once). The cost model may
choose few store loads (none with 87K-token prefix caches), so ``probe`` adds, on the idle
deployment after the replay, forced loads on D (``kv_source`` store, of prefixes P stored;
p2p, through a round-robin router) of 1K, 2K and 4K tokens, twice, each measured alone:
latency_s + bytes / GB/s fitted to the load's (handoff's) seconds. ``contention``: how much
slower a 2,048-token prefill on engine 0 runs while engine 1 prefills one too (their API
servers and engine cores are not pinned). ``overhead``, per deployment: the median TTFT of
fresh 64-token prompts through its router minus straight to an engine (the HTTP hop, the
router's tokenization and store lookup). Plus KV bytes per token,
the prefix-cache capacity per engine (``vllm:cache_config_info``) and the store's DRAM.

Writes ``trace_replay.json`` (all of it, with the trace's ``describe`` and every command),
``trace_replay.md``, ``speeds.json``, the scaled trace (``trace.jsonl``), each router's
decisions over the replay in the order routed (``decisions-{tiered,plain}.jsonl``, from
``mctier proxy --decision-log``) and the client's raw results (``runs/``) to ``--out``
(default ``bench/results/trace_replay/``); prints the table.
Everything started is stopped at the end, also on failure and Ctrl-C (clients before the
master). Exit status 1 if a deployment or a request failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import trace  # noqa: E402
from bench.client import complete, ids, stream  # noqa: E402
from bench.common import machine, model_dir, output_dir, run_deployments, term_as_interrupt  # noqa: E402
from bench.engine_metrics import Key, get, moved, settled  # noqa: E402
from bench.replay_speeds import CHUNK, contention, decode_speeds, fit, handoff_overhead, overhead, prefill_speeds  # noqa: E402
from bench.router_bench import Bench, bench_serve  # noqa: E402
from bench.router_report import router_view  # noqa: E402
from bench.sim import decisions  # noqa: E402
from bench.trace_replay_report import render_markdown, table  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import tiered_config  # noqa: E402

BLOCK = 32
HASH_SEED = "0"  # the client's PYTHONHASHSEED


# ---------------------------------------------------------------- metrics (bench.engine_metrics.scrape's)
def keyed(m: dict[Key, float]) -> dict[str, float]:
    """For JSON: ``name{label="value",...}`` -> value."""
    return dict(sorted((n + ("{" + ",".join(f'{a}="{b}"' for a, b in sorted(ls)) + "}" if ls else ""), round(v, 6))
                       for (n, ls), v in m.items()))


def cache_tokens(m: dict[Key, float]) -> int | None:
    info = [dict(ls) for n, ls in m if n == "vllm:cache_config_info"]
    return int(info[0]["num_gpu_blocks"]) * int(info[0]["block_size"]) if info else None


def hit_tokens(per_engine: dict[str, dict[Key, float]], bpt: int, client_prompt: int) -> dict:
    """Prompt tokens by source (the module docstring defines them)."""
    engines = {}
    for name, d in per_engine.items():
        r = engines[name] = {"prompt": get(d, "vllm:prompt_tokens_total"),
                             "local_hit": get(d, "vllm:prefix_cache_hits_total"),
                             "queries": get(d, "vllm:prefix_cache_queries_total"),
                             "store": get(d, "vllm:mctier_store_loaded_tokens_total"),
                             "p2p": get(d, "vllm:mctier_p2p_bytes_total", kind="pulled") / bpt}
        r["recomputed"] = r["prompt"] - r["local_hit"] - r["store"] - r["p2p"]
        r["preemptions"] = get(d, "vllm:num_preemptions_total")
        r["vllm_by_source"] = {dict(ls)["source"]: v for (n, ls), v in d.items()
                               if n == "vllm:prompt_tokens_by_source_total"}
    tot = {k: round(sum(r[k] for r in engines.values())) for k in ("prompt", "local_hit", "queries", "store", "p2p",
                                                                    "recomputed")}
    return {**tot, "client_prompt": client_prompt, "engines": engines,
            "recomputed_share": tot["recomputed"] / client_prompt if client_prompt else None}


def transfers(per_engine: dict[str, dict[Key, float]]) -> dict:
    """Store loads and P2P handoffs in /metrics deltas, summed over the engines (module docstring)."""
    def s(name, **labels):
        return sum(get(d, name, **labels) for d in per_engine.values())

    st = {"loads": s("vllm:mctier_store_load_seconds_count"), "bytes": s("vllm:mctier_store_loaded_bytes_total"),
          "seconds": s("vllm:mctier_store_load_seconds_sum"),
          "transfer_s": sum(s("vllm:mctier_store_phase_seconds_sum", phase=f"load_{p}")
                            for p in ("transfer", "staging", "copy"))}
    p2p = {"handoffs": s("vllm:mctier_p2p_handoff_seconds_count"), "bytes": s("vllm:mctier_p2p_bytes_total",
                                                                               kind="pulled"),
           "transfer_s": s("vllm:mctier_p2p_transfer_seconds_sum"), "wait_s": s("vllm:mctier_p2p_metadata_seconds_sum")}
    p2p["seconds"] = p2p["transfer_s"] + s("vllm:mctier_p2p_query_seconds_sum") + s("vllm:mctier_p2p_ack_seconds_sum")
    for x, n in ((st, "loads"), (p2p, "handoffs")):
        x["gbps"] = x["bytes"] / x["transfer_s"] / 1e9 if x["transfer_s"] else None
        x["latency_s"] = (x["seconds"] - x["transfer_s"]) / x[n] if x[n] else None
    return {"store": st, "p2p": p2p}


PROBE_SIZES = (1024, 2048, 4096)


def probe(d_url: str, send, kind: str, max_len: int) -> dict:
    """One forced load on D per prompt size (those that fit ``max_len`` with a block of
    suffix and a token out), twice, each with its own /metrics delta; the load's (handoff's)
    seconds fitted as latency_s + bytes / (gbps * 1e9)."""
    pts = []
    for n in [n for n in PROBE_SIZES if n + BLOCK + 1 <= max_len] * 2:
        before = settled(d_url)
        send(n)
        x = transfers({"d": moved(settled(d_url), before)})[kind]
        pts.append((x["bytes"], x["seconds"]))
    f = fit([[1, b] for b, _ in pts], [t for _, t in pts], ("latency_s", "s_per_byte"))
    return {"latency_s": f["latency_s"], "gbps": 1e-9 / f["s_per_byte"] if f["s_per_byte"] > 0 else None,
            "rms_error_s": f["rms_error_s"], "points": [{"bytes": b, "seconds": round(t, 5)} for b, t in pts]}


# ---------------------------------------------------------------- the run
class Replay(Bench):
    def __init__(self, a, model: str, out: Path, trace_file: Path, max_len: int, reqs: list, bpt: int):
        super().__init__(a, model, out)
        self.trace_file, self.timestamps, self.bpt = trace_file, [r.timestamp_ms / 1e3 for r in reqs], bpt
        self.max_len = max_len
        self.extra = ["--max-model-len", str(max_len), "--max-num-batched-tokens", str(CHUNK)]
        self.extra += ["--num-gpu-blocks-override", str(a.cache_blocks)] if a.cache_blocks else []
        self.results: dict[str, dict] = {}
        self.deltas: dict[str, dict[str, dict[Key, float]]] = {}  # deployment -> engine -> /metrics delta
        self.speeds: dict = {}

    def logged_router(self, name: str, args: list[str]):
        """``self.router`` with ``--decision-log runs/{name}-decisions.jsonl`` (fresh):
        (url, process, log path)."""
        log = self.runs / f"{name}-decisions.jsonl"
        log.unlink(missing_ok=True)
        url, proc = self.router(name, [*args, "--decision-log", str(log)])
        return url, proc, log

    def replay(self, name: str, engines: dict[str, str], router_args: list[str], commands: dict,
               direct: str) -> None:
        res = self.results[name] = {"commands": commands}
        url, proc, log = self.logged_router(f"{name}-router", router_args)
        commands["router"] = proc.argv
        self.warm(url, f"{name}-router")
        if not self.a.skip_speeds:  # the router's own share of a TTFT, for the simulator
            self.speeds.setdefault("overhead", {})[name] = overhead(url, direct, random.Random(f"oh-{name}"))
        before = {e: settled(u) for e, u in engines.items()}
        skip = len(log.read_text().splitlines()) if log.exists() else 0  # the warm-up's and overhead's requests
        data = ["--dataset-name", "timed_trace", "--dataset-path", str(self.trace_file),
                "--timed-trace-chunk-hash-size", str(trace.BLOCK // self.a.len_factor),
                "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(len(self.timestamps))]
        t0, clock0 = time.monotonic(), time.time() - time.monotonic()
        # Self-timed: the client ignores the rate; giving one keeps bench_serve from capping concurrency.
        raw = bench_serve(url, name, self.runs, self.model, self.a.seed, data, rate=float("inf"),
                          env={"PYTHONHASHSEED": HASH_SEED})
        res["wall_s"] = round(time.monotonic() - t0, 1)
        # The client schedules by time.time(): a wall-clock step sends requests early or late
        # (seen once here: 42 s early). start_times are its perf_counter(), so they tell.
        sent = [x - raw["start_times"][0] - t for x, t in zip(raw["start_times"], self.timestamps)]
        res.update(sent_vs_trace_s=[round(min(sent), 3), round(max(sent), 3)],
                   wall_clock_step_s=round(time.time() - time.monotonic() - clock0, 3))
        if max(map(abs, sent)) > 1.0:
            print(f"[replay] {name}: WARNING requests sent {min(sent):+.1f} .. {max(sent):+.1f} s off their trace "
                  f"times (wall clock stepped {res['wall_clock_step_s']:+.1f} s during the replay)", flush=True)
        commands.update(client=raw.pop("command"), client_env={"PYTHONHASHSEED": HASH_SEED})
        after = {e: settled(u) for e, u in engines.items()}
        per = self.deltas[name] = {e: moved(after[e], before[e]) for e in engines}
        ttfts, errors = raw.get("ttfts") or [], raw.get("errors") or []
        met = sum(1 for t, e in zip(ttfts, errors) if not e and t and 0 < t <= self.a.ttft_slo)
        res.update({k: raw.get(k) for k in ("completed", "failed", "duration", "request_throughput",
                                             "total_input_tokens", "total_output_tokens")})
        res.update({f"{p}_{m}_ms": raw.get(f"{p}_{m}_ms") for m in ("ttft", "tpot", "itl", "e2el")
                    for p in ("mean", "p50", "p90", "p99")})
        first_error = next((e for e in errors if e), None)
        res.update(requests=len(errors), slo_s=self.a.ttft_slo, slo_attainment=met / len(errors) if errors else None,
                   first_error=first_error and first_error[-300:],
                   tokens=hit_tokens(per, self.bpt, raw.get("total_input_tokens") or 0),
                   cache_tokens_per_engine={e: cache_tokens(after[e]) for e in engines},
                   metrics_delta={e: keyed(d) for e, d in per.items()})
        res["router_view"] = router_view(requests.get(url + "/metrics", timeout=5).text)
        # The replay's own routing decisions in the order routed (the router writes each when
        # its answer ends); bench.sim.validate compares them with the simulator's one by one.
        lines = sorted(log.read_text().splitlines(True)[skip:], key=lambda x: json.loads(x)["t"])
        (self.out / f"decisions-{name}.jsonl").write_text("".join(lines))
        print(f"[replay] {name}: {res['completed']}/{res['requests']} ok, TTFT p50 {res['p50_ttft_ms']:.0f} "
              f"p90 {res['p90_ttft_ms']:.0f} ms, SLO {res['slo_attainment']:.0%}, {res['wall_s']} s", flush=True)

    def deployment_plain(self) -> None:
        print("[replay] B: two plain engines, core 0 and core 1", flush=True)
        n0 = len(self.dep.procs)
        urls = self.start_engines([("plain-0", 0, None), ("plain-1", 1, None)])
        commands = {"engines": [p.argv for p in self.dep.procs[n0:]]}
        for i, u in enumerate(urls):
            self.warm(u, f"plain-{i}")
        if not self.a.skip_speeds:
            rng, t0 = random.Random(f"speeds-{self.a.seed}"), time.monotonic()
            pf = self.speeds["prefill"] = prefill_speeds(urls[0], self.a.quick, rng)
            dc = self.speeds["decode"] = decode_speeds(urls[0], self.a.quick, rng)
            print(f"[replay] speeds on plain-0 ({time.monotonic() - t0:.0f} s): prefill {pf['step_s'] * 1e3:.1f} ms "
                  f"+ {pf['token_s'] * 1e3:.3f} ms/token + {pf['attn_s']:.2e} s/token^2; decode "
                  f"{dc['step_s'] * 1e3:.1f} ms + {dc['per_seq_s'] * 1e3:.2f} ms/seq", flush=True)
            ct = self.speeds["contention"] = contention(urls, rng)
            print(f"[replay] contention: a prefill is {ct['factor']:.0%} slower while the other engine prefills",
                  flush=True)
        self.replay("plain", {"plain-0": urls[0], "plain-1": urls[1]},
                    ["--plain", *urls, "--policy", "round-robin"], commands, urls[0])

    def deployment_tiered(self) -> None:
        print(f"[replay] A: master + store server ({self.a.store_gib} GiB), prefill (core 0), decode (core 1)",
              flush=True)
        self.dep.cluster = StoreCluster(log_dir=self.out / "logs", segment_size=self.a.store_gib << 30).start()
        master, boot, n0 = self.dep.cluster.master_addr, free_port(), len(self.dep.procs)
        p_url, d_url = self.start_engines([("tiered-prefill", 0, tiered_config("kv_producer", master, boot)),
                                           ("tiered-decode", 1, tiered_config("kv_consumer", master, free_port()))])
        commands = {"master": self.dep.cluster.master.argv, "store_server": self.dep.cluster.server.argv,
                    "engines": [p.argv for p in self.dep.procs[n0:]]}
        prefill, n1 = f"{p_url}@http://127.0.0.1:{boot}", len(self.dep.procs)
        try:  # one handoff warms both engines and the Transfer Engine pair (round-robin always hands off)
            self.warm(self.router("tiered-warm", ["--prefill", prefill, "--decode", d_url,
                                                  "--policy", "round-robin"])[0], "tiered")
        finally:
            self.dep.stop(self.dep.procs[n1:])
        if not self.a.skip_speeds:
            # The same fits on the tiered decode engine: its connector adds to every step (in
            # one run its TPOT was 1.22x the plain engines' under the same trace).
            rng, t0 = random.Random(f"speeds-tiered-{self.a.seed}"), time.monotonic()
            self.speeds["tiered"] = {"prefill": prefill_speeds(d_url, self.a.quick, rng),
                                     "decode": decode_speeds(d_url, self.a.quick, rng),
                                     # The prefill engine's own: it saves every prompt to the
                                     # store, and each save shares its core with the next prefill.
                                     "prefill_instance": prefill_speeds(p_url, self.a.quick, rng)}
            print(f"[replay] speeds on tiered-decode ({time.monotonic() - t0:.0f} s)", flush=True)
        self.replay("tiered", {"tiered-prefill": p_url, "tiered-decode": d_url},
                    ["--prefill", prefill, "--decode", d_url, "--policy", "kv", "--store", master], commands, d_url)
        rng = random.Random(self.a.seed)
        rr, _, probe_log = self.logged_router("tiered-probe", ["--prefill", prefill, "--decode", d_url,
                                                                "--policy", "round-robin"])

        def via_store(n: int) -> None:
            prompt = ids(n, rng)
            complete(p_url, prompt, max_tokens=1)  # P computes it and saves it (256-token chunks)
            time.sleep(1.0)  # saves run after the forward pass, off the request path
            stream(d_url, prompt + ids(BLOCK, rng), max_tokens=1, kv={"kv_source": "store"})

        def via_p2p(n: int) -> None:  # round-robin always hands off; kv_source keeps D from recomputing
            stream(rr, ids(n, rng), max_tokens=1, kv={"kv_source": "p2p"})

        for kind, send in (("store", via_store), ("p2p", via_p2p)):
            x = self.speeds[kind] = transfers(self.deltas["tiered"])[kind]
            try:
                x["probe"] = probe(d_url, send, kind, self.max_len)
            except Exception as e:  # noqa: BLE001 - the replay's numbers stand without it
                x["probe"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        if probe_log.exists():
            x = self.speeds["p2p"]
            gbps = x.get("gbps") or (x.get("probe") or {}).get("gbps")  # the replay may have handed nothing off
            x["handoff"] = handoff_overhead(decisions.load(probe_log), self.bpt, gbps)

def window(a: argparse.Namespace, path: Path, positions: int) -> tuple[list[trace.Request], list[str], int]:
    """The scaled trace, written to ``path``; the ``bench.trace`` command that writes it
    (before the cut to the model's ``positions``) and how many prompts that cut shortened."""
    reqs = trace.scale(trace.window(trace.sample(trace.load(a.trace), a.sample), a.start, a.count),
                       len_factor=a.len_factor, out_factor=a.out_factor, time_factor=a.time_factor)
    block, out, cut = trace.BLOCK // a.len_factor, [], 0
    for r in reqs:  # the tail of a prompt goes, its blocks' ids with it: arrivals and shared prefixes stay
        n = min(r.input_length, positions - r.output_length)
        cut += n < r.input_length
        out.append(replace(r, input_length=n, hash_ids=r.hash_ids[:-(-n // block)]))
    trace.write(out, path)
    cmd = [sys.executable, "-m", "bench.trace", "scale", "--trace", a.trace, "--sample", str(a.sample),
           "--start", str(a.start), *(["--count", str(a.count)] if a.count else []), "--len-factor", str(a.len_factor),
           "--out-factor", str(a.out_factor), "--time-factor", str(a.time_factor), "--out", str(path)]
    return out, cmd, cut


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace_replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 requests at twice the rate, fewer speed samples")
    ap.add_argument("--model", default="small")
    ap.add_argument("--trace", default="conversation")
    ap.add_argument("--sample", type=int, default=80)
    ap.add_argument("--len-factor", type=int, default=8)
    ap.add_argument("--out-factor", type=float, default=8.0)
    ap.add_argument("--time-factor", type=float, help="default 0.1 (0.05 with --quick)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, help="requests of the sampled trace (default all; 30 with --quick)")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default 2.0)")
    ap.add_argument("--store-gib", type=int, default=4, help="the store server's DRAM")
    ap.add_argument("--cache-blocks", type=int, help="cut every engine's prefix cache (--num-gpu-blocks-override)")
    ap.add_argument("--only", choices=("tiered", "plain"))
    ap.add_argument("--skip-speeds", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trace_replay"))
    a = ap.parse_args(argv)
    a.time_factor = a.time_factor or (0.05 if a.quick else 0.1)
    a.count = a.count or (30 if a.quick else None)

    from kvcore.platform import engine_dtype, kv_bytes_per_token

    out = output_dir(a.out)
    model = model_dir(a.model)
    positions = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings", 8192)
    reqs, trace_cmd, cut = window(a, out / "trace.jsonl", positions)
    max_len = max(4096, -(-max(r.input_length + r.output_length for r in reqs) // 1024) * 1024)
    desc = trace.describe(reqs, trace.BLOCK // a.len_factor)
    print(f"[replay] trace: {json.dumps(desc)}; {cut} prompts cut to {positions} positions; "
          f"--max-model-len {max_len}", flush=True)
    dtype = engine_dtype()
    b = Replay(a, model, out, out / "trace.jsonl", max_len, reqs, kv_bytes_per_token(model, dtype))
    result = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": a.model,
              "args": vars(a), "trace": {**desc, "file": str(out / "trace.jsonl"), "command": trace_cmd,
                                         "prompts_cut_to_model": cut, "model_positions": positions},
              "max_model_len": max_len, "deployments": b.results}

    term_as_interrupt()
    t0 = time.monotonic()
    deployments = {"plain": b.deployment_plain, "tiered": b.deployment_tiered}
    errors = run_deployments(b.dep, {k: v for k, v in deployments.items() if a.only in (None, k)}, "replay")
    for name, err in errors.items():
        if name in deployments:
            b.results.setdefault(name, {})["error"] = err
    caps = [v for r in b.results.values() for v in (r.get("cache_tokens_per_engine") or {}).values() if v]
    speeds = {**b.speeds, "bytes_per_token": b.bpt, "dtype": dtype, "block_size": BLOCK, "model": a.model,
              "prefix_cache_tokens_per_engine": min(caps) if caps else None,
              "store_dram_bytes": a.store_gib << 30, "store_chunk_tokens": 256}
    result.update(speeds=speeds, seconds=round(time.monotonic() - t0), pids=sorted(set(b.dep.started)))
    if errors:
        result["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    (out / "speeds.json").write_text(json.dumps(speeds, indent=1))
    (out / "trace_replay.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "trace_replay.md").write_text(render_markdown(result))
    print("\n" + table(result))
    print(f"\n[replay] wrote {out}/trace_replay.json, trace_replay.md, speeds.json ({result['seconds']} s)")
    bad = errors or any(r.get("error") or r.get("failed") for r in b.results.values())
    return 130 if "interrupted" in errors else 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
