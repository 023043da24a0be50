"""How long vLLM's scheduling step spends in the store tier when many requests arrive at once:
the blocking lookup (one master round trip per request inside the step) against the
non-blocking one (one batch per step on the lookup thread, answered at a later step), with the
master idle and busy. Not a test; no engine: the store tier's scheduler (``StoreScheduler``, as
in an engine's EngineCore) against a real mooncake_master and store server, driven step by step
as vLLM's scheduler drives it. Three lookups: blocking (``lookup_blocking``), non-blocking
(the default: the step waits up to ``lookup_wait_ms``, 0.5, for the batch) and non-blocking
without that wait (``lookup_wait_ms`` 0).

    .venv/bin/python -m bench.lookup_stall [--quick] [--arrivals 32,64] [--reps 5] [--partial F] [--out DIR]

Each repetition: ``N`` requests of ``--prompt`` tokens (1,024: 4 chunks of 256; their links
from vLLM's sha256 block hashes, vLLM's default) arrive in one step, half of them with their
whole prompt stored (the objects put beforehand). vLLM adds them (``on_new_request``), then
step 1 asks the connector about every one (``get_num_new_matched_tokens``) and ends
(``build_connector_meta``); until every request is answered, each following step waits
``--step-ms`` (a forward pass) and asks again about those not answered yet. Reported per cell
(median over repetitions): the time spent in the connector in step 1 (the arrivals added
included) and in the costliest step, the steps and the wall time until the last answer, and
the hit tokens answered (the same in every mode: nothing is lost). "Busy": while the cell runs,
``--busy-threads`` other clients ask the master ``batch_is_exist`` of 256 keys in a loop
(another process). ``--partial F``: a fraction ``F`` of the requests more (taken from the half
not stored in full) has its prompt stored but its last chunk, of which a part object of 3 blocks
with its directory entry: their lookups read a directory (one ``get_batch`` per step's batch).
Writes ``lookup_stall.json`` and ``lookup_stall.md`` to ``--out``
(default ``bench/results/lookup_stall/``).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import commit, machine, output_dir  # noqa: E402
from mcstore.server import CLIENT_ENV, StoreCluster  # noqa: E402

CHUNK = 256


def _busy(master: str, threads: int, stop) -> None:
    """Another process keeping the master busy: ``threads`` clients' batch_is_exist in a loop."""
    import threading

    from mooncake.store import MooncakeDistributedStore

    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    s = MooncakeDistributedStore()
    if s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
        return
    keys = [f"busy/{i}" for i in range(256)]

    def loop():
        while not stop.is_set():
            s.batch_is_exist(keys)

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    stop.wait()
    for t in ts:
        t.join(5)
    s.close()


def _requests(n: int, tokens: int, tag: str, ks) -> list:
    """Requests as the scheduler sees them, with vLLM's block hashes (vLLM computes them on its
    input thread, before the scheduling step: not timed here either)."""
    from random import Random

    from mcstore.keys import vllm_sha256_block_hashes

    rng = Random(tag)
    out = []
    for i in range(n):
        ids = [rng.randrange(4, 30000) for _ in range(tokens)]
        out.append(SimpleNamespace(request_id=f"{tag}-{i}", prompt_token_ids=ids, num_prompt_tokens=tokens,
                                   num_tokens=tokens, num_computed_tokens=0, cache_salt=None, lora_request=None,
                                   mm_features=None, block_hashes=vllm_sha256_block_hashes(ids, ks.block_hashes)))
    return out


def _step():
    return SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={}, scheduled_new_reqs=[])


MODES = {"blocking": {"lookup_blocking": True}, "non-blocking": {}, "non-blocking, no wait": {"lookup_wait_ms": 0}}


def _store_partial(raw, ks, r) -> None:
    """What a save of ``r``'s prompt cut 3 blocks into its last chunk stores: its whole chunks
    but the last, the part object of those 3 blocks and its directory entry. ``r``'s lookup
    finds them through the entry (a directory read) and hits all but its last 5 blocks."""
    from mcstore.keys import Directory

    hs, cb = r.block_hashes, ks.chunk_blocks
    whole = len(r.prompt_token_ids) // ks.chunk_tokens - 1
    for k in ks.all_rank_keys(ks.links(r.prompt_token_ids)[:whole]):
        raw.put(k, b"kv")
    tail = hs[whole * cb:whole * cb + 3]
    for k in ks.all_rank_keys([ks.part_link(tail[-1], 3)]):
        raw.put(k, b"kv")
    raw.put(ks.dir_key(tail[0]), Directory.of(tail).encode())


