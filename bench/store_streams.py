"""Store hits arriving while decode streams run: what a synchronous load costs the streams.

    .venv/bin/python -m bench.store_streams [--quick] [--prefixes 2048,4096,7936] [--reps 5]
        [--streams 4] [--arm NAME=JSON ...] [--reserve-core]   (``make bench`` runs it)

A synchronous store load (``sync_load_max``, the CPU default) ends inside the engine step
that schedules the request: every running stream waits for it in that step. A background
load takes the engine's core in slices while the steps go on. This benchmark shows what each
costs the decode streams of the engine that reads, and what the arriving request gains.

A Mooncake master and store server on loopback, one writer engine (core 0) and two readers
(core 1, ``kv_consumer``: they never save) with ``StoreConnector`` on the ``small`` model: ``sync`` (the default settings) and
``background`` (``sync_load_max`` 0), and one more per ``--arm`` (settings of its own, e.g.
another ``load_thread_nice``; ``--reserve-core``: every engine in vLLM's layout with a reserved
core, every forward, the writer's too, on core 1: :func:`bench.common.engine_cpus`,
:func:`bench.common.forward_core`), taking turns (order rotating) in one run. Per prefix length and
repetition the writer computes a fresh prefix plus one block (its saves put the prefix in the
store; the bench waits until the store's lookup reaches all of it), and then, for each reader in turn:

1. ``--streams`` streamed completions of 64-token prompts start on the reader, and once each
   has its first token they decode ``--baseline-s`` alone (``--streams 0``: an idle reader);
2. the hit: the prefix plus another block, 4 tokens, on the reader (a whole-prefix store
   hit); then, after ``--baseline-s``, the same prompt again on the reader (its own
   prefix-cache hit: the same suffix to compute, nothing to load);
3. the streams are cancelled.

Reported per reader and length, over the repetitions: the hit's TTFT (median); the longest
gap between two tokens of any stream while the hit was in flight (sent to its last token;
median over repetitions of the per-repetition maximum), the streams' TPOT over that window
(p50 over every stream of every repetition) and over the undisturbed window before it; the
same for the own prefix-cache hit, the stall that computing the suffix costs without a load;
and how the reader's loads ran (``vllm:mctier_store_loads_total`` by kind), so a row says
whether its loads were synchronous. The hit's tokens are checked against the writer's
prefix-cache hit on the same prompt, and the own hit's against the hit; each must report the
prefix as cached. Writes ``store_streams.json`` to ``--out`` (default
``bench/results/store_streams``). ``--quick``: one 512-token prefix, one repetition, two
streams (``make test-bench``'s check). Not a test: nothing here
asserts a speed; the exit status is 1 if a token differed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.client import ids, stream as complete_stream  # noqa: E402
from bench.common import (  # noqa: E402
    RESERVE_CORE_HELP,
    Checker,
    engine_cpus,
    forward_core,
    long_context_args,
    machine,
    model_dir,
    output_dir,
    rotated,
    start_engines,
    term_as_interrupt,
)
from bench.engine_metrics import get, moved, scrape  # noqa: E402
from bench.pd_load import decode_streams, gaps, prompts, raise_if_ended, tpot  # noqa: E402
from bench.sim.report import pct  # noqa: E402
from bench.store_divergence import StoreWatch  # noqa: E402
from bench.store_hit import SETTLE_S, SUFFIX, store_config  # noqa: E402
from bench.store_phases import settings  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

# name -> the reader's kv_connector_extra_config settings; --arm adds more readers.
READERS = {"sync": {}, "background": {"sync_load_max": 0}}
STREAM_PROMPT = 64
HIT_TOKENS = 4


def reader_config(master: str, extra: dict) -> dict:
    """A reader's config: ``kv_consumer``, so that it never saves. A ``kv_both`` reader saved
    the hit's prompt (since key version 4 its tail block too, a part object), and the readers
    after it in the rotation loaded the whole prompt from the store instead of the prefix."""
    return {**store_config(master, **extra), "kv_role": "kv_consumer"}


async def window(url: str, prompt: list[int], ticks: list[list[tuple[float, int]]]):
    """Send ``prompt`` (``HIT_TOKENS`` tokens) while the streams run: its completion, and the
    streams' per-token gaps and TPOT while it was in flight."""
    t0 = time.monotonic()
    got = await asyncio.to_thread(complete_stream, url, prompt, HIT_TOKENS)
    t1 = time.monotonic()
    inside = [gaps(t, t0, t1) for t in ticks]
    return got, {"max_gap_s": max((g for s in inside for g in s), default=None),  # None: no streams
                 "tpot": [tpot(s) for s in inside]}


