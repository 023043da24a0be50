"""Load on a whole P/D deployment: many concurrent streaming clients through ``mctier proxy``.

Starts a Mooncake master + store server, a prefill and a decode engine with
``TieredConnector`` (``multi.cli.deploy.Deployment``, ``tiered_config``; one core each) and the
proxy, all on loopback; then ``--clients`` asyncio clients send completions for
``--duration`` seconds, a mix of shared-prefix prompts (a few long common prefixes with
unique tails: store hits) and unique prompts (P2P handoffs). Reports requests completed,
errors, store hit rate, p50/p99 TTFT and TPOT, bytes per tier (from the engines'
/metrics) and whether both engines' KV usage is back to idle at the end (no held blocks).

    .venv/bin/python bench/load_bench.py --clients 16 --duration 30

Not a test: numbers depend on the box. Everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import sse_events  # noqa: E402
from bench.common import model_dir, term_as_interrupt  # noqa: E402
from bench.engine_metrics import delta, series_delta  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment, metrics, tiered_config  # noqa: E402

VOCAB = 2048
MiB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def usage(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "vllm:kv_cache_usage_perc":
                return s.value
    return float("nan")


class Workload:
    def __init__(self, seed: int, shared_prefixes: int, prefix_tokens: int, shared_ratio: float):
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(4, VOCAB) for _ in range(prefix_tokens)] for _ in range(shared_prefixes)]
        self.shared_ratio = shared_ratio

    def prompt(self, rng: random.Random) -> tuple[str, list[int]]:
        if rng.random() < self.shared_ratio:
            tail = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(32, 256))]
            return "shared", rng.choice(self.prefixes) + tail
        return "unique", [rng.randrange(4, VOCAB) for _ in range(rng.randrange(128, 1536))]


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = last = None
    n = 0
    async for ev in sse_events(session, url, body):
        for ch in ev.get("choices") or []:
            if ch.get("text"):
                now = time.monotonic()
                first = first or now
                last = now
                n += 1
    if first is None:
        raise RuntimeError("no token streamed")
    return {"ttft": first - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n}


async def drive(url: str, clients: int, duration: float, wl: Workload, max_tokens: int, seed: int) -> dict:
    stop = time.monotonic() + duration
    out = {"ok": [], "errors": [], "kinds": {"shared": 0, "unique": 0}}
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as s:
        async def client(i: int):
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < stop:
                kind, prompt = wl.prompt(rng)
                try:
                    res = await one(s, url, prompt, max_tokens)
                    res["kind"] = kind
                    out["ok"].append(res)
                    out["kinds"][kind] += 1
                except Exception as e:  # noqa: BLE001 - counted and reported
                    out["errors"].append(f"{kind}: {type(e).__name__}: {e}"[:300])

        await asyncio.gather(*(client(i) for i in range(clients)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--model", default="tiny", help="built-in preset (tiny, small) or a model directory")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--shared-prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--shared-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir")
    a = ap.parse_args(argv)
    term_as_interrupt()  # kill runs the cleanup, as Ctrl-C does

    model = model_dir(a.model)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="mctier-load-"))
    dep = Deployment(log_dir)
    t_start = time.monotonic()
    try:
        dep.cluster = StoreCluster(log_dir=log_dir, segment_size=1 << 30, extra_flags=["--client_ttl=20"]).start()
        boot = free_port()
        master = dep.cluster.master_addr
        p_url, d_url, proxy = dep.pd_pair(model, tiered_config("kv_producer", master, boot),
                                          tiered_config("kv_consumer", master, free_port()), boot)
        print(f"[load] deployment up in {time.monotonic() - t_start:.0f}s (logs {log_dir})", flush=True)
        wl = Workload(a.seed, a.shared_prefixes, a.prefix_tokens, a.shared_ratio)
        asyncio.run(drive(proxy, 2, 3.0, wl, 4, a.seed + 99))  # warm-up: first-request compilation
        time.sleep(2.0)
        idle = {"prefill": usage(p_url), "decode": usage(d_url)}
        m0 = {"p": metrics(p_url), "d": metrics(d_url)}
        t0 = time.monotonic()
        res = asyncio.run(drive(proxy, a.clients, a.duration, wl, a.max_tokens, a.seed))
        wall = time.monotonic() - t0
        # Blocks held at the end: usage back to idle within a few seconds.
        settle_deadline = time.monotonic() + 15
        end = {"prefill": usage(p_url), "decode": usage(d_url)}
        while any(end[k] > idle[k] + 1e-9 for k in end) and time.monotonic() < settle_deadline:
            time.sleep(0.5)
            end = {"prefill": usage(p_url), "decode": usage(d_url)}
        m1 = {"p": metrics(p_url), "d": metrics(d_url)}
        report(a, res, wall, idle, end, m0, m1)
        return 0 if not res["errors"] and all(end[k] <= idle[k] + 1e-9 for k in end) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        dep.stop()


def report(a, res: dict, wall: float, idle: dict, end: dict, m0: dict, m1: dict) -> None:
    ok = res["ok"]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    plan = "vllm:mctier_tiered_planned_tokens_total"
    d_tok = {k: series_delta(m1["d"], m0["d"], plan, k) for k in ("local", "store", "p2p", "recompute")}
    p_tok = {k: series_delta(m1["p"], m0["p"], plan, k) for k in ("local", "store", "p2p", "recompute")}
    p_total = sum(p_tok.values())
    hits = series_delta(m1["p"], m0["p"], "vllm:mctier_store_lookups_total", "hit") + \
        series_delta(m1["d"], m0["d"], "vllm:mctier_store_lookups_total", "hit")
    looks = hits + sum(series_delta(m1[e], m0[e], "vllm:mctier_store_lookups_total", k)
                       for e in ("p", "d") for k in ("miss", "unavailable"))
    print(f"\n== load: {a.clients} clients, {a.duration:.0f}s, model {a.model}, max_tokens {a.max_tokens}, "
          f"{a.shared_ratio:.0%} shared-prefix ({a.shared_prefixes} x {a.prefix_tokens} tokens) ==")
    print(f"requests completed {len(ok)} ({len(ok) / wall:.2f}/s; shared {res['kinds']['shared']}, "
          f"unique {res['kinds']['unique']}), errors {len(res['errors'])}")
    for e in res["errors"][:5]:
        print(f"  error: {e}")
    print(f"TTFT p50 {pct(ttft, .5) * 1e3:.0f} ms, p99 {pct(ttft, .99) * 1e3:.0f} ms; "
          f"TPOT p50 {pct(tpot, .5) * 1e3:.1f} ms, p99 {pct(tpot, .99) * 1e3:.1f} ms")
    print(f"store hit rate: {hits:.0f}/{looks:.0f} lookups hit ({hits / max(looks, 1):.0%}); prefill-side prompt "
          f"tokens from the store {p_tok['store']:.0f}/{p_total:.0f} ({p_tok['store'] / max(p_total, 1):.0%}), "
          f"from its prefix cache {p_tok['local']:.0f}")
    print(f"decode-side plan tokens: {', '.join(f'{k} {v:.0f}' for k, v in d_tok.items())}")
    print("bytes: saved to store (P) {:.1f} MiB, loaded from store (P {:.1f}, D {:.1f}) MiB, "
          "P2P pulled (D) {:.1f} MiB".format(
              series_delta(m1["p"], m0["p"], "vllm:mctier_store_saved_bytes_total") / MiB,
              series_delta(m1["p"], m0["p"], "vllm:mctier_store_loaded_bytes_total") / MiB,
              series_delta(m1["d"], m0["d"], "vllm:mctier_store_loaded_bytes_total") / MiB,
              series_delta(m1["d"], m0["d"], "vllm:mctier_p2p_bytes_total", "pulled") / MiB))
    fails = {k[1] or k[0]: m1[e][k] for e in ("p", "d") for k, d in delta(m1[e], m0[e]).items()
             if k[0] in ("vllm:mctier_store_failures_total", "vllm:mctier_p2p_failures_total") and d > 0}
    print(f"tier failures during the run: {fails or 'none'}")
    print(f"KV usage idle -> end: prefill {idle['prefill']:.4f} -> {end['prefill']:.4f}, "
          f"decode {idle['decode']:.4f} -> {end['decode']:.4f} "
          f"({'no blocks held' if all(end[k] <= idle[k] + 1e-9 for k in end) else 'BLOCKS STILL HELD'})")


if __name__ == "__main__":
    sys.exit(main())
