"""The SSD rows of the store-hit comparison: a section of ``bench/suite.py`` (not a test).

A store cluster of its own with Mooncake's SSD offload on (``--ssd``, a fresh directory
per run: a store server re-registers whatever files it finds there). Per repetition and
prefix length, with a fresh random prefix ``P`` and three one-block suffixes:

1. the writer (core 0) serves ``P + a``; its chunks are saved, and offloaded to disk by
   the store server within about a second;
2. the reader (core 1, vLLM's prefix cache off, so every hit is the store's) serves
   ``P + b`` from the chunks' DRAM copies: the **DRAM hit**;
3. ``P``'s chunks are pushed out of DRAM (:func:`evict_to_disk`: filler objects put with a
   pure store client until the master lists no memory replica of any of them, then
   removed), and their files' pages are dropped from the kernel's page cache
   (:func:`drop_page_cache`), so the read below comes from the disk;
4. the reader serves ``P + c``: the **SSD hit**;
5. the no-connector engine (core 1) serves ``P + a`` (the **miss**), then ``P + b`` and
   ``P + c`` from its own prefix cache (``P + b`` timed: the **floor**; ``P + c`` is the
   token reference for the SSD hit).

Greedy ids are checked: the writer's against the miss, each hit against the no-connector
engine's prefix-cache hit on the same prompt (the same split). The first repetition is
a check and warm-up, not timed. The target (issue 17): an SSD hit below half of a miss
from 4K tokens up.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from bench.client import ids, stream
from bench.common import Checker, spread, start_engines
from mcstore.admin import MasterAdmin

FILLER_BYTES = 8 << 20   # one filler object
OFFLOAD_S = 60.0         # deadline for the store server to write a prompt's chunks to disk
EVICT_S = 120.0          # deadline for pushing them out of DRAM
SAVE_S = 60.0            # deadline for the writer's saves to be listed by the master


def segment_bytes(prefix_tokens: int, bytes_per_token: int) -> int:
    """A DRAM segment that holds one prompt's chunks twice over (the prefix being read and the
    next one written), at least Mooncake's 16 MiB minimum."""
    return max(16 << 20, 2 * prefix_tokens * bytes_per_token + (16 << 20))


def new_chunks(admin: MasterAdmin, before: set[str], want: int, timeout: float = SAVE_S) -> list[str]:
    """The chunk objects listed since ``before`` once there are ``want`` of them (the writer's
    saves run after its answer); TimeoutError naming how many there are."""
    deadline = time.monotonic() + timeout
    while True:
        new = sorted(k for k in set(admin.all_keys()) - before if not k.endswith("/meta"))
        if len(new) >= want:
            return new
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(new)} of {want} chunks saved within {timeout:.0f}s")
        time.sleep(0.2)


def _replicas(admin: MasterAdmin, keys: list[str]) -> tuple[list[str], list[str]]:
    """(keys with a DRAM replica, keys with a disk replica), from the master's descriptors."""
    q = admin.query(keys)
    mem = [k for k in keys if q[k] and q[k].get("values")]
    disk = [k for k in keys if q[k] and (q[k].get("local_disk_values") or q[k].get("disk_values"))]
    return mem, disk


def evict_to_disk(admin: MasterAdmin, client, keys: list[str], limit_bytes: int) -> int:
    """Leave ``keys`` on disk only: wait until each has a disk replica, then put filler
    objects (``client``: a :class:`mcstore.client.StoreClient` with no segment) until none has
    a DRAM replica, and
    remove the filler. Returns the filler bytes it took; TimeoutError past the deadlines or
    past ``limit_bytes`` of filler."""
    deadline = time.monotonic() + OFFLOAD_S
    while len(_replicas(admin, keys)[1]) < len(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(keys) - len(_replicas(admin, keys)[1])} of {len(keys)} chunks "
                               f"not offloaded to disk within {OFFLOAD_S:.0f}s")
        time.sleep(0.2)
    filler, value = [], b"\xa5" * FILLER_BYTES
    deadline = time.monotonic() + EVICT_S
    try:
        while True:
            mem, disk = _replicas(admin, keys)
            if len(disk) < len(keys):
                raise RuntimeError(f"{len(keys) - len(disk)} chunks lost their disk replica while evicting")
            if not mem:
                return len(filler) * FILLER_BYTES
            if time.monotonic() > deadline or len(filler) * FILLER_BYTES > limit_bytes:
                raise TimeoutError(f"{len(mem)} of {len(keys)} chunks still in DRAM after "
                                   f"{len(filler) * FILLER_BYTES >> 20} MiB of filler")
            key = f"bench-filler/{time.monotonic_ns()}"
            if client.upsert(key, value) == 0:
                filler.append(key)
            else:  # the pool is full until the master's eviction thread runs
                time.sleep(0.05)
    finally:
        client.remove(filler, force=True)


