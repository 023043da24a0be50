"""The benchmark harness itself, so that it cannot rot: ``make test-bench``.

The tests marked ``bench_harness`` run the benchmark programs' reduced versions for real
(``bench.suite --quick``, ``bench.router_bench --quick``, ``bench.trace_replay --quick``,
``bench.tiered_bench --quick``, ``bench.store_streams --quick``, ``bench.no_reuse --quick``,
``bench.step_cost --quick``,
``bench.lookup_stall --quick``, ``bench.store_divergence --quick``,
``bench.hybrid_memory --quick``): a Mooncake master, the
store tier's writer and reader engines, LMCache's server and engines from their own
virtualenv, 1P1D pairs, the TieredConnector and stock MultiConnector pairs, routers, and the
raw-API benchmarks. They assert what the harness promises (every section and configuration
measured, greedy tokens identical across configurations, the outputs written, every process
it started gone afterwards), never how fast anything was. They take about 15 minutes here,
so ``make test`` deselects them (``-m "not bench_harness"``; pytest reports them as
deselected) to stay within CI's budget on the slower CPU class; ``make test-bench`` runs
them, and so does a plain ``pytest tests``. The raw probe's two tests below need no engine
and run in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import requests

from tests.harness import ROOT

# The first run also builds LMCache's virtualenv (a few minutes of downloads).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # One store-hit length (the quick default has two): every code path of the section runs
    # on each, and the check is one engine start shorter.
    proc = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--prefixes", "2048", "--out", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=2100)
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    return proc, out


@pytest.mark.bench_harness
def test_quick_bench_measures_every_section(quick):
    proc, out = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "bench.json").read_text())
    assert r["quick"] and r["sections"] == ["store_hit", "ssd_hit", "pd", "composite", "raw"]
    assert r["lmcache"] and r["lmcache"] != "unknown"
    assert [row["prefix_tokens"] for row in r["store_hit"]] == [2048]
    for row in r["store_hit"]:
        assert set(row["ttft"]) >= {"miss", "floor", "ours", "lmcache", "previous"}
        # Both stores served the whole shared prefix, and so did our store to the reader on the
        # previous load path: the cell compares hits, not misses.
        n = row["prefix_tokens"]
        assert row["hit_tokens"] == {"ours": n, "lmcache": n, "previous": n}
        assert row["previous_load"]["ranges_per_chunk"] >= 1 and row["previous_load"]["gbps"] > 0
        # Our reader's load, from its own metrics: at least one range per chunk (a KV region's
        # run of blocks), and a rate.
        assert row["ours_load"]["ranges_per_chunk"] >= 1 and row["ours_load"]["gbps"] > 0
        # The raw get of the same bytes on the reader's core, just after: a rate, and a
        # bound above the floor (the floor plus a read that takes time).
        assert row["ours_load"]["raw_gbps"] > 0 and row["ours_load"]["raw_ranges_gbps"] > 0
        assert row["ours_raw_bound_vs_floor"] > 1
        # vLLM's own times of our hit (queued through its load, then to the first token) and
        # of the floor's request.
        assert row["ours_load"]["queue_s"] > 0 and row["ours_load"]["prefill_s"] > 0
        assert row["floor_times"]["prefill_s"] > 0
    # The SSD row read the whole prefix from DRAM, and again after it was pushed to disk.
    assert [x["prefix_tokens"] for x in r["ssd_hit"]] == [2048]
    assert all(x["hit_tokens"] == {"dram": 2048, "ssd": 2048} and x["filler_mib"] > 0 and x["dram_resident_min"] == 1
               for x in r["ssd_hit"])
    assert [x["prompt_tokens"] for x in r["pd"]] == [513, 2049]
    assert all(x["transfer"]["n"] >= 1 and 0 < x["kv_move_share_of_ttft"] < 1 for x in r["pd"])
    assert r["composite"] and all(set(x["ttft"]) == {"tiered", "stock"} for x in r["composite"])
    assert r["raw"]["store"]["gbps"]["tier_load"] > 0 and r["raw"]["p2p"]["gbps"]["tier_transfer"] > 0


@pytest.mark.bench_harness
def test_quick_bench_checks_tokens_across_configurations(quick):
    _, out = quick
    r = json.loads((out / "bench.json").read_text())
    # store_hit: 1 length x 2 repetitions x (1 + 2 per store + the previous load path's reader);
    # ssd_hit: 1 x 2 x 3; pd: 2 x 2 x 2; composite: 1 x 2 x 2.
    assert r["token_checks"] >= 1 * 2 * 6 + 1 * 2 * 3 + 2 * 2 * 2 + 2 * 2
    assert r["token_mismatches"] == []


@pytest.mark.bench_harness
def test_quick_bench_writes_outputs_and_stops_everything(quick):
    _, out = quick
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    for title in ("Store-hit TTFT", "SSD-hit TTFT", "P/D handoff", "Composite vs stock", "Tier vs raw"):
        assert title in md
    r = json.loads((out / "bench.json").read_text())
    # base + 2 store engines + LMCache server and 2 engines + 2 SSD engines with their master and
    # store server + 3 P/D pairs with proxies + master + store server
    assert len(r["pids"]) >= 20
    assert [p for p in r["pids"] if not _gone(p)] == []
    # Each was a process-group leader: nothing it spawned (EngineCore, workers) is left either.
    leaders = set(r["pids"])
    left = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) in leaders and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    assert left == []


@pytest.mark.bench_harness
def test_router_bench_quick_reports_every_row(tmp_path):
    """``python -m bench.router_bench --quick --policies kv,round-robin``: the P/D deployment
    behind the kv and round-robin routers, the plain one behind both, the admission pair;
    every row measured with finite numbers, every request through the routers answered
    except the 429s of admission, every process gone. No assertion on speed. (The full run's
    least-outstanding router is one more ``--policy`` value through the same code; left out
    here to keep the check short.)"""
    import math

    proc = subprocess.run([sys.executable, "-m", "bench.router_bench", "--quick", "--policies", "kv,round-robin",
                           "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "router.json").read_text())
    got = sorted((x["workload"], x["deployment"], x["policy"], x["admission"]) for x in r["rows"])
    assert got == sorted([("prefix", "pd", p, False) for p in ("kv", "round-robin")]
                         + [("prefix", "plain", p, False) for p in ("kv", "round-robin")]
                         + [("admission", "pd", "kv", False), ("admission", "pd", "kv", True)])
    for x in r["rows"]:
        assert not x.get("skipped") and not x.get("error"), x
        for k in ("mean_ttft_ms", "p90_ttft_ms", "request_throughput", "output_throughput"):
            assert isinstance(x[k], (int, float)) and math.isfinite(x[k]) and x[k] >= 0, (x["name"], k, x[k])
        assert x["other_failures"] == 0, x
        assert x["completed"] + x["rejected_429"] == x["requests"] > 0, x
        assert x["completed"] > 0 and (x["rejected_429"] == 0 or x["admission"]), x
        if x["workload"] == "admission":
            assert 0 <= x["within_slo_share"] <= 1 and x["slo_s"] > 0 and x["rate"] > 0, x
    assert (tmp_path / "router.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "router.md").read_text()
    assert "Every run" in md and "Side by side" in md and "Admission above capacity" in md
    assert len(r["pids"]) >= 2 + 3 + 2 + 6  # store pair, A's engines, B's engines, a router per run
    assert [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_no_reuse_quick_measures_every_connector_beside_plain(tmp_path):
    """``python -m bench.no_reuse --quick``: one round of 16 prompts on a plain engine and on one
    with each connector; every run completed every request, the connectors' lookups ran (their
    counters), each connector has its ratios to plain, and every process is gone. No assertion
    on speed."""
    import math

    proc = subprocess.run([sys.executable, "-m", "bench.no_reuse", "--quick", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "no_reuse.json").read_text())
    assert r["arms"] == ["plain", "store", "p2p", "tiered"] and r["rounds"] == 1 and not r["errors"]
    for arm in r["arms"]:
        (row,) = r["results"][arm]
        assert row["completed"] == r["prompts"] == 16
        for k in ("p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "output_throughput"):
            assert math.isfinite(row[k]) and row[k] > 0, (arm, k, row[k])
        assert row["cpu_ms_per_request"]["worker"] > 0
        assert row["vllm_request_ms"]["prefill_s"] > 0 and row["vllm_request_ms"]["queue_s"] >= 0
        if arm != "plain":
            assert set(r["summary"][arm]["ratio"]) >= {"mean_tpot_ms", "p99_ttft_ms", "output_throughput"}
    for arm in ("store", "tiered"):  # their store lookups ran, one per request at least
        (row,) = r["results"][arm]
        assert sum(v for k, v in row["mctier_counters"].items() if k.startswith("store_lookups_total")) >= 16
    assert "TPOT / plain" in (tmp_path / "no_reuse.md").read_text()
    assert len(r["pids"]) >= 4 + 2 and [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_step_cost_quick_times_each_arm_in_turn_beside_plain_and_an_earlier_tree(tmp_path):
    """``python -m bench.step_cost --quick --arms plain,tiered --before DIR`` (DIR: an export of
    this tree): four rounds, each arm's two batches timed every round between plain runs, the ``-before`` arm's
    engine importing the connector from DIR, a ratio to plain per arm and batch, and every
    process gone. No assertion on speed."""
    import math
    import shutil

    before = tmp_path / "before"
    skip = shutil.ignore_patterns(".venv", ".cache", ".git", ".hypothesis", "results", "__pycache__")
    shutil.copytree(ROOT, before, ignore=skip)
    proc = subprocess.run([sys.executable, "-m", "bench.step_cost", "--quick", "--arms", "plain,tiered",
                           "--before", str(before), "--out", str(tmp_path / "out")],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "step_cost.json").read_text())
    assert r["arms"] == ["plain", "tiered", "tiered-before"] and r["rounds"] == 4 and not r["errors"]
    for batch in ("decode", "mixed"):
        for arm in r["arms"]:
            xs = r["results"][batch][arm]
            # plain: once at the start of each round and once after each of the two other arms
            assert len(xs) == (12 if arm == "plain" else 4), (batch, arm, xs)
            assert all(math.isfinite(x) and x > 0 for x in xs), (batch, arm, xs)
            if arm != "plain":
                assert len(r["ratios"][batch][arm]) == 4 and r["summary"][batch][arm]["ratio"]["median"] > 0
    logs = tmp_path / "out" / "logs"
    assert f"connector packages of {before}" in (logs / "tiered-before.log").read_text()
    assert f"connector packages of {ROOT}" in (logs / "tiered.log").read_text()
    assert len(r["pids"]) == 3 and [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_no_reuse_kept_up_runs_two_rounds_on_one_engine_per_arm_reset_between(tmp_path):
    """``python -m bench.no_reuse --quick --keep-up --rounds 2 --arms plain,store``: each arm's
    engine started once and kept for both rounds (one engine process per arm), every run
    complete, the store arm's lookups counted per run (the counters' difference, not their
    total), and its reset before round 1 removed round 0's saved chunks from the store (the
    engine's log). No assertion on speed."""
    import re

    proc = subprocess.run([sys.executable, "-m", "bench.no_reuse", "--quick", "--keep-up", "--rounds", "2",
                           "--arms", "plain,store", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "no_reuse.json").read_text())
    assert r["keep_up"] and r["rounds"] == 2 and not r["errors"]
    for arm in ("plain", "store"):
        assert [row["completed"] for row in r["results"][arm]] == [16, 16]
    for row in r["results"]["store"]:  # this run's lookups: 16 prompts, each looked up once or more
        assert 16 <= sum(v for k, v in row["mctier_counters"].items() if k.startswith("store_lookups_total")) < 48
    assert len(r["pids"]) == 2 + 2  # the master and store server, one engine per arm
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == ["plain.log", "store.log"]
    # Reset before each run: before round 0 the warm-up's chunk, before round 1 round 0's chunks.
    removed = [int(n) for n in re.findall(r"reset removed (\d+) object", (tmp_path / "logs" / "store.log").read_text())]
    assert len(removed) == 2 and removed[1] >= 16 > removed[0], removed
    assert [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_lookup_stall_quick_measures_every_mode_with_the_same_hits(tmp_path):
    """``python -m bench.lookup_stall --quick`` (32 arrivals, two repetitions, no engine): every
    lookup mode with the master idle and busy, each answering every request with the same hit
    tokens. No assertion on speed."""
    proc = subprocess.run([sys.executable, "-m", "bench.lookup_stall", "--quick", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "lookup_stall.json").read_text())
    cells = {(x["master"], x["arrivals"], x["mode"]) for x in r["rows"]}
    assert cells == {(m, 32, mode) for m in ("idle", "busy")
                     for mode in ("blocking", "non-blocking", "non-blocking, no wait")}
    assert len({tuple(x["hit_tokens_all"]) for x in r["rows"]}) == 1
    assert all(x["hit_tokens"] == 16 * (4 * 256 - 1) and x["steps"] >= 1 for x in r["rows"])


@pytest.mark.bench_harness
def test_lookup_stall_quick_with_partial_hits_finds_every_partial_hit_in_every_mode(tmp_path):
    """``--partial 0.25``: 8 of the 32 requests more are stored but their last chunk, of which a
    part object of 3 blocks found through its directory entry (the step's directory reads in one
    ``get_batch``): every mode answers every request with the same hit tokens, those 8 included."""
    proc = subprocess.run([sys.executable, "-m", "bench.lookup_stall", "--quick", "--partial", "0.25",
                           "--out", str(tmp_path)], cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "lookup_stall.json").read_text())
    assert len(r["rows"]) == 6 and len({tuple(x["hit_tokens_all"]) for x in r["rows"]}) == 1
    assert all(x["hit_tokens"] == 16 * (4 * 256 - 1) + 8 * (3 * 256 + 3 * 32) and x["timeouts"] == 0
               for x in r["rows"])


