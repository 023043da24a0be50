"""Decision quality of the composite (not a test): is ``auto`` as fast as the best forced source?

    .venv/bin/python -m bench.tiered_bench [--quick] [--reps N] [--lengths 64,256,...] [--out DIR]
    (``make bench`` runs it after ``bench.suite``)

A 1P1D ``TieredConnector`` deployment (``small`` model, prefill on core 0, decode on core
1, a Mooncake master and store server) answers prompts of ``--lengths`` tokens (65 to 16K + 1;
past the model's 8,192 positions the engines get ``--hf-overrides`` for more, which a
random-weight model with rotary positions takes as it is) whose leading 0%, 50% or 100%
(rounded down to whole 256-token chunks; a fraction that rounds to the same chunks as
one before it is not run again) the prefill instance stored just before, in two layouts:

- ``with prefill``: through ``mctier proxy`` (every request handed off: the decode
  instance's composite chooses, range by range, between the store, the prefill instance
  and recomputing); sources ``recompute``, ``store``, ``p2p``, ``auto``;
- ``decode only``: straight to the decode instance (no handoff to draw on); sources
  ``recompute``, ``store``, ``auto``;
- ``cold prefill`` (not in the default ``--layouts``): as ``with prefill``, but the prefill
  instance's prefix cache is emptied after it stored the prefix (``POST
  /reset_prefix_cache``; its engine runs with ``VLLM_SERVER_DEV_MODE=1``), as when another
  instance computed the prefix: a handoff then costs the prefill instance's own store load
  of the prefix, which the decode instance's estimate of a connector-equipped prefill
  instance does not count (``multi.policy.TierReach.remote_cached`` is None: the instance
  is taken to hold what the earlier tiers hold).

A forced source is ``kv_transfer_params.kv_source``; ``auto`` is the product's default.
Every prompt is fresh (random ids, its own prefix), so no request hits a prefix cache
the cell did not set up. Repetitions are interleaved: each repetition runs every source
of a cell once, in orders of a Williams design (:func:`bench.common.balanced_orders`,
the sources' roles shuffled per cell, seeded): over each cycle of orders (4 with four
sources, 6 with three) every source runs right after every other equally often, so that
whatever a request leaves behind on the engines (such as the freed blocks the next load
writes into) weighs on every source alike. Not rotated: rotating one order keeps the
cyclic sequence, so ``auto`` followed ``p2p`` (and, with the decode instance alone,
``store``) in almost every repetition; nor shuffled, as until 2026-12-04: in one run's
decode-only cells with a stored prefix, 22 of 40 ``store`` requests ran right after
``auto``. A cell runs ``--reps`` repetitions (default 3), then more, up to ``--max-reps`` (9),
until its timed repetitions have run ``--min-cell-s`` seconds (60): a request of 30 to
600 ms spreads by 15% or more between repetitions of one plan on a 2-core host (the fifth
full run's misses, docs/benchmarks/decisions.md), and three of them do not give a median within 10%; a cell of
long prompts takes a minute in three repetitions anyway. Per cell: TTFT median and min-max
per source; the best forced source (lowest median); the per-request oracle, the fastest forced
source within each repetition (it knows the outcome; its median is what a perfect
chooser gets); the plan ``auto`` chose (the decode engine's
``vllm:mctier_tiered_decisions_total`` across each ``auto`` request, read the same way
around every request: ``planned`` in the JSON), every request's TTFT with each
repetition's order, and for every request whose plan loaded from the store, that load's
buffer ranges per chunk and GB/s (``store_io``; the report gives the cell's medians), to
tell a slow load from scattered blocks; ``auto``'s ratios to the best forced source and to
recomputing with their 90% intervals over the repetitions (:func:`ratio_interval`), so that
a miss inside the spread is told from one beyond it. Each request waits
``bench.common.QUIET_S`` after the one before it, so that no engine is still spinning on
the core of the one it goes to. Targets (the issue's): ``auto`` within 10% of the best
forced source's median in at least 90% of the cells, and never more than 5% slower than
always recomputing.

Tokens are checked before the timing, once per cell and source (untimed, also the
warm-up): a non-streamed request returns the plan the decode instance followed
(``kv_transfer_params.kv_plan``), and a no-connector engine (core 1) reproduces it
(:func:`reference_passes`): it computes the stored prefix's pass (``prefix + [5]``, what
the prefill instance ran), then, when the decode instance took KV computed by the
handoff, the whole prompt (the prefill instance's pass), and then the prompt, whose
greedy ids must equal the decode instance's, with exactly as many cached tokens as the
plan loaded. Lengths are 32k + 1 tokens so that a handoff's N - 1 tokens are whole
blocks that the reference's prefix cache can hold. One split has no such reproduction:
the decode instance recomputing after KV the handoff's own pass computed (the prefill
instance's saves of it can reach the store before the decode instance looks); those
requests are counted as unchecked, with their plans. Exit status 1 if tokens differed.

Writes ``decisions.json`` and ``decisions.md`` to ``--out`` (default
``bench/results/decisions``). Stops everything it started, also on failure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.client import complete, ids, reset_prefix_cache, stream  # noqa: E402
from bench.common import (  # noqa: E402
    QUIET_S,
    Checker,
    balanced_orders,
    long_context_args,
    machine,
    model_dir,
    output_dir,
    ratio_interval,
    spread,
    term_as_interrupt,
)
from bench.decisions_report import progress_line, render  # noqa: E402
from bench.engine_metrics import DECISIONS, counted_plan, load_io  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment, metrics, tiered_config  # noqa: E402

LAYOUTS = {"with prefill": ("recompute", "store", "p2p", "auto"), "decode only": ("recompute", "store", "auto"),
           "cold prefill": ("recompute", "store", "p2p", "auto")}
DEFAULT_LAYOUTS = ("with prefill", "decode only")
HANDOFF = {"with prefill", "cold prefill"}  # layouts whose requests go through the proxy
CHUNK = 256
BLOCK = 32
STORED_PASS_TAIL = [5]  # store_prefix's extra token: a pass the reference repeats exactly
WITHIN_BEST, WITHIN_RECOMPUTE = 1.10, 1.05


def store_prefix(p_url: str, prefix: list[int], forget: bool = False) -> None:
    """A prefill-only request on the prefill instance saves the prefix's chunks (``forget``:
    then its prefix cache is emptied, :func:`bench.client.reset_prefix_cache`); then a pause in every
    case (QUIET_S: saves run off the forward path, and every engine that just ran still
    spins), so that each request after it starts on quiet engines."""
    if prefix:
        complete(p_url, prefix + STORED_PASS_TAIL, 1)
    if forget:
        reset_prefix_cache(p_url)
    time.sleep(QUIET_S)


def loaded_tokens(plan: list[dict], n: int) -> int:
    """Where the decode instance started computing: the tokens its plan loaded."""
    return next((s["start"] for s in plan if s["source"] == "recompute"), n)


def reference_passes(plan: list[dict], prompt: list[int], hit: int, handoff: bool) -> list[list[int]] | None:
    """The prompts a no-connector engine computes before ``prompt`` so that it holds the KV
    the decode instance loaded (``plan``: its ``kv_plan``), computed in the same passes, and
    then computes what the decode instance computed; None when no such sequence exists.

    The decode instance's KV came from the prefill instance: ``[0, hit)`` from the stored
    prefix's pass (``prefix + STORED_PASS_TAIL``), the rest (``handoff``) from its pass
    over the whole prompt, where ``[0, hit)`` was a prefix-cache hit."""
    n = len(prompt)
    start = loaded_tokens(plan, n)
    stored = [prompt[:hit] + STORED_PASS_TAIL] if hit else []
    if start == 0:
        return []
    if start == hit:
        return stored
    if handoff and start == n - 1 and start % BLOCK == 0:
        return stored + [prompt]
    return None


def check_cell(urls: dict[str, str], layout: str, n: int, hit: int, rng: random.Random,
               check: Checker) -> tuple[list[str], dict]:
    """One untimed request per source against the reference (see the module docstring): the
    plans it could not reproduce, and what ``auto``'s request weighed (its
    ``kv_plan_estimates``: every plan's estimated seconds, the parts, the requests the
    engine held), to tell a wrong estimate from a wrong objective."""
    target = urls["proxy"] if layout in HANDOFF else urls["decode"]
    cold = layout == "cold prefill"
    unchecked, estimates, prefill_plans = [], {}, {}
    for src in LAYOUTS[layout]:
        prefix = ids(hit, rng)
        store_prefix(urls["prefill"], prefix, forget=cold)
        prompt = prefix + ids(n - hit, rng)
        p_before = metrics(urls["prefill"], (DECISIONS,)) if cold else {}
        r = complete(target, prompt, 2, {"kv_source": src})
        params = r.get("kv_transfer_params") or {}
        plan = params.get("kv_plan") or []
        if src == "auto":
            estimates = params.get("kv_plan_estimates") or {}
        shown = "+".join(f"{s['source']}[{s['start']},{s['end']})" for s in plan) or "no plan"
        passes = reference_passes(plan, prompt, hit, layout in HANDOFF)
        if cold:
            # The reference's prefill pass takes [0, hit) from the stored pass's KV: true
            # only if the prefill instance loaded it from the store (its own plan).
            prefill_plans[src] = counted_plan(urls["prefill"], p_before)
            if hit and passes and len(passes) > 1 and "store" not in prefill_plans[src].split("+"):
                passes = None
            shown += f"; the prefill instance's plan: {prefill_plans[src]}"
        if passes is None:
            unchecked.append(f"{src}: {shown}")
            continue
        for p in passes:
            complete(urls["base"], p, 1)
        ref = stream(urls["base"], prompt, 2)
        what = f"{layout}, kv_source {src} ({shown})"
        check.same("decisions", f"{what}: reference cached tokens", n, [ref.cached], [loaded_tokens(plan, n)])
        check.same("decisions", f"{what} vs same-split reference", n, r["choices"][0]["token_ids"], ref.token_ids)
    if cold:
        estimates = {**estimates, "prefill_plans": prefill_plans}
    return unchecked, estimates


def cell(urls: dict[str, str], layout: str, n: int, f: float, reps: int, rng: random.Random, k0: int,
         check: Checker | None = None, min_cell_s: float = 0.0, max_reps: int = 0) -> dict:
    """One cell: ``reps`` interleaved repetitions, then more (up to ``max_reps``) while the
    timed repetitions have run for less than ``min_cell_s`` seconds: cheap cells get more
    samples, where a few ms of spread decide a median (module doc)."""
    sources = LAYOUTS[layout]
    target = urls["proxy"] if layout in HANDOFF else urls["decode"]
    times: dict[str, list[float]] = {s: [] for s in sources}
    planned: dict[str, list[str]] = {s: [] for s in sources}  # what the composite counted per request
    store_io: dict[str, list[dict | None]] = {s: [] for s in sources}  # each request's store load, if any
    hit = int(n * f) // CHUNK * CHUNK
    unchecked, estimates = check_cell(urls, layout, n, hit, rng, check) if check is not None else ([], {})
    orders: list[list[str]] = []
    plan_orders = balanced_orders(sources, max(reps, max_reps), seed=k0)
    t0 = time.monotonic()
    while len(orders) < reps or (len(orders) < max_reps and time.monotonic() - t0 < min_cell_s):
        orders.append(plan_orders[len(orders)])
        for src in orders[-1]:
            prefix = ids(hit, rng)
            # Before the pause: a /metrics scrape runs on the decode engine's core, so it must
            # not run right before a timed request; and every source's requests get the same
            # scrapes, so that none is treated differently.
            before = metrics(urls["decode"])
            store_prefix(urls["prefill"], prefix, forget=layout == "cold prefill")
            times[src].append(stream(target, prefix + ids(n - hit, rng), 2, {"kv_source": src}).ttft)
            planned[src].append(plan := counted_plan(urls["decode"], before))
            store_io[src].append(load_io(urls["decode"], before) if "store" in plan.split("+") else None)
    forced = [s for s in sources if s != "auto"]
    med = {s: statistics.median(v) for s, v in times.items()}
    best = min(forced, key=lambda s: med[s])
    oracle = [min(times[s][r] for s in forced) for r in range(len(orders))]
    return {"layout": layout, "tokens": n, "store_fraction": f, "stored_tokens": hit,
            "ttft": {s: spread(v) for s, v in times.items()}, "best_forced": best,
            # Every timed request (seconds, per source in repetition order) and each
            # repetition's order: what preceded a slow request.
            "times": times, "orders": orders,
            "oracle_median": statistics.median(oracle), "auto_plans": planned["auto"], "planned": planned,
            # Per request that loaded from the store: buffer ranges per chunk and GB/s of that load.
            "store_io": store_io,
            "unchecked": unchecked,
            "auto_check_estimates": estimates,
            "auto_vs_best": med["auto"] / med[best], "auto_vs_oracle": med["auto"] / statistics.median(oracle),
            "auto_vs_recompute": med["auto"] / med["recompute"],
            # 90% bootstrap intervals of the two ratios over the repetitions (ratio_interval).
            "auto_vs_best_interval": ratio_interval(times["auto"], times[best]),
            "auto_vs_recompute_interval": ratio_interval(times["auto"], times["recompute"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tiered_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="257 and 2049 tokens, 0 and 100%%, 1 repetition")
    ap.add_argument("--lengths", help="prompt lengths, 32k + 1 (default 65,257,1025,2049,4097,8193,16385)")
    ap.add_argument("--fractions", help="stored fractions (default 0,0.5,1)")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                    help="with prefill, decode only, cold prefill (default the first two)")
    ap.add_argument("--reps", type=int,
                    help="interleaved repetitions per cell, at least (default 3; 1 with --quick)")
    ap.add_argument("--min-cell-s", type=float, help="a cell repeats until its timed repetitions have run this "
                    "long, up to --max-reps (default 60; 0 with --quick)")
    ap.add_argument("--max-reps", type=int, default=9, help="repetitions a cell may grow to (default 9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decisions"))
    a = ap.parse_args(argv)
    lengths = [int(x) for x in
               (a.lengths or ("257,2049" if a.quick else "65,257,1025,2049,4097,8193,16385")).split(",")]
    if bad := [n for n in lengths if n % BLOCK != 1]:
        ap.error(f"lengths {bad} are not 32k + 1: a handoff's N - 1 tokens must be whole blocks for the token check")
    fractions = [float(x) for x in (a.fractions or ("0,1" if a.quick else "0,0.5,1")).split(",")]
    layouts = [x.strip() for x in a.layouts.split(",")]
    if unknown := [x for x in layouts if x not in LAYOUTS]:
        ap.error(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    reps = a.reps or (1 if a.quick else 3)
    min_cell_s = a.min_cell_s if a.min_cell_s is not None else (0.0 if a.quick else 60.0)
    max_reps = max(reps, a.max_reps)
    out = output_dir(a.out)
    model = model_dir("small")
    extra = long_context_args(max(lengths) + 64)
    rng = random.Random(a.seed)
    check = Checker()
    dep = Deployment(out / "logs")
    rec: dict = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model),
                 "args": {"lengths": lengths, "fractions": fractions, "layouts": layouts, "reps": reps,
                          "min_cell_s": min_cell_s, "max_reps": max_reps,
                          "engine_extra": extra}, "cells": []}
    t0 = time.monotonic()

    term_as_interrupt()
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=8 << 30).start()
        master, boot = dep.cluster.master_addr, free_port()
        # The reference starts beside the pair (started after it, it would leave a core idle).
        base_url, base = dep.engine("reference", model, 1, None, extra=extra)
        p_url, d_url, proxy = dep.pd_pair(model, tiered_config("kv_producer", master, boot),
                                          tiered_config("kv_consumer", master, free_port()), boot, extra=extra,
                                          # /reset_prefix_cache is a dev-mode route
                                          prefill_env={"VLLM_SERVER_DEV_MODE": "1"} if "cold prefill" in layouts
                                          else None)
        dep.wait_http(base_url, base)
        urls = {"prefill": p_url, "decode": d_url, "proxy": proxy, "base": base_url}
        cell(urls, "with prefill", 513, 0.5, 1, rng, 0)  # untimed: the first handoff and loads set things up
        for n in lengths:
            seen = set()
            for f in fractions:
                if (hit := int(n * f) // CHUNK * CHUNK) in seen:
                    continue  # a fraction that stores the same whole chunks as one before it: the same cell
                seen.add(hit)
                for layout in layouts:
                    r = cell(urls, layout, n, f, reps, rng, len(rec["cells"]), check, min_cell_s, max_reps)
                    rec["cells"].append(r)
                    print(progress_line(r), flush=True)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the cells measured so far are still written
        rec["error"] = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"[:2000]
        print(f"[decisions] FAILED: {rec['error']}", flush=True)
    finally:
        dep.stop()
    cells = rec["cells"]
    rec["summary"] = {"cells": len(cells), "within_best": sum(r["auto_vs_best"] <= WITHIN_BEST for r in cells),
                      "within_recompute": sum(r["auto_vs_recompute"] <= WITHIN_RECOMPUTE for r in cells)}
    rec["summary"]["within_best_share"] = rec["summary"]["within_best"] / max(1, len(cells))
    # Against the intervals: a miss (or a hit) whose whole interval is past the line.
    rec["summary"]["beyond_best"] = sum(r["auto_vs_best_interval"][0] > WITHIN_BEST for r in cells)
    rec["summary"]["surely_best"] = sum(r["auto_vs_best_interval"][1] <= WITHIN_BEST for r in cells)
    rec["summary"]["beyond_recompute"] = sum(r["auto_vs_recompute_interval"][0] > WITHIN_RECOMPUTE for r in cells)
    # Whether auto took the plan of the fastest forced source, whatever the clock said (at
    # 30 ms a few ms of noise decide auto/best).
    # (A forced store with nothing stored is recomputation: the composite falls back.)
    rec["summary"]["same_plan"] = sum(set(c["auto_plans"]) == {"recompute" if c["best_forced"] == "store" and
                                                               not c["stored_tokens"] else c["best_forced"]}
                                      for c in cells)
    rec["token_checks"], rec["token_mismatches"] = check.checked, check.mismatches
    rec["seconds"], rec["pids"] = round(time.monotonic() - t0), sorted(set(dep.started))
    (out / "decisions.json").write_text(json.dumps(rec, indent=1))
    md = render(rec)
    (out / "decisions.md").write_text(md)
    print("\n" + md + f"\n[decisions] wrote {out / 'decisions.json'}, {out / 'decisions.md'} ({rec['seconds']} s)")
    return 1 if "error" in rec or check.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
