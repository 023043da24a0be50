"""Composite benchmarks (not a test): decision quality and TieredConnector vs stock MultiConnector.

    .venv/bin/python bench/tiered_bench.py [--quick] [--out bench/out]

1. Decision quality: for prompt lengths 64..8K tokens and store-hit fractions 0, 50%,
   100%, TTFT through the proxy with each forced source (recompute, store, p2p) and
   with ``auto``; reports the share of cases where auto is within 10% of the best
   forced source (target >= 90%).
2. Composite vs stock: decode-side TTFT of TieredConnector against vLLM's MultiConnector
   over this project's two tiers ([P2PConnector, StoreConnector], the documented
   Mooncake pairing), with half of the prompt already in the store.

Both run side by side in one invocation on the ``small`` model, engines pinned one
per core; medians of interleaved repetitions; every process is stopped at the end.
A table is printed and saved as JSON, and a plot as PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.demo import Deployment, tiered_config  # noqa: E402

SOURCES = ("recompute", "store", "p2p", "auto")


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(4, 2048) for _ in range(n)]


def ttft(url: str, prompt: list[int], kv: dict | None = None) -> float:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    if kv:
        body["kv_transfer_params"] = kv
    t0 = time.monotonic()
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                return time.monotonic() - t0
    raise RuntimeError("no token streamed")


def first_token(url: str, prompt: list[int]) -> tuple[float, str]:
    """Seconds to a 1-token (non-streamed) answer, and the decode instance's plan."""
    t0 = time.monotonic()
    r = requests.post(url + "/v1/completions", timeout=600, json={
        "model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    plan = (r.json().get("kv_transfer_params") or {}).get("kv_plan") or []
    return time.monotonic() - t0, "+".join(seg["source"] for seg in plan) or "-"


def store_prefix(p_url: str, prefix: list[int]) -> None:
    """A prefill-only request on the prefill instance saves the prefix's chunks."""
    if prefix:
        requests.post(p_url + "/v1/completions", timeout=600, json={
            "model": "demo", "prompt": prefix + [5], "max_tokens": 1, "temperature": 0}).raise_for_status()
        time.sleep(0.3)  # saves run off the forward path


def start_pair(dep: Deployment, model: str, p_cfg: dict, d_cfg: dict, boot: int) -> tuple[str, str]:
    p_url, _, proxy = dep.pd_pair(model, p_cfg, d_cfg, boot)
    return p_url, proxy


def stock_config(role: str, master: str, boot: int) -> dict:
    store_role = "kv_both" if role == "kv_producer" else "kv_consumer"
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p", "kv_role": role,
                 "kv_connector_extra_config": {"bootstrap_port": boot}},
                {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": store_role,
                 "kv_connector_extra_config": {"master": master, "chunk_tokens": 256}}]}}


def decision_quality(p_url, proxy, lengths, fractions, reps, rng) -> list[dict]:
    rows = []
    for n in lengths:
        for f in fractions:
            times: dict[str, list[float]] = {s: [] for s in SOURCES}
            for _ in range(reps):
                for src in SOURCES:  # interleaved
                    hit = int(n * f) // 256 * 256
                    prefix = ids(hit, rng)
                    store_prefix(p_url, prefix)
                    prompt = prefix + ids(n - hit, rng)
                    times[src].append(ttft(proxy, prompt, {"kv_source": src}))
            med = {s: statistics.median(v) for s, v in times.items()}
            best = min(med[s] for s in SOURCES if s != "auto")
            row = {"tokens": n, "store_fraction": f, **{f"ttft_{s}": med[s] for s in SOURCES},
                   "auto_vs_best": med["auto"] / best}
            rows.append(row)
            print(f"  n={n:>5} f={f:.0%}  " + "  ".join(f"{s} {med[s] * 1e3:7.0f}ms" for s in SOURCES)
                  + f"  auto/best {row['auto_vs_best']:.2f}", flush=True)
    return rows


