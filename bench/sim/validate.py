"""The simulator against the real stack on the same scaled window (``bench.trace_replay``).

Reads ``--replay``'s ``trace.jsonl`` (the window as the client replayed it),
``speeds.json`` (this machine's engines, measured in that run) and ``trace_replay.json``
(what the real deployments did), simulates both deployments with those speeds and sizes
(each deployment's own measured router overhead, and the tiered engines' own prefill and
decode fits when the replay measured them, :func:`bench.sim.speeds.from_measured`):

- ``tiered``: 1 prefill + 1 decode instance, the router's ``kv`` policy starting from the
  product's default :class:`multi.policy.PolicyConfig` (as the real router did), prefix
  caches of the engines' measured size, the store's DRAM and chunk size as configured;
- ``plain``: 2 plain instances without a store behind round-robin;

and compares, per deployment, median TTFT (target: within 25%) and prompt tokens by source
counted per engine (local prefix-cache hits, store loads, P2P pulls, recomputed; target:
within 5 points of the client's prompt tokens), and, where the replay kept its router's
decision log, the routes request by request (:mod:`bench.sim.decisions`), and for a
deployment with a prefill instance the shares again with its speed scaled by a few
percent (:func:`sensitivity`). Writes ``validation.json`` and
``validation.md`` and returns 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from bench import trace as T
from bench.sim import decisions
from bench.sim.cluster import Cluster
from bench.sim.report import summarize
from bench.sim.router import simulate
from bench.sim.speeds import from_measured

TTFT_TOLERANCE = 0.25
HIT_TOLERANCE = 0.05
SHARES = (("local", "local_hit", "engine_local"), ("store", "store", "engine_store"),
          ("p2p", "p2p", "engine_p2p"), ("recomputed", "recomputed", "recomputed_share"))


def clusters(run: dict, speeds: dict, block: int) -> dict[str, tuple[Cluster, str]]:
    cache = (speeds.get("prefix_cache_tokens_per_engine") or 0) // block
    bytes_per_block = block * speeds["bytes_per_token"]
    store = int(speeds.get("store_dram_bytes", 0) // bytes_per_block)
    chunk = max(1, speeds.get("store_chunk_tokens", block) // block)
    return {"tiered": (Cluster(prefill=1, decode=1, cache_blocks=cache, store_dram_blocks=store,
                               store_chunk_blocks=chunk, block=block), "kv"),
            "plain": (Cluster(plain=2, cache_blocks=cache, block=block), "round-robin")}


def compare(real: dict, sim: dict) -> dict:
    tok = real["tokens"]
    client = tok["client_prompt"] or 1
    out = {"ttft_p50": {"real": real["p50_ttft_ms"] / 1e3, "sim": sim["ttft_p50"]},
           "ttft_p90": {"real": real["p90_ttft_ms"] / 1e3, "sim": sim["ttft_p90"]},
           "tpot_p50": {"real": real["p50_tpot_ms"] / 1e3, "sim": sim["tpot_p50"]},
           "slo_attainment": {"real": real["slo_attainment"], "sim": sim["slo_attainment"]}}
    e = out["ttft_p50"]
    e["error"] = abs(e["sim"] - e["real"]) / e["real"] if e["real"] else None
    e["ok"] = e["error"] is not None and e["error"] <= TTFT_TOLERANCE
    for name, real_key, sim_key in SHARES:
        r = tok[real_key] / client
        out[f"share_{name}"] = {"real": r, "sim": sim[sim_key], "points": abs(sim[sim_key] - r),
                                "ok": abs(sim[sim_key] - r) <= HIT_TOLERANCE}
    return out


SPEED_FACTORS = (0.95, 1.0, 1.03, 1.05, 1.1)


def sensitivity(reqs, sp, cl: Cluster, policy: str, block: int, slo: float) -> list[dict]:
    """The same simulation with the prefill instance's speed scaled by each of
    ``SPEED_FACTORS`` (its prefill taking that many times as long): how far the token
    shares move for a few percent of speed, i.e. how much of a share's error the
    measured speeds' own uncertainty can explain."""
    base = sp.role_prefill.get("prefill", sp.prefill)
    out = []
    for f in SPEED_FACTORS:
        p = replace(base, step_s=base.step_s * f, token_s=base.token_s * f, attn_s=base.attn_s * f)
        s = summarize(simulate(reqs, replace(sp, role_prefill={**sp.role_prefill, "prefill": p}), cl, policy),
                      reqs, block, slo)
        out.append({"factor": f, "ttft_p50": s["ttft_p50"], "share_p2p": s["engine_p2p"],
                    "share_local": s["engine_local"], "routes": s["routes"]})
    return out


