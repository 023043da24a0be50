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


# Host counters that grow when a process writes into memory it never touched before, or the
# kernel has to find memory for it: transparent huge pages, compaction, direct reclaim.
VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "allocstall_normal", "pgscan_direct",
          "pgmajfault")


def process_tree(pid: int, alone: bool = False) -> list:
    """``pid``'s ``psutil.Process`` with its descendants (an engine is an API server, an engine
    core and a worker), or alone; empty if it has ended."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root] if alone else [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def host_counters(pid: int) -> dict[str, float]:
    """Minor and major page faults of ``pid`` and its descendants (``/proc/<pid>/stat``) and
    the host's :data:`VMSTAT` counters (``/proc/vmstat``). A process that ended in between is
    left out."""
    out = {"minflt": 0.0, "majflt": 0.0}
    for p in process_tree(pid):
        try:
            # Fields after the command name (which may hold spaces): minflt is field 10, majflt 12.
            fields = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out["minflt"] += int(fields[7])
        out["majflt"] += int(fields[9])
    with open("/proc/vmstat") as f:
        vm = dict(line.split() for line in f)
    out.update({k: float(vm.get(k, 0)) for k in VMSTAT})
    return out


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}