def composite_vs_stock(pairs: dict[str, tuple[str, str]], lengths, reps, rng) -> list[dict]:
    rows = []
    for n in lengths:
        times: dict[str, list[float]] = {k: [] for k in pairs}
        plans: dict[str, list[str]] = {k: [] for k in pairs}
        for _ in range(reps):
            for name, (p_url, proxy) in pairs.items():
                prefix = ids(n // 2 // 256 * 256, rng)
                store_prefix(p_url, prefix)
                t, plan = first_token(proxy, prefix + ids(n - len(prefix), rng))
                times[name].append(t)
                plans[name].append(plan)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"tokens": n, **{f"ttft_{k}": v for k, v in med.items()}, "plans": plans,
                     "tiered_vs_stock": med["tiered"] / med["stock"]})
        print(f"  n={n:>5}  tiered {med['tiered'] * 1e3:7.0f}ms  stock {med['stock'] * 1e3:7.0f}ms  "
              f"ratio {med['tiered'] / med['stock']:.2f}  tiered plans {plans['tiered']}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({r["store_fraction"] for r in rows})
    fig, axes = plt.subplots(1, len(fractions), figsize=(5 * len(fractions), 4), squeeze=False)
    for ax, f in zip(axes[0], fractions):
        rs = [r for r in rows if r["store_fraction"] == f]
        for s in SOURCES:
            ax.plot([r["tokens"] for r in rs], [r[f"ttft_{s}"] * 1e3 for r in rs], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(f"store holds {f:.0%} of the prompt")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--only-stock", action="store_true", help="skip the decision-quality matrix")
    a = ap.parse_args()
    lengths = [256, 2048] if a.quick else [64, 256, 1024, 2048, 4096, 8000]
    fractions = [0.0, 1.0] if a.quick else [0.0, 0.5, 1.0]
    reps = a.reps or (1 if a.quick else 2)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from multi.models import build

    model = str(build("small", Path(os.environ.get("MCTIER_CACHE", ".cache")) / "models" / "small"))
    rng = random.Random(0)
    dep = Deployment(out / "logs")
    result: dict = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M"), "model": "small"}
    try:
        dep.cluster = StoreCluster(log_dir=out / "logs", segment_size=4 << 30).start()
        master = dep.cluster.master_addr
        boot = free_port()
        tiered = start_pair(dep, model, tiered_config("kv_producer", master, boot),
                            tiered_config("kv_consumer", master, free_port()), boot)
        result["decision_quality"] = []
        if not a.only_stock:
            print("decision quality (TTFT medians through the proxy):", flush=True)
            result["decision_quality"] = decision_quality(*tiered, lengths, fractions, reps, rng)
        ok = sum(r["auto_vs_best"] <= 1.10 for r in result["decision_quality"])
        result["auto_within_10pct"] = ok / max(1, len(result["decision_quality"]))
        boot2 = free_port()
        stock = start_pair(dep, model, stock_config("kv_producer", master, boot2),
                           stock_config("kv_consumer", master, free_port()), boot2)
        print("TieredConnector vs stock MultiConnector (half the prompt in the store):", flush=True)
        result["composite_vs_stock"] = composite_vs_stock({"tiered": tiered, "stock": stock},
                                                          [n for n in lengths if n >= 1024] or lengths, reps, rng)
    finally:
        dep.stop()
    (out / "tiered_bench.json").write_text(json.dumps(result, indent=1))
    if result["decision_quality"]:
        plot(result["decision_quality"], out / "tiered_decisions.png")
    print(f"\nauto within 10% of the best forced source in {result['auto_within_10pct']:.0%} of cases "
          f"(target >= 90%)")
    for r in result["composite_vs_stock"]:
        print(f"  {r['tokens']:>5} tokens: TieredConnector / stock MultiConnector TTFT = {r['tiered_vs_stock']:.2f}")
    print(f"wrote {out / 'tiered_bench.json'} and {out / 'tiered_decisions.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