def drop_page_cache(directory: str) -> int:
    """Flush and drop the kernel's cached pages of every file under ``directory``
    (``posix_fadvise(DONTNEED)``, no privileges needed); returns the bytes covered."""
    total = 0
    for path in Path(directory).rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def ssd_hit(base: str, writer: str, reader: str, admin: MasterAdmin, client, ssd_dir: str, prefixes: list[int],
            reps: int, chunk: int, suffix: int, max_tokens: int, filler_limit: int, rng, check: Checker) -> list[dict]:
    if any(n % chunk or n <= 0 for n in prefixes):
        raise ValueError(f"ssd_hit prefixes {prefixes} must be positive whole chunks of {chunk} tokens")
    rows = []
    for n_pfx in prefixes:
        t: dict[str, list[float]] = {k: [] for k in ("miss", "floor", "dram", "ssd")}
        hits: dict[str, list[int]] = {"dram": [], "ssd": []}
        filler: list[int] = []
        resident: list[float] = []
        for rep in range(reps + 1):
            pfx, sa, sb, sc = ids(n_pfx, rng), ids(suffix, rng), ids(suffix, rng), ids(suffix, rng)
            before = set(admin.all_keys())
            got = {"write": stream(writer, pfx + sa, max_tokens)}
            keys = new_chunks(admin, before, n_pfx // chunk)
            # Whether the DRAM hit read DRAM only (recorded: eviction could have taken some already).
            resident.append(len(_replicas(admin, keys)[0]) / len(keys))
            got["dram"] = stream(reader, pfx + sb, max_tokens)
            time.sleep(1.0)  # the read's lease (--default_kv_lease_ttl) ends: the chunks may be evicted
            filler.append(evict_to_disk(admin, client, keys, filler_limit))
            drop_page_cache(ssd_dir)
            got["ssd"] = stream(reader, pfx + sc, max_tokens)
            got["miss"] = stream(base, pfx + sa, max_tokens)
            got["floor"] = stream(base, pfx + sb, max_tokens)
            ref_c = stream(base, pfx + sc, max_tokens)
            n = n_pfx + suffix
            check.same("ssd_hit", "writer vs cold run", n, got["write"].token_ids, got["miss"].token_ids)
            check.same("ssd_hit", "DRAM hit vs vLLM prefix-cache hit", n, got["dram"].token_ids,
                       got["floor"].token_ids)
            check.same("ssd_hit", "SSD hit vs vLLM prefix-cache hit", n, got["ssd"].token_ids, ref_c.token_ids)
            if rep == 0:
                continue  # check and warm-up
            for k in t:
                t[k].append(got[k].ttft)
            for k in hits:
                hits[k].append(got[k].cached)
        med = {k: spread(v) for k, v in t.items()}
        row = {"prompt_tokens": n_pfx + suffix, "prefix_tokens": n_pfx, "ttft": med,
               "hit_tokens": {k: statistics.median(h) for k, h in hits.items()},
               "filler_mib": statistics.median(filler) / (1 << 20),
               "dram_resident_min": min(resident),  # share of the chunks in DRAM before a DRAM hit
               "ssd_vs_miss": med["ssd"]["median"] / med["miss"]["median"],
               "ssd_vs_dram": med["ssd"]["median"] / med["dram"]["median"],
               "dram_vs_floor": med["dram"]["median"] / med["floor"]["median"]}
        rows.append(row)
        print(f"  {n_pfx + suffix:>5} tokens  miss {med['miss']['median'] * 1e3:7.0f} ms  "
              f"floor {med['floor']['median'] * 1e3:6.0f} ms"
              f"  DRAM hit {med['dram']['median'] * 1e3:6.0f} ms  SSD hit {med['ssd']['median'] * 1e3:6.0f} ms "
              f"(x{row['ssd_vs_miss']:.2f} miss, x{row['ssd_vs_dram']:.2f} DRAM; hits {row['hit_tokens']})", flush=True)
    return rows


def run_section(dep, model: str, base: str, out: Path, prefixes: list[int], reps: int, store_config, extra: list[str],
                rng, check: Checker, chunk: int, suffix: int, max_tokens: int) -> list[dict]:
    """Start the SSD cluster, a writer (core 0) and a reader without a local prefix cache
    (core 1) on it and a pure store client, run :func:`ssd_hit`, and stop them (the client before the
    cluster). ``store_config(master)``: the engines' connector config."""
    import shutil

    from kvcore.platform import kv_bytes_per_token
    from mcstore.client import StoreClient
    from mcstore.config import StoreConfig
    from mcstore.server import StoreCluster

    ssd_dir = out / "ssd"
    shutil.rmtree(ssd_dir, ignore_errors=True)  # files left there would be registered as stored objects
    seg = segment_bytes(max(prefixes), kv_bytes_per_token(model))
    cluster = StoreCluster(log_dir=out / "logs", segment_size=seg, ssd_dir=str(ssd_dir),
                           extra_flags=["--default_kv_lease_ttl=500"]).start()
    client = None
    try:
        # A filler put may wait for the master's eviction: no slow-call trips (as a tool's client).
        client = StoreClient(StoreConfig(master=cluster.master_addr, local_buffer_size=2 * FILLER_BYTES,
                                         slow_rpc_s=120.0), "ssd-filler", segment=False)
        cfg = store_config(cluster.master_addr)
        (w_url, _), (r_url, _) = start_engines(
            dep, model, [("ssd-writer", 0, cfg), ("ssd-reader", 1, cfg, {"extra": ["--no-enable-prefix-caching"]})],
            extra=extra)
        print(f"[bench] ssd_hit: DRAM segment {seg >> 20} MiB, offload to {ssd_dir} ({reps} reps):", flush=True)
        admin = MasterAdmin(f"http://127.0.0.1:{cluster.metrics_port}")
        return ssd_hit(base, w_url, r_url, admin, client, str(ssd_dir), prefixes, reps, chunk, suffix, max_tokens,
                       4 * seg, rng, check)
    finally:
        dep.stop([p for p in dep.procs if p.name in ("ssd-writer", "ssd-reader")])
        if client is not None:
            client.close()
        dep.started += [p.popen.pid for p in (cluster.master, cluster.server) if p is not None]
        cluster.stop()
        shutil.rmtree(ssd_dir, ignore_errors=True)