@pytest.mark.bench_harness
def test_store_streams_reads_with_each_load_kind_under_running_streams(tmp_path):
    """``python -m bench.store_streams --quick`` (one 512-token prefix, two streams, one
    repetition): the sync reader's load ran synchronously and the background reader's in the background
    (each reader's ``vllm:mctier_store_loads_total`` by kind, so each row is what its name
    says), both hits measured while both streams ran, their tokens equal to the writer's
    prefix-cache hit with the prefix cached, every process gone. No assertion on speed."""
    proc = subprocess.run([sys.executable, "-m", "bench.store_streams", "--quick", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "store_streams.json").read_text())
    rows = {x["reader"]: x for x in r["rows"]}
    assert sorted(rows) == ["background", "sync"]
    assert rows["sync"]["loads"] == {"sync": 1.0, "background": 0.0}, rows["sync"]
    assert rows["background"]["loads"] == {"sync": 0.0, "background": 1.0}, rows["background"]
    for x in rows.values():
        assert x["hit_ttft_s"] > 0 and x["own_ttft_s"] > 0 and x["before_tpot_p50_s"] > 0, x
        assert x["hit_max_gap_s"] > 0 and x["hit_tpot_p50_s"] > 0, x  # the streams ran through the hit
    # 2 repetitions (warm-up included) x 2 readers x 3 checks (vs the writer, vs the own hit, cached tokens)
    assert r["token_checks"] == 12 and r["token_mismatches"] == [], r["token_mismatches"]
    assert len(r["pids"]) == 2 + 3  # master, store server, writer, two readers
    assert [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_store_divergence_quick_measures_every_case_through_both_readers(tmp_path):
    """``python -m bench.store_divergence --quick`` (one 1,024-token length, one repetition):
    every case (a chunk-aligned prefix, one ending at a random offset inside a chunk, the next
    turn of the writer's prompt) read by the store tier and by the composite, each reaching what
    the floor's prefix cache reuses (its cached tokens, tokens equal), the raw get of the same
    bytes and the lookup time measured, objects per prompt counted, every process gone. No
    assertion on speed."""
    proc = subprocess.run([sys.executable, "-m", "bench.store_divergence", "--quick", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "store_divergence.json").read_text())
    assert [(x["prefix_tokens"], x["case"]) for x in r["rows"]] == [
        (1024, "aligned"), (1024, "divergent"), (1024, "next_turn")]
    for x in r["rows"]:
        assert x["floor_cached"] == x["own_cached"] == x["store_cached"] == x["tiered_cached"] > 0, x
        assert x["store_ttft_s"] > 0 and x["tiered_ttft_s"] > 0 and x["floor_ttft_s"] > 0 and x["writer_ttft_s"] > 0, x
        assert x["raw_get_s"] > 0 and x["lookup_s"] > 0 and x["failures"] == 0, x
        assert x["tiered_sync_loads"] == x["store_sync_loads"] == 1, x  # both readers' loads in-step
        assert x["objects"]["chunks"] == 4 and x["objects"]["directories"] >= 4, x
    aligned, divergent, turn = r["rows"]
    # what the store served past the whole chunks: the blocks of the prefix's last part chunk
    # (the bench draws each end at least one block into a chunk)
    assert [x["partial_tokens"] for x in r["rows"]] == [x["store_cached"] % 256 for x in r["rows"]], r["rows"]
    assert aligned["partial_tokens"] == 0 and divergent["partial_tokens"] > 0 and turn["partial_tokens"] > 0
    # 2 repetitions (warm-up included) x 3 cases x (2 readers x 2 checks (tokens, cached tokens)
    # + the cached tokens of the reader's own prefix-cache hit)
    assert r["token_checks"] == 30 and r["token_mismatches"] == [], r["token_mismatches"]
    assert (tmp_path / "store_divergence.md").read_text().count("\n| 1024 |") == 3
    assert len(r["pids"]) == 2 + 3  # master, store server, writer, two readers
    assert [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_hybrid_memory_quick_measures_both_models_allocator_on_and_off(tmp_path):
    """``python -m bench.hybrid_memory --quick`` (2,048 tokens, one request per cell): for each
    sliding-window model, a store engine with vLLM's hybrid allocator on and one with it off
    (or the refusal, named), each cell's KV usage, saved objects, loaded bytes and hit measured,
    the hit's tokens those of a no-connector engine with the same allocator setting, every
    process gone. No assertion on speed or on the size of the saving."""
    proc = subprocess.run([sys.executable, "-m", "bench.hybrid_memory", "--quick", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "hybrid_memory.json").read_text())
    assert r["errors"] == {}
    cells = {(x["model"], x["arm"]) for x in r["rows"]} | {tuple(k.split("/")) for k in r["refused"]}
    assert cells == {(m, a) for m in ("tiny-swa", "tiny-swa-all") for a in ("on", "off")}
    assert not {(x["model"], x["arm"]) for x in r["rows"]} & {tuple(k.split("/")) for k in r["refused"]}
    for x in r["rows"]:
        assert x["tokens"] == 2048 and x["hit_cached"] == x["ref_cached"] == 2048, x
        assert x["kv_bytes_decode"] > 0 and x["saved_objects"] > 0 and x["saved_bytes_master"] > 0, x
        assert x["loaded_bytes"] > 0 and x["failures"] == 0 and x["hit_ttft_s"] > 0, x
    assert r["token_checks"] == 2 * len(r["rows"]) and r["token_mismatches"] == [], r["token_mismatches"]
    assert "| tiny-swa | 2048 |" in (tmp_path / "hybrid_memory.md").read_text()
    assert [p for p in r["pids"] if not _gone(p)] == []


@pytest.mark.bench_harness
def test_trace_replay_quick_runs_both_deployments_and_feeds_the_simulator(tmp_path):
    """``python -m bench.trace_replay --quick`` on 8 requests of the scaled conversation
    trace: both deployments served every request, the token accounting adds up, the speeds
    the simulator needs were measured, every process is gone; then ``bench.sim validate``
    reads that run and compares both deployments (its verdict is a measurement: not asserted)."""
    import math

    proc = subprocess.run([sys.executable, "-m", "bench.trace_replay", "--quick", "--count", "8",
                           "--time-factor", "0.02", "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "trace_replay.json").read_text())
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 8
    for name in ("tiered", "plain"):
        d = r["deployments"][name]
        assert not d.get("error") and d["completed"] == d["requests"] == 8, d
        assert all(math.isfinite(d[f"{p}_ttft_ms"]) and d[f"{p}_ttft_ms"] > 0 for p in ("p50", "p90", "p99"))
        t = d["tokens"]
        assert t["recomputed"] == t["prompt"] - t["local_hit"] - t["store"] - t["p2p"]
    plain = r["deployments"]["plain"]["tokens"]
    assert plain["store"] == plain["p2p"] == 0 and plain["prompt"] == plain["client_prompt"]
    s = json.loads((tmp_path / "speeds.json").read_text())
    assert s["prefill"]["token_s"] > 0 and s["decode"]["step_s"] > 0 and s["bytes_per_token"] > 0
    assert s["prefix_cache_tokens_per_engine"] > 0 and set(s["overhead"]) == {"plain", "tiered"}
    assert s["contention"]["factor"] >= 0 and s["tiered"]["prefill"]["token_s"] > 0
    # The probes: the sizes that fit --max-model-len 4096 (1024 and 2048 tokens), twice each.
    assert "error" not in s["p2p"]["probe"] and "error" not in s["store"]["probe"], (s["p2p"], s["store"])
    assert len(s["p2p"]["handoff"]["gaps"]) == 4 and s["p2p"]["handoff"]["overhead_s"] is not None
    assert [p for p in r["pids"] if not _gone(p)] == []
    v = subprocess.run([sys.executable, "-m", "bench.sim", "validate", "--replay", str(tmp_path)],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert v.returncode in (0, 1), v.stdout[-2000:] + v.stderr[-2000:]  # 1: a target missed, a measurement
    rec = json.loads((tmp_path / "validation.json").read_text())
    assert set(rec["deployments"]) == {"tiered", "plain"}
    for d in rec["deployments"].values():
        assert d["sim"]["served"] == 8 and d["compare"]["ttft_p50"]["sim"] > 0
    # Each router's decision log over the replay (not the warm-up's requests): 8 streamed
    # answers, each timed to its first token, paired one by one with the simulator's routes.
    for name in ("tiered", "plain"):
        log = [json.loads(x) for x in (tmp_path / f"decisions-{name}.jsonl").read_text().splitlines()]
        assert len(log) == 8 and all(x["status"] == 200 and x["ttft_s"] > 0 for x in log), log
        assert rec["deployments"][name]["decisions"]["paired"] == 8
    assert all(len(x["candidates"]) == 2 for x in map(json.loads, (tmp_path / "decisions-tiered.jsonl").open()))


@pytest.mark.bench_harness
def test_decision_bench_quick_measures_every_cell_with_the_same_tokens(tmp_path):
    """``python -m bench.tiered_bench --quick --lengths 257 --min-cell-s 600 --max-reps 2
    --layouts "with prefill,decode only,cold prefill"``: the three layouts at 0% and 100%
    stored, each cell grown from one repetition to two (its repetitions ran under 600 s),
    every source timed, the plan ``auto`` chose read from the decode engine (and, for every
    request whose plan loaded from the store, that load's ranges per chunk and rate), every
    answer's greedy ids those of a no-connector engine on the plan's split, every process
    gone. In ``cold prefill`` the prefill instance's prefix cache was emptied after it stored
    the prefix, so with the prefix stored it loaded it from the store itself (its own plan,
    read from its /metrics). No assertion on which source wins."""
    proc = subprocess.run([sys.executable, "-m", "bench.tiered_bench", "--quick", "--lengths", "257",
                           "--min-cell-s", "600", "--max-reps", "2", "--layouts", "with prefill,decode only,cold prefill",
                           "--out", str(tmp_path)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (tmp_path / "stdout.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "decisions.json").read_text())
    got = sorted((c["layout"], c["store_fraction"], sorted(c["ttft"])) for c in r["cells"])
    assert got[:2] == [("cold prefill", f, ["auto", "p2p", "recompute", "store"]) for f in (0.0, 1.0)], got
    assert got[2:] == [("decode only", 0.0, ["auto", "recompute", "store"]),
                       ("decode only", 1.0, ["auto", "recompute", "store"]),
                       ("with prefill", 0.0, ["auto", "p2p", "recompute", "store"]),
                       ("with prefill", 1.0, ["auto", "p2p", "recompute", "store"])], got
    cold = {c["store_fraction"]: c["auto_check_estimates"]["prefill_plans"] for c in r["cells"]
            if c["layout"] == "cold prefill"}
    assert cold[0.0] == dict.fromkeys(["recompute", "store", "p2p", "auto"], "recompute"), cold
    assert cold[1.0] == dict.fromkeys(["recompute", "store", "p2p", "auto"], "store"), cold
    for c in r["cells"]:
        assert len(c["orders"]) == 2 and all(sorted(o) == sorted(c["ttft"]) for o in c["orders"]), c
        assert all(x["n"] == 2 and x["median"] > 0 for x in c["ttft"].values()), c
        assert len(c["auto_plans"]) == 2 and "?" not in c["auto_plans"], c
        forced = [s for s in c["times"] if s != "auto"]
        oracle = [min(c["times"][s][r] for s in forced) for r in (0, 1)]
        assert c["oracle_median"] == pytest.approx(sum(oracle) / 2)
        # A request's store load is read off the decode engine exactly when its plan loaded from the store.
        for src, plans in c["planned"].items():
            for plan, io in zip(plans, c["store_io"][src]):
                assert (io is not None) == ("store" in plan.split("+")), (src, plan, io)
                assert io is None or (io["ranges_per_chunk"] >= 1 and io["gbps"] > 0), (src, io)
    assert any(io for c in r["cells"] for io in c["store_io"]["store"]), "no forced store request loaded"
    assert "within 10% of the best forced source" in (tmp_path / "decisions.md").read_text()
    # At 257 tokens every plan has a reference (a stored chunk is the handoff's N - 1 tokens):
    # 22 requests (3 sources x 2 cells decode only, 4 x 2 with prefill, 4 x 2 cold prefill),
    # cached tokens and ids each.
    assert [c["unchecked"] for c in r["cells"]] == [[]] * 6
    assert r["token_checks"] == 44 and r["token_mismatches"] == []
    assert len(r["pids"]) >= 6 and [p for p in r["pids"] if not _gone(p)] == []


def test_raw_probe_reads_its_bytes_back_on_one_core_and_removes_them(store_cluster):
    from bench import raw_probe

    def keys() -> set[str]:
        r = requests.get(f"http://127.0.0.1:{store_cluster.metrics_port}/get_all_keys", timeout=5)
        r.raise_for_status()
        return set(r.text.split())

    before = keys()
    r = raw_probe.run(store_cluster.master_addr, chunks=4, chunk_bytes=(1 << 20) + 1, core=0, reps=2, ranges=3,
                      timeout=120)
    assert r["bytes"] == 4 * ((1 << 20) + 1) and r["ranges"] == 3
    # Every read returned each object's whole size (else the probe raises): one rate per read.
    assert len(r["gbps"]) == len(r["gbps_ranges"]) == 2 and all(g > 0 for g in r["gbps"] + r["gbps_ranges"])
    assert keys() == before  # its objects removed: nothing left in the store


def test_raw_probe_failure_is_an_error_not_a_rate():
    from bench import raw_probe
    from kvcore.procs import free_port

    with pytest.raises(RuntimeError, match="raw probe failed"):
        raw_probe.run(f"127.0.0.1:{free_port()}", chunks=1, chunk_bytes=1 << 20, core=0, reps=1, timeout=120)


def test_host_thread_cpu_sees_a_busy_process_and_leaves_out_the_excluded_tree():
    """The store-hit section's "other processes' CPU": a child spinning 0.3 s of CPU shows
    about that much under its own pid; excluding this process leaves out it and its child."""
    import select

    from bench.engine_metrics import host_thread_cpu

    spin = ("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\nsys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line() -> str:
        assert select.select([child.stdout], [], [], 30)[0], "the child did not answer in 30 s"
        return child.stdout.readline().strip()
    try:
        assert line() == "ready"
        before = host_thread_cpu()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert line() == "done"
        after = host_thread_cpu()
        excluded = host_thread_cpu(exclude=os.getpid())
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdin.close()
        child.stdout.close()
    mine = {k: v - before.get(k, 0.0) for k, v in after.items() if f"[{child.pid}]/" in k}
    assert 0.29 <= sum(mine.values()) <= 0.5, mine
    assert any(f"[{os.getpid()}]/" in k for k in after)
    assert not any(f"[{pid}]/" in k for k in excluded for pid in (os.getpid(), child.pid))
    assert not any(k.startswith("kworker/") and "-" in k.split("[", 1)[0] for k in after)
