"""Benchmarks against the peers: one command, side by side, with plots (not a test).

    make bench                      # == .venv/bin/python -m bench.suite (from the repository root)
    .venv/bin/python bench/suite.py [--quick] [--reps N] [--sections store_hit,ssd_hit,pd,composite,raw]

On the ``small`` model, engines pinned one per core (writers and prefill on core 0,
readers, decode and the single-instance baseline on core 1), in one invocation:

1. store_hit: TTFT of a prompt whose prefix another engine stored, read by an engine
   that never saw it: this project's ``StoreConnector`` (Mooncake on loopback) and
   LMCache in multi-process mode (``lmcache server`` + ``LMCacheMPConnector``), against
   vLLM's own prefix-cache hit on one engine (the floor) and a miss (the ceiling). A
   second reader of ours, on the store tier's load path before issue 17
   (``PREVIOUS_LOAD_PATH``), reads the same stored prefixes, taking turns with the first
   (``bench/store_hit.py``).
   ssd_hit: the same read from chunks Mooncake offloaded to disk (``bench/ssd_hit.py``),
   against their DRAM copies and a miss.
2. pd: decode-side TTFT and total time of 1P1D (``P2PConnector`` through
   ``mctier proxy``) against one instance doing both, and the share of TTFT the
   Transfer Engine read takes.
3. composite: ``TieredConnector`` against vLLM's stock ``MultiConnector`` over this
   project's two tiers, half of each prompt already in the store.
4. raw: each tier's throughput against the raw Mooncake API on the same bytes
   (``bench/store_bench.py`` and ``bench/p2p_bench.py``).

Repetitions are interleaved (the order of configurations rotates), each uses fresh
random prompts, and every figure is a median with its min..max. Greedy token ids
are compared across configurations (the first repetition is a check and warm-up,
not timed): whatever a configuration loaded, its tokens must be those of one
no-connector engine that computed the same split (prefix from its own prefix cache,
the rest in one pass), and a store writer's those of a cold run. Writes
``bench.json``, ``bench.png`` and ``bench.md`` to ``--out``; stops every process it
started, also on Ctrl-C. Exit status 1 if tokens differed anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import lmcache_peer, ssd_hit, store_hit  # noqa: E402
from bench.client import complete, ids, stream  # noqa: E402
from bench.common import Checker, long_context_args, machine, model_dir, output_dir, rotated, spread, term_as_interrupt  # noqa: E402
from bench.engine_metrics import new_plans, settle_metric  # noqa: E402
from bench.report import plot, publish, render_markdown, render_table  # noqa: E402
from bench.store_hit import CHUNK, MAX_TOKENS, SETTLE_S, SUFFIX, store_config  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment, metrics, tiered_config  # noqa: E402

SECTIONS = ("store_hit", "ssd_hit", "pd", "composite", "raw")
PD_MAX_TOKENS = 32   # generated per P/D request: "total time" includes decoding
BLOCK = 32
# A decode instance that receives a whole prompt recomputes only its last token (vLLM's
# scheduler does num_computed_tokens = N - 1). A no-connector reference reproduces that
# exact split only when N - 1 is a whole number of blocks, so P/D prompts are 32k + 1 tokens.
# (bf16 on this deliberately sensitive model: another split may flip a near-tie greedy token.)
PD_LENGTHS = {"quick": [513, 2049], "full": [513, 1025, 2049, 4097, 8001]}
# Whole 256-token chunks (both stores hit whole chunks only, so a prefix that ends mid-chunk
# makes the reader recompute up to 255 tokens more than the floor: 32,736 tokens cost 6.2x the
# floor, 32,512 the same chunks without that tail).
PREFIXES = {"quick": [512, 2048], "full": [512, 1024, 2048, 4096, 7936, 16384, 32512]}
SSD_PREFIXES = {"quick": [2048], "full": [4096, 7936]}


def p2p_config(role: str, bootstrap_port: int) -> dict:
    return {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": role,
            "kv_connector_extra_config": {"bootstrap_port": bootstrap_port}}


def stock_config(role: str, master: str, bootstrap_port: int) -> dict:
    """vLLM's MultiConnector over this project's tiers, P2P first (the documented Mooncake pairing)."""
    store_role = "kv_both" if role == "kv_producer" else "kv_consumer"
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [
                p2p_config(role, bootstrap_port),
                {**store_config(master), "kv_role": store_role}]}}


# ---------------------------------------------------------------- sections



def pd(base: str, p_url: str, d_url: str, proxy: str, lengths: list[int], reps: int, rng: random.Random,
       check: Checker) -> list[dict]:
    rows = []
    for n in lengths:
        t = {k: [] for k in ("single_ttft", "single_total", "pd_ttft", "pd_total", "transfer", "handoff")}
        for rep in range(reps + 1):
            prompt = ids(n, rng)
            got = {}
            for who in rotated(["single", "pd"], rep):
                if who == "single":
                    got["single"] = stream(base, prompt, PD_MAX_TOKENS)
                else:
                    before = metrics(d_url)
                    got["pd"] = stream(proxy, prompt, PD_MAX_TOKENS)
                    xfer, cnt = settle_metric(d_url, "vllm:mctier_p2p_transfer_seconds", before)
                    hand, _ = settle_metric(d_url, "vllm:mctier_p2p_handoff_seconds", before)
                    got["xfer"] = xfer if cnt == 1 else None
                    got["hand"] = hand if cnt == 1 else None
            # Same split as D: the prompt computed cold (the single run above), then its last token alone.
            ref = stream(base, prompt, PD_MAX_TOKENS)
            check.same("pd", "reference cached tokens", n, [ref.cached], [n - 1])
            check.same("pd", "1P1D vs single instance (same split)", n, got["pd"].token_ids, ref.token_ids)
            if rep == 0:
                continue
            t["single_ttft"].append(got["single"].ttft)
            t["single_total"].append(got["single"].total)
            t["pd_ttft"].append(got["pd"].ttft)
            t["pd_total"].append(got["pd"].total)
            if got["xfer"] is not None:
                t["transfer"].append(got["xfer"])
                t["handoff"].append(got["hand"])
        med = {k: spread(v) for k, v in t.items() if v}
        share = (med["transfer"]["median"] / med["pd_ttft"]["median"]) if "transfer" in med else None
        rows.append({"prompt_tokens": n, "max_tokens": PD_MAX_TOKENS, **med, "kv_move_share_of_ttft": share,
                     "pd_vs_single_ttft": med["pd_ttft"]["median"] / med["single_ttft"]["median"],
                     "pd_vs_single_total": med["pd_total"]["median"] / med["single_total"]["median"]})
        print(f"  {n:>5} tokens  single TTFT {med['single_ttft']['median'] * 1e3:6.0f} ms total "
              f"{med['single_total']['median'] * 1e3:6.0f} ms   1P1D TTFT {med['pd_ttft']['median'] * 1e3:6.0f} ms "
              f"total {med['pd_total']['median'] * 1e3:6.0f} ms   KV move "
              + (f"{share:.1%} of TTFT" if share is not None else "n/a"), flush=True)
    return rows


def reference(base: str, prompt: list[int], splits: list[int], max_tokens: int) -> tuple[list[int], int, int]:
    """What one no-connector engine gives after computing ``prompt[:s]`` for each split first,
    i.e. the same computation split as a connector that loaded those ranges: (tokens,
    cached tokens it had, cached tokens it should have had)."""
    for s in splits:
        complete(base, prompt[:s], 1)
    r = stream(base, prompt, max_tokens)
    want = min(max(splits, default=0) // BLOCK * BLOCK, (len(prompt) - 1) // BLOCK * BLOCK)
    return r.token_ids, r.cached, want


def composite(base: str, pairs: dict[str, tuple[str, str, str]], lengths: list[int], reps: int,
              rng: random.Random, check: Checker) -> list[dict]:
    """``pairs``: name -> (prefill URL, decode URL, proxy URL)."""
    rows = []
    for n in lengths:
        t: dict[str, list[float]] = {k: [] for k in pairs}
        plans: dict[str, list[str]] = {k: [] for k in pairs}
        for rep in range(reps + 1):
            for name in rotated(list(pairs), rep):
                p_url, d_url, proxy = pairs[name]
                half = n // 2 // CHUNK * CHUNK
                prompt = ids(n, rng)
                # The prefill instance stores the first half. One token more, so that the reference
                # below can repeat this exact pass (same shapes, same bf16 rounding).
                complete(p_url, prompt[:half + 1], 1)
                time.sleep(SETTLE_S)
                before = metrics(d_url)
                r = stream(proxy, prompt, MAX_TOKENS)
                plan = new_plans(metrics(d_url), before)
                if rep == 0:
                    # The stock pair always pulls the whole prompt (P2P is its first child).
                    pulled = name == "stock" or any("p2p" in x for x in plan)
                    splits = [half + 1, n] if pulled else [half + 1] if any("store" in x for x in plan) else []
                    want, cached, should = reference(base, prompt, splits, MAX_TOKENS)
                    check.same("composite", f"{name} reference cached tokens", n, [cached], [should])
                    check.same("composite", f"{name} ({'+'.join(plan) or 'p2p'}) vs same-split reference", n,
                               r.token_ids, want)
                    continue
                t[name].append(r.ttft)
                plans[name].append("+".join(plan) or "-")
        med = {k: spread(v) for k, v in t.items()}
        rows.append({"prompt_tokens": n, "store_tokens": n // 2 // CHUNK * CHUNK, "ttft": med, "plans": plans,
                     "tiered_vs_stock": med["tiered"]["median"] / med["stock"]["median"]})
        print(f"  {n:>5} tokens  tiered {med['tiered']['median'] * 1e3:6.0f} ms  stock "
              f"{med['stock']['median'] * 1e3:6.0f} ms  ratio {rows[-1]['tiered_vs_stock']:.2f}  "
              f"tiered plans {plans['tiered']}", flush=True)
    return rows


def raw(out: Path, quick: bool) -> dict:
    """The tier-vs-raw benchmarks, each in its own process (they start their own cluster / producer)."""
    res = {}
    print("[bench] raw: each tier against the raw Mooncake API on the same bytes", flush=True)
    store_args = ["--chunks", "32", "--reps", "3", "--lookups", "200"] if quick else ["--reps", "7"]
    p2p_args = ["--throughput-blocks", "512", "--reps", "3"] if quick else ["--reps", "7"]
    for name, script, args in (("store", "store_bench.py", store_args), ("p2p", "p2p_bench.py", p2p_args)):
        path = out / f"raw_{name}.json"
        path.unlink(missing_ok=True)
        print(f"  {script} {' '.join(args)}", flush=True)
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--json", str(path)],
                              cwd=str(ROOT), capture_output=True, text=True, timeout=1800)
        (out / "logs" / f"raw_{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        res[name] = json.loads(path.read_text())
        print("    " + proc.stdout.strip().replace("\n", "\n    "), flush=True)
    return res


# ---------------------------------------------------------------- orchestration

def run(a: argparse.Namespace) -> int:
    sections = [s for s in a.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    quick = a.quick
    reps = a.reps or (1 if quick else 5)
    prefixes = [int(x) for x in a.prefixes.split(",")] if a.prefixes else PREFIXES["quick" if quick else "full"]
    ssd_prefixes = ([int(x) for x in a.ssd_prefixes.split(",")] if a.ssd_prefixes
                    else SSD_PREFIXES["quick" if quick else "full"])
    # The store-hit engines and the reference take the longest prompt (its suffix and output too).
    long = long_context_args(max(prefixes + ssd_prefixes) + SUFFIX + MAX_TOKENS + 64)
    lengths = PD_LENGTHS["quick" if quick else "full"]
    out = output_dir(a.out)
    model = model_dir("small")
    lmc_python = None
    if "store_hit" in sections and not a.no_lmcache:
        lmc_python = str(lmcache_peer.ensure_venv())
    rng = random.Random(a.seed)
    check = Checker()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(model), "model": "small",
                    "quick": quick, "reps": reps, "sections": sections,
                    "lmcache": lmcache_peer.version() if lmc_python else None}
    dep = Deployment(out / "logs")
    errors: dict[str, str] = {}

    term_as_interrupt()
    t_start = time.monotonic()

    def section(name: str, fn) -> None:
        """Run one section; a failure is recorded and the next section still runs."""
        if name not in sections:
            return
        n0 = len(dep.procs)
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"[bench] {name} FAILED: {errors[name][:2000]}", flush=True)
        finally:
            dep.stop(dep.procs[n0:])

    def pair(p_cfg, d_cfg, boot: int) -> tuple[str, str, str]:
        return dep.pd_pair(model, p_cfg(boot), d_cfg(free_port()), boot)

    def run_store_hit() -> list[dict]:
        return store_hit.run_section(dep, model, base_url, base, master, out, prefixes, reps, rng, check, long,
                                     lmc_python, previous_path=not a.no_previous_path, probe=not a.no_raw_probe)

    def run_ssd_hit() -> list[dict]:
        print("[bench] ssd_hit: starting an SSD-offload store, a writer (core 0) and a reader (core 1)", flush=True)
        dep.wait_http(base_url, base)
        return ssd_hit.run_section(dep, model, base_url, out, ssd_prefixes, reps, store_config, long, rng, check,
                                   CHUNK, SUFFIX, MAX_TOKENS)

    def run_pd() -> list[dict]:
        print("[bench] pd: starting a P2PConnector prefill (core 0) and decode (core 1) behind mctier proxy",
              flush=True)
        p_url, d_url, proxy = pair(lambda b: p2p_config("kv_producer", b), lambda b: p2p_config("kv_consumer", b),
                                   free_port())
        dep.wait_http(base_url, base)
        print(f"[bench] pd: 1P1D through the proxy vs one instance ({reps} reps):", flush=True)
        return pd(base_url, p_url, d_url, proxy, lengths, reps, rng, check)

    def run_composite() -> list[dict]:
        print("[bench] composite: starting TieredConnector and stock MultiConnector pairs", flush=True)
        # Each bootstrap port is picked right before its pair starts: engines that are
        # starting bind ports of their own, and one of them could take a port picked earlier.
        pairs = {"tiered": pair(lambda b: tiered_config("kv_producer", master, b),
                                lambda b: tiered_config("kv_consumer", master, b), free_port())}
        pairs["stock"] = pair(lambda b: stock_config("kv_producer", master, b),
                              lambda b: stock_config("kv_consumer", master, b), free_port())
        dep.wait_http(base_url, base)
        print(f"[bench] composite: decode-side TTFT, half of the prompt in the store ({reps} reps):", flush=True)
        return composite(base_url, pairs, [n for n in lengths if n >= 1024] or lengths, reps, rng, check)

    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=4 << 30).start()
        master = dep.cluster.master_addr
        # The no-connector engine starts with the first section's engines (each section waits
        # for it before its first request): started alone it leaves a core idle for ~25 s.
        base_url, base = dep.engine("base", model, 1, None, extra=long)
        section("store_hit", run_store_hit)
        section("ssd_hit", run_ssd_hit)
        section("pd", run_pd)
        section("composite", run_composite)
    except KeyboardInterrupt:
        print("\n[bench] interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        dep.stop()
    section("raw", lambda: raw(out, quick))
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    result["seconds"] = round(time.monotonic() - t_start)
    result["token_checks"] = check.checked
    result["token_mismatches"] = check.mismatches
    result["errors"] = errors
    result["pids"] = sorted(set(dep.started))
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    table = render_table(result)
    print("\n" + table)
    (out / "bench.md").write_text(render_markdown(result))
    plot(result, out / "bench.png")
    if a.publish:
        docs = ROOT / "docs" / "benchmarks"
        publish(result, out, docs / "store-hit.md", docs / "bench-latest.png")
        print("[bench] docs/benchmarks/store-hit.md latest table and docs/benchmarks/bench-latest.png updated")
    print(f"\n[bench] {check.checked} token comparisons, {len(check.mismatches)} mismatches; "
          f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} ({result['seconds']} s)")
    for name, err in errors.items():
        print(f"[bench] section {name} failed: {err.splitlines()[0][:300]}", file=sys.stderr)
    return 1 if check.mismatches or errors else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced matrix (2 lengths, 1 timed repetition)")
    ap.add_argument("--reps", type=int, help="timed repetitions per cell (default 5, quick 1)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--prefixes", help="store_hit prefix lengths, comma-separated (default 512,1024,2048,4096,7936,"
                                       "16384,32512; quick 512,2048); past the model's 8,192 positions the engines get "
                                       "--hf-overrides")
    ap.add_argument("--ssd-prefixes", help="ssd_hit prefix lengths, comma-separated whole chunks of 256 tokens "
                                           "(default 4096,7936; quick 2048)")
    ap.add_argument("--no-lmcache", action="store_true",
                    help="leave LMCache out of store_hit (recorded in the JSON and the table)")
    ap.add_argument("--no-previous-path", action="store_true",
                    help="store_hit: leave out the reader on the store tier's load path before issue 17 "
                         "(PREVIOUS_LOAD_PATH: no host staging, loads always in the background, no pause at empty "
                         "steps, load thread at nice 0)")
    ap.add_argument("--no-raw-probe", action="store_true",
                    help="leave out the raw get on the reader's core after each of our store hits (bench/raw_probe.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--publish", action="store_true",
                    help="write the table and plot into docs/benchmarks/store-hit.md (between its bench markers)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
