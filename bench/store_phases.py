"""Where a store hit's time goes, read from live engines' /metrics (not a test).

    .venv/bin/python -m bench.store_phases [--prefixes 2048,4096,7936] [--reps 3] [--ab KEY=JSON]
        [--reader-blocks N]

A Mooncake master and store server on loopback, a writer engine (core 0) and a reader
engine (core 1) with ``StoreConnector`` on the ``small`` model; with ``--ab``, a second
pair with those settings, the pairs taking turns (order rotating) in the same run. Per
prefix length, each repetition writes a fresh prefix on the writer and reads it on the
reader (a whole-prefix store hit), then the script takes the difference of both engines'
store metrics
(:mod:`mcstore.metrics`): time per phase of the saves and loads, buffer ranges per chunk,
bytes, and the rate of Mooncake's own transfer call; and the reader's per-request times from
vLLM (queued until first scheduled, which holds the load; scheduled until the first token),
beside two prefix-cache hits on the reader's prompt right after: the writer's (core 0), and the
reader's own (core 1, the blocks it just loaded), each with vLLM's split. The reader's tokens
are checked against both. Prints a table and writes
``store_phases.json`` to ``--out``.

``--reader-blocks`` gives the readers a small KV cache: once it has cycled, the blocks vLLM
gives a request no longer form ascending runs, so a chunk's blocks become many buffer
ranges (the live engine's case that ``stage_above_ranges_per_region`` is for).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.client import ids, stream  # noqa: E402
from bench.common import (  # noqa: E402
    Checker,
    long_context_args,
    machine,
    model_dir,
    output_dir,
    rotated,
    start_engines,
    term_as_interrupt,
)
from bench.engine_metrics import REQUEST_TIMES, get, moved, request_sums, request_times, scrape  # noqa: E402
from bench.store_hit import SETTLE_S, SUFFIX, store_config  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

PHASES = ("load_queue", "load_transfer", "load_staging", "load_copy", "load_recheck",
          "save_queue", "save_exists", "save_transfer")


def summarise(d: dict, n_req: int) -> dict:
    """Per request, from what the store tier's series moved by (:func:`bench.engine_metrics.moved`
    of two scrapes): seconds per phase, plus ranges per chunk and the rate of Mooncake's calls
    (a load's bytes over its transfer and staging phases, a save's over its transfer). vLLM's
    per-request split is read per request (:func:`bench.engine_metrics.request_times`)."""
    ph = "vllm:mctier_store_phase_seconds_sum"
    per = {p: get(d, ph, phase=p) / n_req for p in PHASES}
    row = {"phase_s": per,
           "load_s": get(d, "vllm:mctier_store_load_seconds_sum") / n_req,
           "save_s": get(d, "vllm:mctier_store_save_seconds_sum") / n_req,
           "lookup_s": get(d, "vllm:mctier_store_lookup_seconds_sum")
           / max(1.0, get(d, "vllm:mctier_store_lookup_seconds_count"))}
    row["failures"] = {dict(ls)["kind"]: v for (n, ls), v in d.items()
                       if n == "vllm:mctier_store_failures_total" and dict(ls).get("kind")}
    for kind in ("load", "save"):
        chunks = get(d, "vllm:mctier_store_io_chunks_total", kind=kind)
        ranges = get(d, "vllm:mctier_store_io_ranges_total", kind=kind)
        row[f"{kind}_ranges_per_chunk"] = ranges / chunks if chunks else None
        moved_bytes = get(d, f"vllm:mctier_store_{'loaded' if kind == 'load' else 'saved'}_bytes_total")
        # A load's bytes arrive in two of Mooncake's calls: straight into the pages (transfer)
        # and, for scattered chunks, into host staging; over the first alone the rate of a
        # mostly staged load came out at 14 GB/s.
        calls = ("transfer", "staging") if kind == "load" else ("transfer",)
        secs = sum(get(d, ph, phase=f"{kind}_{p}") for p in calls)
        row[f"{kind}_bytes"] = moved_bytes / n_req
        row[f"{kind}_transfer_gbps"] = moved_bytes / secs / 1e9 if secs else None
    return row


def settings(pairs: list[str], flag: str = "--set/--ab") -> dict:
    """``KEY=JSON`` arguments as a dict (SystemExit naming ``flag`` for one without ``=``)."""
    out = {}
    for x in pairs:
        k, sep, v = x.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes KEY=JSON, got {x!r}")
        out[k] = json.loads(v)
    return out


def _print(name: str, n_pfx: int, row: dict) -> None:
    ld, sv = row["load"], row["save"]
    fl, own = row["floor_times"], row["own_times"]
    print(f"{name:>10} {n_pfx:>6} tokens  TTFT {row['reader_ttft_s'] * 1e3:6.0f} ms | "
          f"reader queued {ld['queue_s'] * 1e3:.1f} ms,"
          f" scheduled to first token {ld['prefill_s'] * 1e3:.1f} | prefix-cache hits: writer's TTFT "
          f"{row['floor_ttft_s'] * 1e3:.0f} (scheduled to first token {fl['prefill_s'] * 1e3:.1f}), reader's own "
          f"{row['own_ttft_s'] * 1e3:.0f} ({own['prefill_s'] * 1e3:.1f})"
          f" | load {ld['load_s'] * 1e3:6.1f} ms: "
          + " ".join(f"{p[5:]} {ld['phase_s'][p] * 1e3:.1f}" for p in PHASES[:5])
          + f" | {ld['load_ranges_per_chunk'] or 0:.0f} ranges/chunk, {ld['load_transfer_gbps'] or 0:.2f} GB/s"
          + f" | save {sv['save_s'] * 1e3:6.1f} ms: "
          + " ".join(f"{p[5:]} {sv['phase_s'][p] * 1e3:.1f}" for p in PHASES[5:])
          + f" | {sv['save_ranges_per_chunk'] or 0:.0f} ranges/chunk, {sv['save_transfer_gbps'] or 0:.2f} GB/s"
          + f" | failures {sum(ld['failures'].values()) + sum(sv['failures'].values()):.0f}", flush=True)


def run(a: argparse.Namespace) -> int:
    out = output_dir(a.out)
    model = model_dir("small")
    rng = random.Random(a.seed)
    check = Checker()
    dep = Deployment(out / "logs")
    common = settings(a.set)
    configs = {"default": common}
    if a.ab:
        configs["ab"] = {**common, **settings(a.ab)}
    rows = []
    prefixes = [int(x) for x in a.prefixes.split(",")]
    long = long_context_args(max(prefixes) + SUFFIX + 64)  # past 8,192 positions: --hf-overrides
    term_as_interrupt()
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=4 << 30).start()
        master = dep.cluster.master_addr
        small = {"extra": ["--num-gpu-blocks-override", str(a.reader_blocks)] if a.reader_blocks else []}
        specs = [spec for name, extra in configs.items()
                 for spec in ((f"phases-{name}-writer", 0, store_config(master, **extra)),
                              (f"phases-{name}-reader", 1, store_config(master, **extra), small))]
        started = iter(url for url, _ in start_engines(dep, model, specs, extra=long))
        urls = {name: (next(started), next(started)) for name in configs}
        for n_pfx in prefixes:
            before, ttft, floor = {}, {name: [] for name in configs}, {name: [] for name in configs}
            own_ttft, times = {name: [] for name in configs}, {name: [] for name in configs}
            for rep in range(a.reps + 1):
                for name in rotated(list(configs), rep):
                    w_url, r_url = urls[name]
                    pfx, tail = ids(n_pfx, rng), ids(SUFFIX, rng)
                    stream(w_url, pfx + ids(SUFFIX, rng), 1)
                    time.sleep(SETTLE_S)
                    rq = request_sums(r_url)
                    got = stream(r_url, pfx + tail, 4)
                    hit_t = request_times(r_url, rq)
                    wq = request_sums(w_url)
                    want = stream(w_url, pfx + tail, 4)
                    floor_t = request_times(w_url, wq)
                    rq = request_sums(r_url)
                    own = stream(r_url, pfx + tail, 4)  # the reader's own prefix-cache hit, same core as its store hit
                    own_t = request_times(r_url, rq)
                    check.same("store_phases", f"{name}: reader hit vs writer prefix-cache hit", n_pfx + SUFFIX,
                               got.token_ids, want.token_ids)
                    check.same("store_phases", f"{name}: reader hit vs its own prefix-cache hit", n_pfx + SUFFIX,
                               got.token_ids, own.token_ids)
                    check.same("store_phases", f"{name}: reader hit tokens, its own prefix-cache hit tokens",
                               n_pfx + SUFFIX, [got.cached, own.cached], [n_pfx, n_pfx])
                    if rep:
                        ttft[name].append(got.ttft)
                        floor[name].append(want.ttft)
                        own_ttft[name].append(own.ttft)
                        times[name].append((hit_t, floor_t, own_t))
                    time.sleep(SETTLE_S)  # the other pair's engines go quiet before the next one is timed
                if rep == 0:  # warm-up: not in the figures
                    before = {name: (scrape(w), scrape(r)) for name, (w, r) in urls.items()}
            time.sleep(0.5)
            for name, (w_url, r_url) in urls.items():
                dw = moved(scrape(w_url), before[name][0])
                dr = moved(scrape(r_url), before[name][1])
                row = {"config": name, "settings": configs[name], "prefix_tokens": n_pfx,
                       "reader_ttft_s": statistics.median(ttft[name]), "floor_ttft_s": statistics.median(floor[name]),
                       "own_ttft_s": statistics.median(own_ttft[name]),
                       "load": summarise(dr, a.reps), "save": summarise(dw, a.reps)}
                # vLLM's split per request (queued until scheduled, scheduled to first token)
                for i, who in enumerate(("hit", "floor", "own")):
                    row[f"{who}_times"] = {k: statistics.median(x[i][k] for x in times[name])
                                           for k in REQUEST_TIMES.values()}
                row["load"].update(row["hit_times"])
                rows.append(row)
                _print(name, n_pfx, row)
    finally:
        dep.stop()
    if a.ab:
        print("\nab / default (same run, same prompts lengths, interleaved):")
        for d, b in zip([r for r in rows if r["config"] == "default"], [r for r in rows if r["config"] == "ab"]):
            n_pfx = d["prefix_tokens"]

            def ratio(f):
                x, y = f(d), f(b)
                return f"{y / x:.2f}" if x and y else "n/a"
            print(f"  {n_pfx:>6} tokens ({d['load']['load_ranges_per_chunk'] or 0:.0f} / "
                  f"{b['load']['load_ranges_per_chunk'] or 0:.0f} "
                  f"ranges per loaded chunk)  reader TTFT x{ratio(lambda r: r['reader_ttft_s'])}  "
                  f"load x{ratio(lambda r: r['load']['load_s'])}  save x{ratio(lambda r: r['save']['save_s'])}  "
                  f"save GB/s x{ratio(lambda r: r['save']['save_transfer_gbps'])}")
    result = {"machine": machine(model), "configs": configs, "reps": a.reps, "rows": rows}
    return check.write(out / "store_phases.json", result, "store_phases")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", default="2048,4096,7936", help="prefix lengths in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per length (after one warm-up)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a kv_connector_extra_config setting for every engine, e.g. verify_checksums=true")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=JSON",
                    help="also run a second writer/reader pair with these settings, interleaved with the "
                         "default pair in the same run, e.g. verify_checksums=true")
    ap.add_argument("--reader-blocks", type=int, default=0,
                    help="KV cache blocks of the readers (--num-gpu-blocks-override): a small cache cycles "
                         "after a few prompts, and a cycled engine's blocks come back scattered")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "store_phases"))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
