"""What vLLM's hybrid KV cache allocator saves with the store tier (not a test): KV memory per
request, bytes saved to the store and loaded on a hit, and the hit's TTFT, hybrid allocator on
against off, side by side in one run.

    .venv/bin/python -m bench.hybrid_memory [--quick] [--lengths 2048,8192,16384] [--reps 2]
        [--models tiny-swa,tiny-swa-all]

Per model (``tiny-swa``: a 64-token sliding-window layer and a full-attention one, Gemma-2
style; ``tiny-swa-all``: both layers slide, Mistral style), four engines in dev mode
(``/reset_prefix_cache``), started together and stopped before the next model's:

- ``store-on`` (core 0) and ``store-off`` (core 1): ``StoreConnector``, ``kv_both``, each in a
  store namespace of its own (``key_prefix``), 256-token chunks. ``on``: vLLM's hybrid allocator
  (the store tier declares ``SupportsHMA``, so vLLM keeps it): one KV cache group per layer kind,
  a sliding group's blocks behind the window freed, stored and loaded only inside the window
  (``mcstore.groups``). ``off``: ``--disable-hybrid-kv-cache-manager``.
- ``ref-on`` (core 0) and ``ref-off`` (core 1): no connector, the same allocator setting, a
  sliding-window checkpoint kept every chunk (``--prefix-cache-retention-interval 256``, where
  the engine has a sliding group: vLLM refuses the flag for ``tiny-swa`` with the allocator off,
  whose sliding layer it promotes to full attention) so that their own prefix cache hits where
  the store does: the reference for the greedy ids.

An engine that does not start (vLLM or a tier refusing the layout) is reported as refused, with
the line of its log that says why; the other arm still runs.

Per prompt length ``L`` (a multiple of 256), ``--reps`` times (a fresh prompt each), per arm
(the arms' order rotating), on the arm's store engine:

1. the **miss**: a fresh prompt ``P`` of ``L + 8`` tokens (no full block past ``L``: no tail
   object), decoding 64 tokens while a thread reads the engine's ``vllm:kv_cache_usage_perc``
   off ``/metrics`` every 50 ms. **KV per request** = the gauge (blocks in use / the pool's
   blocks less the null block; blocks of finished requests kept only in the prefix cache count
   as free, so this is what the running request holds) x (``num_gpu_blocks`` - 1, from
   ``vllm:cache_config_info``) blocks x the bytes of a block (``VLLM_CPU_KVCACHE_SPACE`` /
   ``num_gpu_blocks``: the CPU backend splits exactly that space into the pool; a block holds
   one block of every layer of the largest group, so its size differs between the arms). Given
   as the median while it decodes (samples after its first token: steady) and the peak over the
   request (a lower bound: the gauge moves once a step, and a prefill step between two samples
   is missed).
2. **saved**: once the store tier's ``saved_tokens`` counter has moved by ``L``, the objects
   new in the arm's namespace, and the sum of their sizes as the master lists them (its admin
   API's replica descriptors; the store tier's own ``saved_bytes`` counter beside it).
3. the **hit**: the engine's prefix cache emptied, ``P[:L]`` plus one new block: its TTFT, the
   cached tokens, and the bytes the store tier loaded (``vllm:mctier_store_loaded_bytes_total``).
4. the **reference**: the arm's ``ref`` engine, its prefix cache emptied, serves ``P`` (streamed:
   the no-connector miss TTFT) then the hit's prompt (its own prefix-cache hit: the floor); the
   hit's greedy ids and cached tokens must equal the reference's. A mismatch is reported (exit
   status 1), never asserted away; no speed is asserted.

Writes ``hybrid_memory.json`` and ``hybrid_memory.md`` (the table: the median of each quantity
on and off and their ratio on/off) to ``--out`` (default ``bench/results/hybrid_memory``).
``--quick``: 2,048 tokens, one request per cell. Everything started is stopped at the end, also on failure and Ctrl-C.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.client import ids, reset_prefix_cache, stream  # noqa: E402
from bench.common import (  # noqa: E402
    QUIET_S,
    Checker,
    commit,
    long_context_args,
    machine,
    model_dir,
    output_dir,
    rotated,
    run_deployments,
    term_as_interrupt,
)
from bench.engine_metrics import get, moved, scrape  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.cli.deploy import Deployment  # noqa: E402

MODELS = ("tiny-swa", "tiny-swa-all")
ARMS = ("on", "off")  # vLLM's hybrid KV cache allocator
CHUNK = 256
BLOCK = 32
TAIL = 8  # P's tokens past L: fewer than a block, so no tail (part) object is saved
SUFFIX = 32  # the hit's new block
DECODE = 64  # tokens the miss decodes while its KV usage is sampled
MAX_TOKENS = 8  # the hit's and the reference's greedy ids
SAMPLE_S = 0.05
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
OFF_FLAG = "--disable-hybrid-kv-cache-manager"
USAGE = "vllm:kv_cache_usage_perc"


def store_config(master: str, namespace: str) -> dict:
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, "chunk_tokens": CHUNK, "key_prefix": namespace}}


def kv_bytes(usage: float | None, num_blocks: int, space_bytes: int) -> tuple[float, float] | None:
    """``(blocks, bytes)`` a ``vllm:kv_cache_usage_perc`` reading stands for in a pool of
    ``num_blocks`` blocks (the null block among them, which the gauge leaves out) splitting
    ``space_bytes``; None without a reading."""
    if usage is None or num_blocks < 2:
        return None
    blocks = usage * (num_blocks - 1)
    return blocks, blocks * (space_bytes // num_blocks)


def ratio(on, off) -> float | None:
    return on / off if on is not None and off else None


def refusal(log: str) -> str:
    """The line of a log that says why an engine did not start (the last error-like line)."""
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for needle in ("cannot save or load", "ConfigError", "ValueError", "NotImplementedError", "AssertionError",
                   "RuntimeError", "Error", "error"):
        hit = [x for x in lines if needle in x]
        if hit:
            return hit[-1][-400:]
    return (lines[-1] if lines else "no log")[-400:]


class UsageSampler:
    """``vllm:kv_cache_usage_perc`` read every ``SAMPLE_S`` while a request runs: (time, value)."""

    def __init__(self, url: str):
        self.url, self.samples, self._stop = url, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), get(scrape(self.url), USAGE)))
            except Exception:  # noqa: BLE001 - a missed sample is only a gap
                pass
            self._stop.wait(SAMPLE_S)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._t.join()


def usage_summary(samples: list[tuple[float, float]], first_token_at: float) -> dict:
    """Peak usage over the request and the median of the samples after its first token."""
    after = [u for t, u in samples if t >= first_token_at]
    return {"peak": max((u for _, u in samples), default=None), "decode": statistics.median(after) if after else None,
            "samples": len(samples), "decode_samples": len(after)}


def num_gpu_blocks(url: str) -> int:
    for (name, labels), _ in scrape(url).items():
        if name == "vllm:cache_config_info":
            return int(dict(labels).get("num_gpu_blocks") or 0)
    return 0


def wait_saved(url: str, m0: dict, tokens: int, timeout: float = 120.0) -> dict:
    """The store tier's counters once it has saved ``tokens`` since ``m0`` (and they settled)."""
    deadline = time.monotonic() + timeout
    while True:
        d = moved(scrape(url), m0)
        if get(d, "vllm:mctier_store_saved_tokens_total") >= tokens:
            time.sleep(0.3)
            return moved(scrape(url), m0)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: saved {get(d, 'vllm:mctier_store_saved_tokens_total'):.0f} of {tokens} "
                               f"tokens within {timeout:.0f} s")
        time.sleep(0.1)


