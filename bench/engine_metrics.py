"""What a benchmark reads off an engine's ``/metrics`` (and the host's counters) around a
request or a run, and what moved in between.

Two kinds of snapshot: :func:`multi.cli.deploy.metrics` (re-exported here), ``(name, kind
label) -> value`` of the mctier series or of the named ones, read with :func:`series_delta`;
and :func:`scrape`, every ``vllm:`` sample with its labels, read with :func:`get` and
compared with :func:`moved`.
"""

from __future__ import annotations

import os
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from multi.cli.deploy import metrics

Key = tuple[str, frozenset]  # a sample of scrape(): name, labels


def scrape(url: str) -> dict[Key, float]:
    """Every ``vllm:`` sample of an engine except histogram buckets, keyed by name and labels
    (the engine's own ``model_name`` and ``engine`` labels left out)."""
    out: dict[Key, float] = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("vllm:") and not s.name.endswith(("_bucket", "_created")):
                k = (s.name, frozenset((a, b) for a, b in s.labels.items() if a not in ("model_name", "engine")))
                out[k] = out.get(k, 0.0) + s.value
    return out


def settled(url: str, wait_s: float = 10.0) -> dict[Key, float]:
    """A scrape once two in a row agree: stats reach /metrics a step or a log interval late."""
    prev, deadline = scrape(url), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if (cur := scrape(url)) == prev:
            break
        prev = cur
    return prev


def get(m: dict[Key, float], name: str, **labels) -> float:
    """The sum of a scrape's samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls)


def delta(after: dict, before: dict) -> dict:
    """``after - before`` for every key of ``after`` (a key ``before`` lacks counts from 0):
    two snapshots of counters of any kind."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def moved(after: dict[Key, float], before: dict[Key, float]) -> dict[Key, float]:
    """The counters and histogram sums and counts of two scrapes that moved, by how much."""
    return {k: d for k, d in delta(after, before).items() if d and k[0].endswith(("_total", "_sum", "_count"))}


def series_delta(after: dict, before: dict, name: str, kind: str = "") -> float:
    """How much one series of two :func:`metrics` snapshots moved."""
    return after.get((name, kind), 0.0) - before.get((name, kind), 0.0)


def settle_metric(url: str, name: str, before: dict, want_count: float = 1.0) -> tuple[float, float]:
    """(sum delta, count delta) of a histogram once the engine has exported the new samples."""
    deadline = time.monotonic() + 3.0
    while True:
        after = metrics(url)
        d_sum, d_cnt = (series_delta(after, before, name + part) for part in ("_sum", "_count"))
        if d_cnt >= want_count or time.monotonic() > deadline:
            return d_sum, d_cnt
        time.sleep(0.1)


# The composite's decisions, counted by plan ("store+recompute", ...).
DECISIONS = "vllm:mctier_tiered_decisions_total"


def new_plans(after: dict, before: dict) -> list[str]:
    """The plans the composite counted between two :func:`metrics` snapshots, sorted."""
    return sorted(kind for (name, kind), d in delta(after, before).items() if name == DECISIONS and d > 0)


def counted_plan(url: str, before: dict, deadline_s: float = 5.0) -> str:
    """The plan an engine's composite counted since the :func:`metrics` snapshot ``before``
    (its stats reach /metrics a step late); ``?`` when none showed up in time."""
    end = time.monotonic() + deadline_s
    while True:
        plans = new_plans(metrics(url, (DECISIONS,)), before)
        if plans or time.monotonic() > end:
            return "+".join(plans) or "?"
        time.sleep(0.2)


# vLLM's own per-request times (engine-core timestamps): queued from arrival until first
# scheduled (a store hit waits for its load there), then scheduled until the first token.
REQUEST_TIMES = {"vllm:request_queue_time_seconds": "queue_s", "vllm:request_prefill_time_seconds": "prefill_s"}
_REQUEST_SERIES = tuple(f"{n}_{s}" for n in REQUEST_TIMES for s in ("sum", "count"))


def request_sums(url: str) -> dict:
    """The engine's sums and counts of :data:`REQUEST_TIMES`, to pass to :func:`request_times`."""
    return metrics(url, _REQUEST_SERIES)


def request_times(url: str, before: dict) -> dict:
    """The times of the one request the engine finished since ``before`` (``queue_s``,
    ``prefill_s``), once it has exported them (waits up to 3 s)."""
    deadline = time.monotonic() + 3.0
    while True:
        after = request_sums(url)
        done = all(series_delta(after, before, f"{n}_count") > 0 for n in REQUEST_TIMES)
        if done or time.monotonic() > deadline:
            return {key: series_delta(after, before, f"{n}_sum") for n, key in REQUEST_TIMES.items()}
        time.sleep(0.1)


def load_io(url: str, before: dict) -> dict:
    """A store reader's one load since ``before``: buffer ranges per whole chunk handed to
    Mooncake (fewest while its blocks are contiguous, one per KV region; more as they
    scatter), GB/s over the load's duration (``vllm:mctier_store_load_seconds``), and the
    bytes it loaded."""
    seconds, _ = settle_metric(url, "vllm:mctier_store_load_seconds", before)
    after = metrics(url)
    chunks = series_delta(after, before, "vllm:mctier_store_io_chunks_total", "load")
    loaded = series_delta(after, before, "vllm:mctier_store_loaded_bytes_total")
    ranges = series_delta(after, before, "vllm:mctier_store_io_ranges_total", "load")
    return {"ranges_per_chunk": ranges / chunks if chunks else 0.0,
            "seconds": seconds, "gbps": loaded / seconds / 1e9 if seconds else 0.0, "bytes": loaded}


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


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds each thread of ``pid`` and its descendants has run
    (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds, unlike ``stat``'s 10 ms ticks),
    by process and thread name, and ``main`` for a process's first thread, else its thread id
    (threads a library starts keep their creator's name): ``"VLLM::Worker/VLLM::Worker/main"``."""
    return _threads([p.pid for p in process_tree(pid)], tag_pid=False)


def host_thread_cpu(exclude: int | None = None) -> dict[str, float]:
    """:func:`thread_cpu` for every process on the host except ``exclude`` and its
    descendants, keyed ``"<process>[<pid>]/<thread>/<main or tid>"``: who else ran while
    one engine served a request (two engines of a benchmark share each core)."""
    skip = {p.pid for p in process_tree(exclude)} if exclude else set()
    return _threads([int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) not in skip], tag_pid=True)


def _comm(path: str) -> str:
    # A kernel worker's name ends with the workqueue it last served ("kworker/1:1-mm_percpu_wq"),
    # which changes from one read to the next: keep the thread's own part.
    name = open(path).read().strip()
    return name.split("-", 1)[0] if name.startswith("kworker/") else name


def _threads(pids: list[int], tag_pid: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in pids:
        try:
            pname = _comm(f"/proc/{pid}/comm")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process ended in between
        if tag_pid:
            pname = f"{pname}[{pid}]"
        for tid in tids:
            try:
                name = _comm(f"/proc/{pid}/task/{tid}/comm")
                ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended in between
            out[f"{pname}/{name}/{'main' if int(tid) == pid else tid}"] = ns / 1e9
    return out
