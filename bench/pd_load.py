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
   tokens, 4 output tokens each, one every ``--intervals`` seconds (one run per interval,
   2 s then 1 s by default: the share of the instance's time the arrivals' prefills take
   is what decides how much P/D pays, so the benchmark shows two such loads);
3. when every arrival has ended, the streams are cancelled (the client closes the
   connection; the engine aborts them: part of what is checked is that nothing is left);
4. the control: new streams of other 64-token prompts, the same pause, then a window as
   long as the one just measured with no arrivals (``--no-control`` leaves it out). The
   streams' TPOT there is what their own growth costs (their context grows over the
   window), so the rise from it to the window with arrivals is what the arrivals cost.

Measured from the client, from the ``continuous_usage_stats`` of every chunk (a chunk's gap
over the tokens it added, :func:`gaps`), in the window where arrivals are in flight (first
arrival sent to last arrival ended) and before it: each stream's TPOT over the window
(its time there over its tokens there, as vLLM's benchmark defines a request's TPOT), p50
and p99 over the streams of all repetitions; ITL p99 and max over the window's tokens (a
prefill that shares a step with the decodes shows as one long gap, which is under 1% of
the tokens when the decode steps are fast, so ITL p99 alone can miss it); the arrivals'
TTFT p50 and p90. And where the two cores went in the window: the CPU seconds of each
process tree the deployment started (engine, proxy) and of this client, per second of
window (1.0 is a whole core), to tell an engine that was slower from one that was starved.
Writes ``pd_load.json`` and ``pd_load.md`` to ``--out`` (default ``bench/results/pd_load``).
Everything started is stopped at the end, also on failure. Exit status 1 if a deployment
or a request failed. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import sse_events  # noqa: E402
from bench.common import machine, model_dir, output_dir, start_engines, start_router, term_as_interrupt  # noqa: E402
from bench.engine_metrics import process_tree  # noqa: E402
from bench.sim.report import pct  # noqa: E402
from bench.suite import p2p_config  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

MODEL_NAME = "demo"  # Deployment.engine's --served-model-name
STREAM_PROMPT = 64
ARRIVAL_OUTPUT = 4
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # the small model's vocabulary is 2,048
REQUEST_TIMEOUT_S = 600
CLIENT = frozenset({"client"})  # counted without its descendants (cpu_seconds)


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


@contextlib.asynccontextmanager
async def decode_streams(session: aiohttp.ClientSession, url: str, stream_prompts: list[list[int]],
                         max_tokens: int, first_token_s: float = 120.0):
    """One :func:`stream` per prompt, running once every one has its first token (within
    ``first_token_s``): yields ``(ticks, tasks)``, each stream's ticks and task; the streams
    are cancelled on exit (the engine aborts them)."""
    ticks: list[list[tuple[float, int]]] = [[] for _ in stream_prompts]
    firsts = [asyncio.Event() for _ in stream_prompts]
    tasks = [asyncio.create_task(stream(session, url, p, max_tokens, e, t))
             for p, e, t in zip(stream_prompts, firsts, ticks)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), first_token_s)
        yield ticks, tasks
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def raise_if_ended(tasks: list[asyncio.Task], why: str) -> None:
    """Raise if a stream's task ended: its own error if it failed, else ``why``."""
    if any(t.done() for t in tasks):
        for t in tasks:
            if t.done() and t.exception():
                raise t.exception()
        raise RuntimeError(why)


def gaps(ticks: list[tuple[float, int]], start: float, end: float) -> list[float]:
    """Per-token times of the chunks that arrived in ``[start, end]`` (a chunk adding k
    tokens after a gap g counts k tokens of g/k each)."""
    out = []
    for (t0, n0), (t1, n1) in zip(ticks, ticks[1:]):
        if start <= t1 <= end and n1 > n0:
            out += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    return out