def stored_objects(admin, namespace: str, before: set[str]) -> tuple[int, int]:
    """``(objects, bytes)`` new in ``namespace`` since ``before`` (chunks and part objects; not the
    published metadata nor directory entries), sizes as the master lists them."""
    from mcstore.tools.results import Replicas

    new = sorted(k for k in set(admin.all_keys()) - before
                 if k.startswith(namespace + "/") and not k.endswith("/meta") and k.split("/")[2:3] != ["d"])
    sizes = [Replicas.from_admin(v).bytes for v in admin.query(new).values()] if new else []
    return len(new), sum(sizes)


def hit_metrics(url: str, m0: dict) -> dict:
    deadline = time.monotonic() + 5
    while True:
        d = moved(scrape(url), m0)
        if get(d, "vllm:mctier_store_load_seconds_count") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"loaded_tokens": get(d, "vllm:mctier_store_loaded_tokens_total"),
            "loaded_bytes": get(d, "vllm:mctier_store_loaded_bytes_total"),
            "failures": get(d, "vllm:mctier_store_failures_total")}


def measure(arm: str, store: str, ref: str, namespace: str, admin, n: int, rng: random.Random, check: Checker,
            model: str, space: int, blocks: int) -> dict:
    p = ids(n + TAIL, rng)
    q = p[:n] + ids(SUFFIX, rng)
    time.sleep(QUIET_S)
    m0, keys0 = scrape(store), set(admin.all_keys())
    t0 = time.monotonic()
    with UsageSampler(store) as s:
        miss = stream(store, p, DECODE)
    use = usage_summary(s.samples, t0 + miss.ttft)
    d = wait_saved(store, m0, n)
    objects, obj_bytes = stored_objects(admin, namespace, keys0)
    reset_prefix_cache(store)  # the hit comes from the store
    time.sleep(QUIET_S)
    m1 = scrape(store)
    hit = stream(store, q, MAX_TOKENS)
    h = hit_metrics(store, m1)
    reset_prefix_cache(ref)
    time.sleep(QUIET_S)
    ref_miss = stream(ref, p, 1)
    time.sleep(QUIET_S)
    want = stream(ref, q, MAX_TOKENS)
    where = f"{model} hybrid {arm}, {n} tokens"
    check.same("hybrid_memory", f"{where}: store hit vs no-connector prefix-cache hit", len(q), hit.token_ids,
               want.token_ids)
    check.same("hybrid_memory", f"{where}: cached tokens, store hit vs reference", len(q), [hit.cached], [want.cached])
    peak, dec = kv_bytes(use["peak"], blocks, space), kv_bytes(use["decode"], blocks, space)
    row = {"model": model, "arm": arm, "tokens": n, "usage": use,
           "kv_blocks_peak": peak and peak[0], "kv_bytes_peak": peak and peak[1],
           "kv_blocks_decode": dec and dec[0], "kv_bytes_decode": dec and dec[1],
           "saved_objects": objects, "saved_bytes_master": obj_bytes,
           "saved_bytes_counter": get(d, "vllm:mctier_store_saved_bytes_total"),
           "saved_tokens": get(d, "vllm:mctier_store_saved_tokens_total"),
           "hit_ttft_s": hit.ttft, "hit_cached": hit.cached, **h, "ref_hit_ttft_s": want.ttft,
           "ref_cached": want.cached, "ref_miss_ttft_s": ref_miss.ttft, "store_miss_ttft_s": miss.ttft,
           "tokens_match": hit.token_ids == want.token_ids}
    print(f"[hybrid_memory] {where}: KV {_mb(row['kv_bytes_decode'])} MB decoding (peak {_mb(row['kv_bytes_peak'])}), "
          f"saved {objects} objects {_mb(obj_bytes)} MB (counter {_mb(row['saved_bytes_counter'])}), loaded "
          f"{_mb(h['loaded_bytes'])} MB, hit {_ms(hit.ttft)} ms (cached {hit.cached}), ref hit {_ms(want.ttft)} ms, "
          f"miss {_ms(ref_miss.ttft)} ms, tokens {'match' if row['tokens_match'] else 'DIFFER'}", flush=True)
    return row