def run_cell(master: str, ks, raw, n: int, tokens: int, mode: str, step_s: float, tag: str,
             partial: float = 0.0) -> dict:
    from mcstore.config import load_config
    from mcstore.scheduler import StoreScheduler

    reqs = _requests(n, tokens, tag, ks)
    for r in reqs[: n // 2]:  # half stored in full
        for k in ks.all_rank_keys(ks.links(r.prompt_token_ids)):
            raw.put(k, b"kv")
    for r in reqs[n // 2: n // 2 + round(n * partial)]:  # --partial: found through a directory entry
        _store_partial(raw, ks, r)
    cfg = load_config({"master": master, "chunk_tokens": CHUNK, **MODES[mode]}, env={})
    s = StoreScheduler(cfg, ks, 32, load=True, save=False)
    try:
        s.client.exists(["warm"])  # a warm client, as in a running engine
        answers: dict[str, tuple] = {}
        steps, in_step, t0 = 0, [], time.perf_counter()
        while len(answers) < n:
            if steps:
                time.sleep(step_s)
            steps += 1
            a = time.perf_counter()
            if steps == 1:  # vLLM adds the arrivals between steps (EngineCore's thread too)
                for r in reqs:
                    s.on_new_request(r)
            for r in reqs:
                if r.request_id not in answers:
                    got = s.get_num_new_matched_tokens(r, 0)
                    if got[0] is not None:
                        answers[r.request_id] = got
            s.build_connector_meta(_step())
            in_step.append(time.perf_counter() - a)
            if steps > 10000:
                raise RuntimeError("lookups never answered")
        wall = time.perf_counter() - t0
        return {"first_step_ms": in_step[0] * 1e3, "max_step_ms": max(in_step) * 1e3, "steps": steps,
                "answered_ms": wall * 1e3, "hit_tokens": sum(a[0] for a in answers.values()),
                "timeouts": s.stats.data["counters"].get("lookups:timeout", 0)}
    finally:
        s.close()
        # The closed scheduler's Mooncake client sits in a reference cycle (its breaker's probe);
        # collected by a later cell's garbage collection, its destructor (5 to 9 ms, the GIL held)
        # would land in that cell's steps: collected here, between cells. An engine has one
        # client for its lifetime.
        s = None
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lookup_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="arrivals 32, 2 repetitions")
    ap.add_argument("--arrivals", default="32,64")
    ap.add_argument("--prompt", type=int, default=4 * CHUNK)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--busy-threads", type=int, default=4)
    ap.add_argument("--partial", type=float, default=0.0,
                    help="fraction of the requests (of the half not stored in full) whose prompt is stored but "
                         "its last chunk, of which a part object of 3 blocks, found through its directory entry")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lookup_stall"))
    a = ap.parse_args(argv)
    if a.quick:
        a.arrivals, a.reps = "32", 2
    arrivals = [int(x) for x in a.arrivals.split(",")]
    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    out = output_dir(a.out)
    from mooncake.store import MooncakeDistributedStore

    from mcstore.keys import KeySpace, VllmBlockHashes, fingerprint

    # Links from vLLM's sha256 block hashes: the key space of an engine with vLLM's default hashing.
    ks = KeySpace(fingerprint({"bench": "lookup_stall"}), CHUNK,
                  block_hashes=VllmBlockHashes(algo="sha256", seed="bench", block_size=32))
    cluster = StoreCluster(out / "logs", segment_size=512 << 20).start()
    rows = []
    try:
        raw = MooncakeDistributedStore()  # puts the stored prompts' objects
        if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", cluster.master_addr) != 0:
            raise RuntimeError("raw Mooncake client set-up failed")
        for load in ("idle", "busy"):
            ctx = mp.get_context("spawn")
            stop = ctx.Event()
            busy = None
            if load == "busy":
                busy = ctx.Process(target=_busy, args=(cluster.master_addr, a.busy_threads, stop),
                                                       daemon=True)
                busy.start()
                time.sleep(2.0)
            try:
                for n in arrivals:
                    cells = {m: [] for m in MODES}
                    for rep in range(a.reps):
                        for mode in (cells if rep % 2 == 0 else reversed(list(cells))):
                            cells[mode].append(run_cell(cluster.master_addr, ks, raw, n, a.prompt, mode,
                                                        a.step_ms / 1e3, f"{load}-{n}-{rep}", a.partial))
                    for mode, reps in cells.items():
                        row = {"master": load, "arrivals": n, "mode": mode,
                               **{k: statistics.median(r[k] for r in reps) for k in reps[0]},
                               "hit_tokens_all": [r["hit_tokens"] for r in reps]}
                        rows.append(row)
                        print(f"[lookup_stall] {load} {n} {mode}: step 1 {row['first_step_ms']:.2f} ms, max step "
                              f"{row['max_step_ms']:.2f} ms, {row['steps']:.0f} steps, answered in "
                              f"{row['answered_ms']:.1f} ms, hit tokens {row['hit_tokens']:.0f}", flush=True)
            finally:
                stop.set()
                if busy is not None:
                    busy.join(10)
                    if busy.is_alive():
                        busy.kill()
        raw.close()
    finally:
        cluster.stop()
    rev = commit()
    m = machine()
    lines = ["| master | arrivals | lookup | in the connector, step 1 (ms) | costliest step (ms) | steps to answer | "
             "answered after (ms) | hit tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['master']} | {r['arrivals']} | {r['mode']} | {r['first_step_ms']:.2f} | "
                     f"{r['max_step_ms']:.2f} | {r['steps']:.0f} | {r['answered_ms']:.1f} | {r['hit_tokens']:.0f} |")
    lines.append("")
    lines.append(f"{time.strftime('%Y-%m-%d')}, {m['cpu']} (engines {m['dtype']}), commit {rev}, "
                 f"{a.reps} repetitions (medians), prompts of {a.prompt} tokens, half stored, "
                 f"steps {a.step_ms:g} ms apart, busy = {a.busy_threads} threads of batch_is_exist(256 keys)"
                 + (f", {a.partial:g} of the requests partial hits through a directory entry" if a.partial else "")
                 + ".")
    table = "\n".join(lines)
    print(table)
    (out / "lookup_stall.md").write_text(table + "\n")
    (out / "lookup_stall.json").write_text(json.dumps({"machine": m, "commit": rev, "rows": rows,
                                                       "args": vars(a)}, indent=1))
    lost = [r for r in rows if r["timeouts"]]
    k = len(MODES)
    same = all(len({tuple(r["hit_tokens_all"]) for r in rows[i:i + k]}) == 1 for i in range(0, len(rows), k))
    print(f"[lookup_stall] hit tokens equal in both modes: {same}; cells with timeouts: {len(lost)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
