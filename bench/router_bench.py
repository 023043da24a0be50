"""The KV-aware router's benchmark: ``mctier proxy --policy kv`` against round-robin and
least-outstanding routing, and P/D behind the router against plain engines, measured by
vLLM's own client (``vllm bench serve``), side by side in one run (not a test).

    .venv/bin/python -m bench.router_bench [--quick] [--policies kv,...] [--out DIR]    (``make bench`` runs it too)

Deployments, one after the other on the same two cores (``small`` model, block size 32):

- A, P/D: a Mooncake master + store server, prefill P1 (core 0), prefill P2 (core 1) and
  decode D, all with ``TieredConnector``. D is pinned to core 1 beside P2: there is no
  third core, and sharing one makes P2 the slower prefill instance, a load imbalance that
  round-robin cannot see and the load-aware policies can. Routers, each its own
  ``mctier proxy`` process started fresh for its run: ``--policy kv`` (with ``--store``,
  the store view), ``round-robin``, ``least-outstanding``.
- B, plain: two engines without a connector, one per core, behind
  ``mctier proxy --plain U1 U2 --policy round-robin`` and ``--policy kv``.

``--policies`` keeps some of the routers (the admission pair always runs the kv one).

Workloads (``--max-concurrency 4`` closed loop, 16 output tokens, ``--ignore-eos``):

- prefix: ``--dataset-name prefix_repetition``, 1024-token prefixes (512 in ``--quick``),
  32-token suffixes. Every engine's prefix cache is cut to ``Scale.cache_blocks`` blocks
  (``--num-gpu-blocks-override``; ``VLLM_CPU_KVCACHE_SPACE`` cannot go below 1 GiB, which on
  ``small`` holds ~87K tokens at 12 KiB per token), so that all prefixes together are ~1.5x
  what one instance holds and half of them ~0.75x: round-robin makes both instances cycle
  through every prefix, affinity lets each keep its half. The report states the sizes.
- chat (full run only): ``--dataset-name sharegpt`` from a generated file, 12 conversations
  of 5 turns whose prompt k is the text of turns 1..k (up to ~800 tokens), turn-major so
  that conversations interleave (``--disable-shuffle``: the loader shuffles otherwise; no
  chat template on that path). ``custom`` (JSONL) would need pandas, absent from the venv.
- short (full run only): ``--dataset-name random``, 256-token prompts: the P/D overhead case.
- admission: the prefix workload open loop at twice the throughput the kv router reached
  unthrottled, kv router without and with ``--ttft-slo T`` (T: ``--ttft-slo`` or the p90
  TTFT of that unthrottled run), ``--save-detailed`` for per-request TTFTs, ``--goodput``.

Every run uses its own ``--seed`` (so its own prefixes and conversations); the engines and
the store are not reset between runs, so a run starts with caches full of the previous
run's prefixes, which it cannot hit. Not timed: each P -> D pair hands off once and each
plain engine serves once after start, and each router serves one unrelated text request
before its run (it loads its tokenizer and store client on first use). Routers and the
client run unpinned. Each run's row also shows the router's own view from its /metrics
(where it sent requests, its predicted against actual mean TTFT, which admission uses).
Writes ``router.json``, ``router.md``, ``router.png`` and each run's raw result (``runs/``)
to ``--out`` (default ``bench/results/router/``), prints the table and the verdicts against
the issue's targets. Everything started is stopped
at the end, also on failure and Ctrl-C. Exit status 1 if a run failed or a request failed
other than with a 429 from admission.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, model_dir, output_dir, run_deployments, start_engines, start_router, term_as_interrupt  # noqa: E402
from bench.router_report import plot, render_markdown, render_table, router_view, summarize  # noqa: E402
from kvcore.procs import Proc, free_port  # noqa: E402
from mcstore.server import StoreCluster, client_env  # noqa: E402
from multi.cli.deploy import Deployment, tiered_config  # noqa: E402

BLOCK = 32
SUFFIX, OUTPUT = 32, 16     # short suffixes, short outputs
CONCURRENCY = 4             # closed loop: two requests in flight per prefill core
MODEL_NAME = "demo"         # Deployment.engine's --served-model-name
BENCH_TIMEOUT_S = 1200      # one `vllm bench serve` run
POLICIES = {"pd": ("kv", "round-robin", "least-outstanding"), "plain": ("round-robin", "kv")}


@dataclass(frozen=True)
class Scale:
    cache_blocks: int  # every engine's prefix cache (--num-gpu-blocks-override)
    max_model_len: int  # below cache_blocks * BLOCK: vLLM needs room for one longest request
    prefix_len: int
    num_prefixes: int
    prefix_prompts: int
    admission_prompts: int
    chat: tuple[int, int, int, int] | None  # conversations, turns, user tokens, assistant tokens per turn
    short_prompts: int


# All prefixes (with their suffix block) ~1.4-1.5x one engine's cache, each engine's half ~0.7x.
QUICK = Scale(cache_blocks=96, max_model_len=2048, prefix_len=512, num_prefixes=8, prefix_prompts=16,
              admission_prompts=16, chat=None, short_prompts=0)
FULL = Scale(cache_blocks=192, max_model_len=4096, prefix_len=1024, num_prefixes=9, prefix_prompts=72,
             admission_prompts=54, chat=(12, 5, 80, 40), short_prompts=48)


def chat_dataset(path: Path, model: str, seed: int, conversations: int, turns: int, user: int, assistant: int) -> int:
    """Synthetic conversations in ShareGPT's format, one entry per turn: turn k of conversation
    c asks with the text of turns 1..k (user and assistant text from random token ids),
    turn-major so that turns of different conversations interleave. Returns the entry count.
    (``--dataset-name custom`` would take JSONL but needs pandas, which the venv lacks.)"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    rng = random.Random(seed)
    text = lambda n: tok.decode([rng.randrange(4, tok.get_vocab_size()) for _ in range(n)])  # noqa: E731
    history = [""] * conversations
    entries = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += f"user: {text(user)}\n"
            reply = f"assistant: {text(assistant)}\n"  # what "the model said", fixed in advance
            entries.append({"id": f"c{c}t{len(entries)}", "conversations": [
                {"from": "human", "value": history[c] + "assistant:"}, {"from": "gpt", "value": reply}]})
            history[c] += reply
    longest = max(len(tok.encode(e["conversations"][0]["value"]).ids) for e in entries)
    if longest > 1000:  # bench serve drops ShareGPT prompts over 1024 tokens
        raise ValueError(f"chat prompts reach {longest} tokens; ShareGPT sampling keeps <= 1024")
    path.write_text(json.dumps(entries))
    return len(entries)


