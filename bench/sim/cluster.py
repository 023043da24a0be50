"""A discrete-event cluster: instances with prefix caches, a store, links, and the
product's router deciding (:class:`multi.router.choose.Chooser`, imported, not re-implemented).

Time is in seconds from the first arrival. One run (:func:`bench.sim.router.simulate`) replays a list of
:class:`bench.trace.Request` (``hash_ids`` are blocks of ``block`` tokens) through:

- **instances**: ``plain`` (serve whole requests), or ``prefill`` and ``decode`` (P/D).
  Each is an engine stepping as vLLM's scheduler does (:class:`Engine`): a step runs every
  decoding sequence (at most ``max_seqs``) and at most ``chunk_tokens`` of the prefill at
  the head of its queue; its length is :meth:`bench.sim.speeds.Speeds.step_s`, times
  ``1 + contention`` per other busy engine of the host when they share one. A
  request's KV loads (store, P2P) happen off the engine, as vLLM's asynchronous
  connectors do: the request joins the engine's queue when they are done.
- **prefix caches**: per instance an LRU of full blocks, ``cache_blocks`` long. A
  prefill instance (or a plain one) inserts a prompt's full blocks when its prefill ends;
  a decode instance those it received. The router sees each cache exactly (what vLLM's
  KV events give :mod:`multi.router.index`), and reads it without touching it.
- **the store** (:class:`Store`): DRAM and SSD LRUs in blocks, objects of
  ``store_chunk_blocks`` blocks. A prefill (or plain)
  instance saves every prompt's full blocks when its prefill ends (the save's own time
  is not modelled: it runs off the forward path); DRAM evicts to SSD, SSD evicts for
  good. A load reads the leading blocks held in either, at that medium's link speed.
- **links**: each decode instance receives one transfer at a time (its NIC), at
  ``p2p`` speed; store loads run at ``store``/``ssd`` speed, unshared. With
  ``Speeds.handoff_waits_step`` (this machine's measured speeds), a handoff whose prefill
  instance goes straight on to another prefill starts its transfer when that step ends:
  a CPU engine computing a step answers its side channel late (the replay of 2026-12-01:
  handoffs took 0.02 to 0.12 s from the prefill's answer to the first token while the
  prefill instance was idle, and 0.36 to 1.55 s while it computed the next prompt).

Routing mirrors :mod:`multi.router.forward` step by step, through the same methods: a request
reaches the router ``overhead_s`` after it arrives; ``Chooser.choose`` with the cached
prefixes and the store's reach, then ``Chooser.begin`` (``inflight`` work and
``outstanding`` counts), ``Chooser.prefill_done`` when a handoff's prefill ends,
``Chooser.end`` at the last token and ``Chooser.learn_request`` (the prefill's time, the
time from its end to the first token, the time to first token). A rejected request (``slo``)
is counted and never served. Policies:
``kv``, ``least-outstanding``, ``round-robin`` (the product's) and ``prefix-affinity``
(a baseline of this module: the prefill or plain instance with the longest cached
prefix, ties in turn, load ignored).

Plans: a handoff's prefill instance loads ``[C_p, S)`` from the store and computes
``[max(C_p, S), N)``; the decode instance receives ``[L_d, N - 1)`` from it or, when
the chosen plan includes the store, ``[L_d, S)`` from the store and ``[max(L_d, S), N - 1)``
from it at the same time. A direct request's instance loads ``[L, S)`` when its plan
includes the store and computes the rest. Its first token
comes at the end of the step that finishes its prefill; a handed-off request's at the end
of the decode instance's step that computes its last prompt token (vLLM schedules a
received request as a prefill of that one token).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from bench.sim.speeds import Speeds
from multi.policy import PolicyConfig
from multi.router.instances import Instance

POLICIES = ("kv", "least-outstanding", "round-robin", "prefix-affinity")


class LRU:
    """Blocks by hash id, oldest first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes) -> int:
        k = 0
        for h in hashes:
            if h not in self.d:
                break
            k += 1
        return k

    def touch(self, hashes) -> None:
        for h in hashes:
            if h in self.d:
                self.d.move_to_end(h)

    def insert(self, hashes) -> list[int]:
        """Insert or touch, in order; the evicted ids."""
        for h in hashes:
            self.d[h] = None
            self.d.move_to_end(h)
        out = []
        while len(self.d) > self.capacity:
            out.append(self.d.popitem(last=False)[0])
        return out


class Store:
    """DRAM and SSD LRUs of blocks; objects of ``chunk`` blocks (the store tier's
    ``chunk_tokens``): only whole chunks are saved, and a reach ends at a chunk's end."""

    def __init__(self, dram_blocks: int, ssd_blocks: int, chunk: int = 1):
        self.dram, self.ssd = LRU(dram_blocks), LRU(ssd_blocks)
        self.chunk = chunk

    @property
    def enabled(self) -> bool:
        return self.dram.capacity + self.ssd.capacity > 0

    def reach(self, hashes) -> tuple[int, int]:
        """(leading blocks held in DRAM or SSD, how many of them are on SSD)."""
        k = on_ssd = 0
        for h in hashes:
            if h in self.dram.d:
                k += 1
            elif h in self.ssd.d:
                k, on_ssd = k + 1, on_ssd + 1
            else:
                break
        whole = k - k % self.chunk
        if whole < k:
            on_ssd = sum(1 for h in hashes[:whole] if h not in self.dram.d)
        return whole, on_ssd

    def save(self, hashes) -> None:
        hashes = hashes[:len(hashes) - len(hashes) % self.chunk]
        for h in hashes:
            self.ssd.d.pop(h, None)  # written again: DRAM holds the newest copy
        self.ssd.insert(self.dram.insert(hashes))

    def read(self, hashes) -> None:
        self.dram.touch(hashes)
        self.ssd.touch(hashes)


