"""The CPUs a tier's I/O threads run on (``io_cpus``): off the cores vLLM computes on.

A CPU engine's worker runs its forward passes on the cores of ``VLLM_CPU_OMP_THREADS_BIND`` (one
list per local rank, ``|``-separated), and a thread the worker starts inherits the core its
starter is bound to. The store tier's load and save threads, and the transfer threads Mooncake
starts inside its client, poll and copy bytes: on the compute core every microsecond of it is
taken from the forward pass (docs/benchmarks/no-reuse.md). vLLM itself keeps cores outside the
OpenMP lists for the engine's other processes, and with a KV connector one more per rank for the
connector's transfers (``OMPProcessManager.reserve_cpu_num`` in vLLM's
``utils/ompmultiprocessing.py``). Those are where this module puts the I/O.

``io_cpus`` (a tier's config key) is ``"auto"``, ``"none"`` or a CPU list (``"0,2-3"``):

- ``auto``: the CPUs the engine was started on (its worker's parent process's affinity: the
  worker's own is narrowed by OpenMP) minus every rank's OpenMP list and this process's
  ``OMP_PLACES``; when nothing is left (an engine pinned whole to its compute cores, as
  ``taskset -c 1``), the threads stay where they are. With ``VLLM_CPU_OMP_THREADS_BIND=auto``
  only this rank's list is known (``OMP_PLACES``): set the list explicitly for TP > 1 there.
  Several engines on one host each started on every CPU: another engine's compute cores look
  free to this one (docs/deploy.md, "CPU engines: a core for the connector").
- ``none``: the threads stay where they are.
- a list: exactly those CPUs (those the host does not have are an error).

Linux only (per-thread affinity); elsewhere nothing moves.
"""

from __future__ import annotations

import contextlib
import os
import re

from kvcore.errors import ConfigError
from kvcore.log import get_logger

logger = get_logger("kvcore.iocpus")


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``; ``ValueError`` on anything else."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"not a CPU list: {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 4096:
            raise ValueError(f"not a CPU range: {part!r}")
        out.update(range(lo, hi + 1))
    return out


def check_spec(spec: str, key: str = "io_cpus") -> str:
    """``spec`` normalised, or :class:`ConfigError` naming ``key``."""
    s = str(spec).strip().lower()
    if s in ("auto", "none"):
        return s
    try:
        cpus = parse_cpu_list(s)
    except ValueError as e:
        raise ConfigError(f"{key} must be 'auto', 'none' or a CPU list such as '0,2-3': {e}") from None
    if not cpus:
        raise ConfigError(f"{key} must be 'auto', 'none' or a non-empty CPU list, got {spec!r}")
    return s


def compute_cpus(env: dict[str, str]) -> set[int]:
    """Every CPU the engine's OpenMP threads are bound to, as far as ``env`` says."""
    out: set[int] = set()
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind and bind not in ("auto", "nobind"):
        for rank in bind.split("|"):
            try:
                out |= parse_cpu_list(rank)
            except ValueError:
                continue
    places = env.get("OMP_PLACES", "").strip()
    if places:
        try:
            out |= parse_cpu_list(places.replace("{", ",").replace("}", ","))
        except ValueError:
            pass
    return out


def resolve(spec: str, env: dict[str, str] | None = None, started_on: set[int] | None = None) -> set[int] | None:
    """The CPUs for I/O threads (None: leave them where they are). ``started_on``: the
    CPUs the engine was started on (default: the parent process's affinity)."""
    s = check_spec(spec)
    if s == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    if s != "auto":
        cpus = parse_cpu_list(s)
        missing = cpus - set(range(os.cpu_count() or 1))
        if missing:
            raise ConfigError(f"io_cpus names CPUs this host does not have: {sorted(missing)}")
        return cpus
    if started_on is None:
        try:
            started_on = os.sched_getaffinity(os.getppid())
        except OSError:
            started_on = os.sched_getaffinity(0)
    left = set(started_on) - compute_cpus(dict(os.environ) if env is None else env)
    return left or None


def pin_this_thread(cpus: set[int] | None, who: str) -> None:
    """Bind the calling thread to ``cpus`` (None: nothing). A refusal is logged, not raised."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux)
    except OSError as e:
        logger.warning("%s: could not bind its I/O thread to CPUs %s: %s", who, sorted(cpus), e)


@contextlib.contextmanager
def threads_started_on(cpus: set[int] | None, who: str):
    """Threads started inside (Mooncake's, at client set-up) inherit ``cpus``; the calling
    thread's own affinity is restored afterwards."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_this_thread(cpus, who)
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError as e:
            logger.warning("%s: could not restore the thread's CPUs %s: %s", who, sorted(before), e)