def run_model(dep: Deployment, model_name: str, lengths: list[int], reps: int, rng: random.Random, check: Checker,
              rows: list[dict], refused: dict, space: int, info: dict) -> None:
    from mcstore.admin import MasterAdmin

    model = model_dir(model_name)
    info.setdefault("models", {})[model_name] = machine(model).get("model_shape")
    dep.cluster = StoreCluster(log_dir=dep.log_dir / f"store-{model_name}", segment_size=1 << 30).start()
    admin = MasterAdmin(f"http://{dep.cluster.host}:{dep.cluster.metrics_port}")
    long = long_context_args(max(lengths) + TAIL + DECODE + SUFFIX)
    procs = {}
    for arm, core in (("on", 0), ("off", 1)):
        flags = [*long, *([OFF_FLAG] if arm == "off" else [])]
        ns = f"hm{model_name.replace('-', '')}{arm}"
        procs[arm] = (ns, dep.engine(f"hm-{model_name}-store-{arm}", model, core, store_config(dep.cluster.master_addr, ns),
                                     env=DEV_MODE, extra=flags),
                      dep.engine(f"hm-{model_name}-ref-{arm}", model, core, None, env=DEV_MODE,
                                 extra=flags + retention(model, arm)))
    ready = {}
    for arm, (ns, (s_url, s_proc), (r_url, r_proc)) in procs.items():
        try:
            dep.wait_http(s_url, s_proc)
            dep.wait_http(r_url, r_proc)
            ready[arm] = (ns, s_url, r_url)
        except RuntimeError as e:
            who = s_proc if not s_proc.alive() else r_proc
            log = who.log_path.read_text(errors="replace") if who.log_path.exists() else str(e)
            refused[f"{model_name}/{arm}"] = f"{who.name}: {refusal(log)}"
            print(f"[hybrid_memory] {model_name} hybrid {arm}: REFUSED: {refused[f'{model_name}/{arm}']}", flush=True)
            dep.stop([s_proc, r_proc])
    blocks = {arm: num_gpu_blocks(s_url) for arm, (_, s_url, _) in ready.items()}
    info.setdefault("num_gpu_blocks", {})[model_name] = blocks
    k = 0
    for n in lengths:
        for rep in range(reps):
            for arm in rotated([a for a in ARMS if a in ready], k):
                ns, s_url, r_url = ready[arm]
                rows.append({**measure(arm, s_url, r_url, ns, admin, n, rng, check, model_name, space, blocks[arm]),
                             "rep": rep})
            k += 1


