"""Where P/D separation pays: decode streams running while long prefills keep arriving.

    .venv/bin/python -m bench.pd_load [--quick] [--reps N] [--out DIR]   (``make bench`` runs it)

The single-stream benchmarks cannot show what P/D is for: an engine that prefills and
decodes runs a long prompt's prefill inside the same steps as its running decodes, so
every running stream stalls for it. Three deployments, one after the other on the same two
cores (``small`` model, block size 32, fresh engines each):

- ``one``: one plain engine on core 0 doing both (what the issue compares against);
- ``two``: two plain engines (cores 0 and 1) behind ``mctier proxy --plain --policy
  round-robin``: the same cores as 1P1D, both doing both;
- ``pd``: 1P1D, a ``P2PConnector`` prefill (core 0) and decode (core 1) behind
  ``mctier proxy`` (``least-outstanding``: every request is prefilled on P and decoded on D).

The workload, identical in each (prompts from ``--seed``; random token ids, so nothing is
shared and no prefix cache helps):

1. ``--streams`` streaming completions of 64-token prompts start together, ``ignore_eos``,
   with a ``max_tokens`` that outlasts the phase below;
2. once every stream has its first token: ``--arrivals`` prompts of ``--prompt-len``
   tokens, 4 output tokens each, one every ``--interval`` seconds;
3. when every arrival has ended, the streams are cancelled (the client closes the
   connection; the engine aborts them: part of what is checked is that nothing is left).

Measured per repetition, from the client: each stream's time per output token from the
``continuous_usage_stats`` of every chunk (a chunk's gap over the tokens it added), split
into the window where arrivals are in flight (first arrival sent to last arrival ended)
and before it; TPOT p50 and p99 over the window's tokens; the arrivals' TTFT p50 and p90.
Writes ``pd_load.json`` and ``pd_load.md`` to ``--out`` (default ``bench/results/pd_load``).
Everything started is stopped at the end, also on failure. Exit status 1 if a deployment
or a request failed. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import sse_events  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.sim.report import pct  # noqa: E402
from bench.suite import p2p_config  # noqa: E402
from kvcore.procs import Proc, free_port  # noqa: E402
from multi.deploy import Deployment  # noqa: E402

MODEL_NAME = "demo"  # Deployment.engine's --served-model-name
STREAM_PROMPT = 64
ARRIVAL_OUTPUT = 4
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # the small model's vocabulary is 2,048
REQUEST_TIMEOUT_S = 600
START_TIMEOUT_S = 300


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(n)]


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                 first: asyncio.Event, ticks: list[tuple[float, int]]) -> None:
    """One streamed completion; ``ticks`` gets (time, completion tokens so far) per chunk."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async for ev in sse_events(session, url, body):
        n = (ev.get("usage") or {}).get("completion_tokens")
        if n:
            ticks.append((time.monotonic(), n))
            first.set()


