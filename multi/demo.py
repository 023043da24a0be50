"""``mctier demo``: a whole deployment on one machine, a workload, a printed summary.

Everything it starts (master, store server, engines, proxy) runs as a child
process in its own group and is stopped at the end, also on Ctrl-C.
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


class Deployment:
    """Processes of the demo, stopped in reverse order of start."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.cluster: StoreCluster | None = None

    def engine(self, name: str, model: str, core: int, kv_config: dict | None, extra: list[str] = ()) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "multi.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                "--enforce-eager", "--block-size", "32", "--max-model-len", "8192", "--seed", "0",
                "--served-model-name", "demo", "--enable-prompt-tokens-details", *extra]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        env = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        self.procs.append(Proc(name, argv, self.log_dir / f"{name}.log", env=env))
        return f"http://127.0.0.1:{port}"

    def wait_http(self, url: str, proc: Proc, timeout: float = 240) -> None:
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

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(grace=15)
        if self.cluster is not None:
            self.cluster.stop()


def workload(seed: int = 0) -> list[tuple[str, str]]:
    """(kind, prompt) pairs: shared-prefix chats, long documents, short questions."""
    rng = random.Random(seed)
    words = ("cache block layer store transfer decode prefill model request engine memory disk "
             "network latency bandwidth master segment chunk key value query answer document").split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    system = "You are a careful assistant. " + text(300)
    items = [("chat", f"{system}\nuser: {text(20)}") for _ in range(4)]
    items += [("document", text(900)) for _ in range(2)]
    items += [("short", text(12)) for _ in range(3)]
    rng.shuffle(items)
    return items


def run(args: argparse.Namespace) -> int:
    from multi.models import build

    cache = Path(os.environ.get("MCTIER_CACHE", Path.cwd() / ".cache"))
    model = args.model or str(build("small", cache / "models" / "small"))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mctier-demo-"))
    dep = Deployment(log_dir)
    stop = {"flag": False}

    def on_signal(*_):
        stop["flag"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    rows: list[dict] = []
    try:
        print(f"[demo] logs in {log_dir}")
        dep.cluster = StoreCluster(log_dir=log_dir, segment_size=1 << 30,
                                   extra_flags=["--client_ttl=2"]).start()
        print(f"[demo] mooncake master {dep.cluster.master_addr} + store server (1 GiB DRAM)")
        url = dep.engine("engine", model, core=0, kv_config=None)
        dep.wait_http(url, dep.procs[-1])
        print(f"[demo] engine ready at {url} ({time.monotonic() - t0:.0f}s)")
        for kind, prompt in workload():
            t = time.monotonic()
            r = requests.post(url + "/v1/completions", timeout=300, json={
                "model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": False})
            r.raise_for_status()
            body = r.json()
            usage = body["usage"]
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
            rows.append({"kind": kind, "prompt_tokens": usage["prompt_tokens"], "cached": cached,
                         "seconds": time.monotonic() - t})
        print_summary(rows)
        return 0
    except KeyboardInterrupt:
        print("\n[demo] interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        dep.stop()
        print(f"[demo] stopped all processes ({time.monotonic() - t0:.0f}s total)")


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'kind':<10} {'requests':>8} {'prompt tok':>11} {'cached tok':>11} {'median s':>9}")
    for kind in sorted({r['kind'] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        print(f"{kind:<10} {len(rs):>8} {sum(r['prompt_tokens'] for r in rs):>11} "
              f"{sum(r['cached'] for r in rs):>11} {statistics.median(r['seconds'] for r in rs):>9.2f}")
    total_p = sum(r["prompt_tokens"] for r in rows)
    total_c = sum(r["cached"] for r in rows)
    print(f"{'total':<10} {len(rows):>8} {total_p:>11} {total_c:>11}   hit rate {total_c / max(total_p, 1):.0%}")
    print("\nnext: `mctier master`, `mctier serve MODEL --kv-transfer-config @examples/...`")


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="run the demo deployment and a workload, print a summary")
    d.add_argument("--model", help="model directory (default: the built-in 'small' model)")
    d.add_argument("--log-dir")
    d.set_defaults(func=lambda a, rest: run(a), passthrough=False)
