"""The table (terminal and Markdown) of one ``bench/trace_replay.py`` result."""

from __future__ import annotations


def _tok(k: str):
    return lambda r: f"{r['tokens'][k]:,}"


ROWS = [("requests ok / failed", lambda r: f"{r['completed']} / {r['requests'] - r['completed']}"),
        *[(f"TTFT {p} (ms)", lambda r, p=p: f"{r[f'{p}_ttft_ms']:.0f}") for p in ("p50", "p90", "p99")],
        *[(f"TPOT {p} (ms)", lambda r, p=p: f"{r[f'{p}_tpot_ms']:.1f}") for p in ("p50", "p90", "p99")],
        ("TTFT <= SLO", lambda r: f"{r['slo_attainment']:.1%} (SLO {r['slo_s']} s)"),
        ("client prompt tokens", _tok("client_prompt")), ("engine prompt tokens", _tok("prompt")),
        ("local prefix-cache hits", _tok("local_hit")), ("store-loaded tokens", _tok("store")),
        ("P2P-pulled tokens", _tok("p2p")),
        ("recomputed tokens (share of client's)",
         lambda r: f"{r['tokens']['recomputed']:,} ({r['tokens']['recomputed_share']:.0%})"),
        ("local hits / queries, per engine", lambda r: ", ".join(
            f"{e.split('-', 1)[-1]} {x['local_hit'] / x['queries']:.0%}" if x["queries"] else f"{e} -"
            for e, x in r["tokens"]["engines"].items())),
        ("prefix cache per engine (tokens)",
         lambda r: ", ".join(f"{v:,}" for v in r["cache_tokens_per_engine"].values())),
        ("router routes", lambda r: ", ".join(f"{k} {v}" for k, v in r["router_view"]["routes"].items())),
        ("replay wall time (s)", lambda r: f"{r['wall_s']}"),
        ("sent vs trace time, min / max (s)", lambda r: " / ".join(f"{x:+.2f}" for x in r["sent_vs_trace_s"]))]


def table(result: dict) -> str:
    deps = [d for d in ("tiered", "plain") if d in result["deployments"]]
    lines = ["| | " + " | ".join(f"{d} ({'A' if d == 'tiered' else 'B'})" for d in deps) + " |",
             "|---|" + "---|" * len(deps)]
    for label, f in ROWS:
        cells = []
        for d in deps:
            try:
                cells.append(f(result["deployments"][d]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a failed deployment's missing numbers
                cells.append("-")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    for d in deps:
        if err := result["deployments"][d].get("error"):
            lines.append(f"\n{d} FAILED: {err.splitlines()[0][:200]} ... {err.splitlines()[-1][:200]}")
    return "\n".join(lines)


def render_markdown(result: dict) -> str:
    t, sp = result["trace"], result.get("speeds") or {}
    return (f"# Trace replay ({result['date']}, {result['model']}, {sp.get('dtype')})\n\n"
            f"`python {' '.join(t['command'][1:])}`: {t['requests']} requests over {t['span_s']} s, mean input "
            f"{t['avg_input']}, output {t['avg_output']}, ideal reuse {t['ideal_reuse']:.0%} "
            f"({t['prompts_cut_to_model']} prompts cut to the model's positions).\n\n{table(result)}\n")