def dataset_args(workload: str, sc: Scale, model: str, seed: int, runs: Path, name: str) -> list[str]:
    if workload in ("prefix", "admission"):
        n = sc.prefix_prompts if workload == "prefix" else sc.admission_prompts
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(n),
                "--prefix-repetition-prefix-len", str(sc.prefix_len), "--prefix-repetition-suffix-len", str(SUFFIX),
                "--prefix-repetition-num-prefixes", str(sc.num_prefixes), "--prefix-repetition-output-len", str(OUTPUT)]
    if workload == "chat":
        path = runs / f"{name}.sharegpt.json"
        n = chat_dataset(path, model, seed, *sc.chat)
        return ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", str(n),
                "--sharegpt-output-len", str(OUTPUT), "--disable-shuffle"]
    return ["--dataset-name", "random", "--num-prompts", str(sc.short_prompts), "--random-input-len", "256",
            "--random-output-len", str(OUTPUT), "--random-range-ratio", "0"]


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
    def __init__(self, a: argparse.Namespace, model: str, out: Path):
        self.a, self.model, self.out = a, model, out
        self.sc = QUICK if a.quick else FULL
        self.runs = out / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.dep = Deployment(out / "logs")
        self.rows: list[dict] = []
        self.n = 0
        # Every engine's flags: the small prefix cache.
        self.extra = ["--num-gpu-blocks-override", str(self.sc.cache_blocks), "--max-model-len",
                      str(self.sc.max_model_len)]

    # ---- processes
    def start_engines(self, specs: list[tuple[str, int, dict | None]]) -> list[str]:
        """Engines started together (name, core, kv config), each with :attr:`extra`: their URLs."""
        return [url for url, _ in start_engines(self.dep, self.model, specs, self.extra)]

    def router(self, name: str, args: list[str]) -> tuple[str, Proc]:
        # The router hashes text prompts with the served model's tokenizer; the store view's
        # Mooncake client binds loopback, as the engines' do.
        return start_router(self.dep, name, ["--connect-timeout", "5", *args, "--tokenizer", self.model],
                            env={**client_env("127.0.0.1"), "VLLM_HOST_IP": "127.0.0.1"})

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
            slo: float | None = None, admission: bool = False, rate: float | None = None) -> dict:
        self.n += 1
        seed = self.a.seed + 1000 * self.n  # a fresh dataset per run: no run warms the next
        name = f"{self.n:02d}-{workload}-{deployment}-{policy}" + ("-slo" if admission else "")
        row = {"workload": workload, "deployment": deployment, "policy": policy, "admission": admission,
               "slo_s": slo, "rate": rate, "seed": seed, "name": name}
        n0 = len(self.dep.procs)
        try:
            url, _ = self.router(name, router_args + (["--ttft-slo", f"{slo:.3f}"] if admission else []))
            self.warm(url, name)
            data = dataset_args(workload, self.sc, self.model, seed, self.runs, name)
            res = bench_serve(url, name, self.runs, self.model, seed, data, rate=rate,
                              goodput_ms=slo * 1e3 if slo else None)
            row.update(summarize(res, slo))
            try:  # the router's own view of the run (its warm-up request included)
                m = requests.get(url + "/metrics", timeout=5)
                if m.status_code == 200:
                    (self.runs / f"{name}.router-metrics.txt").write_text(m.text)
                    row["router_view"] = router_view(m.text)
            except (requests.RequestException, ValueError):
                pass
            print(f"[router] {name}: {row['completed']}/{row['requests']} ok ({row['rejected_429']} rejected), "
                  f"TTFT mean {row['mean_ttft_ms']:.0f} ms p90 {row['p90_ttft_ms']:.0f} ms, "
                  f"{row['request_throughput']:.2f} req/s", flush=True)
        except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
            print(f"[router] {name} FAILED: {row['error']}", flush=True)
        finally:
            self.dep.stop(self.dep.procs[n0:])
        self.rows.append(row)
        return row

    # ---- deployments
    def policies(self, deployment: str) -> list[str]:
        return [p for p in POLICIES[deployment] if not self.a.policies or p in self.a.policies]

    def workloads(self) -> list[str]:
        every = ["prefix"] + (["chat"] if self.sc.chat else []) + (["short"] if self.sc.short_prompts else [])
        return [w for w in every if not self.a.workloads or w in self.a.workloads]

    def deployment_pd(self) -> None:
        print("[router] A: master + store server, prefill P1 (core 0), P2 (core 1), decode D (core 1)", flush=True)
        self.dep.cluster = StoreCluster(log_dir=self.out / "logs", segment_size=4 << 30).start()
        master = self.dep.cluster.master_addr
        b1, b2 = free_port(), free_port()
        while b2 == b1:
            b2 = free_port()
        p1, p2, d_url = self.start_engines([("pd-prefill1", 0, tiered_config("kv_producer", master, b1)),
                                            ("pd-prefill2", 1, tiered_config("kv_producer", master, b2)),
                                            ("pd-decode", 1, tiered_config("kv_consumer", master, free_port()))])
        prefills = [f"{p1}@http://127.0.0.1:{b1}", f"{p2}@http://127.0.0.1:{b2}"]
        # Every P -> D pair hands off once before timing (round-robin always hands off; the kv
        # policy may serve a request whole on D).
        handoff = ["--policy", "round-robin"]
        for i, p in enumerate(prefills):
            n0 = len(self.dep.procs)
            try:
                self.warm(self.router(f"warm-pd-{i}", ["--prefill", p, "--decode", d_url, *handoff])[0], f"pd-{i}")
            finally:
                self.dep.stop(self.dep.procs[n0:])
        base = ["--prefill", *prefills, "--decode", d_url]
        for w in self.workloads():
            for pol in self.policies("pd"):
                extra = ["--store", master] if pol == "kv" else []
                self.run(w, "pd", pol, base + ["--policy", pol] + extra)
        if not self.a.workloads or "admission" in self.a.workloads:
            self.admission(base + ["--policy", "kv", "--store", master])

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
        slo = self.a.ttft_slo or max(0.5, ref["p90_ttft_ms"] / 1e3)
        print(f"[router] admission: {rate:.2f} req/s (2x the {ref['policy']} router's "
              f"{ref['request_throughput']:.2f}), "
              f"TTFT target {slo:.2f} s", flush=True)
        self.run("admission", "pd", "kv", kv_args, slo=slo, rate=rate)
        self.run("admission", "pd", "kv", kv_args, slo=slo, admission=True, rate=rate)

    def deployment_plain(self) -> None:
        print("[router] B: two plain engines, core 0 and core 1", flush=True)
        urls = self.start_engines([("plain-0", 0, None), ("plain-1", 1, None)])
        for i, u in enumerate(urls):
            self.warm(u, f"plain-{i}")
        for w in self.workloads():
            for pol in self.policies("plain"):
                self.run(w, "plain", pol, ["--plain", *urls, "--policy", pol])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.router_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="prefix workload and the admission pair, few prompts")
    ap.add_argument("--model", default="small", help="built-in preset (as bench/suite.py: small) or a model directory")
    ap.add_argument("--workloads", type=lambda v: v.split(","), help="some of prefix,chat,short,admission")
    ap.add_argument("--policies", type=lambda v: v.split(","),
                    help="some of kv,round-robin,least-outstanding (default all; plain has no least-outstanding run)")
    ap.add_argument("--ttft-slo", type=float, help="admission target in seconds (default: p90 TTFT of the kv run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router"))
    a = ap.parse_args(argv)
    known = set(POLICIES["pd"]) | set(POLICIES["plain"])
    if a.policies and not set(a.policies) <= known:
        ap.error(f"--policies: unknown {sorted(set(a.policies) - known)}; known: {sorted(known)}")

    from kvcore.platform import engine_dtype, kv_bytes_per_token

    out = output_dir(a.out)
    model = model_dir(a.model)
    dtype, b = engine_dtype(), Bench(a, model, out)
    sc, per_token = b.sc, kv_bytes_per_token(model, dtype)
    cap = sc.cache_blocks * BLOCK
    working = sc.num_prefixes * (sc.prefix_len + SUFFIX)
    result = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": a.model,
              "quick": a.quick, "scale": asdict(sc), "concurrency": CONCURRENCY, "output_tokens": OUTPUT,
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
    errors = run_deployments(b.dep, {"pd": b.deployment_pd, "plain": b.deployment_plain}, "router")
    if errors:
        result["error"] = "; ".join(f"deployment {k}: {v}" for k, v in errors.items())
    result.update(rows=b.rows, seconds=round(time.monotonic() - t0), pids=sorted(set(b.dep.started)))
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    (out / "router.json").write_text(json.dumps(result, indent=1))
    (out / "router.md").write_text(render_markdown(result))
    plot(result, out / "router.png")
    print("\n" + render_table(result))
    print(f"\n[router] wrote {out / 'router.json'}, {out / 'router.md'}, {out / 'router.png'} ({result['seconds']} s)")
    bad = result.get("error") or any(r.get("error") or r.get("other_failures") or
                                     (r.get("rejected_429") and not r.get("admission")) for r in b.rows)
    return 130 if "interrupted" in errors else 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
