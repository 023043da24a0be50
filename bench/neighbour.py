"""Does a busy core slow the engine on the other one? (not a test)

    .venv/bin/python -m bench.neighbour [--streams 4] [--seconds 8] [--reps 3] [--out DIR]

Why it exists: in ``bench.pd_load`` the 1P1D decode instance's streams slow down while
arrivals are in flight, although that instance keeps its core (its process tree used 0.9
to 1.0 core of CPU time in the window, the proxy 0.05, the client next to nothing). So the
question is whether the prefill instance computing on the *other* core slows a decode
step, through what the two cores share (caches, memory bandwidth, or one physical core
under two virtual CPUs).

Two plain engines (``small`` model): B on core 1 runs ``--streams`` streaming decodes
(64-token prompts, ``ignore_eos``), as a decode instance would; A on core 0 is, in turn
(order shuffled per repetition, seeded):

- ``quiet``: A idle and asleep (more than ``QUIET_S`` after its last request);
- ``spinning``: A awake but not computing: a 4-token prompt every 0.5 s keeps its
  processes spinning on ``sched_yield`` (vLLM's 1 s busy loop after a step), as a
  prefill instance is between prompts;
- ``prefilling``: A answers fresh 2,048-token prompts (1 output token) back to back, as a
  prefill instance does while long prompts keep arriving.

Per condition: B's streams' TPOT over ``--seconds`` (each stream's time over its tokens
there), the median over streams and repetitions, and its ratio to ``quiet``; plus A's
process tree's CPU share over the window. Prints a table and writes ``neighbour.json``
and ``neighbour.md`` to ``--out`` (default ``bench/results/neighbour``). Stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import QUIET_S, machine, model_dir, output_dir, start_engines, term_as_interrupt  # noqa: E402
from bench.pd_load import MODEL_NAME, cpu_seconds, decode_streams, gaps, prompts, raise_if_ended, tpot  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

CONDITIONS = ("quiet", "spinning", "prefilling")
PREFILL_LEN = 2048


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        await r.read()


async def neighbour(session: aiohttp.ClientSession, url: str, condition: str, stop: asyncio.Event,
                    seed: int) -> int:
    """Keep engine A in ``condition`` until ``stop``; the number of requests it answered."""
    n = 0
    while not stop.is_set():
        if condition == "quiet":
            await stop.wait()
        elif condition == "spinning":
            await complete(session, url, prompts(seed + n, 1, 4)[0])
            n += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        else:
            await complete(session, url, prompts(seed + n, 1, PREFILL_LEN)[0])
            n += 1
    return n


async def measure(a_url: str, b_url: str, condition: str, a: argparse.Namespace, seed: int,
                  a_pid: int) -> dict:
    """B's streams' TPOT over a window of ``a.seconds`` while A is in ``condition``."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stop = asyncio.Event()
        load = None
        try:
            async with decode_streams(session, b_url, prompts(seed, a.streams, 64), 3000) as (ticks, tasks):
                load = asyncio.create_task(neighbour(session, a_url, condition, stop, seed + 1))
                await asyncio.sleep(1.0)  # A reaches its state (a prefill is under way, the spin has begun)
                cpu0, w0 = cpu_seconds({"A": a_pid}), time.monotonic()
                await asyncio.sleep(a.seconds)
                cpu1, w1 = cpu_seconds({"A": a_pid}), time.monotonic()
                raise_if_ended(tasks, "a stream ended early")
        finally:
            stop.set()
            answered = await asyncio.wait_for(load, 600) if load is not None else 0
    return {"condition": condition, "tpot": [tpot(gaps(t, w0, w1)) for t in ticks],
            "a_core_share": round((cpu1["A"] - cpu0["A"]) / (w1 - w0), 3), "a_requests": answered}


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per condition measured: B's TPOT median, min and max (ms) over every stream of every
    repetition, and the median of A's core share."""
    res = {}
    for cond in CONDITIONS:
        xs = [x for r in rows if r["condition"] == cond for x in r["tpot"] if x is not None]
        if xs:
            res[cond] = {"tpot_median_ms": statistics.median(xs) * 1e3, "tpot_min_ms": min(xs) * 1e3,
                         "tpot_max_ms": max(xs) * 1e3,
                         "a_core_share": statistics.median(r["a_core_share"] for r in rows if r["condition"] == cond)}
    return res


def render(res: dict[str, dict], streams: int, reps: int, seconds: float) -> str:
    quiet = res.get("quiet", {}).get("tpot_median_ms")
    lines = [f"B's decode streams ({streams}) on core 1 while engine A on core 0 is quiet, spinning or "
             f"prefilling ({reps} repetitions of {seconds:g} s; {time.strftime('%Y-%m-%d %H:%M %Z')})", "",
             "| A on core 0 | A's core share | B's TPOT median (min-max), ms | / quiet |", "|---|---|---|---|"]
    for cond, r in res.items():
        ratio = f"{r['tpot_median_ms'] / quiet:.2f}" if quiet else "-"
        lines.append(f"| {cond} | {r['a_core_share']:.2f} | {r['tpot_median_ms']:.1f} ({r['tpot_min_ms']:.1f}-"
                     f"{r['tpot_max_ms']:.1f}) | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.neighbour", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window per condition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "neighbour"))
    a = ap.parse_args(argv)
    term_as_interrupt()  # kill runs the cleanup, as Ctrl-C does
    out = output_dir(a.out)
    model = model_dir("small")
    dep = Deployment(out / "logs")
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        (a_url, a_proc), (b_url, _) = start_engines(dep, model, [("A", 0, None), ("B", 1, None)],
                                                    extra=["--max-model-len", "4096"])
        # Untimed: each engine's first requests.
        asyncio.run(measure(a_url, b_url, "prefilling", argparse.Namespace(**{**vars(a), "seconds": 2.0}),
                            10**6, a_proc.pid))
        for rep in range(a.reps):
            order = list(CONDITIONS)
            random.Random(a.seed * 1000 + rep).shuffle(order)
            for cond in order:
                time.sleep(QUIET_S)  # both engines asleep before each condition starts
                r = asyncio.run(measure(a_url, b_url, cond, a, a.seed + 100 * rep + CONDITIONS.index(cond), a_proc.pid))
                rows.append({**r, "rep": rep})
                tp = [x for x in r["tpot"] if x is not None] or [float("nan")]
                print(f"[neighbour] rep {rep} {cond}: B's TPOT median {statistics.median(tp) * 1e3:.1f} ms; "
                      f"A used {r['a_core_share']:.2f} core, answered {r['a_requests']}", flush=True)
    finally:
        dep.stop()
    res = summarise(rows)
    md = render(res, a.streams, a.reps, a.seconds)
    (out / "neighbour.json").write_text(json.dumps({"machine": machine(model), "args": vars(a), "rows": rows,
                                                    "summary": res, "seconds": round(time.monotonic() - t0),
                                                    "pids": sorted(set(dep.started))}, indent=1))
    (out / "neighbour.md").write_text(md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