async def arrival(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": ARRIVAL_OUTPUT, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    ttft = None
    async for ev in sse_events(session, url, body):
        if ttft is None and ev.get("choices"):
            ttft = time.monotonic() - t0
    return {"sent": t0, "ttft": ttft, "end": time.monotonic()}


def gaps(ticks: list[tuple[float, int]], start: float, end: float) -> list[float]:
    """Per-token times of the chunks that arrived in ``[start, end]`` (a chunk adding k
    tokens after a gap g counts k tokens of g/k each)."""
    out = []
    for (t0, n0), (t1, n1) in zip(ticks, ticks[1:]):
        if start <= t1 <= end and n1 > n0:
            out += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    return out


async def workload(url: str, a: argparse.Namespace, seed: int) -> dict:
    streams = prompts(seed, a.streams, STREAM_PROMPT)
    arrivals = prompts(seed + 1, a.arrivals, a.prompt_len)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ticks: list[list[tuple[float, int]]] = [[] for _ in streams]
        firsts = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(stream(session, url, p, a.stream_tokens, e, t))
                 for p, e, t in zip(streams, firsts, ticks)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            t_stream = time.monotonic()
            await asyncio.sleep(a.interval)  # a baseline of undisturbed decode steps
            done = []
            for p in arrivals:
                done.append(asyncio.create_task(arrival(session, url, p)))
                await asyncio.sleep(a.interval)
            arr = await asyncio.wait_for(asyncio.gather(*done), REQUEST_TIMEOUT_S)
            if any(t.done() for t in tasks):  # a stream that ended early did not see the whole window
                for t in tasks:
                    if t.done() and t.exception():
                        raise t.exception()
                raise RuntimeError("a stream ended before the arrivals did: raise --stream-tokens")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    w0, w1 = arr[0]["sent"], max(x["end"] for x in arr)
    inside = [g for t in ticks for g in gaps(t, w0, w1)]
    before = [g for t in ticks for g in gaps(t, t_stream, w0)]
    ttfts = [x["ttft"] for x in arr]
    return {"tpot_p50": pct(inside, 0.5), "tpot_p99": pct(inside, 0.99), "tokens_in_window": len(inside),
            "tpot_p50_before": pct(before, 0.5), "window_s": w1 - w0,
            "arrival_ttft_p50": pct(ttfts, 0.5), "arrival_ttft_p90": pct(ttfts, 0.9)}


class Bench:
    def __init__(self, a: argparse.Namespace, model: str, out: Path):
        self.a, self.model, self.out = a, model, out
        self.dep = Deployment(out / "logs")

    def engines(self, specs: list[tuple[str, int, dict | None]]) -> list[str]:
        extra = ["--max-model-len", str(max(4096, self.a.prompt_len + 64))]
        started = [self.dep.engine(n, self.model, core, kv, extra=extra) for n, core, kv in specs]
        for url, proc in started:
            self.dep.wait_http(url, proc, START_TIMEOUT_S)
        return [u for u, _ in started]

    def router(self, args: list[str]) -> str:
        port = free_port()
        proc = self.dep.track(Proc("router", [sys.executable, "-m", "multi.cli", "proxy", "--host", "127.0.0.1",
                                              "--port", str(port), "--timeout", "600", *args],
                                   self.dep.log_dir / f"router-{port}.log", cwd=str(ROOT)))
        proc.wait_port(port, 60)
        return f"http://127.0.0.1:{port}"

    def url(self, name: str) -> str:
        if name == "one":
            return self.engines([("one", 0, None)])[0]
        if name == "two":
            u = self.engines([("two-0", 0, None), ("two-1", 1, None)])
            return self.router(["--plain", *u, "--policy", "round-robin"])
        boot = free_port()
        _, _, proxy = self.dep.pd_pair(self.model, p2p_config("kv_producer", boot),
                                       p2p_config("kv_consumer", free_port()), boot)
        return proxy

    def deployment(self, name: str) -> dict:
        row: dict = {"deployment": name, "reps": []}
        try:
            url = self.url(name)
            # Untimed: each engine's (and the P -> D pair's) first requests set things up.
            asyncio.run(workload(url, argparse.Namespace(**{**vars(self.a), "arrivals": 2, "prompt_len": 256,
                                                              "interval": 0.2}), seed=999))
            for rep in range(self.a.reps):
                r = asyncio.run(workload(url, self.a, seed=self.a.seed + 10 * rep))
                row["reps"].append(r)
                print(f"[pd_load] {name} rep {rep}: TPOT p50 {r['tpot_p50'] * 1e3:.0f} ms p99 "
                      f"{r['tpot_p99'] * 1e3:.0f} ms in the window ({r['tokens_in_window']} tokens; "
                      f"{r['tpot_p50_before'] * 1e3:.0f} ms before), arrivals TTFT p50 "
                      f"{r['arrival_ttft_p50']:.2f} s", flush=True)
            for k in ("tpot_p50", "tpot_p99", "tpot_p50_before", "arrival_ttft_p50", "arrival_ttft_p90"):
                row[k] = pct([r[k] for r in row["reps"]], 0.5)  # median over repetitions
        except Exception as e:  # noqa: BLE001 - one broken deployment must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[pd_load] {name} FAILED: {row['error']}", flush=True)
        finally:
            self.dep.stop()
        return row


def render(rec: dict) -> str:
    a = rec["args"]
    lines = [f"{a['streams']} decode streams while {a['arrivals']} prompts of {a['prompt_len']} tokens arrive one "
             f"every {a['interval']:g} s; medians of {a['reps']} repetitions ({rec['date']}, "
             f"{rec['machine']['cpu']}, {rec['machine']['dtype']}).", "",
             "| deployment | TPOT p50 (ms) | TPOT p99 (ms) | TPOT p50 before arrivals (ms) | arrivals TTFT p50 (s) "
             "| arrivals TTFT p90 (s) | p99 / one's |", "|---|---|---|---|---|---|---|"]
    one = next((r for r in rec["rows"] if r["deployment"] == "one" and "error" not in r), None)
    f = lambda v, s=1e3, d=0: "-" if v is None else f"{v * s:.{d}f}"  # noqa: E731
    for r in rec["rows"]:
        if "error" in r:
            lines.append(f"| {r['deployment']} | failed: {r['error'][:120]} |  |  |  |  |  |")
            continue
        ratio = f"{r['tpot_p99'] / one['tpot_p99']:.2f}" if one else "-"
        lines.append(f"| {r['deployment']} | {f(r['tpot_p50'])} | {f(r['tpot_p99'])} | {f(r['tpot_p50_before'])} | "
                     f"{f(r['arrival_ttft_p50'], 1, 2)} | {f(r['arrival_ttft_p90'], 1, 2)} | {ratio} |")
    pd = next((r for r in rec["rows"] if r["deployment"] == "pd" and "error" not in r), None)
    if one and pd:
        ok = pd["tpot_p99"] <= 0.5 * one["tpot_p99"]
        lines += ["", f"Target (1P1D TPOT p99 at most half of one instance doing both): "
                      f"{pd['tpot_p99'] / one['tpot_p99']:.2f}x, {'met' if ok else 'missed'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition, 4 arrivals of 1,024 tokens")
    ap.add_argument("--model", default="small")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, help="default 8 (4 with --quick)")
    ap.add_argument("--prompt-len", type=int, help="default 2048 (1024 with --quick)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between arrivals")
    ap.add_argument("--stream-tokens", type=int, default=3000, help="max_tokens of a stream (cancelled earlier)")
    ap.add_argument("--reps", type=int, help="default 3 (1 with --quick)")
    ap.add_argument("--deployments", default="one,two,pd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd_load"))
    a = ap.parse_args(argv)
    a.arrivals = a.arrivals or (4 if a.quick else 8)
    a.prompt_len = a.prompt_len or (1024 if a.quick else 2048)
    a.reps = a.reps or (1 if a.quick else 3)

    from multi.models import build

    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("MCTIER_CACHE", ROOT / ".cache"))
    model = a.model if os.path.isdir(a.model) else str(build(a.model, cache / "models" / a.model))
    b = Bench(a, model, out)

    def on_signal(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    rec = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": a.model,
           "args": {k: v for k, v in vars(a).items() if k != "out"}, "rows": []}
    try:
        for name in a.deployments.split(","):
            rec["rows"].append(b.deployment(name))
    except KeyboardInterrupt:
        rec["error"] = "interrupted"
    finally:
        b.dep.stop()
    rec.update(seconds=round(time.monotonic() - t0), pids=sorted(set(b.dep.started)))
    (out / "pd_load.json").write_text(json.dumps(rec, indent=1))
    md = render(rec)
    (out / "pd_load.md").write_text(md)
    print("\n" + md + f"\n[pd_load] wrote {out / 'pd_load.json'}, {out / 'pd_load.md'} ({rec['seconds']} s)")
    if rec.get("error"):
        return 130
    return 1 if any("error" in r for r in rec["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