async def one_rep(url: str, hit: list[int], seed: int, a: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams = prompts(seed, a.streams, STREAM_PROMPT)  # with --streams 0 the windows start at once
        async with decode_streams(session, url, streams, a.stream_tokens) as (ticks, tasks):
            t_base = time.monotonic()
            await asyncio.sleep(a.baseline_s)
            before = [tpot(gaps(t, t_base, time.monotonic())) for t in ticks]
            got, during = await window(url, hit, ticks)
            await asyncio.sleep(a.baseline_s)
            own, own_during = await window(url, hit, ticks)
            raise_if_ended(tasks, "a stream ended inside the measured windows: raise --stream-tokens")
    return {"hit": got, "own": own, "before_tpot": before, "during": during, "own_during": own_during}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(num: float | None, den: float | None) -> str:
    return f"x{num / den:.2f}" if num and den else "-"


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(reps: list[dict]) -> dict:
    def tp(key):
        return [x for r in reps for x in r[key]["tpot"] if x is not None]
    before = [x for r in reps for x in r["before_tpot"] if x is not None]
    return {"hit_ttft_s": statistics.median(r["hit"].ttft for r in reps),
            "own_ttft_s": statistics.median(r["own"].ttft for r in reps),
            "hit_max_gap_s": _median(r["during"]["max_gap_s"] for r in reps),
            "own_max_gap_s": _median(r["own_during"]["max_gap_s"] for r in reps),
            "hit_tpot_p50_s": pct(tp("during"), 0.5), "own_tpot_p50_s": pct(tp("own_during"), 0.5),
            "before_tpot_p50_s": pct(before, 0.5)}


def run(a: argparse.Namespace) -> int:
    names = [x.partition("=")[0] for x in a.arm]
    if taken := sorted({n for n in names if n in READERS or names.count(n) > 1}):
        raise SystemExit(f"--arm names {taken} are taken (by the default readers or another --arm)")
    arms = {**READERS, **settings(a.arm, "--arm")}
    out = output_dir(a.out)
    model = model_dir("small")
    rng = random.Random(a.seed)
    check = Checker()
    dep = Deployment(out / "logs")
    prefixes = [int(x) for x in a.prefixes.split(",")]
    long = long_context_args(max(max(prefixes) + SUFFIX + 64, STREAM_PROMPT + a.stream_tokens))
    rows, watch = [], None
    term_as_interrupt()
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=4 << 30).start()
        master = dep.cluster.master_addr
        cpus = engine_cpus(a.reserve_core)
        (w_url, _), *started = start_engines(
            dep, model, [("streams-writer", forward_core(0, a.reserve_core), store_config(master), cpus),
                         *((f"streams-{name}", 1, reader_config(master, extra), cpus) for name, extra in arms.items())],
            extra=long)
        readers = dict(zip(arms, started))
        watch = StoreWatch(dep.cluster)
        for n_pfx in prefixes:
            reps: dict[str, list[dict]] = {name: [] for name in arms}
            before = {}
            for rep in range(a.reps + 1):  # the first is a warm-up, not in the figures
                # One prefix per repetition, written once and read by every reader in turn: each
                # reader's first sight of it is a store hit (readers do not share a prefix cache).
                pfx = ids(n_pfx, rng)
                written = pfx + ids(SUFFIX, rng)
                complete_stream(w_url, written, 1)
                watch.wait_stored(written)  # a reader that looks before the save ends finds nothing
                hit = pfx + ids(SUFFIX, rng)
                got = {}
                for name in rotated(list(arms), rep):
                    time.sleep(SETTLE_S)  # the previous engine on this core goes quiet
                    got[name] = asyncio.run(one_rep(readers[name][0], hit, rng.randrange(1 << 30), a))
                time.sleep(SETTLE_S)
                want = complete_stream(w_url, hit, HIT_TOKENS)  # the writer's prefix-cache hit
                for name, res in got.items():
                    what = f"{name} reader with {a.streams} streams"
                    check.same("store_streams", f"{what}: store hit vs writer's prefix-cache hit", len(hit),
                               res["hit"].token_ids, want.token_ids)
                    check.same("store_streams", f"{what}: own prefix-cache hit vs store hit", len(hit),
                               res["own"].token_ids, res["hit"].token_ids)
                    check.same("store_streams", f"{what}: cached tokens of the store hit and the own hit", len(hit),
                               [res["hit"].cached, res["own"].cached], [n_pfx, n_pfx])
                    if rep:
                        reps[name].append(res)
                if rep == 0:
                    before = {name: scrape(url) for name, (url, _) in readers.items()}
            for name, (url, _) in readers.items():
                d = moved(scrape(url), before[name])
                loads = {k: get(d, "vllm:mctier_store_loads_total", kind=k) for k in ("sync", "background")}
                row = {"reader": name, "settings": arms[name], "prefix_tokens": n_pfx, "streams": a.streams,
                       "loads": loads, **summarise(reps[name])}
                rows.append(row)
                print(f"{name:>10} {n_pfx:>6} tokens, {a.streams} streams | loads sync {loads['sync']:.0f} "
                      f"background {loads['background']:.0f} | store hit TTFT {_ms(row['hit_ttft_s'])} ms, "
                      f"streams' longest gap {_ms(row['hit_max_gap_s'])} ms, TPOT {_ms(row['hit_tpot_p50_s'])}"
                      f" | own prefix-cache hit TTFT {_ms(row['own_ttft_s'])} ms, longest gap "
                      f"{_ms(row['own_max_gap_s'])} ms, TPOT {_ms(row['own_tpot_p50_s'])}"
                      f" | TPOT undisturbed {_ms(row['before_tpot_p50_s'])} ms", flush=True)
    finally:
        if watch is not None:
            watch.close()  # a Mooncake client: closed before the master stops
        dep.stop()
    print("\neach reader / background, same run (interleaved):")
    for b in [r for r in rows if r["reader"] == "background"]:
        for s in [r for r in rows if r["reader"] != "background" and r["prefix_tokens"] == b["prefix_tokens"]]:
            print(f"  {s['prefix_tokens']:>6} tokens {s['reader']:>12}  store hit TTFT "
                  f"{_x(s['hit_ttft_s'], b['hit_ttft_s'])}  "
                  f"streams' longest gap {_x(s['hit_max_gap_s'], b['hit_max_gap_s'])}"
                  f"  streams' TPOT while the hit runs {_x(s['hit_tpot_p50_s'], b['hit_tpot_p50_s'])}")
    result = {"machine": machine(model), "readers": arms, "reserve_core": a.reserve_core,
              "reps": a.reps, "streams": a.streams, "rows": rows,
              "pids": sorted(set(dep.started))}
    return check.write(out / "store_streams.json", result, "store_streams")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="--prefixes 512 --reps 1 --streams 2 --baseline-s 0.2")
    ap.add_argument("--prefixes", default="2048,4096,7936", help="prefix lengths in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per length (after one warm-up)")
    ap.add_argument("--streams", type=int, default=4, help="decode streams running on the reader (0: idle)")
    ap.add_argument("--stream-tokens", type=int, default=2000,
                    help="max_tokens of each stream (cancelled after the windows; must outlast them)")
    ap.add_argument("--baseline-s", type=float, default=0.5,
                    help="the streams decode alone this long before each window")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                    help="one more reader with these kv_connector_extra_config settings, e.g. "
                         "'bg-nice0={\"sync_load_max\": 0, \"load_thread_nice\": 0}'")
    ap.add_argument("--reserve-core", action="store_true", help=RESERVE_CORE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "store_streams"))
    a = ap.parse_args(argv)
    if a.quick:
        a.prefixes, a.reps, a.streams, a.baseline_s = "512", 1, 2, 0.2
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