def validate(replay: Path, out: Path | None = None) -> int:
    out = out or replay
    run = json.loads((replay / "trace_replay.json").read_text())
    speeds_raw = json.loads((replay / "speeds.json").read_text())
    reqs = T.load(str(replay / "trace.jsonl"))
    block = T.BLOCK // run["args"]["len_factor"]
    slo = run["args"]["ttft_slo"]
    rec = {"replay": str(replay), "speeds": speeds_raw, "deployments": {}}
    ok = True
    for name, (cl, policy) in clusters(run, speeds_raw, block).items():
        real = run["deployments"].get(name) or {}
        if real.get("error") or "tokens" not in real:
            rec["deployments"][name] = {"skipped": real.get("error", "not in the replay")}
            ok = False
            continue
        sp = from_measured(replay / "speeds.json", name)
        results = simulate(reqs, sp, cl, policy)
        sim = summarize(results, reqs, block, slo)
        cmp = compare(real, sim)
        rec["deployments"][name] = {"cluster": vars(cl), "policy": policy, "overhead_s": sp.overhead_s, "sim": sim,
                                    "compare": cmp}
        log = replay / f"decisions-{name}.jsonl"
        if log.exists():
            rec["deployments"][name]["decisions"] = decisions.compare(decisions.load(log), results)
        if cl.prefill:
            rec["deployments"][name]["sensitivity"] = sensitivity(reqs, sp, cl, policy, block, slo)
        ok &= all(v.get("ok", True) for v in cmp.values())
    rec["ok"] = ok
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(rec, indent=1, default=str))
    lines = [f"Simulator against the real replay in {replay} (targets: median TTFT within "
             f"{TTFT_TOLERANCE:.0%}, token shares within {HIT_TOLERANCE * 100:.0f} points).", "",
             "| deployment | figure | real | simulated | error | ok |", "|---|---|---|---|---|---|"]
    for name, d in rec["deployments"].items():
        if "skipped" in d:
            lines.append(f"| {name} | skipped: {d['skipped'][:120]} | | | | |")
            continue
        for fig, v in d["compare"].items():
            err = (f"{v['error']:.0%}" if v.get("error") is not None else
                   f"{v['points'] * 100:.1f} pt" if "points" in v else "")
            real_v = "-" if v["real"] is None else f"{v['real']:.3f}"
            sim_v = "-" if v["sim"] is None else f"{v['sim']:.3f}"
            ok = "" if "ok" not in v else "yes" if v["ok"] else "NO"
            lines.append(f"| {name} | {fig} | {real_v} | {sim_v} | {err} | {ok} |")
    for name, d in rec["deployments"].items():
        if "sensitivity" in d:
            lines += ["", f"**{name}**, the prefill instance's speed scaled (its prefill takes x times as long):", "",
                      "| x | TTFT p50 (s) | P2P share | local share | handoffs |", "|---|---|---|---|---|"]
            lines += [f"| {x['factor']:g} | {x['ttft_p50']:.3f} | {x['share_p2p']:.3f} | {x['share_local']:.3f} | "
                      f"{x['routes']['pd']} |" for x in d["sensitivity"]]
        if "decisions" in d:
            head, *table = decisions.markdown(d["decisions"])
            lines += ["", f"**{name}**: " + head, *table]
    (out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1
