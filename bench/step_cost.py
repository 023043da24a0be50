"""What each connector adds to an engine's steps, measured quietly: engines run in turn, one
batch each, so the host's drift in speed hits every arm alike (not a test).

    .venv/bin/python -m bench.step_cost [--quick] [--rounds 20] [--arms plain,null,store,p2p,tiered]
    .venv/bin/python -m bench.step_cost --arms plain,tiered --before DIR    (DIR: `git archive` of an earlier commit)
    MCTIER_SIMULATE_CPU=avx2 .venv/bin/python -m bench.step_cost         (the slow CPU class)

Why: ``bench.no_reuse`` serves vLLM's client through each engine's API server; there the per-step
cost of a connector (a few percent of a step) drowns in this host's run-to-run drift: two plain
engines differed by up to 1.18x in TPOT (docs/benchmarks/no-reuse.md). Here each arm is one
in-process vLLM engine (``vllm.LLM``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker
and connector hooks on one thread, no API server), its own process pinned to core 1, the
``tiny`` model (``--model``), block size 32, at most 4 sequences; the arms' engines all stay up and run one
at a time. Two batches:

- ``decode``: 4 prompts of 16 tokens, 128 tokens each: 128 steps of 4 decoding requests;
- ``mixed``: 16 prompts of 256 tokens, 64 tokens each: prefills between decodes.

A round runs each batch on ``plain``, then on each other arm (their order rotated by one per
round) with ``plain`` again after each: an arm's ratio is its time over the mean of the two
``plain`` runs beside it, a second or two apart. Every run has its own random prompts (so
nothing is reused: ``store`` saves, and looks up, prompts it never saw). Arms are
``bench.no_reuse``'s (``plain``, ``null``, ``store`` kv_both, ``p2p`` and ``tiered``
kv_consumer, ``--variant``), each with its own store namespace on one Mooncake master and
store server (started beside the driver, on core 0). The table gives per arm the median over
rounds of each batch's seconds and of its ratio to the ``plain`` runs beside it, with the
ratios' interquartile range. ``--before DIR`` runs each of the ``store``, ``p2p`` and ``tiered``
arms asked for once more with the connector packages (and ``bench.no_reuse``'s arms) of DIR's
tree (``ARM-before``). Writes ``step_cost.json`` and ``step_cost.md`` to ``--out`` (default
``bench/results/step_cost/``); everything started is stopped at the end, also on failure and
Ctrl-C. Exit status 1 when an arm failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE_ENV = "MCTIER_STEP_COST_TREE"  # a --before arm's engine: that tree's packages first
sys.path.insert(0, str(ROOT))
if os.environ.get(TREE_ENV):
    sys.path.insert(0, os.environ[TREE_ENV])

from bench.client import ids  # noqa: E402
from bench.common import commit, machine, model_dir, output_dir, rotated, term_as_interrupt  # noqa: E402
from bench.no_reuse import ARMS, BEFORE, add_variant, kv_config  # noqa: E402

ENGINE_CORE = 1
BATCHES = {  # name: (prompts, prompt tokens, output tokens)
    "decode": (4, 16, 128),
    "mixed": (16, 256, 64),
}
START_TIMEOUT_S, BATCH_TIMEOUT_S = 300, 300


def prompts(name: str, run: int) -> list[list[int]]:
    n, length, _ = BATCHES[name]
    rng = random.Random(f"{name}-{run}")
    return [ids(length, rng) for _ in range(n)]


def child(arm: str, master: str, model: str, variants: list[str]) -> None:
    """One arm's engine: answers each ``BATCH ROUND`` line on stdin with the batch's seconds."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: the pipe carries answers only
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvcore.platform import engine_dtype

    for v in variants:
        add_variant(v)
    cfg = kv_config(arm.removesuffix(BEFORE), master, f"sc{arm.replace('-', '')}")
    llm = LLM(model=model, enforce_eager=True, block_size=32, max_model_len=2048, seed=0,
              max_num_seqs=4, dtype=engine_dtype(),
              **({"kv_transfer_config": KVTransferConfig(**cfg)} if cfg else {}))

    import multi

    print(f"[step_cost] {arm}: connector packages of {Path(multi.__file__).resolve().parent.parent}", file=sys.stderr)

    def run(name: str, seq: int) -> float:
        sp = SamplingParams(max_tokens=BATCHES[name][2], ignore_eos=True, temperature=0)
        batch = [{"prompt_token_ids": p} for p in prompts(name, seq)]
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        return time.perf_counter() - t0

    for name in BATCHES:  # untimed warm-up
        run(name, -1)
    print("READY", file=answers)
    for line in sys.stdin:
        name, seq = line.split()
        print(f"{run(name, int(seq)):.6f}", file=answers)


class Arm:
    def __init__(self, arm: str, master: str, model: str, a, log_dir: Path):
        from kvcore.platform import engine_env

        env = {**os.environ, **engine_env(ENGINE_CORE), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.pop(TREE_ENV, None)
        if arm.endswith(BEFORE):
            env[TREE_ENV] = a.before
        self.log = open(log_dir / f"{arm}.log", "w")
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(ENGINE_CORE), sys.executable, str(Path(__file__).resolve()), "--child", arm, master, model,
             *sum((["--variant", v] for v in a.variant), [])],
            cwd=a.before if arm.endswith(BEFORE) else str(ROOT), env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.name = arm

    def wait_ready(self) -> None:
        if self._line(START_TIMEOUT_S) != "READY":
            raise RuntimeError(f"{self.name}: engine did not start (its log: {self.log.name})")

    def _line(self, timeout_s: float) -> str:
        import select

        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s (its log: {self.log.name})")
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"{self.name}: engine exited {self.proc.poll()} (its log: {self.log.name})")
        return line

    def batch(self, name: str, seq: int) -> float:
        """Seconds of batch ``name`` with prompts ``seq`` (every run its own)."""
        self.proc.stdin.write(f"{name} {seq}\n")
        self.proc.stdin.flush()
        return float(self._line(BATCH_TIMEOUT_S))

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        self.log.close()


