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
import threading
import time
from pathlib import Path

import requests

from kvcore.procs import free_port
from mcstore.server import StoreCluster
from multi.cli.deploy import Deployment, metrics, tiered_config

PLANS = ("recompute", "store", "p2p", "store+p2p")


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


def _sample(url: str, names: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """The named series of an engine, or nothing when it does not answer within a second:
    the status line must never hold the demo up."""
    try:
        return metrics(url, names, timeout=1)
    except requests.RequestException:
        return {}


def new_plan(before: dict, after: dict) -> str | None:
    """The plan the decode instance chose between two samples of its metrics."""
    return next((p for p in PLANS if after.get(("vllm:mctier_tiered_decisions_total", p), 0)
                 > before.get(("vllm:mctier_tiered_decisions_total", p), 0)), None)


class Live:
    """A status line while one request is in flight: elapsed seconds, which engine is working
    on it, and the plan once the decode instance chose one. Redrawn in place on a terminal,
    a line every 5 s otherwise (logs, CI)."""

    RUNNING = "vllm:num_requests_running"
    DECISIONS = "vllm:mctier_tiered_decisions_total"

    def __init__(self, label: str, prefill: str, decode: str, before: dict):
        self.label, self.prefill, self.decode, self.before = label, prefill, decode, before
        self.tty = sys.stdout.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> Live:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        if self.tty:
            print("\r\033[K", end="", flush=True)

    def line(self) -> str:
        p = _sample(self.prefill, (self.RUNNING,)).get((self.RUNNING, ""), 0)
        d = _sample(self.decode, (self.RUNNING, self.DECISIONS))
        plan = new_plan(self.before, d)
        working = [name for name, n in (("prefill", p), ("decode", d.get((self.RUNNING, ""), 0))) if n]
        return (f"[demo]   {self.label}: {time.monotonic() - self._t0:5.1f} s, "
                f"{' + '.join(working) or 'proxy'} working, plan {plan or 'not chosen yet'}")

    def _run(self) -> None:
        last_print = time.monotonic()
        while not self._stop.wait(0.5):
            line = self.line()
            if self.tty:
                print("\r\033[K" + line, end="", flush=True)
            elif time.monotonic() - last_print >= 5:
                print(line, flush=True)
                last_print = time.monotonic()


def run(args: argparse.Namespace) -> int:
    from kvcore.platform import cpu_summary
    from multi.cli.models import build, describe

    cache = Path(os.environ.get("MCTIER_CACHE", Path.cwd() / ".cache"))
    cpu = cpu_summary()
    print(f"[demo] {cpu['cpu']} ({', '.join(cpu['isa'])}"
          f"{'; simulating an AVX2-only CPU' if cpu['simulated'] else ''}): engines run {cpu['dtype']}")
    if not args.model:
        print("[demo] sizing the 'small' model for this CPU (once; measured, then cached) ...", flush=True)
    model = args.model or str(build("small", cache / "models" / "small"))
    print(f"[demo] model {describe(model)}")
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
        for i, (kind, prompt) in enumerate(items, 1):
            before = metrics(d_url)
            with Live(f"request {i}/{len(items)} ({kind})", p_url, d_url, before):
                ttft, n = ask(proxy, prompt)
            after = metrics(d_url)
            plan = new_plan(before, after) or "recompute"
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
        print(f"[demo] stopped all processes; the demo took {time.monotonic() - t0:.0f} s in all")


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
