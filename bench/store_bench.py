"""Store tier benchmark (not a test): the tier's save/load data path against the
raw Mooncake API on the same chunks, in one run, plus scheduler lookup latency.

    .venv/bin/python bench/store_bench.py [--chunks 128] [--reps 5]

Starts its own mooncake_master + store server on loopback (the pool lives in the
store server, engines are pure clients, as in deployment). The tier's numbers
are end to end: jobs handed to the worker as vLLM would (``wait_for_save`` /
``start_load_kv``) until ``get_finished`` reports them, including the dedup
``batch_is_exist`` of a save and the post-load existence check. The raw numbers
are ``batch_put_from`` / ``batch_get_into`` of contiguous chunk-sized buffers,
the best case for Mooncake.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import term_as_interrupt  # noqa: E402
from mcstore.server import CLIENT_ENV  # noqa: E402

for _k, _v in CLIENT_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from mcstore.config import load_config  # noqa: E402
from mcstore.keys import KeySpace, fingerprint  # noqa: E402
from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata  # noqa: E402
from mcstore.scheduler import StoreScheduler  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from mcstore.worker import StoreWorker  # noqa: E402

LAYERS, HEADS, HEAD, BS, CHUNK = 8, 2, 64, 32, 256  # 16 KiB pages; 1 MiB per 256-token chunk
BLOCKS_PER_CHUNK = CHUNK // BS
PER_JOB = 16  # chunks per request (a 4K-token prompt)


def wait(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark job did not finish")
        time.sleep(0.0005)


def take_phases(w: StoreWorker, into: dict[str, list[float]]) -> None:
    """Append the worker's time per phase since the last call (summed over its jobs) to ``into``."""
    stats = w.take_stats()
    for op, xs in (stats.data["ops"] if stats else {}).items():
        if op.startswith("phase:"):
            into.setdefault(op[len("phase:"):], []).append(sum(xs))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--lookup-tokens", type=int, default=32768, help="prompt length of the lookup timing")
    ap.add_argument("--lookup-gap-ms", type=float, default=0.0,
                    help="sleep before each timed lookup, as an engine idles between arrivals (default: none)")
    ap.add_argument("--verify", action="store_true", help="tier with its (opt-in) xxh3 trailer check")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    term_as_interrupt()  # kill runs the cleanup, as Ctrl-C does
    n = a.chunks
    blocks = n * BLOCKS_PER_CHUNK + 1
    logs = Path(tempfile.mkdtemp(prefix="store-bench-"))
    with StoreCluster(logs, segment_size=max(1 << 30, 4 * n << 20), extra_flags=["--client_ttl=2"]) as c:
        cfg = load_config({"master": c.master_addr, "chunk_tokens": CHUNK,
                           "verify_checksums": a.verify}, env={})
        keys = KeySpace(fingerprint({"bench": 1}), CHUNK)
        w = StoreWorker(cfg, keys, BS, blocks, 0, load=True, save=True)
        kv = torch.randn(LAYERS, blocks, HEADS, 2 * BS, HEAD).to(torch.bfloat16)
        w.register_kv_caches({f"l{i}": kv[i] for i in range(LAYERS)})
        chunk_bytes = w.chunk_bytes
        total = n * chunk_bytes
        raw = w.client.store  # same client, same transport: only the data path differs
        src = torch.randint(0, 255, (n, chunk_bytes), dtype=torch.uint8)
        dst = torch.empty_like(src)
        for t in (src, dst):
            w.client.register(t.data_ptr(), t.numel())
        res = {k: [] for k in ("raw_put", "raw_get", "tier_save", "tier_load", "mb_put", "mb_get")}
        phases: dict[str, list[float]] = {}  # the tier's time per phase (mcstore.metrics), per repetition
        for rep in range(a.reps):
            tag = f"{rep}-{time.monotonic_ns()}"
            # raw Mooncake
            rk = [f"raw/{tag}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            for j in range(0, n, PER_JOB):
                rcs = raw.batch_put_from(rk[j:j + PER_JOB], [src[i].data_ptr() for i in range(j, min(n, j + PER_JOB))],
                                         [chunk_bytes] * len(rk[j:j + PER_JOB]))
                assert all(rc == 0 for rc in rcs), rcs
            res["raw_put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for j in range(0, n, PER_JOB):
                rcs = raw.batch_get_into(rk[j:j + PER_JOB], [dst[i].data_ptr() for i in range(j, min(n, j + PER_JOB))],
                                         [chunk_bytes] * len(rk[j:j + PER_JOB]))
                assert all(rc == chunk_bytes for rc in rcs), rcs
            res["raw_get"].append(time.perf_counter() - t0)
            # raw Mooncake on the KV pages themselves (multi-buffer, one range per layer)
            mk = [f"mb/{tag}/{i}" for i in range(n)]
            cblocks = [list(range(1 + i * BLOCKS_PER_CHUNK, 1 + (i + 1) * BLOCKS_PER_CHUNK)) for i in range(n)]
            ptrs = [w._ptrs(b) for b in cblocks]
            t0 = time.perf_counter()
            for j in range(0, n, PER_JOB):
                sl = range(j, min(n, j + PER_JOB))
                rcs = raw.batch_put_from_multi_buffers(mk[j:j + PER_JOB], [ptrs[i][0] for i in sl],
                                                       [ptrs[i][1] for i in sl])
                assert all(rc == 0 for rc in rcs), rcs
            res["mb_put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for j in range(0, n, PER_JOB):
                sl = range(j, min(n, j + PER_JOB))
                rcs = raw.batch_get_into_multi_buffers(mk[j:j + PER_JOB], [ptrs[i][0] for i in sl],
                                                       [ptrs[i][1] for i in sl])
                assert all(rc == chunk_bytes for rc in rcs), rcs
            res["mb_get"].append(time.perf_counter() - t0)
            raw.batch_remove(mk, True)
            # the tier: chunks are KV pages (one block per chunk slot), layer-major objects
            links = [f"tier/{tag}/{i}" for i in range(n)]
            chunk_blocks = [list(range(1 + i * BLOCKS_PER_CHUNK, 1 + (i + 1) * BLOCKS_PER_CHUNK)) for i in range(n)]
            saves = [SaveJob(f"s{tag}-{j}", [ChunkIO(links[i], i, chunk_blocks[i])
                                             for i in range(j, min(n, j + PER_JOB))])
                     for j in range(0, n, PER_JOB)]
            ids = {s.req_id for s in saves}
            done: set[str] = set()
            t0 = time.perf_counter()
            w.wait_for_save(StoreMetadata(saves=saves))
            wait(lambda: done.update(w.get_finished(ids)[0] or ()) or done >= ids)
            res["tier_save"].append(time.perf_counter() - t0)
            take_phases(w, phases)
            loads = [LoadJob(f"l{tag}-{j}", [ChunkIO(links[i], i, chunk_blocks[i])
                                             for i in range(j, min(n, j + PER_JOB))], 60)
                     for j in range(0, n, PER_JOB)]
            ids = {x.req_id for x in loads}
            done = set()
            t0 = time.perf_counter()
            w.start_load_kv(StoreMetadata(loads=loads))
            wait(lambda: done.update(w.get_finished(set())[1] or ()) or done >= ids)
            res["tier_load"].append(time.perf_counter() - t0)
            take_phases(w, phases)
            errors = w.get_block_ids_with_load_errors()
            assert not errors, f"{len(errors)} blocks failed to load"
            raw.batch_remove(rk, True)
            raw.batch_remove([keys.key(x, 0) for x in links], True)

        def gbps(xs):
            return total / statistics.median(xs) / 1e9

        print(f"chunks: {n} x {chunk_bytes >> 10} KiB ({LAYERS} layers x {BLOCKS_PER_CHUNK} pages of "
              f"{chunk_bytes // LAYERS // BLOCKS_PER_CHUNK >> 10} KiB), {PER_JOB} chunks per batch, "
              f"median of {a.reps}, tier checksums {'on' if a.verify else 'off (default)'}")
        print(f"save  raw batch_put_from  {gbps(res['raw_put']):6.2f} GB/s   tier {gbps(res['tier_save']):6.2f} GB/s"
              f"   ratio {gbps(res['tier_save']) / gbps(res['raw_put']):.2f}")
        print(f"load  raw batch_get_into  {gbps(res['raw_get']):6.2f} GB/s   tier {gbps(res['tier_load']):6.2f} GB/s"
              f"   ratio {gbps(res['tier_load']) / gbps(res['raw_get']):.2f}")
        med = lambda k: statistics.median(phases.get(k, [0.0])) * 1e3  # noqa: E731
        for kind, tier, mb in (("save", "tier_save", "mb_put"), ("load", "tier_load", "mb_get")):
            # Phases of the jobs' own thread, one job after another; the queue phase is left out
            # (jobs handed over together wait for each other there, so it overlaps the rest).
            other = ("exists",) if kind == "save" else ("recheck", "staging", "copy")
            took = statistics.median(res[tier]) * 1e3  # not ``total``: gbps() reads that one
            rest = took - med(kind + "_transfer") - sum(med(f"{kind}_{o}") for o in other)
            print(f"{kind}  where the tier's {took:.1f} ms went: Mooncake's transfer calls "
                  f"{med(kind + '_transfer'):.1f} ms (raw multi-buffer on the same pages "
                  f"{statistics.median(res[mb]) * 1e3:.1f} ms), "
                  + ", ".join(f"{o} {med(f'{kind}_{o}'):.1f} ms" for o in other)
                  + f", the rest (hand-over, polling, bookkeeping) {rest:.1f} ms")
        print(f"(raw multi-buffer on the same KV pages: put {gbps(res['mb_put']):.2f} GB/s, "
              f"get {gbps(res['mb_get']):.2f} GB/s; "
              f"tier/that: save {gbps(res['tier_save']) / gbps(res['mb_put']):.2f}, "
              f"load {gbps(res['tier_load']) / gbps(res['mb_get']):.2f})")

        # Lookup latency: the scheduler's whole lookup for a fresh prompt of --lookup-tokens
        # (its links + one batch_is_exist of its chunks' keys; none stored: every key asked), and
        # its two parts: the links (computed once per request) and the rest. The rest is then
        # asked again at once ("again"): the same call to a master whose threads were just busy
        # instead of idle since the previous prompt; the difference is their wake-up.
        # Two key spaces, interleaved per prompt: the default (links from the block hashes vLLM
        # computed on its input thread: a real vLLM Request, hashed before the clock starts) and
        # the previous path (our chain over the token ids), as an engine with another
        # --prefix-caching-hash-algo still does.
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_none_hash_seed
        from vllm.v1.request import Request

        from mcstore.keys import VllmBlockHashes

        init_none_hash(sha256)
        scheme = VllmBlockHashes(algo="sha256", seed=resolve_none_hash_seed(sha256), block_size=BS)
        vkeys = KeySpace(fingerprint({"bench": 1, "block_hashes": scheme.algo}), CHUNK, block_hashes=scheme)
        hasher, params = get_request_block_hasher(BS, sha256), SamplingParams(max_tokens=1)
        paths = {"vllm": StoreScheduler(cfg, vkeys, BS, load=True, save=False),
                 "tokens": StoreScheduler(cfg, keys, BS, load=True, save=False)}
        times = {p: {"whole": [], "chain": [], "ask": [], "again": []} for p in paths}
        nt = a.lookup_tokens
        # vLLM's engine core freezes its start-up heap (freeze_gc_heap) so that the collector
        # does not walk it at every collection: the same here, or the p99 is torch's and vLLM's
        # imported objects being walked in the middle of a lookup.
        gc.collect()
        gc.freeze()
        for i in range(a.lookups):
            req = Request(f"q{i}", torch.randint(4, 2048, (nt,)).tolist(), params, None, block_hasher=hasher)
            for name in (("vllm", "tokens") if i % 2 else ("tokens", "vllm")):
                sched, t = paths[name], times[name]
                if a.lookup_gap_ms:
                    time.sleep(a.lookup_gap_ms / 1e3)
                t0 = time.perf_counter()
                st = sched._state(req)  # what lookup() does first: the links
                t1 = time.perf_counter()
                sched.lookup(req)
                t2 = time.perf_counter()
                st.hit = None  # forget the answer: the next lookup asks the master again
                sched.lookup(req)
                t3 = time.perf_counter()
                for k, v in (("whole", t2 - t0), ("chain", t1 - t0), ("ask", t2 - t1), ("again", t3 - t2)):
                    t[k].append(v)
                sched._reqs.pop(req.request_id)
                # Drop the last reference to the request here, outside the clock. Held in ``st``
                # until the next prompt's ``st = sched._state(...)``, the previous prompt (32K
                # int objects) was freed inside that timed line: 0.3 to 0.5 ms of the "links"
                # p50 in every run up to 2026-12-05 was that deallocation, which an engine pays
                # when a request finishes, not in its lookup.
                del st

        def q(xs, p):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3

        def lookup_ms(t):
            return {"p50": q(t["whole"], 0.5), "p99": q(t["whole"], 0.99), "n": len(t["whole"]), "tokens": nt,
                    "chain_p50": q(t["chain"], 0.5), "chain_p99": q(t["chain"], 0.99),
                    "exists_p50": q(t["ask"], 0.5), "exists_p99": q(t["ask"], 0.99),
                    "exists_again_p50": q(t["again"], 0.5), "exists_again_p99": q(t["again"], 0.99)}
        for name, label in (("vllm", "links from vLLM's block hashes (default)"),
                            ("tokens", "our chain over the token ids (previous)")):
            lk = lookup_ms(times[name])
            print(f"lookup {nt}-token prompt ({nt // CHUNK} chunks), {label}: p50 {lk['p50']:.3f} ms  "
                  f"p99 {lk['p99']:.3f} ms  max {max(times[name]['whole']) * 1e3:.3f} ms  (n={lk['n']}); "
                  f"of which the links p50 {lk['chain_p50']:.3f} p99 {lk['chain_p99']:.3f} ms, batch_is_exist "
                  f"and the rest p50 {lk['exists_p50']:.3f} p99 {lk['exists_p99']:.3f} ms (asked again at once: "
                  f"p50 {lk['exists_again_p50']:.3f} p99 {lk['exists_again_p99']:.3f} ms)")
        if a.json:
            Path(a.json).write_text(json.dumps({
                "bytes": total, "reps": a.reps, "gbps": {k: gbps(v) for k, v in res.items()},
                "save_ratio": gbps(res["tier_save"]) / gbps(res["raw_put"]),
                "load_ratio": gbps(res["tier_load"]) / gbps(res["raw_get"]),
                "seconds": res, "tier_phase_seconds": phases,
                "lookup_ms": lookup_ms(times["vllm"]), "lookup_previous_ms": lookup_ms(times["tokens"])}, indent=1))
        for sched in paths.values():
            sched.close()
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