def summarize(results: dict[str, dict[str, list[float]]], ratios: dict[str, dict[str, list[float]]]) -> dict:
    out = {}
    for name, per_arm in results.items():
        out[name] = {}
        for arm, xs in per_arm.items():
            s = {"median_s": statistics.median(xs), "runs": len(xs)}
            if r := sorted(ratios[name].get(arm, [])):
                s["ratio"] = {"median": statistics.median(r), "q1": r[len(r) // 4], "q3": r[(3 * len(r)) // 4]}
            out[name][arm] = s
    return out


def render(summary: dict, info: dict) -> str:
    lines = ["| arm | " + " | ".join(f"{b} s | {b} / plain (IQR)" for b in BATCHES) + " |",
             "|---|" + "---|---|" * len(BATCHES)]
    for arm in info["arms"]:
        cells = []
        for b in BATCHES:
            s = summary[b][arm]
            r = s.get("ratio")
            cells += [f"{s['median_s']:.4f}", f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})" if r else "-"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    m = info["machine"]
    lines += ["", f"{info['date']}, {m.get('cpu')} ({', '.join(m.get('isa', []))}; engines {m.get('dtype')}"
              f"{', simulated ' + m['simulated'] if m.get('simulated') else ''}), commit {info['commit']}, "
              f"model {info['model']}, {info['rounds']} rounds, arms in turn on core {ENGINE_CORE}. "
              f"Ratios: median over rounds of each run over the mean of the plain runs before and after it "
              f"(interquartile range); seconds: median of every run."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        variants = [argv[i + 1] for i, x in enumerate(argv) if x == "--variant"]
        child(argv[1], argv[2], argv[3], variants)
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 rounds")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--arms", default="plain,null,store,p2p,tiered")
    ap.add_argument("--model", default="tiny", help="built-in preset (tiny, small) or a model directory")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:JSON",
                    help="one more arm, as bench.no_reuse's --variant")
    ap.add_argument("--before", metavar="DIR", help="also run each connector arm from DIR's tree, as ARM-before")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_cost"))
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (4 if a.quick else 20)
    arms = [x for x in a.arms.split(",") if x]
    if arms[0] != "plain" or len(arms) < 2 or "plain" in arms[1:]:
        raise SystemExit("--arms: plain first (the ratios' base), then at least one other arm")
    arms += [add_variant(v) for v in a.variant if v.partition("=")[0] not in arms]
    if a.before:
        a.before = str(Path(a.before).resolve())
        arms += [x + BEFORE for x in arms if x in ARMS and x != "plain"]
    for arm in arms:
        kv_config(arm, "-")  # an unknown arm fails before anything starts
    term_as_interrupt()
    from mcstore.server import StoreCluster

    out = output_dir(a.out)
    model = model_dir(a.model)  # built here once: a --before arm's engine loads the same
    info = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "before": a.before, "machine": machine(),
            "rounds": a.rounds, "arms": arms, "batches": BATCHES, "model": a.model}
    results = {b: {arm: [] for arm in arms} for b in BATCHES}  # seconds of every run
    ratios = {b: {arm: [] for arm in arms[1:]} for b in BATCHES}  # each run over the plain runs beside it
    started, errors, cluster = [], {}, None
    try:
        cluster = StoreCluster(out / "logs" / "store", segment_size=1 << 30).start()
        for arm in arms:
            started.append(Arm(arm, cluster.master_addr, model, a, out / "logs"))
            started[-1].wait_ready()
        plain, others, seq = started[0], started[1:], 0
        for rnd in range(a.rounds):
            for b in BATCHES:
                before = plain.batch(b, seq := seq + 1)
                results[b]["plain"].append(before)
                for eng in rotated(others, rnd):
                    x = eng.batch(b, seq := seq + 1)
                    after = plain.batch(b, seq := seq + 1)
                    results[b][eng.name].append(x)
                    results[b]["plain"].append(after)
                    ratios[b][eng.name].append(x / ((before + after) / 2))
                    before = after
            print(f"[step_cost] round {rnd}: " + ", ".join(
                f"{arm} {ratios['decode'][arm][-1]:.3f}/{ratios['mixed'][arm][-1]:.3f}" for arm in arms[1:]), flush=True)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the rounds done still stand
        errors["run"] = f"{type(e).__name__}: {e}"
        print(f"[step_cost] FAILED: {errors['run']}", file=sys.stderr, flush=True)
    finally:
        for eng in started:
            eng.stop()
        if cluster is not None:
            cluster.stop()
    n = min(len(xs) for per in ratios.values() for xs in per.values())  # rounds complete
    ratios = {b: {arm: xs[:n] for arm, xs in per.items()} for b, per in ratios.items()}
    info["rounds"] = n
    summary = summarize(results, ratios) if n else {}
    table = render(summary, info) if n else "no round completed"
    print(table)
    (out / "step_cost.md").write_text(table + "\n")
    (out / "step_cost.json").write_text(json.dumps({**info, "results": results, "ratios": ratios,
                                                    "summary": summary, "errors": errors,
                                                    "pids": [e.proc.pid for e in started]}, indent=1))
    print(f"[step_cost] wrote {out / 'step_cost.json'} and {out / 'step_cost.md'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