@dataclass
class Result:
    """One request's outcome (seconds from the start; tokens by where they came from)."""

    i: int
    arrival: float
    n: int
    out: int
    kind: str = ""  # pd, direct, reject
    plan: str = ""
    predicted: float = 0.0
    first: float | None = None
    done: float | None = None
    instances: tuple[str, ...] = ()  # (prefill instance, decode instance) or (target,)
    prefilled: float | None = None  # a handoff: the prefill instance's prefill ended
    ready: float | None = None  # a handoff: the KV is on the decode instance
    local: int = 0  # prefix-cache hit of the instance that computed
    store: int = 0  # loaded from the store by that instance (tokens)
    store_ssd: int = 0  # of which from SSD
    computed: int = 0
    p2p: int = 0  # tokens handed to the decode instance
    d_local: int = 0  # a handoff: the decode instance's own prefix-cache hit
    d_store: int = 0  # a handoff: what the decode instance loaded from the store
    # What the router knew and weighed (multi.router.choose.Route's fields of the same names).
    cached_prefill: int = 0
    cached_target: int = 0
    store_view: int = 0
    candidates: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.first is None or self.out < 2:
            return None
        return (self.done - self.first) / (self.out - 1)


class Seq:
    __slots__ = ("ctx0", "left", "end_step", "on_first", "on_done", "started")

    def __init__(self, ctx0: int, left: int, on_first, on_done):
        self.ctx0, self.left, self.on_first, self.on_done = ctx0, left, on_first, on_done
        self.end_step = 0
        self.started = False


@dataclass
class Job:
    start: int  # tokens already in the cache (local hit and loaded ones)
    end: int  # the prompt's length
    on_done: object  # callable(now)
    done: int = 0


class Engine:
    """One vLLM engine stepping: decodes plus one prefill chunk per step (module docstring)."""

    def __init__(self, sim: "Sim", inst: Instance, cache_blocks: int):
        self.sim, self.inst, self.sp = sim, inst, sim.speeds
        self.cache = LRU(cache_blocks)
        self.queue: deque[Job] = deque()
        self.joining: deque[Seq] = deque()
        self.running: list[tuple[int, int, Seq]] = []  # heap by the step of the last token
        self.ctx = 0
        self.step_no = 0
        self.busy = False
        self.step_end = 0.0  # when the step under way ends
        self._tie = itertools.count()
        sim.engines.append(self)

    @property
    def seqs(self) -> int:
        return len(self.running)

    def prefill(self, job: Job) -> None:
        self.queue.append(job)
        self._kick()

    def decode(self, seq: Seq) -> None:
        self.joining.append(seq)
        self._kick()

    def _kick(self) -> None:
        if not self.busy:
            self.busy = True
            self._step()

    def _step(self) -> None:
        sp = self.sp
        fresh = []
        while self.joining and len(self.running) < sp.max_seqs:
            s = self.joining.popleft()
            s.end_step = self.step_no + s.left
            self.ctx += s.ctx0
            heapq.heappush(self.running, (s.end_step, next(self._tie), s))
            fresh.append(s)
        job, k = (self.queue[0], 0) if self.queue else (None, 0)
        if job is not None:
            k = min(sp.chunk_tokens, job.end - job.start - job.done)
        if not self.running and job is None:
            self.busy = False
            return
        dt = sp.step_s(len(self.running), self.ctx, k, job.start + job.done if job else 0, self.inst.role)
        if sp.contention:
            dt *= 1 + sp.contention * sum(1 for e in self.sim.engines if e is not self and e.busy)
        self.step_end = self.sim.now + dt
        self.sim.at(self.step_end, lambda: self._end(fresh, job, k))

    def _end(self, fresh: list[Seq], job: Job | None, k: int) -> None:
        now = self.sim.now
        if self.running:
            self.step_no += 1
            self.ctx += len(self.running)
            for s in fresh:
                s.on_first(now)
            while self.running and self.running[0][0] <= self.step_no:
                s = heapq.heappop(self.running)[2]
                self.ctx -= s.ctx0 + s.left
                s.on_done(now)
        if job is not None:
            job.done += k
            if job.start + job.done >= job.end:
                self.queue.popleft()
                job.on_done(now)
        self._step()


@dataclass
class Cluster:
    prefill: int = 0
    decode: int = 0
    plain: int = 0
    cache_blocks: int = 2000  # each instance's prefix cache, in trace blocks
    store_dram_blocks: int = 0
    store_ssd_blocks: int = 0
    store_chunk_blocks: int = 1  # the store tier's chunk_tokens, in blocks
    block: int = 512  # tokens per hash id


@dataclass
class Sim:
    speeds: Speeds
    cluster: Cluster
    policy: str = "kv"
    slo: float | None = None  # the router's admission target (s); None: admit everything
    policy_cfg: PolicyConfig | None = None
    now: float = 0.0
    events: list = field(default_factory=list)
    engines: list = field(default_factory=list)  # every Engine (host contention)
    _seq: itertools.count = field(default_factory=itertools.count)

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