def cpu_seconds(pids: dict[str, int], alone: frozenset[str] = frozenset()) -> dict[str, float]:
    """User plus system CPU seconds so far of each named process with its descendants (an
    engine is an API server, an engine core and a worker); the names in ``alone`` without
    them (this client, whose descendants are the engines and proxies it started)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        total = 0.0
        tree = process_tree(pid, alone=name in alone)
        if not tree:
            continue
        for p in tree:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[name] = total
    return out


async def workload(url: str, a: argparse.Namespace, seed: int, pids: dict[str, int] | None = None,
                   quiet_s: float | None = None) -> dict:
    """``pids``: name -> PID of the processes whose CPU use over the window is reported.
    With ``quiet_s``, the control: no arrivals, the window is ``quiet_s`` seconds of the
    streams alone."""
    pids = {**(pids or {}), "client": os.getpid()}  # the client alone: the engines are its children
    streams = prompts(seed, a.streams, STREAM_PROMPT)
    arrivals = prompts(seed + 1, a.arrivals, a.prompt_len)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with decode_streams(session, url, streams, a.stream_tokens) as (ticks, tasks):
            t_stream = time.monotonic()
            await asyncio.sleep(a.interval)  # a baseline of undisturbed decode steps
            done = []
            cpu0 = cpu_seconds(pids, CLIENT)
            if quiet_s is None:
                for p in arrivals:
                    done.append(asyncio.create_task(arrival(session, url, p)))
                    await asyncio.sleep(a.interval)
                arr = await asyncio.wait_for(asyncio.gather(*done), REQUEST_TIMEOUT_S)
                w0, w1 = arr[0]["sent"], max(x["end"] for x in arr)
            else:
                arr, w0 = [], time.monotonic()
                await asyncio.sleep(quiet_s)
                w1 = time.monotonic()
            cpu1 = cpu_seconds(pids, CLIENT)
            # a stream that ended early did not see the whole window
            raise_if_ended(tasks, "a stream ended before the arrivals did: raise --stream-tokens")
    inside = [gaps(t, w0, w1) for t in ticks]
    before = [gaps(t, t_stream, w0) for t in ticks]
    # The CPU snapshots bracket the window (taken just before the first arrival is sent and
    # just after the last one ended).
    cores = {k: round((cpu1[k] - cpu0[k]) / (w1 - w0), 3) for k in cpu1 if k in cpu0}
    return {"tpot": [tpot(g) for g in inside], "tpot_before": [tpot(g) for g in before],
            "itl": [x for g in inside for x in g], "window_s": w1 - w0, "arrival_ttft": [x["ttft"] for x in arr],
            "cores": cores}


def tpot(stream_gaps: list[float]) -> float | None:
    """A stream's time per output token over a span: the span's time over its tokens (the
    mean of its per-token gaps), as vLLM's benchmark defines TPOT for a request."""
    return sum(stream_gaps) / len(stream_gaps) if stream_gaps else None


def summary(reps: list[dict]) -> dict:
    """Percentiles over every stream (TPOT), token (ITL) and arrival (TTFT) of all
    repetitions together."""
    pool = {k: [x for r in reps for x in r[k] if x is not None] for k in ("tpot", "tpot_before", "itl",
                                                                          "arrival_ttft")}
    control = [x for r in reps for x in (r.get("control") or {}).get("tpot", []) if x is not None]
    names = sorted({k for r in reps for k in r.get("cores", {})})
    cores = {k: pct([r["cores"][k] for r in reps if k in r.get("cores", {})], 0.5) for k in names}
    return {"cores": cores, "tpot_p50": pct(pool["tpot"], 0.5), "tpot_p99": pct(pool["tpot"], 0.99),
            "tpot_p50_before": pct(pool["tpot_before"], 0.5), "itl_p50": pct(pool["itl"], 0.5),
            "itl_p99": pct(pool["itl"], 0.99), "itl_max": max(pool["itl"], default=None),
            "streams": len(pool["tpot"]), "tokens_in_window": len(pool["itl"]),
            "arrival_ttft_p50": pct(pool["arrival_ttft"], 0.5), "arrival_ttft_p90": pct(pool["arrival_ttft"], 0.9),
            "control_tpot_p50": pct(control, 0.5), "control_tpot_p99": pct(control, 0.99)}