def retention(model: str, arm: str) -> list[str]:
    """The reference's flag for a sliding-window checkpoint every chunk, where it has a sliding
    group (vLLM refuses the flag otherwise): not a mixed model with the allocator off, whose
    sliding layers vLLM promotes to full attention."""
    import json

    kinds = set(json.loads((Path(model) / "config.json").read_text()).get("layer_types") or ())
    if arm == "off" and "full_attention" in kinds:
        return []
    return ["--prefix-cache-retention-interval", str(CHUNK)]


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


PAIRED = ("kv_bytes_decode", "kv_blocks_decode", "kv_bytes_peak", "saved_bytes_master", "loaded_bytes", "hit_ttft_s")
PER_ARM = ("saved_objects", "ref_hit_ttft_s", "ref_miss_ttft_s", "hit_cached")


def pairs(rows: list[dict]) -> list[dict]:
    """One row per (model, length): the median over repetitions of each quantity with the
    allocator on and off, and on/off; whether every repetition's tokens matched the reference."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for n in dict.fromkeys(r["tokens"] for r in rows if r["model"] == model):
            by = {a: [r for r in rows if r["model"] == model and r["tokens"] == n and r["arm"] == a] for a in ARMS}
            by = {a: rs for a, rs in by.items() if rs}
            row = {"model": model, "tokens": n, "reps": max(len(rs) for rs in by.values())}
            for k in PAIRED:
                on, off = (_med(r[k] for r in by.get(a, [])) for a in ARMS)
                row[k] = {"on": on, "off": off, "on/off": ratio(on, off)}
            for k in PER_ARM:
                row[k] = {a: _med(r[k] for r in rs) for a, rs in by.items()}
            row["tokens_match"] = {a: all(r["tokens_match"] for r in rs) for a, rs in by.items()}
            out.append(row)
    return out


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _n(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(paired: list[dict], result: dict) -> str:
    """The markdown table of :func:`pairs`' rows: per quantity on / off (on/off), then refusals."""
    m = result["machine"]
    head = (f"Run {result['date']}, commit {result['commit']}, {m['cpu']} ({', '.join(m['isa']) or 'no bf16/AMX flags'}; "
            f"engines {m['dtype']}), {m['cores']} cores, {result['chunk_tokens']}-token chunks, block "
            f"{result['block_tokens']}, median of {result['reps']} request(s) per cell. Each cell: hybrid allocator "
            f"on / off (on/off).\n\n")
    cols = ["model", "prompt", "KV per request decoding, MB [blocks]", "KV peak, MB", "saved to store, MB [objects]",
            "loaded on hit, MB", "hit TTFT ms", "no-connector hit / miss ms (on; off)", "cached on / off",
            "tokens = reference"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def cell(r, k, fmt):
        c = r[k]
        return f"{fmt(c['on'])} / {fmt(c['off'])} ({_x(c['on/off'])})"

    def per_arm(d, fmt=str):
        return " / ".join(fmt(d[a]) if a in d else "-" for a in ARMS)

    for r in paired:
        saved = f"{cell(r, 'saved_bytes_master', _mb)} [{per_arm(r['saved_objects'], _n)}]"
        kv = f"{cell(r, 'kv_bytes_decode', _mb)} [{_n(r['kv_blocks_decode']['on'])} / {_n(r['kv_blocks_decode']['off'])}]"
        refs = "; ".join(f"{_ms(r['ref_hit_ttft_s'][a])} / {_ms(r['ref_miss_ttft_s'][a])}" if a in r["ref_hit_ttft_s"]
                         else "-" for a in ARMS)
        lines.append("| " + " | ".join([
            r["model"], str(r["tokens"]), kv, cell(r, "kv_bytes_peak", _mb), saved,
            cell(r, "loaded_bytes", _mb), cell(r, "hit_ttft_s", _ms), refs, per_arm(r["hit_cached"], _n),
            per_arm(r["tokens_match"], lambda ok: "yes" if ok else "**no**")]) + " |")
    tail = "".join(f"\nRefused: {k} (hybrid allocator {k.split('/')[1]}): `{v}`\n"
                   for k, v in result.get("refused", {}).items())
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="--lengths 2048")
    ap.add_argument("--lengths", default="2048,8192,16384", help="prompt lengths in tokens (multiples of 256)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=2, help="requests per cell, each a fresh prompt (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hybrid_memory"))
    a = ap.parse_args(argv)
    if a.quick:
        a.lengths, a.reps = "2048", 1
    lengths = [int(x) for x in a.lengths.split(",")]
    if any(n % CHUNK or n < CHUNK for n in lengths):
        raise SystemExit(f"--lengths must be positive multiples of {CHUNK}")
    from kvcore.platform import engine_env

    space = int(float(engine_env()["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    out = output_dir(a.out)
    check, rng = Checker(), random.Random(a.seed)
    info: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "commit": commit(),
                  "machine": machine(), "chunk_tokens": CHUNK, "block_tokens": BLOCK, "kv_cache_space_bytes": space,
                  "lengths": lengths, "reps": a.reps, "quick": a.quick,
                  "command": " ".join(["python -m bench.hybrid_memory", *(sys.argv[1:] if argv is None else argv)])}
    rows: list[dict] = []
    refused: dict[str, str] = {}
    dep = Deployment(out / "logs")
    term_as_interrupt()
    errors = run_deployments(dep, {m: (lambda m=m: run_model(dep, m, lengths, a.reps, rng, check, rows, refused, space, info))
                                   for m in a.models.split(",")}, "hybrid_memory")
    paired = pairs(rows)
    result = {**info, "rows": rows, "pairs": paired, "refused": refused, "errors": errors,
              "pids": sorted(set(dep.started))}
    (out / "hybrid_memory.md").write_text(table(paired, result))
    print("\n" + table(paired, result))
    status = check.write(out / "hybrid_memory.json", result, "hybrid_memory")
    return 1 if errors else status


if __name__ == "__main__":
    sys.exit(main())
