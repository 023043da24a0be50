"""Replay a decode engine's calibration samples through the cost model's fits, two ways.

    VLLM_LOGGING_LEVEL=DEBUG .venv/bin/python -m bench.tiered_bench ... --out DIR
    .venv/bin/python -m bench.calibration_replay DIR/logs/decode-1.log [more logs]

An engine whose composite runs at debug level logs every sample it learns
(``learned store: estimate ..., measured ... (LoadSample(tier='store', bytes=..., seconds=...))``,
``multi.scheduler.TieredScheduler._learn``). This feeds each log's samples, in their order,
into fresh fits started where the engine's start (``PolicyConfig``'s forward prior, each
tier's ``LOAD_PRIOR``) and reports, per kind (``forward``, each tier), over the second half
of the samples (the first half is the fit's warm-up): the mean estimate over the mean
measured seconds, the median of estimate / measured, and the mean relative error, for

- ``prediction``: the fit as it is (a sample's error taken relative to the fit's own
  prediction, :class:`multi.calibration.OnlineFit`);
- ``sample``: the previous weighting (relative to the sample's own seconds, until
  2026-12-05; ``relative_to="sample"``), which sits below the samples' median where they
  spread.

Each estimate is the fit's prediction for a sample before it learns that sample: what a
plan would have been told. Not a test: it reads logs, it never fails on a figure.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcstore.config import LOAD_PRIOR as STORE_PRIOR  # noqa: E402
from multi.calibration import OnlineFit  # noqa: E402
from multi.policy import CostModel, PolicyConfig, forward_features, load_features  # noqa: E402
from p2p.config import LOAD_PRIOR as P2P_PRIOR  # noqa: E402

PRIORS = {"store": STORE_PRIOR, "p2p": P2P_PRIOR}
LOAD = re.compile(r"learned (\w+): .*LoadSample\(tier='(\w+)', bytes=(\d+), seconds=([0-9.e-]+)")
FORWARD = re.compile(r"learned forward: .*ForwardSample\(new_tokens=\[([0-9, ]*)\], context=\[([0-9, ]*)\], "
                     r"seconds=([0-9.e-]+)\)")


def samples(path: Path) -> list[tuple[str, list[float], float]]:
    """(kind, features, measured seconds) of every sample an engine log records, in order."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if m := FORWARD.search(line):
            n = [int(v) for v in m[1].split(",") if v.strip()]
            c = [int(v) for v in m[2].split(",") if v.strip()]
            out.append(("forward", forward_features(n, c), float(m[3])))
        elif m := LOAD.search(line):
            out.append((m[2], load_features(float(m[3])), float(m[4])))
    return out


def replay(recorded: list[tuple[str, list[float], float]], fit) -> dict[str, list]:
    """Per kind, (estimate before the sample, measured) for each sample, fits started fresh
    (``fit``: what makes a fit, an ``OnlineFit`` with its weighting)."""
    model = CostModel(PolicyConfig(), fit=fit)
    pairs: dict[str, list] = {}
    for kind, x, y in recorded:
        fit = model.prefill if kind == "forward" else model.load_fit(kind, PRIORS.get(kind))
        pairs.setdefault(kind, []).append((fit.predict(x), y))
        fit.update(x, y)
    return pairs


def summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
    late = pairs[len(pairs) // 2:]
    est, got = [p for p, _ in late], [y for _, y in late]
    return {"n": len(late), "mean_ratio": statistics.mean(est) / statistics.mean(got),
            "median_ratio": statistics.median(p / y for p, y in late),
            "rel_error": statistics.mean(abs(p - y) / y for p, y in late),
            "measured_median_ms": 1e3 * statistics.median(got), "estimate_median_ms": 1e3 * statistics.median(est)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibration_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, help="engine logs written at VLLM_LOGGING_LEVEL=DEBUG")
    a = ap.parse_args(argv)
    print("| log | kind | weighting | samples (second half) | estimate/measured, means | median of "
          "estimate/measured | mean relative error | measured median ms | estimate median ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in a.logs:
        recorded = samples(path)
        if not recorded:
            print(f"{path}: no calibration samples (was the engine at VLLM_LOGGING_LEVEL=DEBUG?)", file=sys.stderr)
            continue
        by = {name: replay(recorded, functools.partial(OnlineFit, relative_to=name))
              for name in ("prediction", "sample")}
        for kind in by["prediction"]:
            for name, pairs in by.items():
                s = summary(pairs[kind])
                print(f"| {path.name} | {kind} | {name} | {s['n']} | {s['mean_ratio']:.2f} | {s['median_ratio']:.2f} "
                      f"| {s['rel_error']:.2f} | {s['measured_median_ms']:.1f} | {s['estimate_median_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
