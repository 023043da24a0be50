"""What a benchmark reads off an engine's ``/metrics`` around one request."""

from __future__ import annotations

import time

from multi.deploy import metrics


def settle_metric(url: str, name: str, before: dict, want_count: float = 1.0) -> tuple[float, float]:
    """(sum delta, count delta) of a histogram once the engine has exported the new samples."""
    deadline = time.monotonic() + 3.0
    while True:
        after = metrics(url)
        d_sum = after.get((name + "_sum", ""), 0.0) - before.get((name + "_sum", ""), 0.0)
        d_cnt = after.get((name + "_count", ""), 0.0) - before.get((name + "_count", ""), 0.0)
        if d_cnt >= want_count or time.monotonic() > deadline:
            return d_sum, d_cnt
        time.sleep(0.1)


def load_io(url: str, before: dict) -> dict:
    """A store reader's one load since ``before``: buffer ranges per whole chunk handed to
    Mooncake (fewest while its blocks are contiguous, one per KV region; more as they
    scatter) and GB/s over the load's duration (``vllm:mctier_store_load_seconds``)."""
    seconds, _ = settle_metric(url, "vllm:mctier_store_load_seconds", before)
    after = metrics(url)

    def d(name: str, kind: str = "") -> float:
        return after.get((name, kind), 0.0) - before.get((name, kind), 0.0)
    chunks = d("vllm:mctier_store_io_chunks_total", "load")
    return {"ranges_per_chunk": d("vllm:mctier_store_io_ranges_total", "load") / chunks if chunks else 0.0,
            "seconds": seconds, "gbps": d("vllm:mctier_store_loaded_bytes_total") / seconds / 1e9 if seconds else 0.0}
