"""The decision matrix's report (``bench.tiered_bench``): its progress line per cell and its
Markdown table with the summary against the issue's targets."""

from __future__ import annotations

from bench.common import spread


def io_cell(r: dict) -> str:
    """Medians (min-max) of the cell's store loads, every source's: buffer ranges per chunk and GB/s."""
    loads = [x for xs in r.get("store_io", {}).values() for x in xs if x]
    if not loads:
        return "-"

    def m(key: str, fmt: str) -> str:
        v = spread([x[key] for x in loads])
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"
    return f"{m('ranges_per_chunk', '.0f')}, {m('gbps', '.2f')}"


def progress_line(r: dict) -> str:
    """One finished cell, for the log: medians by source, the plan ``auto`` chose, and its check
    request's estimates (plan seconds, where the instance's own compute is weighted, and the
    chosen plan's compute unweighted, which a measured prefill compares with)."""
    est = r["auto_check_estimates"]
    meds = "  ".join(f"{s} {x['median'] * 1e3:.0f}" for s, x in r["ttft"].items())
    plans = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in est.get("seconds", {}).items())
    compute = 1e3 * est.get("parts", {}).get("compute_s", float("nan"))
    return (f"[decisions] {r['layout']:<12} n={r['tokens']:>5} stored={r['stored_tokens']:>5} "
            f"reps={len(r['orders'])}  {meds} ms; auto chose {','.join(sorted(set(r['auto_plans'])))}; "
            f"auto/best {r['auto_vs_best']:.2f}; its check request's estimates {plans} ms, weighted; the chosen "
            f"plan's compute unweighted {compute:.0f} ms (busy {est.get('busy', '?')})"
            + (f"; the prefill instance's plans by source {pp}" if (pp := est.get("prefill_plans")) else ""))


def render(rec: dict) -> str:
    rows = rec["cells"]
    lines = [f"Decision quality ({rec['date']}, {rec['machine']['cpu']}, {rec['machine']['dtype']}, `small`): TTFT "
             f"median (min-max) in ms over the cell's interleaved repetitions (`reps`: at least "
             f"{rec['args']['reps']}; more, up to {rec['args']['max_reps']}, while a cell's repetitions had "
             f"run under {rec['args']['min_cell_s']:.0f} s).", "",
             "| layout | prompt | stored | reps | recompute | store | p2p | auto | auto chose | best forced "
             "| auto/best (90% interval) | auto/oracle | auto/recompute (90% interval) "
             "| store loads: ranges/chunk, GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r, key):
        lo, hi = r[f"{key}_interval"]
        return f"{r[key]:.2f} ({lo:.2f}-{hi:.2f})"

    def t(r, s):
        x = r["ttft"].get(s)
        return "-" if x is None else f"{x['median'] * 1e3:.0f} ({x['min'] * 1e3:.0f}-{x['max'] * 1e3:.0f})"

    for r in rows:
        chose = ", ".join(sorted(set(r["auto_plans"])))
        lines.append(f"| {r['layout']} | {r['tokens']} | {r['stored_tokens']} | {len(r['orders'])} "
                     f"| {t(r, 'recompute')} | {t(r, 'store')} | {t(r, 'p2p')} | {t(r, 'auto')} | {chose} "
                     f"| {r['best_forced']} | {ratio(r, 'auto_vs_best')} | {r['auto_vs_oracle']:.2f} "
                     f"| {ratio(r, 'auto_vs_recompute')} | {io_cell(r)} |")
    s = rec["summary"]
    lines += ["", f"- `auto` within 10% of the best forced source in {s['within_best']}/{s['cells']} cells "
                  f"({s['within_best_share']:.0%}; target 90%): {'met' if s['within_best_share'] >= 0.9 else 'missed'}",
              f"- `auto` at most 5% slower than always recomputing in {s['within_recompute']}/{s['cells']} cells "
              f"(target: all): {'met' if s['within_recompute'] == s['cells'] else 'missed'}",
              f"- against each cell's 90% interval (the repetitions drawn again, `ratio_interval`): `auto` "
              f"more than 10% slower than the best forced source over the whole interval in "
              f"{s['beyond_best']}/{s['cells']} cells, within 10% over the whole interval in {s['surely_best']}, "
              f"undecided by the repetitions in {s['cells'] - s['beyond_best'] - s['surely_best']}; more than 5% "
              f"slower than recomputing over the whole interval in {s['beyond_recompute']}",
              f"- `auto` chose the plan of the fastest forced source in {s['same_plan']}/{s['cells']} cells",
              f"- greedy token identity with a no-connector engine on the same split: {rec['token_checks']} "
              f"comparisons, {len(rec['token_mismatches'])} mismatches; unchecked (a split no reference repeats): "
              + ("none" if not (u := [f"{r['layout']} {r['tokens']}: {x}" for r in rows for x in r["unchecked"]])
                 else "; ".join(u))]
    return "\n".join(lines) + "\n"
