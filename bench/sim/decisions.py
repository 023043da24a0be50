"""The real router's decisions against the simulator's, request by request.

The real side is ``mctier proxy --decision-log`` over a replay (``bench.trace_replay``
writes ``decisions-<deployment>.jsonl``, in the order routed); the simulated side the
:class:`bench.sim.cluster.Result` of the same requests, in trace order. Request ``i`` of
one is request ``i`` of the other when the prompt lengths agree (the client sends them in
trace order; two sent within the same millisecond may swap, which the length check catches
unless both are of one length).

Per pair: the route kind each took (``pd`` or ``direct``), what each router knew (the
prefix on the prefill and the decode instance, the store's reach) and how much cheaper
it estimated the winner than the loser: the margin ``m = t_pd - t_direct`` in seconds
from the route's ``candidates`` (negative: the handoff looked cheaper). Reported: the
2x2 table of kinds, the share that agree, and for each kind of disagreement the medians
of both sides' margins, of ``cached_target`` (what the decode instance held) and of the
predicted wait on the chosen route; these say whether the two routers saw different
caches (the index) or weighed the same ones differently (the cost model and its fits).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.sim.cluster import Result
from bench.sim.report import pct


def load(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _margin(candidates: dict[str, float]) -> float | None:
    """``t_pd - t_direct`` over the best of each kind; None unless both were weighed."""
    best: dict[str, float] = {}
    for key, s in candidates.items():
        kind = key.split(" ", 1)[0]
        best[kind] = min(s, best.get(kind, float("inf")))
    return best["pd"] - best["direct"] if "pd" in best and "direct" in best else None


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return pct(xs, 0.5)


def compare(real: list[dict], sim: list[Result]) -> dict:
    """Pairs ``real[i]`` with ``sim[i]`` (see the module docstring); unpaired or
    mismatched-length requests are counted, not compared."""
    pairs = [(r, s) for r, s in zip(real, sim) if r["n"] == s.n]
    table: dict[str, int] = {}
    groups: dict[str, list[tuple[dict, Result]]] = {}
    for r, s in pairs:
        key = f"real {r['kind']}, sim {s.kind}"
        table[key] = table.get(key, 0) + 1
        groups.setdefault(key, []).append((r, s))
    out = {"real": len(real), "sim": len(sim), "paired": len(pairs),
           "length_mismatch": min(len(real), len(sim)) - len(pairs),
           "agree": sum(1 for r, s in pairs if r["kind"] == s.kind) / len(pairs) if pairs else None,
           "table": table, "groups": {}}
    for key, g in sorted(groups.items()):
        out["groups"][key] = {
            "count": len(g),
            "n_p50": _med(r["n"] for r, _ in g),
            "real_margin_p50_s": _med(_margin(r["candidates"]) for r, _ in g),
            "sim_margin_p50_s": _med(_margin(s.candidates) for _, s in g),
            "real_cached_target_p50": _med(r["cached_target"] for r, _ in g),
            "sim_cached_target_p50": _med(s.cached_target for _, s in g),
            "real_cached_prefill_p50": _med(r["cached_prefill"] for r, _ in g),
            "sim_cached_prefill_p50": _med(s.cached_prefill for _, s in g),
            "real_store_p50": _med(r["store"] for r, _ in g),
            "sim_store_p50": _med(s.store_view for _, s in g),
            "real_wait_p50_s": _med(r["wait_s"] for r, _ in g),
            "real_ttft_p50_s": _med(r["ttft_s"] for r, _ in g),
            "sim_ttft_p50_s": _med(s.ttft for _, s in g),
        }
    return out


def markdown(cmp: dict) -> list[str]:
    lines = [f"Routes request by request: {cmp['paired']} of {cmp['real']} real and {cmp['sim']} simulated "
             f"requests paired, {cmp['agree']:.0%} took the same kind of route." if cmp["agree"] is not None
             else "Routes request by request: nothing to pair.", "",
             "| real, sim | requests | prompt p50 | margin pd-direct real / sim (s) | decode holds real / sim "
             "| prefill holds real / sim | TTFT real / sim (s) |", "|---|---|---|---|---|---|---|"]

    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    for key, g in cmp["groups"].items():
        lines.append(f"| {key} | {g['count']} | {f(g['n_p50'], '.0f')} | {f(g['real_margin_p50_s'])} / "
                     f"{f(g['sim_margin_p50_s'])} | {f(g['real_cached_target_p50'], '.0f')} / "
                     f"{f(g['sim_cached_target_p50'], '.0f')} | {f(g['real_cached_prefill_p50'], '.0f')} / "
                     f"{f(g['sim_cached_prefill_p50'], '.0f')} | {f(g['real_ttft_p50_s'])} / "
                     f"{f(g['sim_ttft_p50_s'])} |")
    return lines
