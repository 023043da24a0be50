"""Shorter busy-waits on vLLM's shared-memory queues, for TP/PP > 1 engines on CPU.

With more than one rank, vLLM's multiprocess executor passes every step to the worker
processes and their replies back through shared-memory rings
(``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``). A reader busy-waits
(``sched_yield`` in a loop) for ``busy_loop_s`` = 1 s after its last read before it sleeps
on a socket. Our connectors keep an engine stepping while it holds blocks for a pull
(``has_pending_push_work``) or waits for remote KV, a step every few milliseconds, so
its engine core and every rank busy-wait for as long as that lasts. On a CPU host those
processes share the cores with the engine's own API server (and, on a small host, with
other instances), which then starves: on two cores a TP 2 instance holding blocks or
waiting for KV stopped serving its own and its neighbours' requests
(docs/benchmarks/idle-steps.md).

:func:`shorten` lowers ``busy_loop_s`` of the queues this process reads to a few
milliseconds: between steps of a busy engine the readers still spin (a step follows
within microseconds), between the slow steps of a waiting engine they sleep on the
queue's own notification socket. It is enough only together with the tiers' pacing of
steps that compute nothing (:data:`IDLE_STEP_S`; docs/benchmarks/idle-steps.md). It reaches
into vLLM's internals (the attribute names of vLLM 0.32); when they are not there it logs
once and changes nothing.
"""

from __future__ import annotations

import gc

from kvcore.log import get_logger

logger = get_logger("kvcore.shmspin")

BUSY_LOOP_S = 0.005
# How long a connector's scheduler sleeps before a step that computes nothing (an engine
# that only waits for KV or holds blocks), on TP/PP > 1 CPU engines: both tiers pace so.
IDLE_STEP_S = 0.02


def cpu_ranks(vllm_config) -> bool:
    """Whether this engine has more than one rank on CPU (where the busy-wait hurts)."""
    from kvcore import platform

    par = vllm_config.parallel_config
    return par.tensor_parallel_size * par.pipeline_parallel_size > 1 and platform.current().device_type == "cpu"


def _reader_conditions() -> list:
    """The spin conditions of every shared-memory queue this process reads (none outside
    vLLM 0.32's layout)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    except ImportError:
        return []
    out = []
    for obj in gc.get_objects():
        if type(obj) is not MessageQueue:  # isinstance would probe every object's __class__
            continue
        cond = getattr(obj, "_spin_condition", None)
        if cond is not None and getattr(cond, "is_reader", False) and hasattr(cond, "busy_loop_s"):
            out.append(cond)
    return out


def shorten(busy_loop_s: float = BUSY_LOOP_S) -> int:
    """Set ``busy_loop_s`` of every shared-memory queue this process reads; how many."""
    conds = _reader_conditions()
    for cond in conds:
        cond.busy_loop_s = min(cond.busy_loop_s, busy_loop_s)
    n = len(conds)
    if n == 0:
        logger.info("no vLLM shared-memory queue read in this process (or not vLLM 0.32's layout): "
                    "busy-wait left as it is")
    else:
        logger.info("busy-wait of %d vLLM shared-memory queue(s) shortened to %.0f ms", n, busy_loop_s * 1e3)
    return n


# A one-rank CPU worker whose store I/O runs off its compute core: while a background load is
# in flight, its 1 s busy-wait on the step queue and the load's transfer poll filled both cores
# and starved the store server (8K gets up to 1.2 s); shortened for good, every decode step
# waited for a wake-up (TPOT 4-29x). So only while a load is in flight
# (docs/benchmarks/store-divergence.md).
LOADING_BUSY_LOOP_S = 0.001


class LoadSpin:
    """The busy-wait of this process's shared-memory queue readers, short while ``begin`` holds
    loads not yet ``end``-ed, vLLM's own otherwise. Each load is dropped at its deadline too,
    so that a load never reported back cannot keep the short wait. Not thread-safe: the
    worker's step hooks call it, on one thread."""

    def __init__(self, busy_loop_s: float = LOADING_BUSY_LOOP_S):
        self.busy_loop_s = busy_loop_s
        self._conds: list | None = None  # (condition, vLLM's busy_loop_s), found at first use
        self._loads: dict[str, float] = {}  # request id -> deadline (monotonic seconds)
        self.short = False

    def begin(self, req_ids, deadline: float) -> None:
        for rid in req_ids:
            self._loads[rid] = deadline
        self._apply()

    def end(self, req_ids, now: float) -> None:
        for rid in req_ids:
            self._loads.pop(rid, None)
        for rid in [r for r, d in self._loads.items() if d <= now]:
            del self._loads[rid]
        self._apply()

    def _apply(self) -> None:
        want = bool(self._loads)
        if want == self.short:
            return
        if self._conds is None:
            self._conds = [(c, c.busy_loop_s) for c in _reader_conditions()]
        for cond, default in self._conds:
            cond.busy_loop_s = min(default, self.busy_loop_s) if want else default
        self.short = want
