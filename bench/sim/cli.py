"""``python -m bench.sim``: the cluster runs and the validation against a real replay.

    .venv/bin/python -m bench.sim cluster [--trace conversation] [--prefill 8 --decode 8]
        [--rates 1,1.25,1.5,2] [--slo 10] [--store-tb 16] [--out bench/results/sim]
    .venv/bin/python -m bench.sim validate --replay bench/results/trace_replay

``cluster`` replays a whole trace at its real scale on the ``a800x8`` preset
(:mod:`bench.sim.speeds`; every figure's source is in the output) and writes
``sim.json``, ``sim.md`` and ``sim.png`` (TTFT p50/p90 and SLO attainment against the
arrival rate, per policy) to ``--out``:

- policies at each arrival rate (the trace's times divided by the rate): round-robin and
  ``kv`` without the store; with the store ``round-robin``, ``least-outstanding``,
  ``prefix-affinity``, ``kv``, and ``kv`` with SLO admission (``--slo``);
- store sizes (``kv``, the first rate): reuse and attainment per DRAM size, and the smallest
  size reaching 90% of the ideal reuse;
- link bandwidth (``kv``, the first rate): the store and P2P links scaled by 0.1 and 0.01;
- capacity (:mod:`bench.sim.capacity`): for round-robin and ``kv`` without the store, ``kv``
  with it and ``kv`` with admission, the highest arrival rate at which at least
  ``--capacity-target`` of the requests meet the TTFT SLO, and each one's gain over
  round-robin without the store (Mooncake's "more requests within the SLO").

The router's cost model starts from the preset's speeds (an operator's profile of its
hardware; the CPU defaults of :class:`multi.policy.PolicyConfig` are ten to a hundred
times off for a GPU node) and calibrates online from there, as in the product.

``validate`` runs the deployments of ``bench.trace_replay`` (its ``trace.jsonl``,
``speeds.json`` and ``trace_replay.json`` in ``--replay``) through the simulator with
that run's measured speeds and compares median TTFT and hit rates with the real ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import trace as T
from bench.sim.capacity import capacity
from bench.sim.cluster import Cluster
from bench.sim.report import summarize
from bench.sim.router import simulate
from bench.sim.speeds import Speeds, a800x8
from bench.sim.validate import validate
from kvcore.tier import LoadPrior
from multi.policy import PolicyConfig

COLUMNS = ("slo_attainment", "goodput_rps", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "reuse",
           "reuse_of_ideal", "hit_local", "hit_store", "rejected")


# The capacity comparison: Mooncake's baseline (round-robin, no store) first.
CAPACITY_VARIANTS = ("round-robin, no store", "kv, no store", "kv", "kv, admission")


def policy_cfg(sp: Speeds) -> PolicyConfig:
    """The router's starting point: the preset's own speeds (module docstring)."""
    return PolicyConfig(prefill_step_s=sp.prefill.step_s, prefill_token_s=sp.prefill.token_s,
                        prefill_attn_s=sp.prefill.attn_s,
                        tiers={"store": LoadPrior(latency_s=sp.store.latency_s, bandwidth_gbps=sp.store.gbps),
                               "p2p": LoadPrior(latency_s=sp.p2p.latency_s, bandwidth_gbps=sp.p2p.gbps)})


def at_rate(reqs: list[T.Request], rate: float) -> list[T.Request]:
    return [replace(r, timestamp_ms=r.timestamp_ms / rate) for r in reqs]


def run_one(reqs, sp: Speeds, cl: Cluster, policy: str, slo: float | None, slo_metric: float) -> dict:
    t = time.monotonic()
    res = simulate(reqs, sp, cl, policy, slo=slo, policy_cfg=policy_cfg(sp))
    s = summarize(res, reqs, cl.block, slo_metric)
    s["wall_s"] = round(time.monotonic() - t, 1)
    return s


def cluster_runs(a: argparse.Namespace) -> dict:
    reqs = T.load(a.trace, a.limit)
    sp = a800x8()
    block_bytes = T.BLOCK * sp.bytes_per_token
    tb = lambda x: int(x * 1e12 // block_bytes)  # noqa: E731 - TB of DRAM to blocks
    base = Cluster(prefill=a.prefill, decode=a.decode, cache_blocks=int(a.cache_gb * 1e9 // block_bytes),
                   block=T.BLOCK)
    store = replace(base, store_dram_blocks=tb(a.store_tb), store_ssd_blocks=tb(a.ssd_tb))
    rates = [float(x) for x in a.rates.split(",")]
    variants = [("round-robin, no store", base, "round-robin", None), ("kv, no store", base, "kv", None),
                ("round-robin", store, "round-robin", None), ("least-outstanding", store, "least-outstanding", None),
                ("prefix-affinity", store, "prefix-affinity", None), ("kv", store, "kv", None),
                ("kv, admission", store, "kv", a.slo)]
    rows = []
    for rate in rates:
        rr = at_rate(reqs, rate)
        for name, cl, policy, slo in variants:
            rows.append({"rate": rate, "variant": name, **run_one(rr, sp, cl, policy, slo, a.slo)})
            print(f"rate x{rate:g} {name:28s} " + " ".join(f"{k}={_fmt(rows[-1][k])}" for k in COLUMNS[:6]),
                  flush=True)
    first = at_rate(reqs, rates[0])
    sizes = []
    for x in [float(v) for v in a.store_sizes_tb.split(",")]:
        s = run_one(first, sp, replace(base, store_dram_blocks=tb(x)), "kv", None, a.slo)
        sizes.append({"store_tb": x, **s})
        print(f"store {x:g} TB: reuse of ideal {_fmt(s['reuse_of_ideal'])}, attainment {_fmt(s['slo_attainment'])}",
              flush=True)
    enough = next((r["store_tb"] for r in sizes if (r["reuse_of_ideal"] or 0) >= 0.9), None)
    links = []
    for f in (1.0, 0.1, 0.01):
        sp2 = replace(sp, store=replace(sp.store, gbps=sp.store.gbps * f), p2p=replace(sp.p2p, gbps=sp.p2p.gbps * f),
                      ssd=replace(sp.ssd, gbps=sp.ssd.gbps * f))
        s = run_one(first, sp2, store, "kv", None, a.slo)
        links.append({"link_factor": f, "store_gbps": sp2.store.gbps, "p2p_gbps": sp2.p2p.gbps, **s})
        print(f"links x{f:g}: attainment {_fmt(s['slo_attainment'])}, ttft p50 {_fmt(s['ttft_p50'])}", flush=True)
    caps = []
    for name, cl, policy, slo in [v for v in variants if v[0] in CAPACITY_VARIANTS]:
        c = capacity(lambda r: run_one(at_rate(reqs, r), sp, cl, policy, slo, a.slo)["slo_attainment"],
                     a.capacity_target, a.capacity_tol)
        caps.append({"variant": name, **c})
        print(f"capacity {name:28s} x{_fmt(c['rate'])} {c['bound'] or ''} ({len(c['runs'])} runs)", flush=True)
    base_cap = caps[0]["rate"] if caps else None
    for c in caps:
        c["gain_over_first"] = (c["rate"] / base_cap - 1) if c["rate"] and base_cap else None
    return {"trace": T.describe(reqs, T.BLOCK), "cluster": {"prefill": a.prefill, "decode": a.decode,
            "cache_gb_per_instance": a.cache_gb, "store_tb": a.store_tb, "ssd_tb": a.ssd_tb}, "slo_s": a.slo,
            "speeds": sp.to_dict(), "rows": rows, "store_sizes": sizes, "store_tb_for_90pct_of_ideal": enough,
            "links": links, "capacity_target": a.capacity_target, "capacity": caps}


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write(out: Path, rec: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim.json").write_text(json.dumps(rec, indent=1))
    lines = [f"Trace: {rec['trace']}; cluster {rec['cluster']}; TTFT SLO {rec['slo_s']} s.", "",
             "| rate | variant | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for r in rec["rows"]:
        lines.append(f"| x{r['rate']:g} | {r['variant']} | " + " | ".join(_fmt(r[k]) for k in COLUMNS) + " |")
    lines += ["", "| store DRAM (TB) | reuse of ideal | SLO attainment | TTFT p50 |", "|---|---|---|---|"]
    lines += [f"| {r['store_tb']:g} | {_fmt(r['reuse_of_ideal'])} | {_fmt(r['slo_attainment'])} | "
              f"{_fmt(r['ttft_p50'])} |" for r in rec["store_sizes"]]
    lines += ["", f"Smallest store reaching 90% of the ideal reuse: {rec['store_tb_for_90pct_of_ideal']} TB", "",
              "| links | store GB/s | P2P GB/s | SLO attainment | TTFT p50 | TTFT p90 |", "|---|---|---|---|---|---|"]
    lines += [f"| x{r['link_factor']:g} | {r['store_gbps']:g} | {r['p2p_gbps']:g} | {_fmt(r['slo_attainment'])} | "
              f"{_fmt(r['ttft_p50'])} | {_fmt(r['ttft_p90'])} |" for r in rec["links"]]
    if rec.get("capacity"):
        first = rec["capacity"][0]["variant"]
        lines += ["", f"Capacity: the highest arrival rate (x the trace's) with at least "
                  f"{rec['capacity_target']:.0%} of requests within {rec['slo_s']:g} s (bench/sim/capacity.py)", "",
                  f"| variant | capacity | search bound hit | runs | more requests than {first} |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c['variant']} | {_fmt(c['rate'])} | {c['bound'] or '-'} | {len(c['runs'])} | "
                  f"{'-' if c['gain_over_first'] is None else format(c['gain_over_first'], '+.0%')} |"
                  for c in rec["capacity"]]
    lines += ["", "Sources of the speed model:"] + [f"- {k}: {v}" for k, v in rec["speeds"]["sources"].items()]
    (out / "sim.md").write_text("\n".join(lines) + "\n")
    plot(out / "sim.png", rec)
    print("\n".join(lines))


def plot(path: Path, rec: dict) -> None:
    from bench.report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    names = list(dict.fromkeys(r["variant"] for r in rec["rows"]))
    for name in names:
        rows = [r for r in rec["rows"] if r["variant"] == name]
        x = [r["rate"] for r in rows]
        axes[0].plot(x, [r["ttft_p50"] for r in rows], marker="o", label=name)
        axes[1].plot(x, [r["ttft_p90"] for r in rows], marker="o", label=name)
        axes[2].plot(x, [r["slo_attainment"] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("TTFT p50 (s)", "TTFT p90 (s)", f"requests within {rec['slo_s']:g} s")):
        ax.set_title(title)
        ax.set_xlabel("arrival rate (x the trace's)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cluster", help="a whole trace at cluster scale (module docstring)")
    c.add_argument("--trace", default="conversation")
    c.add_argument("--limit", type=int, default=None, help="only the first LIMIT requests")
    c.add_argument("--prefill", type=int, default=8)
    c.add_argument("--decode", type=int, default=8)
    c.add_argument("--cache-gb", type=float, default=300.0, help="each instance's prefix cache (GB of HBM)")
    c.add_argument("--store-tb", type=float, default=16.0, help="the store's DRAM (TB, the whole cluster)")
    c.add_argument("--ssd-tb", type=float, default=0.0)
    c.add_argument("--store-sizes-tb", default="0,0.5,1,2,4,8,16,32")
    c.add_argument("--rates", default="1,1.25,1.5,2")
    c.add_argument("--slo", type=float, default=10.0, help="TTFT target (s): attainment and admission")
    c.add_argument("--capacity-target", type=float, default=0.9,
                   help="SLO attainment a rate must reach to count in the capacity search")
    c.add_argument("--capacity-tol", type=float, default=0.05, help="capacity search stops at hi/lo <= 1+tol")
    c.add_argument("--out", default="bench/results/sim")
    v = sub.add_parser("validate", help="the simulator against bench.trace_replay's real run")
    v.add_argument("--replay", default="bench/results/trace_replay")
    v.add_argument("--out", default=None, help="default: the replay directory")
    a = ap.parse_args(argv)
    if a.cmd == "cluster":
        write(Path(a.out), cluster_runs(a))
        return 0
    try:
        return validate(Path(a.replay), Path(a.out) if a.out else None)
    except (OSError, ValueError, KeyError) as e:
        print(f"validate: {e!r}", file=sys.stderr)
        return 2