class Bench:
    def __init__(self, a: argparse.Namespace, model: str, out: Path):
        self.a, self.model, self.out = a, model, out
        self.dep = Deployment(out / "logs")

    def engines(self, specs: list[tuple[str, int, dict | None]]) -> list[str]:
        extra = ["--max-model-len", str(max(4096, self.a.prompt_len + 64))]
        return [url for url, _ in start_engines(self.dep, self.model, specs, extra)]

    def url(self, name: str) -> str:
        if name == "one":
            return self.engines([("one", 0, None)])[0]
        if name == "two":
            u = self.engines([("two-0", 0, None), ("two-1", 1, None)])
            return start_router(self.dep, "router-two", ["--plain", *u, "--policy", "round-robin"], timeout=120)[0]
        boot = free_port()
        _, _, proxy = self.dep.pd_pair(self.model, p2p_config("kv_producer", boot),
                                       p2p_config("kv_consumer", free_port()), boot)
        return proxy

    def deployment(self, name: str) -> list[dict]:
        """One row per arrival interval, on one start of the deployment."""
        rows = [{"deployment": name, "interval": iv, "reps": []} for iv in self.a.intervals]
        row = rows[0]
        try:
            url = self.url(name)
            # Untimed: each engine's (and the P -> D pair's) first requests set things up.
            asyncio.run(workload(url, argparse.Namespace(**{**vars(self.a), "arrivals": 2, "prompt_len": 256,
                                                              "interval": 0.2}), seed=10**6))
            for k, row in enumerate(rows):
                a = argparse.Namespace(**{**vars(self.a), "interval": row["interval"]})
                for rep in range(self.a.reps):
                    # Prompts of their own per interval and repetition: a repeated one would be
                    # a prefix-cache hit on the engines that saw it (the same seeds in every
                    # deployment, so each runs the same prompts).
                    seed = self.a.seed + 10 * rep + 1000 * (k + 1)
                    pids = {p.name: p.popen.pid for p in self.dep.procs}
                    res = asyncio.run(workload(url, a, seed=seed, pids=pids))
                    if self.a.control:
                        # Other stream prompts (seed + 5: no other run's), the window just measured.
                        res["control"] = asyncio.run(workload(url, a, seed=seed + 5, pids=pids,
                                                              quiet_s=res["window_s"]))
                    row["reps"].append(res)
                    r = summary(row["reps"][-1:])
                    print(f"[pd_load] {name} every {a.interval:g} s, rep {rep}: streams' TPOT p50 "
                          f"{r['tpot_p50'] * 1e3:.1f} ms, worst {max(row['reps'][-1]['tpot']) * 1e3:.1f} ms in the "
                          f"window ({r['tpot_p50_before'] * 1e3:.1f} before); ITL p99 {r['itl_p99'] * 1e3:.0f} ms, "
                          f"max {r['itl_max'] * 1e3:.0f} ms; arrivals TTFT p50 {r['arrival_ttft_p50']:.2f} s; "
                          + (f"without arrivals TPOT p50 {r['control_tpot_p50'] * 1e3:.1f} ms; "
                             if r["control_tpot_p50"] is not None else "")
                          + "cores " + ", ".join(f"{k} {v:.2f}" for k, v in r["cores"].items()), flush=True)
                row.update(summary(row["reps"]))
        except Exception as e:  # noqa: BLE001 - one broken deployment must not lose the others
            err = f"{type(e).__name__}: {e}"[:2000]
            for r in rows[rows.index(row):]:
                r["error"] = err
            print(f"[pd_load] {name} FAILED: {err}", flush=True)
        finally:
            self.dep.stop()
        return rows


