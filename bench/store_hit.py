"""The store-hit rows of the comparison: a section of ``bench/suite.py`` (not a test).

TTFT of a prompt whose prefix another engine stored, read by an engine that never saw it:
this project's ``StoreConnector`` (Mooncake on loopback) and LMCache in multi-process mode
(``lmcache server`` + ``LMCacheMPConnector``), writers on core 0 and readers on core 1,
against vLLM's own prefix-cache hit on one engine (the floor) and a miss (the ceiling). A
second reader of ours, on the store tier's load path before issue 17
(:data:`PREVIOUS_LOAD_PATH`), reads the same stored prefixes, taking turns with the first.
Per repetition and prefix length, a fresh random prefix and two one-block suffixes; the
first repetition is a check and warm-up, not timed; greedy ids are checked against the
no-connector engine's (the same split). :func:`store_hit` measures,
:func:`run_section` starts and stops the engines around it.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Callable

from bench import lmcache_peer, raw_probe
from bench.client import ids, stream
from bench.common import QUIET_S, Checker, rotated, spread, start_engines
from bench.engine_metrics import (
    VMSTAT,
    delta,
    host_counters,
    host_thread_cpu,
    load_io,
    request_sums,
    request_times,
    thread_cpu,
)
from multi.cli.deploy import metrics

SUFFIX = 32          # the unshared tail of a store_hit prompt: one block
MAX_TOKENS = 8       # generated per timed request (store_hit, and the suite's composite)
SETTLE_S = QUIET_S   # writer -> reader: saves run off the forward path in both systems, and the writer spins
CHUNK = 256

# The store tier's load path before issue 17 (2026-11-30): straight into the pages however
# scattered, always in the background, no pause at empty steps, the load thread at the
# engine's priority. Its reader is the store-hit table's "previous default path" column, until
# that path is removed.
PREVIOUS_LOAD_PATH = {"stage_above_ranges_per_region": 0, "sync_load_max": 0, "idle_step_ms": 0,
                      "load_thread_nice": 0}


def store_config(master: str, **extra) -> dict:
    # A failed load is recomputed, as an operator would configure it (vLLM's default fails the request).
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, "chunk_tokens": CHUNK, **extra}}


def store_hit(base: str, peers: dict[str, tuple[str, str]], prefixes: list[int], reps: int,
              rng: random.Random, check: Checker, reader_pid: int | None = None,
              probe: Callable[[int, int, int], dict] | None = None,
              also_read: dict[str, tuple[str, str]] | None = None) -> list[dict]:
    """``peers``: name -> (writer URL on core 0, reader URL on core 1). ``also_read``: name ->
    (peer, reader URL on core 1), a second reader of what that peer's writer stored (the
    same prompt, the reader order rotating by repetition, ``QUIET_S`` apart); its loads'
    ranges per chunk and rate go to ``{name}_load``. With ``reader_pid``
    (our reader's), each of its loads also reports the page faults of its processes, the
    host's THP, compaction and reclaim counters, and the CPU time of every thread of the
    reader (``threads``) and of every other process on the host (``others``: the engines
    sharing its core, both stores' servers, kernel workers) over its request
    (``ours_load``). With
    ``probe(chunks, chunk_bytes, ranges)`` (:func:`bench.raw_probe.run` on the reader's core),
    each of our reader's hits is followed by the raw get of the same bytes in a plain process
    on that core: into one buffer per chunk (``ours_load["raw_gbps"]``) and into as many ranges
    per chunk as the hit's load had (``raw_ranges_gbps``)."""
    also_read = also_read or {}
    readers = {**{p: (p, url) for p, (_, url) in peers.items()}, **also_read}  # name -> (peer, reader URL)
    rows = []
    for n_pfx in prefixes:
        t: dict[str, list[float]] = {k: [] for k in ("floor", "miss", *readers, *(f"{p}_store_miss" for p in peers))}
        hits: dict[str, list[int]] = {p: [] for p in readers}
        io: list[dict] = []
        also_io: dict[str, list[dict]] = {name: [] for name in also_read}
        floor_times: list[dict] = []
        for rep in range(reps + 1):
            pfx, sa, sb = ids(n_pfx, rng), ids(SUFFIX, rng), ids(SUFFIX, rng)
            got: dict[str, object] = {}
            for who in rotated(["base", *peers], rep):
                if who == "base":
                    got["miss"] = stream(base, pfx + sa, MAX_TOKENS)
                    # A reader on the same core may have run just before the miss, and a short
                    # miss ends inside that engine's spin (QUIET_S). The run without this pause
                    # (2026-12-01 13:21) put the store hits at 512 and 1,024 tokens at 0.74x and
                    # 0.72x the floor, which is suspect.
                    rq0 = request_sums(base)
                    time.sleep(QUIET_S)
                    got["floor"] = stream(base, pfx + sb, MAX_TOKENS)
                    if rep:
                        floor_times.append(request_times(base, rq0))
                else:
                    writer, reader = peers[who]
                    second = [name for name, (peer, _) in also_read.items() if peer == who]
                    # Before the writer's request: a scrape runs on the reader's core.
                    io0 = metrics(reader) if who == "ours" else None
                    rq0 = request_sums(reader) if io0 is not None else None
                    also0 = {name: metrics(also_read[name][1]) for name in second}
                    got[f"{who}_store_miss"] = stream(writer, pfx + sa, MAX_TOKENS)
                    time.sleep(SETTLE_S)
                    order = rotated([who, *second], rep)
                    for name in order[:order.index(who)]:
                        got[name] = stream(also_read[name][1], pfx + sb, MAX_TOKENS)
                        if rep:
                            also_io[name].append(load_io(also_read[name][1], also0[name]))
                        time.sleep(QUIET_S)  # the same core as the next reader
                    c0 = host_counters(reader_pid) if io0 is not None and reader_pid else None
                    th0 = thread_cpu(reader_pid) if c0 is not None else None
                    oth0 = host_thread_cpu(exclude=reader_pid) if c0 is not None else None
                    got[who] = stream(reader, pfx + sb, MAX_TOKENS)
                    oth1 = host_thread_cpu(exclude=reader_pid) if oth0 is not None else None
                    th1 = thread_cpu(reader_pid) if th0 is not None else None
                    c1 = host_counters(reader_pid) if c0 is not None else None
                    if io0 is not None and rep:
                        io.append({**load_io(reader, io0), **(delta(c1, c0) if c0 else {}),
                                   **request_times(reader, rq0)})
                        if th0 is not None:
                            for key, (a, b) in (("threads", (th0, th1)), ("others", (oth0, oth1))):
                                io[-1][key] = {k: v for k, v in delta(b, a).items() if v > 1e-3}
                            top = sorted(io[-1]["others"].items(), key=lambda kv: -kv[1])[:4]
                            print(f"        rep {rep}: ours {got[who].ttft * 1e3:.0f} ms, "
                                  f"load {io[-1]['seconds'] * 1e3:.0f} ms;"
                                  " others' CPU: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in top), flush=True)
                        if probe is not None and got[who].cached >= n_pfx and io[-1]["bytes"] > 0:  # a whole hit
                            time.sleep(QUIET_S)  # the reader spins after its request, on the probe's core
                            chunks, ranges = n_pfx // CHUNK, max(1, round(io[-1]["ranges_per_chunk"]))
                            pr = probe(chunks, round(io[-1]["bytes"] / chunks), ranges)
                            io[-1]["raw_gbps"] = statistics.median(pr["gbps"])
                            io[-1]["raw_ranges_gbps"] = statistics.median(pr.get("gbps_ranges", pr["gbps"]))
                    for name in order[order.index(who) + 1:]:
                        time.sleep(QUIET_S)
                        got[name] = stream(also_read[name][1], pfx + sb, MAX_TOKENS)
                        if rep:
                            also_io[name].append(load_io(also_read[name][1], also0[name]))
            n = n_pfx + SUFFIX
            check.same("store_hit", "floor (vLLM prefix cache) cached tokens", n, [got["floor"].cached], [n_pfx])
            for p in peers:
                check.same("store_hit", f"{p} writer vs cold run", n, got[f"{p}_store_miss"].token_ids,
                           got["miss"].token_ids)
            for p in readers:
                check.same("store_hit", f"{p} hit vs vLLM prefix-cache hit", n, got[p].token_ids,
                           got["floor"].token_ids)
                if rep:
                    hits[p].append(got[p].cached)
            if rep == 0:
                continue  # check and warm-up
            for k, c in got.items():
                t[k].append(c.ttft)
        med = {k: spread(v) for k, v in t.items()}
        row = {"prompt_tokens": n_pfx + SUFFIX, "prefix_tokens": n_pfx, "ttft": med,
               "hit_tokens": {p: statistics.median(h) for p, h in hits.items()}}
        if io:
            # Keys every load has (a partial hit is not probed).
            common = [k for k in io[0] if k not in ("threads", "others") and all(k in x for x in io)]
            row["ours_load"] = {k: statistics.median(x[k] for x in io) for k in common}
            # CPU seconds per thread over the hit's request, median: the reader's threads, and
            # every other process's (the engines sharing its core, the stores' servers).
            for key in ("threads", "others"):
                if key in io[0]:
                    names = {k for x in io for k in x[key]}
                    row["ours_load"][key] = dict(sorted(
                        ((k, statistics.median(x[key].get(k, 0.0) for x in io)) for k in names),
                        key=lambda kv: -kv[1]))
        if floor_times:  # the floor's own split, beside ours_load's queue_s / prefill_s
            row["floor_times"] = {k: statistics.median(x[k] for x in floor_times) for k in floor_times[0]}
        for name, xs in also_io.items():
            if xs:
                row[f"{name}_load"] = {k: statistics.median(x[k] for x in xs) for k in ("ranges_per_chunk", "gbps")}
        for p in readers:
            row[f"{p}_vs_floor"] = med[p]["median"] / med["floor"]["median"]
            row[f"{p}_vs_miss"] = med[p]["median"] / med["miss"]["median"]
        rows.append(row)
        print(f"  {n_pfx + SUFFIX:>5} tokens  miss {med['miss']['median'] * 1e3:7.0f} ms  floor "
              f"{med['floor']['median'] * 1e3:6.0f} ms  " + "  ".join(
                  f"{p} {med[p]['median'] * 1e3:6.0f} ms (x{row[f'{p}_vs_floor']:.2f} floor, "
                  f"hit {row['hit_tokens'][p]:.0f})" for p in readers), flush=True)
        if "raw_gbps" in row.get("ours_load", {}):
            ld = row["ours_load"]
            # A hit computes the same suffix as the floor, so with the load at the raw rate it
            # would take the floor plus the raw read of its bytes.
            floor = med["floor"]["median"]
            row["ours_raw_bound_vs_floor"] = (floor + ld["bytes"] / ld["raw_gbps"] / 1e9) / floor
            print(f"        ours: load {ld['gbps']:.2f} GB/s in the reader; on its core just after, raw get "
                  f"{ld['raw_gbps']:.2f} GB/s, into {ld['ranges_per_chunk']:.0f} ranges per chunk "
                  f"{ld['raw_ranges_gbps']:.2f}; floor + raw read of the same bytes = "
                  f"x{row['ours_raw_bound_vs_floor']:.2f}"
                  " floor", flush=True)
        if "queue_s" in row.get("ours_load", {}) and "floor_times" in row:
            ld, fl = row["ours_load"], row["floor_times"]
            print(f"        ours: queued {ld['queue_s'] * 1e3:.1f} ms (its load {ld['seconds'] * 1e3:.1f}), "
                  "scheduled to "
                  f"first token {ld['prefill_s'] * 1e3:.1f}; floor: queued {fl['queue_s'] * 1e3:.1f}, scheduled to "
                  f"first token {fl['prefill_s'] * 1e3:.1f} (vLLM's request times)", flush=True)
        if row.get("ours_load", {}).get("threads"):
            ld = row["ours_load"]
            print(f"        ours: reader's CPU over the hit's request (load {ld['seconds'] * 1e3:.0f} ms): "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in list(ld["threads"].items())[:6]), flush=True)
            print("        other processes' CPU over it: " + ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in list(ld.get("others", {}).items())[:8]), flush=True)
        if "minflt" in row.get("ours_load", {}):
            ld = row["ours_load"]
            print(f"        ours: load {ld['gbps']:.2f} GB/s, {ld['ranges_per_chunk']:.1f} ranges per chunk; reader's "
                  f"page faults {ld['minflt']:.0f} minor, {ld['majflt']:.0f} major; host "
                  + ", ".join(f"{k} {ld[k]:.0f}" for k in VMSTAT), flush=True)
    return rows


def run_section(dep, model: str, base_url: str, base, master: str, out: Path, prefixes: list[int], reps: int,
                rng: random.Random, check: Checker, long: list[str], lmc_python: str | None,
                previous_path: bool = True, probe: bool = True) -> list[dict]:
    """Start our writer and reader on ``master`` (and the previous-path reader unless
    ``previous_path`` is off, LMCache's server, writer and reader when ``lmc_python`` names
    its venv's python), wait for them and the no-connector engine ``base`` at ``base_url``,
    and run :func:`store_hit` (with the raw probe unless ``probe`` is off). The suite stops
    the engines this section started."""
    print("[bench] store_hit: starting writers (core 0) and readers (core 1)", flush=True)
    specs = {"ours": [("store-writer", 0, store_config(master)), ("store-reader", 1, store_config(master))]}
    if previous_path:
        specs["previous"] = [("store-reader-previous", 1, store_config(master, **PREVIOUS_LOAD_PATH))]
    if lmc_python:
        _, port = lmcache_peer.start_server(out / "logs", l1_gb=2, track=dep.track)
        kv, peer = lmcache_peer.kv_config(port), {"python": lmc_python, "env": lmcache_peer.ENV}
        specs["lmcache"] = [("lmcache-writer", 0, kv, peer), ("lmcache-reader", 1, kv, peer)]
    started = iter(start_engines(dep, model, [s for group in specs.values() for s in group], extra=long))
    engines = {name: tuple(next(started) for _ in group) for name, group in specs.items()}
    previous = engines.pop("previous", [None])[0]
    dep.wait_http(base_url, base)
    print(f"[bench] store_hit: TTFT of a prompt whose prefix another engine stored ({reps} reps):", flush=True)
    return store_hit(base_url, {k: (w[0], r[0]) for k, (w, r) in engines.items()}, prefixes, reps, rng, check,
                     reader_pid=engines["ours"][1][1].popen.pid,
                     probe=(lambda n, b, r: raw_probe.run(master, n, b, core=1, ranges=r)) if probe else None,
                     also_read={"previous": ("ours", previous[0])} if previous is not None else None)
