"""What the raw Mooncake get moves on one core right now (not a test).

    .venv/bin/python -m bench.raw_probe --master 127.0.0.1:50051 --chunks 64 --chunk-bytes 2883584 --core 1

A plain process, pinned to ``--core``, puts ``--chunks`` objects of ``--chunk-bytes`` each
(one contiguous buffer per object, the raw API's best case) into the store, reads them back
``--reps`` times with ``batch_get_into`` and prints one JSON line: ``{"bytes": ..., "gbps":
[...]}``, one rate per read. With ``--ranges R`` each read is followed by one into R equal
buffer ranges per object (``batch_get_into_multi_buffers``, as the tier reads into a chunk's
layers), rates in ``"gbps_ranges"``. It then removes its objects and closes its client.

The store-hit section runs it on the reader engine's core right after each of that engine's
store hits, with the same bytes the hit loaded: the hit's load rate next to what a process
without an engine around it gets from the same store server, on the same core, at that
moment. Rates on this kind of host change by 2x within an hour, so a rate measured in
another run says little about this one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mcstore.server import CLIENT_ENV  # noqa: E402

PER_CALL = 128  # objects per batch call: a 32K-token prefix in one call


def probe(master: str, chunks: int, chunk_bytes: int, reps: int, ranges: int = 1) -> dict:
    import numpy as np

    from mcstore.client import StoreClient

    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    client = StoreClient.for_tool(master, "raw-probe")
    keys = [f"mctier-probe/{os.getpid()}/{time.monotonic_ns()}/{i}" for i in range(chunks)]
    try:
        buf = np.ones(chunks * chunk_bytes, dtype=np.uint8)  # touched: no page faults while timed
        client.register(buf.ctypes.data, buf.nbytes)
        ptrs = [buf.ctypes.data + i * chunk_bytes for i in range(chunks)]
        for j in range(0, chunks, PER_CALL):
            rcs = client.put_many(keys[j:j + PER_CALL], ptrs[j:j + PER_CALL], [chunk_bytes] * len(ptrs[j:j + PER_CALL]))
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"batch_put_from failed: {sorted(set(rcs))}")
        # With ranges > 1, each chunk is also read into that many equal buffer ranges (one
        # batch_get_into_multi_buffers), as the tier reads a chunk into its layers' pages.
        cut = [chunk_bytes * r // ranges for r in range(ranges + 1)]
        multi_ptrs = [[p + cut[r] for r in range(ranges)] for p in ptrs]
        multi_sizes = [[cut[r + 1] - cut[r] for r in range(ranges)]] * chunks
        rates: dict[str, list[float]] = {"gbps": [], "gbps_ranges": []}
        for _ in range(reps):
            for kind in ("gbps", "gbps_ranges") if ranges > 1 else ("gbps",):
                t0 = time.perf_counter()
                for j in range(0, chunks, PER_CALL):
                    sl = slice(j, j + PER_CALL)
                    if kind == "gbps":
                        rcs = client.get_many(keys[sl], ptrs[sl], [chunk_bytes] * len(ptrs[sl]))
                    else:
                        rcs = client.get_into(keys[sl], multi_ptrs[sl], multi_sizes[sl])
                    if any(rc != chunk_bytes for rc in rcs):
                        raise RuntimeError(f"{kind}: batch get failed: {sorted(set(rcs))}")
                rates[kind].append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
        return {"bytes": buf.nbytes, "ranges": ranges, **{k: v for k, v in rates.items() if v}}
    finally:
        try:
            client.remove(keys, force=True)
        finally:
            client.close()


def run(master: str, chunks: int, chunk_bytes: int, core: int, reps: int = 3, ranges: int = 1,
        timeout: float = 120.0) -> dict:
    """Run the probe in its own process pinned to ``core``; raises if it fails or overruns."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "bench.raw_probe", "--master", master, "--chunks", str(chunks),
         "--chunk-bytes", str(chunk_bytes), "--reps", str(reps), "--ranges", str(ranges), "--core", str(core)],
        capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"raw probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master", required=True)
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--chunk-bytes", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranges", type=int, default=1,
                    help="also read each chunk into this many buffer ranges (default 1: contiguous only)")
    ap.add_argument("--core", type=int, help="pin this process to one core first")
    a = ap.parse_args()
    if a.core is not None:
        os.sched_setaffinity(0, {a.core})
    print(json.dumps(probe(a.master, a.chunks, a.chunk_bytes, a.reps, a.ranges)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
