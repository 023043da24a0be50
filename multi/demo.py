"""``mctier demo``: a whole P/D deployment on one machine, a workload, a summary.

A Mooncake master and store server, a prefill and a decode engine with
``TieredConnector`` (one core each), ``mctier proxy`` in front, a warmup of a
shared system prompt, then a mixed workload (shared-prefix chats, long documents,
short questions) sent through the proxy one at a time. Everything it starts runs
in its own process group and is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from kvcore.procs import Proc, free_port
from mcstore.server import CLIENT_ENV, StoreCluster

ENGINE_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    **CLIENT_ENV,
}
PLANS = ("recompute", "store", "p2p", "store+p2p")


def tiered_config(role: str, master: str, bootstrap_port: int) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": 256},
                                          "p2p": {"bootstrap_port": bootstrap_port}}}


class Deployment:
    """Processes of the demo, stopped in reverse order of start."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.started: list[int] = []  # every PID ever started, for leak checks after stop()
        self.cluster: StoreCluster | None = None

    def track(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        self.started.append(proc.popen.pid)
        return proc

    def engine(self, name: str, model: str, core: int, kv_config: dict | None, *,
               python: str = sys.executable, env: dict[str, str] | None = None) -> tuple[str, Proc]:
        """An OpenAI server pinned whole to ``core``; ``python`` may be another virtualenv's
        interpreter (the benchmarks run peers such as LMCache that way)."""
        port = free_port()
        argv = [python, "-m", "multi.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                "--enforce-eager", "--block-size", "32", "--max-model-len", "8192", "--seed", "0",
                "--served-model-name", "demo", "--enable-prompt-tokens-details"]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        env = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core), **(env or {})}
        proc = self.track(Proc(name, argv, self.log_dir / f"{name}.log", env=env, cpus={core}))
        return f"http://127.0.0.1:{port}", proc

    def pd_pair(self, model: str, p_cfg: dict, d_cfg: dict, bootstrap_port: int) -> tuple[str, str, str]:
        """A prefill engine on core 0, a decode engine on core 1 and the proxy in front of them:
        their (prefill, decode, proxy) URLs."""
        n = len(self.procs)
        p_url, p_proc = self.engine(f"prefill-{n}", model, 0, p_cfg)
        d_url, d_proc = self.engine(f"decode-{n}", model, 1, d_cfg)
        self.wait_http(p_url, p_proc)
        self.wait_http(d_url, d_proc)
        return p_url, d_url, self.proxy(p_url, f"http://127.0.0.1:{bootstrap_port}", d_url)

    def proxy(self, prefill: str, bootstrap: str, decode: str) -> str:
        port = free_port()
        proc = Proc("proxy", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port),
                              "--prefill", f"{prefill}@{bootstrap}", "--decode", decode],
                    self.log_dir / "proxy.log")
        self.track(proc)
        proc.wait_port(port, 30)
        return f"http://127.0.0.1:{port}"

    @staticmethod
    def wait_http(url: str, proc: Proc, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited; log tail:\n{proc.tail()}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{proc.name} not ready after {timeout}s; see {proc.log_path}")

    def stop(self, procs: list[Proc] | None = None) -> None:
        """Stop ``procs`` (default: all, and the store cluster) in reverse order of start."""
        for p in reversed(list(self.procs if procs is None else procs)):
            p.stop(grace=15)
            self.procs.remove(p)
        if procs is not None:
            return
        if self.cluster is not None:
            self.started += [p.popen.pid for p in (self.cluster.master, self.cluster.server) if p is not None]
            self.cluster.stop()
            self.cluster = None


def metrics(url: str) -> dict[tuple[str, str], float]:
    """``(sample name, kind label) -> value`` of an engine's mctier series."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("vllm:mctier_"):
                key = (s.name, s.labels.get("kind", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def workload(seed: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """The shared system prompt, and (kind, prompt) pairs."""
    rng = random.Random(seed)
    words = ("cache block layer store transfer decode prefill model request engine memory disk network "
             "latency bandwidth master segment chunk key value query answer document section table").split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    system = "You are a careful assistant. " + text(700)
    items = [("chat", f"{system}\nuser: {text(30)}") for _ in range(4)]
    items += [("document", text(1500)) for _ in range(2)]
    items += [("short", text(10)) for _ in range(3)]
    rng.shuffle(items)
    return system, items


def ask(url: str, prompt: str, max_tokens: int = 16) -> tuple[float, int]:
    """Streamed completion: (seconds to the first token, prompt tokens)."""
    t0 = time.monotonic()
    ttft = None
    usage = {}
    with requests.post(url + "/v1/completions", stream=True, timeout=300, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = time.monotonic() - t0
            usage = chunk.get("usage") or usage
    return (ttft if ttft is not None else time.monotonic() - t0), int(usage.get("prompt_tokens", 0))


def run(args: argparse.Namespace) -> int:
    from multi.models import build

    cache = Path(os.environ.get("MCTIER_CACHE", Path.cwd() / ".cache"))
    model = args.model or str(build("small", cache / "models" / "small"))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mctier-demo-"))
    dep = Deployment(log_dir)

    def on_signal(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    try:
        print(f"[demo] logs in {log_dir}")
        dep.cluster = StoreCluster(log_dir=log_dir, segment_size=2 << 30, extra_flags=["--client_ttl=2"]).start()
        print(f"[demo] mooncake master {dep.cluster.master_addr} + store server (2 GiB DRAM)")
        boot = free_port()
        master = dep.cluster.master_addr
        p_url, d_url, proxy = dep.pd_pair(model, tiered_config("kv_producer", master, boot),
                                          tiered_config("kv_consumer", master, free_port()), boot)
        print(f"[demo] prefill {p_url}, decode {d_url}, proxy {proxy} ({time.monotonic() - t0:.0f}s)")
        system, items = workload()
        t = time.monotonic()
        ask(p_url, system, max_tokens=1)  # warmup: the prefill instance saves the prompt's chunks
        print(f"[demo] warmed up the shared system prompt ({time.monotonic() - t:.1f}s)")
        rows = []
        for kind, prompt in items:
            before = metrics(d_url)
            ttft, n = ask(proxy, prompt)
            after = metrics(d_url)
            plan = next((p for p in PLANS if after.get(("vllm:mctier_tiered_decisions_total", p), 0)
                         > before.get(("vllm:mctier_tiered_decisions_total", p), 0)), "recompute")
            store_tok = (after.get(("vllm:mctier_tiered_planned_tokens_total", "store"), 0)
                         - before.get(("vllm:mctier_tiered_planned_tokens_total", "store"), 0))
            rows.append({"kind": kind, "plan": plan, "ttft": ttft, "prompt_tokens": n, "store_tokens": store_tok})
            print(f"[demo] {kind:<9} {n:>5} tokens -> {plan:<10} TTFT {ttft * 1e3:7.0f} ms")
        summary(rows, metrics(d_url), metrics(p_url))
        return 0
    except KeyboardInterrupt:
        print("\n[demo] interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        dep.stop()
        print(f"[demo] stopped all processes ({time.monotonic() - t0:.0f}s total)")


def summary(rows: list[dict], d: dict, p: dict) -> None:
    print(f"\n{'plan':<11} {'requests':>8} {'TTFT median ms':>15}")
    for plan in PLANS:
        rs = [r for r in rows if r["plan"] == plan]
        if rs:
            print(f"{plan:<11} {len(rs):>8} {statistics.median(r['ttft'] for r in rs) * 1e3:>15.0f}")
    total = sum(r["prompt_tokens"] for r in rows)
    hit = sum(r["store_tokens"] for r in rows)
    mib = 1 << 20
    print(f"\nrequests {len(rows)}; store hit rate {hit / max(total, 1):.0%} ({hit:.0f} of {total} prompt tokens)")
    print(f"bytes moved: store -> decode {d.get(('vllm:mctier_store_loaded_bytes_total', ''), 0) / mib:.1f} MiB, "
          f"prefill -> decode (P2P) {d.get(('vllm:mctier_p2p_bytes_total', 'pulled'), 0) / mib:.1f} MiB, "
          f"saved to the store {p.get(('vllm:mctier_store_saved_bytes_total', ''), 0) / mib:.1f} MiB")
    print("\nnext: `mctier inspect summary --master HOST:PORT` shows what is stored; "
          "examples/launch-1p1d-tiered.sh runs this deployment by hand")


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="run the demo deployment and a workload, print a summary")
    d.add_argument("--model", help="model directory (default: the built-in 'small' model)")
    d.add_argument("--log-dir")
    d.set_defaults(func=lambda a, rest: run(a), passthrough=False)
