"""P2P tier benchmark (not a test). Two processes over loopback TCP, each pinned to a core:
a producer (prefill side: KV buffer registered with a Transfer Engine, the real bootstrap
server and side channel holding the blocks) and this consumer (decode side: the real
Puller).

1. Throughput, side by side in one run: the tier's pull (side-channel metadata, coalesced
   page runs read as asynchronous batches waited for with pauses, acknowledgement) against
   Mooncake's raw ``batch_transfer_sync_write`` (and ``_read``, which waits by spinning) of
   the very same descriptors.
2. Handoff latency breakdown (bootstrap query, metadata, transfer, acknowledgement) for
   prompts of 512, 2K and 8K tokens with the geometry of a real model's KV cache.

    .venv/bin/python bench/p2p_bench.py [--layers 2 --kv-heads 2 --head-dim 64 --reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import term_as_interrupt  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

BLOCK = 32


def make_kv(layers: int, num_blocks: int, kv_heads: int, head_dim: int, seed: int):
    import torch

    from kvcore.geometry import KVGeometry

    g = torch.Generator().manual_seed(seed)
    # vLLM CPU layout: per layer [num_blocks, kv_heads, block_size, 2*head_dim], views of one buffer.
    buf = torch.empty(layers, num_blocks, kv_heads, BLOCK, 2 * head_dim, dtype=torch.bfloat16)
    buf.view(-1)[: 1 << 20].copy_(torch.randn(1 << 20, generator=g).to(torch.bfloat16))
    kv = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}
    return buf, kv, KVGeometry.from_kv_caches(kv, num_blocks)


def block_set(n: int, start: int, run: int = 16, gap: int = 3) -> list[int]:
    """``n`` block ids in runs of ``run`` consecutive ids separated by ``gap`` (a mostly
    contiguous allocation, as vLLM hands a fresh request)."""
    out, b = [], start
    while len(out) < n:
        out.extend(range(b, b + min(run, n - len(out))))
        b += run + gap
    return out


# ---------------------------------------------------------------- producer process


def producer(args) -> None:
    from kvcore.metrics import TierStats
    from p2p import bootstrap
    from p2p.holds import SideChannel
    from p2p.protocol import RegisterPayload
    from p2p.transfer import TransferEngineHandle

    spec = json.loads(sys.stdin.readline())
    buf, kv, geo = make_kv(args.layers, spec["num_blocks"], args.kv_heads, args.head_dim, seed=1)
    eng = TransferEngineHandle("127.0.0.1", "tcp", "")
    eng.register(geo.buffers)
    server = bootstrap.BootstrapServer("127.0.0.1", 0).start()
    side = SideChannel(geo.regions, eng.addr, TierStats(), threading.Lock(), abort_timeout_s=3600)
    bootstrap.register(server.url, RegisterPayload("bench-P", 0, 0, 0, side.addr), timeout=5)
    for tid, blocks in spec["holds"]:
        side.add_hold("p-" + tid, tid, blocks)
    print("READY " + json.dumps({"boot": server.url, "te": eng.addr, "regions": [r.base for r in geo.regions]}),
          flush=True)
    sys.stdin.readline()  # parent closes stdin when done
    side.close()
    server.stop()


# ---------------------------------------------------------------- consumer (main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--throughput-blocks", type=int, default=2048, help="block set for the throughput part")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    term_as_interrupt()  # kill runs the cleanup, as Ctrl-C does
    if args.producer:
        producer(args)
        return 0

    from kvcore.metrics import TierStats
    from p2p.puller import Puller, PullJob
    from p2p.transfer import TransferEngineHandle

    sizes = {"512": 512 // BLOCK, "2K": 2048 // BLOCK, "8K": 8192 // BLOCK}
    tp_n = args.throughput_blocks
    num_blocks = 2 * (tp_n + tp_n // 4) + 64
    p_tp, d_tp = block_set(tp_n, 1), block_set(tp_n, num_blocks // 2)
    holds = []
    for rep in range(args.reps + 1):  # +1 warm-up
        holds.append((f"tp-{rep}", p_tp))
        for name, n in sizes.items():
            holds.append((f"lat-{name}-{rep}", block_set(n, 1)))
    spec = {"num_blocks": num_blocks, "holds": holds}

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    prod = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "--producer", "--layers", str(args.layers),
                             "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    try:
        os.sched_setaffinity(0, {1})
    except (AttributeError, OSError):
        pass
    try:
        prod.stdin.write(json.dumps(spec) + "\n")
        prod.stdin.flush()
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("READY ") and time.monotonic() < deadline:
            line = prod.stdout.readline()
            if not line and prod.poll() is not None:
                raise RuntimeError("producer exited")
        info = json.loads(line[6:])
        buf, kv, geo = make_kv(args.layers, num_blocks, args.kv_heads, args.head_dim, seed=2)
        eng = TransferEngineHandle("127.0.0.1", "tcp", "")
        eng.register(geo.buffers)
        stats = TierStats()
        puller = Puller(geo, eng, stats, threading.Lock())
        page = geo.block_bytes
        print(f"KV geometry: {args.layers} layers x {geo.regions[0].page_bytes} B pages = {page} B per block "
              f"({page // BLOCK} B per token); loopback TCP, producer on core 0, consumer on core 1\n")

        def job(tid, p_blocks, d_blocks):
            return PullJob("r-" + tid, tid, info["boot"], "bench-P", 0, d_blocks, time.monotonic() + 60)

        # ---- 1. throughput: tier pull vs raw batch write / read, same descriptors, interleaved

        # The descriptors the tier will build (D local <-> P remote), for the raw calls.
        p_regions = [type(r)(r.layer, base, r.block_stride, r.page_bytes)
                     for r, base in zip(geo.regions, info["regions"])]
        local, remote, lens = geo.pair_ranges(d_tp, p_regions, p_tp)
        nbytes = sum(lens)
        tier_x, tier_h, raw_w, raw_r = [], [], [], []
        for rep in range(args.reps + 1):
            # Rotate the order so that no variant always runs first (caches, TCP warm-up).
            timed = {}
            order = ["write", "read", "tier"]
            order = order[rep % 3:] + order[:rep % 3]
            for what in order:
                t0 = time.perf_counter()
                if what == "write":
                    eng.write(info["te"], local, remote, lens)
                elif what == "read":
                    eng.read(info["te"], local, remote, lens)
                else:
                    puller.pull(job(f"tp-{rep}", p_tp, d_tp))
                timed[what] = time.perf_counter() - t0
            tw, tr, th = timed["write"], timed["read"], timed["tier"]
            res = puller.take_results()
            assert res and res[0].ok, res
            if rep == 0:
                continue  # warm-up (connections, first query)
            raw_w.append(tw)
            raw_r.append(tr)
            tier_x.append(res[0].timings["transfer"])
            tier_h.append(th)
        gb = lambda s: nbytes / statistics.median(s) / 1e9  # noqa: E731
        best = lambda s: nbytes / min(s) / 1e9  # noqa: E731
        print(f"Throughput, {tp_n} blocks = {nbytes / 2**20:.1f} MiB, {len(lens)} descriptors, median of {args.reps}"
              f" (best in brackets):")
        print(f"  raw batch_transfer_sync_write   {gb(raw_w):6.2f} GB/s  [{best(raw_w):.2f}]")
        print(f"  raw batch_transfer_sync_read    {gb(raw_r):6.2f} GB/s  [{best(raw_r):.2f}]")
        print(f"  tier pull, transfer phase       {gb(tier_x):6.2f} GB/s  [{best(tier_x):.2f}]  "
              f"ratio vs raw write {gb(tier_x) / gb(raw_w):.2f}, vs raw read {gb(tier_x) / gb(raw_r):.2f}")
        print(f"  tier pull, whole handoff        {gb(tier_h):6.2f} GB/s  [{best(tier_h):.2f}]  "
              f"ratio vs raw write {gb(tier_h) / gb(raw_w):.2f}, vs raw read {gb(tier_h) / gb(raw_r):.2f}")
        figures = {"bytes": nbytes, "descriptors": len(lens), "reps": args.reps,
                   "gbps": {"raw_write": gb(raw_w), "raw_read": gb(raw_r), "tier_transfer": gb(tier_x),
                            "tier_handoff": gb(tier_h)},
                   "transfer_ratio": gb(tier_x) / gb(raw_r), "handoff_ratio": gb(tier_h) / gb(raw_r),
                   "latency_ms": {}}

        # ---- 2. latency breakdown per prompt size
        print(f"\nHandoff latency breakdown (ms, median of {args.reps}; query is cached after the first handoff"
              f" per prefill engine):")
        print(f"  {'prompt':>6} {'blocks':>6} {'MiB':>6} {'query':>7} {'metadata':>9} {'transfer':>9} {'ack':>7}"
              f" {'total':>7}")
        puller._entries.clear()
        first_query = None
        for name, n in sizes.items():
            d_blocks = block_set(n, num_blocks // 2)
            rows = []
            for rep in range(args.reps + 1):
                r = puller.pull(job(f"lat-{name}-{rep}", None, d_blocks))
                res = puller.take_results()
                assert r is None and res and res[0].ok, (r, res)
                if first_query is None:
                    first_query = res[0].timings["query"]
                if rep:
                    rows.append(res[0].timings)
            med = {k: statistics.median(t[k] for t in rows) * 1e3 for k in ("query", "metadata", "transfer", "ack")}
            total = statistics.median(sum(t[k] for k in ("query", "metadata", "transfer", "ack")) for t in rows) * 1e3
            print(f"  {name:>6} {n:>6} {n * page / 2**20:>6.2f} {med['query']:>7.3f} {med['metadata']:>9.3f}"
                  f" {med['transfer']:>9.3f} {med['ack']:>7.3f} {total:>7.3f}")
            figures["latency_ms"][name] = {**med, "total": total}
        print(f"  first (uncached) bootstrap query: {first_query * 1e3:.2f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return 0
    finally:
        try:
            prod.stdin.close()
        except OSError:
            pass
        try:
            prod.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prod.kill()


if __name__ == "__main__":
    sys.exit(main())
