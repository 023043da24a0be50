"""Decision quality of the composite (not a test): is ``auto`` as fast as the best forced source?

    .venv/bin/python bench/tiered_bench.py [--quick] [--reps N] [--out bench/out]

For prompt lengths 64..8K tokens and store-hit fractions 0, 50%, 100%, TTFT through
the proxy with each forced source (recompute, store, p2p) and with ``auto``, on the
``small`` model, engines pinned one per core; medians of interleaved repetitions.
Reports the share of cells where auto is within 10% of the best forced source
(target >= 90%), prints a table and writes JSON and a PNG. TieredConnector against
the stock MultiConnector is part of ``bench/suite.py`` (``make bench``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import complete, ids, stream  # noqa: E402
from kvcore.procs import free_port  # noqa: E402
from mcstore.server import StoreCluster  # noqa: E402
from multi.deploy import Deployment, tiered_config  # noqa: E402

SOURCES = ("recompute", "store", "p2p", "auto")


def store_prefix(p_url: str, prefix: list[int]) -> None:
    """A prefill-only request on the prefill instance saves the prefix's chunks."""
    if prefix:
        complete(p_url, prefix + [5], 1)
        time.sleep(0.3)  # saves run off the forward path


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
                    times[src].append(stream(proxy, prompt, 2, {"kv_source": src}).ttft)
            med = {s: statistics.median(v) for s, v in times.items()}
            best = min(med[s] for s in SOURCES if s != "auto")
            row = {"tokens": n, "store_fraction": f, **{f"ttft_{s}": med[s] for s in SOURCES},
                   "auto_vs_best": med["auto"] / best}
            rows.append(row)
            print(f"  n={n:>5} f={f:.0%}  " + "  ".join(f"{s} {med[s] * 1e3:7.0f}ms" for s in SOURCES)
                  + f"  auto/best {row['auto_vs_best']:.2f}", flush=True)
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
        p_url, _, proxy = dep.pd_pair(model, tiered_config("kv_producer", master, boot),
                                      tiered_config("kv_consumer", master, free_port()), boot)
        print("decision quality (TTFT medians through the proxy):", flush=True)
        result["decision_quality"] = decision_quality(p_url, proxy, lengths, fractions, reps, rng)
        ok = sum(r["auto_vs_best"] <= 1.10 for r in result["decision_quality"])
        result["auto_within_10pct"] = ok / max(1, len(result["decision_quality"]))
    finally:
        dep.stop()
    (out / "tiered_bench.json").write_text(json.dumps(result, indent=1))
    if result["decision_quality"]:
        plot(result["decision_quality"], out / "tiered_decisions.png")
    print(f"\nauto within 10% of the best forced source in {result['auto_within_10pct']:.0%} of cases "
          f"(target >= 90%)")
    print(f"wrote {out / 'tiered_bench.json'} and {out / 'tiered_decisions.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
