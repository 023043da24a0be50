"""Store hits wherever a shared prefix ends (not a test): the store tier against vLLM's own
prefix cache (the floor) and against the raw Mooncake get of the bytes each hit loads, through
``StoreConnector`` and through a ``TieredConnector``, side by side in one run.

    .venv/bin/python -m bench.store_divergence [--quick] [--prefixes 2048,4096,8192,16384,32768]
        [--reps 3] [--arm NAME=JSON ...] [--no-tiered] [--reserve-core]   (``make bench`` runs it)

A Mooncake master and store server on loopback and, on the ``small`` model: a writer W
(``StoreConnector``, ``kv_producer``: it saves and never looks up, so its prefix-cache hits
carry no store lookup) on core 0; readers S (``StoreConnector``) and T (``TieredConnector``
with the store tier alone, its store plan forced with ``kv_source=store``), both
``kv_consumer`` (they never write) on core 1, in dev mode (``/reset_prefix_cache``). Per prefix length ``L`` and repetition, W
computes a fresh prompt ``P`` of ``L + r`` tokens (``r`` uniform in 32..255, so ``P`` ends inside
a chunk at least one block in; its time is the miss, the ceiling) and saves it; once the store holds all of it, the
objects it holds for ``P`` are counted (whole chunks, part objects, directory entries; before
key version 4 the store kept whole chunks only, ``floor(L / 256)``). Then three prompts that
share a prefix with ``P``:

- ``aligned``: ``P[:L]`` plus one new block (the prefix ends at a chunk boundary: the store's
  best case, and all it served before key version 4);
- ``divergent``: ``P[:D]`` plus one new block, ``D`` uniform in ``[L - 256 + 32, L)``: the prefix ends at
  a random offset inside a chunk, at least one block into it (a shorter reach past the last
  whole chunk adds no block to ``aligned``'s), as a shared system prompt or document does;
- ``next_turn``: ``P`` plus one new block: a conversation's next turn extends the prompt.

Each is read by S and by T in turns (order rotating; each reader's prefix cache emptied first,
so that what it reuses comes from the store). Right after S's hit, S serves the same shared
prefix with another new block: its own prefix-cache hit on what it just loaded, the same split
on the same core, which is **the floor** (it includes S's store lookup, which finds nothing to
add: up to three master round trips, about a millisecond). Then a plain process on core 1 reads
the bytes S loaded with the raw Mooncake get (:mod:`bench.raw_probe`, one object per chunk): a
hit's time beyond the floor is set against that read. Then W serves the readers' prompt from
its own prefix cache (W computed ``P``): the reference for the greedy token ids of both
readers' hits (the same split: equal cached tokens, also checked), and a second floor on
another core. ``--arm NAME=JSON`` adds a ``StoreConnector`` reader ``NAME`` on core 1 with
those settings (e.g. ``{"layerwise_load": true}``), read in turn with the others, with its own
floor (its own prefix-cache hit) and a row of its own per case; ``--no-tiered`` leaves T out.
``--reserve-core``: every engine started on both cores with only its forward bound, the
writer's too, to core 1 (:func:`bench.common.engine_cpus`, :func:`bench.common.forward_core`:
vLLM's layout with a reserved core), so that a reader with ``io_cpus: auto`` (an ``--arm``
setting; the store tier's default is ``none``) puts its I/O threads, and Mooncake's, on core 0,
where no forward runs; the raw get then runs on core 0 too
(the floor is the same reader's own hit: the same layout). Also per hit: S's store lookup time
(``vllm:mctier_store_lookup_seconds``) and
the tokens it loaded. The exit status is 1 if any token differed. Writes
``store_divergence.json`` and ``store_divergence.md`` (the table) to ``--out`` (default
``bench/results/store_divergence``). ``--quick``: one 1,024-token length, one repetition
(``make test-bench``'s check).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import raw_probe  # noqa: E402
from bench.client import ids, reset_prefix_cache, stream  # noqa: E402
from bench.common import (  # noqa: E402
    QUIET_S,
    RESERVE_CORE_HELP,
    Checker,
    commit,
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
from bench.store_hit import CHUNK, SUFFIX  # noqa: E402
from bench.store_lookup import lookup_times  # noqa: E402
from bench.store_phases import settings  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

CASES = ("aligned", "divergent", "next_turn")
READERS = ("store", "tiered")
MAX_TOKENS = 4
BLOCK = 32
DEV_MODE = {"env": {"VLLM_SERVER_DEV_MODE": "1"}}  # the readers' /reset_prefix_cache


def store_config(master: str, role: str, **extra) -> dict:
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, "chunk_tokens": CHUNK, **extra}}


def tiered_config(master: str) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": CHUNK}}}


def prompts(p: list[int], n_pfx: int, rng: random.Random) -> dict[str, tuple[list[int], list[int], int]]:
    """Per case: the readers' prompt, a second one with the same shared prefix and another new
    block (for the reader's own prefix-cache hit), and how many tokens of them a prefix cache
    holding ``p`` reuses (the shared prefix's whole blocks)."""
    d = n_pfx - CHUNK + rng.randrange(BLOCK, CHUNK)  # at least one block past the whole chunks
    out = {"aligned": (p[:n_pfx], n_pfx), "divergent": (p[:d], d), "next_turn": (p, len(p))}
    return {case: (shared + ids(SUFFIX, rng), shared + ids(SUFFIX, rng), n // BLOCK * BLOCK)
            for case, (shared, n) in out.items()}


class StoreWatch:
    """The store as the bench sees it: when a prompt is all stored (the engine's own lookup,
    :mod:`mcstore.lookup`, in the key space the engines published) and its objects."""

    def __init__(self, cluster):
        from mcstore.admin import MasterAdmin
        from mcstore.client import StoreClient

        self.admin = MasterAdmin(f"http://{cluster.host}:{cluster.metrics_port}")
        self.client = StoreClient.for_tool(cluster.master_addr, "bench-watch")
        self._ks = None

    def key_space(self):
        if self._ks is None:
            from mcstore.keys import EngineMeta

            metas = [self.client.read(k, EngineMeta) for k in self.admin.all_keys() if k.endswith("/meta")]
            (meta,) = {m.fingerprint: m for m in metas if m is not None}.values()
            self._ks = meta.key_space()
        return self._ks

    def objects(self, prompt: list[int]) -> dict[str, int]:
        """The objects the store holds for ``prompt`` alone: its whole chunks' parts, its tail's
        parts (a part object) and the directory entries of both."""
        ks = self.key_space()
        hs = ks.hashes(prompt)
        links = ks.links_from_block_hashes(hs, len(prompt))
        tail = len(hs) - len(links) * ks.chunk_blocks
        kinds = {"chunks": ks.all_rank_keys(links),
                 "parts": ks.all_rank_keys([ks.part_link(hs[-1], tail)]) if tail else [],
                 "directories": [ks.dir_key(hs[i]) for i in range(0, len(hs), ks.chunk_blocks)]}
        return {k: sum(rc == 1 for rc in self.client.exists(keys)) for k, keys in kinds.items()}

    def wait_stored(self, prompt: list[int], timeout: float = 120.0) -> float:
        """Seconds until the store's reach of ``prompt`` covers its full blocks."""
        from mcstore.lookup import Probe, reach

        ks, t0 = self.key_space(), time.monotonic()
        want = len(prompt) // ks.block_tokens * ks.block_tokens
        while reach(self.client, Probe(ks, ks.hashes(prompt), len(prompt))).tokens < want:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the writer's {len(prompt)}-token prompt not stored within {timeout:.0f} s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        self.client.close()


def _hit_metrics(url: str, m0: dict) -> dict:
    """What the reader's store tier recorded for the one hit since ``m0``."""
    deadline = time.monotonic() + 5
    while True:
        d = moved(scrape(url), m0)
        if get(d, "vllm:mctier_store_load_seconds_count") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    n_lookups = get(d, "vllm:mctier_store_lookup_seconds_count")
    return {"loaded_tokens": get(d, "vllm:mctier_store_loaded_tokens_total"),
            "loaded_bytes": get(d, "vllm:mctier_store_loaded_bytes_total"),
            "partial_tokens": get(d, "vllm:mctier_store_partial_hit_tokens_total"),
            "load_s": get(d, "vllm:mctier_store_load_seconds_sum"),
            "lookup_s": get(d, "vllm:mctier_store_lookup_seconds_sum") / n_lookups if n_lookups else None,
            "failures": get(d, "vllm:mctier_store_failures_total"),
            "sync_loads": get(d, "vllm:mctier_store_loads_total", kind="sync"),
            "layer_wait_s": get(d, "vllm:mctier_store_phase_seconds_sum", phase="load_layer_wait")}


def run(a: argparse.Namespace) -> int:
    out = output_dir(a.out)
    model = model_dir("small")
    rng = random.Random(a.seed)
    check = Checker()
    dep = Deployment(out / "logs")
    prefixes = [int(x) for x in a.prefixes.split(",")]
    long = long_context_args(max(prefixes) + 2 * CHUNK + SUFFIX)
    arms = {"store": {}, **settings(a.arm, "--arm")}  # the StoreConnector readers: name -> their settings
    cpus = engine_cpus(a.reserve_core)
    io_core = 0 if a.reserve_core else 1  # where the readers' I/O threads run: the raw get's core
    rows, watch, per_rep = [], None, []
    term_as_interrupt()
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=a.segment_gb << 30).start()
        master = dep.cluster.master_addr
        lookups = lookup_times(dep.cluster, a.lookups) if a.lookups else {}
        specs = [("div-writer", forward_core(0, a.reserve_core), store_config(master, "kv_producer"), cpus)]
        specs += [(f"div-{name}", 1, store_config(master, "kv_consumer", **extra), {**DEV_MODE, **cpus})
                  for name, extra in arms.items()]
        if a.tiered:
            specs.append(("div-tiered", 1, tiered_config(master), {**DEV_MODE, **cpus}))
        (w_url, _), *started = start_engines(dep, model, specs, extra=long)
        readers = {name: url for name, (url, _) in zip([*arms, *(["tiered"] if a.tiered else [])], started)}
        watch = StoreWatch(dep.cluster)
        for n_pfx in prefixes:
            per: dict[str, list[dict]] = {c: [] for c in CASES}
            objects, misses = [], []
            for rep in range(a.reps + 1):  # the first is a warm-up, not in the figures
                p = ids(n_pfx + rng.randrange(BLOCK, CHUNK), rng)  # next_turn: a block past the chunks, as above
                miss = stream(w_url, p, 1)
                watch.wait_stored(p)
                objs = watch.objects(p)
                for case, (q, q_own, floor_cached) in prompts(p, n_pfx, rng).items():
                    res: dict = {"prompt_tokens": len(q), "expected_cached": floor_cached}
                    for who in rotated(list(readers), rep):
                        reset_prefix_cache(readers[who])  # what an earlier case left: a store hit, not a local one
                        time.sleep(QUIET_S)  # the other readers on this core go quiet
                        m0 = scrape(readers[who])
                        got = stream(readers[who], q, MAX_TOKENS, kv={"kv_source": "store"} if who == "tiered" else None)
                        res[who] = {"ttft_s": got.ttft, "cached": got.cached, **_hit_metrics(readers[who], m0)}
                        res[f"{who}_tokens"] = got.token_ids
                        if who in arms:
                            # The floor on the reader's own core: its prefix cache now holds what it
                            # loaded, and q_own shares exactly that with q (another new block after it).
                            time.sleep(QUIET_S)
                            own = stream(readers[who], q_own, MAX_TOKENS)
                            res[who].update(own_ttft_s=own.ttft, own_cached=own.cached)
                    if rep and a.raw_probe and res["store"]["loaded_bytes"] > 0:
                        time.sleep(QUIET_S)
                        chunks = max(1, round(res["store"]["loaded_tokens"] / CHUNK))
                        pr = raw_probe.run(master, chunks, int(res["store"]["loaded_bytes"] // chunks), core=io_core)
                        res["raw_gbps"] = statistics.median(pr["gbps"])
                        res["raw_get_s"] = res["store"]["loaded_bytes"] / res["raw_gbps"] / 1e9
                    time.sleep(QUIET_S)
                    floor = stream(w_url, q, MAX_TOKENS)
                    res["writer"] = {"ttft_s": floor.ttft, "cached": floor.cached}
                    for who in readers:
                        if who in arms:
                            check.same("store_divergence", f"{case}: {who} reader's own prefix-cache hit's cached "
                                       "tokens", len(q), [res[who]["own_cached"]], [floor.cached])
                        check.same("store_divergence", f"{case}: {who} hit vs the floor (prefix-cache hit)", len(q),
                                   res.pop(f"{who}_tokens"), floor.token_ids)
                        check.same("store_divergence", f"{case}: {who} hit's cached tokens, the floor's", len(q),
                                   [res[who]["cached"]], [floor.cached])
                    if rep:
                        per[case].append(res)
                if rep:
                    objects.append(objs)
                    misses.append(miss.ttft)
            per_rep.append({"prefix_tokens": n_pfx, "cases": per})
            for arm in arms:
                for case in CASES:
                    rows.append(summarise(n_pfx, case, arm, per[case], objects, misses))
                    _print(rows[-1])
    finally:
        if watch is not None:
            watch.close()
        dep.stop()
    result = {"machine": machine(model), "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
              "commit": commit(), "reps": a.reps, "chunk_tokens": CHUNK, "reserve_core": a.reserve_core,
              "arms": arms, "rows": rows, "per_rep": per_rep, "lookups": lookups, "pids": sorted(set(dep.started))}
    (out / "store_divergence.md").write_text(table(rows, result))
    print("\n" + table(rows, result))
    return check.write(out / "store_divergence.json", result, "store_divergence")


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(n_pfx: int, case: str, arm: str, reps: list[dict], objects: list[dict], misses: list[float]) -> dict:
    """One row: reader ``arm``'s hit of ``case`` against its own prefix-cache hit (the floor) and
    the raw get; the composite's columns on the ``store`` reader's row only."""
    def m(who, key):
        return _med(r[who][key] for r in reps) if who in reps[0] else None

    tiered = arm == "store" and "tiered" in reps[0]
    floor, s, t = m(arm, "own_ttft_s"), m(arm, "ttft_s"), m("tiered", "ttft_s") if tiered else None
    beyond = _med(r[arm]["ttft_s"] - r[arm]["own_ttft_s"] for r in reps)
    raw = _med(r.get("raw_get_s") for r in reps)
    return {"prefix_tokens": n_pfx, "case": case, "reader": arm, "prompt_tokens": _med(r["prompt_tokens"] for r in reps),
            "floor_ttft_s": floor, "writer_ttft_s": m("writer", "ttft_s"), "store_ttft_s": s, "tiered_ttft_s": t,
            "miss_ttft_s": _med(misses), "writer_vs_floor": m("writer", "ttft_s") / floor if floor else None,
            "store_vs_floor": s / floor if s and floor else None, "tiered_vs_store": t / s if t and s else None,
            "floor_cached": m("writer", "cached"), "own_cached": m(arm, "own_cached"), "store_cached": m(arm, "cached"),
            "tiered_cached": m("tiered", "cached") if tiered else None, "partial_tokens": m(arm, "partial_tokens"),
            "loaded_bytes": m(arm, "loaded_bytes"), "load_s": m(arm, "load_s"), "layer_wait_s": m(arm, "layer_wait_s"),
            "lookup_s": m(arm, "lookup_s"), "tiered_lookup_s": m("tiered", "lookup_s") if tiered else None,
            "tiered_sync_loads": sum(r["tiered"]["sync_loads"] for r in reps) if tiered else None,
            "store_sync_loads": sum(r[arm]["sync_loads"] for r in reps),
            "failures": sum(r[arm]["failures"] + (r["tiered"]["failures"] if tiered else 0) for r in reps),
            "beyond_floor_s": beyond, "raw_get_s": raw, "raw_gbps": _med(r.get("raw_gbps") for r in reps),
            "beyond_vs_raw": beyond / raw if beyond is not None and raw else None,
            "objects": {k: _med(o[k] for o in objects) for k in ("chunks", "parts", "directories")},
            "objects_whole_chunks_only": n_pfx // CHUNK, "reps": len(reps)}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _c(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _print(r: dict) -> None:
    print(f"{r['prefix_tokens']:>6} {r['case']:>10} {r['reader']}: floor {_ms(r['floor_ttft_s'])} ms (the writer's "
          f"{_ms(r['writer_ttft_s'])}, cached {r['floor_cached']:.0f}), hit {_ms(r['store_ttft_s'])} ms "
          f"x{_x(r['store_vs_floor'])} (cached "
          f"{r['store_cached']:.0f}, {r['partial_tokens']:.0f} past the whole chunks), tiered "
          f"{_ms(r['tiered_ttft_s'])} ms x{_x(r['tiered_vs_store'])} of store | beyond the floor "
          f"{_ms(r['beyond_floor_s'])} ms, raw get of its {r['loaded_bytes'] / 1e6:.1f} MB {_ms(r['raw_get_s'])} ms "
          f"(x{_x(r['beyond_vs_raw'])}) | lookup {_ms(r['lookup_s'])} ms | objects {r['objects']} "
          f"(whole chunks only: {r['objects_whole_chunks_only']}) | miss {_ms(r['miss_ttft_s'])} ms", flush=True)


def table(rows: list[dict], result: dict) -> str:
    m = result["machine"]
    layout = ("engines started on every core, every forward bound to core 1 "
              "(--reserve-core: a reader's I/O on core 0 with io_cpus auto)"
              if result.get("reserve_core") else "engines pinned whole to one core each")
    arms = "; ".join(f"{k}: {json.dumps(v)}" for k, v in result.get("arms", {}).items() if v)
    head = (f"Run {result['date']}, commit {result.get('commit', '-')}, {m['cpu']} ({m['isa']}; engines in "
            f"{m['dtype']}), small model {m.get('model_shape')}, {result['reps']} repetitions (medians), "
            f"{result['chunk_tokens']}-token chunks, {layout}{'; readers ' + arms if arms else ''}.\n\n")
    cols = ["prefix", "reader", "case", "prompt", "floor ms", "writer's hit ms", "hit ms", "hit /floor", "tiered ms",
            "tiered /store",
            "cached floor / hit / tiered", "past whole chunks", "beyond floor ms", "raw get ms", "beyond /raw",
            "lookup ms", "objects (chunks+tails+dirs)", "before v4", "miss ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        o = r["objects"]
        lines.append("| " + " | ".join(str(x) for x in [
            r["prefix_tokens"], r["reader"], r["case"], f"{r['prompt_tokens']:.0f}", _ms(r["floor_ttft_s"]),
            _ms(r["writer_ttft_s"]), _ms(r["store_ttft_s"]),
            _x(r["store_vs_floor"]), _ms(r["tiered_ttft_s"]), _x(r["tiered_vs_store"]),
            f"{r['floor_cached']:.0f} / {r['store_cached']:.0f} / {_c(r['tiered_cached'])}",
            f"{r['partial_tokens']:.0f}", _ms(r["beyond_floor_s"]), _ms(r["raw_get_s"]), _x(r["beyond_vs_raw"]),
            _ms(r["lookup_s"]), f"{o['chunks']:.0f}+{o['parts']:.0f}+{o['directories']:.0f}",
            r["objects_whole_chunks_only"], _ms(r["miss_ttft_s"])]) + " |")
    tail = "".join(f"\nLookup of a {x['prompt_tokens']}-token prompt, {name} (the master alone, before the engines): "
                   f"p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms, {x['round_trips']} round trip(s)."
                   for name, x in result.get("lookups", {}).items())
    return head + "\n".join(lines) + "\n" + tail + ("\n" if tail else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="--prefixes 1024 --reps 1")
    ap.add_argument("--prefixes", default="2048,4096,8192,16384,32768",
                    help="prefix lengths in tokens (multiples of 256), comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per length (after one warm-up)")
    ap.add_argument("--no-raw-probe", dest="raw_probe", action="store_false",
                    help="leave out the raw get of each hit's bytes")
    ap.add_argument("--segment-gb", type=int, default=6, help="the store server's segment, GiB")
    ap.add_argument("--lookups", type=int, default=300,
                    help="lookups timed alone per kind before the engines start (0: none)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                    help="one more StoreConnector reader NAME with JSON added to its settings (its own floor), "
                         "e.g. 'layerwise={\"layerwise_load\": true}'")
    ap.add_argument("--no-tiered", dest="tiered", action="store_false",
                    help="leave out the TieredConnector reader")
    ap.add_argument("--reserve-core", action="store_true", help=RESERVE_CORE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "store_divergence"))
    a = ap.parse_args(argv)
    if a.quick:
        a.prefixes, a.reps, a.lookups = "1024", 1, 20
    if any(int(x) % CHUNK or int(x) < CHUNK for x in a.prefixes.split(",")):
        raise SystemExit(f"--prefixes must be positive multiples of {CHUNK}")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