def render(rec: dict) -> str:
    a = rec["args"]
    lines = [f"{a['streams']} decode streams while prompts of {a['prompt_len']} tokens arrive, {a['arrivals']} "
             f"at each interval; {a['reps']} repetitions pooled ({rec['date']}, {rec['machine']['cpu']}, "
             f"{rec['machine']['dtype']}). TPOT: each stream's time per output token while arrivals were in "
             "flight (percentiles over streams); ITL: the gaps between its tokens (percentiles over tokens).", "",
             "| deployment | arrival every (s) | TPOT p50 (ms) | TPOT p99 (ms) | TPOT p50 before arrivals (ms) "
             "| ITL p99 (ms) | ITL max (ms) | arrivals TTFT p50 (s) | arrivals TTFT p90 (s) | TPOT p99 / one's "
             "| control: TPOT p50 / p99 without arrivals (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ok_rows = [r for r in rec["rows"] if "error" not in r]
    one = {r["interval"]: r for r in ok_rows if r["deployment"] == "one"}
    f = lambda v, s=1e3, d=0: "-" if v is None else f"{v * s:.{d}f}"  # noqa: E731
    for r in rec["rows"]:
        if "error" in r:
            lines.append(f"| {r['deployment']} | {r['interval']:g} | failed: {r['error'][:120]} |" + "  |" * 8)
            continue
        base = one.get(r["interval"])
        ratio = f"{r['tpot_p99'] / base['tpot_p99']:.2f}" if base else "-"
        lines.append(f"| {r['deployment']} | {r['interval']:g} | {f(r['tpot_p50'], d=1)} | {f(r['tpot_p99'], d=1)} | "
                     f"{f(r['tpot_p50_before'], d=1)} | {f(r['itl_p99'])} | {f(r['itl_max'])} | "
                     f"{f(r['arrival_ttft_p50'], 1, 2)} | {f(r['arrival_ttft_p90'], 1, 2)} | {ratio} | "
                     f"{f(r.get('control_tpot_p50'), d=1)} / {f(r.get('control_tpot_p99'), d=1)} |")
    lines += ["", "Where the cores went while arrivals were in flight (CPU seconds per second of window, "
                  "median over repetitions; 2.0 is both cores):", ""]
    for r in ok_rows:
        lines.append(f"- {r['deployment']}, every {r['interval']:g} s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r.get("cores", {}).items()) + f" (total {sum(r.get('cores', {}).values()):.2f})")
    lines.append("")
    for pd in (r for r in ok_rows if r["deployment"] == "pd" and r["interval"] in one):
        x = pd["tpot_p99"] / one[pd["interval"]]["tpot_p99"]
        lines.append(f"- Target (1P1D TPOT p99 at most half of one instance doing both), arrivals every "
                     f"{pd['interval']:g} s: {x:.2f}x, {'met' if x <= 0.5 else 'missed'}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition, 4 arrivals of 1,024 tokens")
    ap.add_argument("--model", default="small")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, help="default 8 (4 with --quick)")
    ap.add_argument("--prompt-len", type=int, help="default 2048 (1024 with --quick)")
    ap.add_argument("--intervals", default="2,1", help="seconds between arrivals, one run of each (default 2,1)")
    ap.add_argument("--stream-tokens", type=int, default=3000, help="max_tokens of a stream (cancelled earlier)")
    ap.add_argument("--reps", type=int, help="default 3 (1 with --quick)")
    ap.add_argument("--deployments", default="one,two,pd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="leave out the window without arrivals after each repetition")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd_load"))
    a = ap.parse_args(argv)
    a.arrivals = a.arrivals or (4 if a.quick else 8)
    a.prompt_len = a.prompt_len or (1024 if a.quick else 2048)
    a.reps = a.reps or (1 if a.quick else 3)
    try:
        a.intervals = [float(x) for x in a.intervals.split(",")]
    except ValueError:
        ap.error(f"--intervals takes seconds separated by commas, got {a.intervals!r}")
    if not a.intervals or min(a.intervals) <= 0:
        ap.error("--intervals must be positive")

    out = output_dir(a.out)
    model = model_dir(a.model)
    b = Bench(a, model, out)

    term_as_interrupt()
    t0 = time.monotonic()
    rec = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": a.model,
           "args": {k: v for k, v in vars(a).items() if k != "out"}, "rows": []}
    try:
        for name in a.deployments.split(","):
            rec["rows"] += b.deployment(name)
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
