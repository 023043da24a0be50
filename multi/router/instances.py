"""The router's instances: who they are (command line and file), whether they are up,
and how loaded they are.

An instance is one vLLM OpenAI server in a role:

- ``prefill``: computes prompts for a decode instance (``URL[@BOOTSTRAP_URL]``, vLLM's
  Mooncake proxy contract, :mod:`p2p.proxy`);
- ``decode``: serves requests whose KV a prefill instance (or the store) provides;
- ``plain``: serves whole requests (data-parallel engines; with a store connector or none).

The file (``--instances FILE``, TOML; reloaded on SIGHUP) lists them as tables::

    [[prefill]]
    url = "http://10.0.0.2:8100"
    bootstrap = "http://10.0.0.2:8998"     # default: the URL's host, port 8998
    events = "tcp://10.0.0.9:5557"         # its --kv-events-config endpoint (see below)
    replay = "tcp://10.0.0.2:5558"         # its replay endpoint

    [[decode]]
    url = "http://10.0.0.3:8200"

``events``/``replay`` are optional: the router reads them from the engine's
``/kv_event_sources`` (vLLM's route) when not given. They are the strings of the engine's
``--kv-events-config``: an engine ``endpoint`` ``tcp://HOST:P`` connects to a subscriber
there, so ``HOST`` is the router's address and the router binds it; ``tcp://*:P`` or
``ipc://PATH`` is bound by the engine and the router connects (:mod:`multi.router.events`).

An unknown key is an error that names it and lists the known ones. Instances given on
the command line are always kept; a reload replaces only the file's.

Health: every ``interval`` seconds each instance's ``/health`` (deadline
``timeout``) and ``/metrics`` (running and waiting requests, KV usage, and the cache
size in blocks from ``vllm:cache_config_info``) are read. An instance that fails a
health check (:func:`check_health`), or a prefill instance whose request failed (502,
:mod:`multi.router.forward`), is out of rotation until a check succeeds again; a failed check
also forgets a prefill's engine id (it may come back as another engine).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from p2p.config import normalize_url
from p2p.proxy import Backend, default_bootstrap

logger = logging.getLogger("mctier.router")

ROLES = ("prefill", "decode", "plain")


@dataclass(eq=False)
class Instance(Backend):
    role: str = "plain"
    events: str | None = None
    replay: str | None = None
    source: str = "cli"  # "cli" or "file"
    healthy: bool = True
    running: float = 0.0  # vllm:num_requests_running at the last poll
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    cache_blocks: int | None = None  # the engine's KV cache size in blocks
    checked: float = 0.0
    # Prefill work the router sent and that has not finished: request id -> (predicted s, start)
    inflight: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Requests past their first token that still decode here (its decode occupancy)
    decoding: set[str] = field(default_factory=set)
    # When the last request left ``inflight`` (its prefill ended), on the queue's clock
    departed: float = float("-inf")
    # The TTFT deadlines (queue clock) of requests in ``inflight`` admitted with a target
    deadlines: dict[str, float] = field(default_factory=dict)

    def queue_s(self, now: float | None = None) -> float:
        """Seconds of routed prefill work still ahead on this instance (:func:`queue_ahead_s`
        of ``inflight`` after the last departure)."""
        return queue_ahead_s(self.inflight.values(), self.departed,
                             time.monotonic() if now is None else now)

    def times(self, now: float | None = None) -> dict[str, tuple[float, float]]:
        """Every request of ``inflight`` (none has its first token yet), by request id: its
        predicted ``(start, end)`` of compute (:func:`queue_times`)."""
        now = time.monotonic() if now is None else now
        return dict(zip(self.inflight, queue_times(self.inflight.values(), self.departed, now)))

    def pending(self, now: float | None = None) -> dict[str, tuple[float, float]]:
        """The requests of ``inflight`` predicted still without their first token at ``now``
        (their predicted end after ``now``), as :meth:`times`."""
        now = time.monotonic() if now is None else now
        return {rid: se for rid, se in self.times(now).items() if se[1] > now}

    def depart(self, rid: str, now: float | None) -> bool:
        """``rid``'s prefill ended at ``now`` (None: time unknown, no anchor): it leaves the
        queue, and the one behind it starts no earlier than ``now``. Whether it was queued."""
        self.deadlines.pop(rid, None)
        if self.inflight.pop(rid, None) is None:
            return False
        if now is not None:
            self.departed = max(self.departed, now)
        return True


def queue_ahead_s(work, departed: float, now: float) -> float:
    """The queue ahead of a new request on one instance, in seconds: ``work`` is its queued
    prefills ``(s_j, t_j)`` (predicted compute, sent at) in the order sent, ``departed``
    when the last prefill before them ended. An engine works its prefills through one after
    the other (chunked prefill shares a step's token budget, not its throughput), so the
    head starts when it was sent or when the one before it left, whichever is later, and
    each next one when the one before it is predicted done:

        e_0 = min(departed, now),   e_j = max(e_{j-1}, t_j) + s_j,   queue = max(0, e_last - now)

    ``s_j`` is the request's prefill tokens at the instance's fitted per-token compute when
    it was routed (:meth:`multi.router.ledger.Ledger.prefill_work`). Without ``departed``
    (the earlier model) each start was only ``max(e_{j-1}, t_j)``: once the requests ahead
    left, the rest counted as started when sent, as if they had computed while they waited,
    and a request behind a burst saw a queue near 0 (docs/benchmarks/router.md). Counted
    down each from its own start, as if all ran at once, the queue came out a fraction of
    the real wait (docs/benchmarks/sim-cluster.md)."""
    times = queue_times(work, departed, now)
    return max(0.0, times[-1][1] - now) if times else 0.0


def queue_times(work, departed: float, now: float) -> list[tuple[float, float]]:
    """Each queued prefill's predicted ``(start, end)``, as :func:`queue_ahead_s` works them
    through: ``start_j = max(e_{j-1}, t_j)``, ``end_j = start_j + s_j``."""
    t, out = min(departed, now), []
    for s, t0 in work:
        start = max(t, t0)
        t = start + s
        out.append((start, t))
    return out


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    bootstrap: str | None = None
    events: str | None = None
    replay: str | None = None


class _File(msgspec.Struct, forbid_unknown_fields=True):
    prefill: list[_Entry] = []
    decode: list[_Entry] = []
    plain: list[_Entry] = []


def make(role: str, url: str, bootstrap: str | None = None, events: str | None = None,
         replay: str | None = None, source: str = "cli") -> Instance:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    url = normalize_url(url)
    boot = (normalize_url(bootstrap) if bootstrap else default_bootstrap(url)) if role == "prefill" else None
    return Instance(url, boot, role=role, events=events, replay=replay, source=source)


def load_file(path: str) -> list[Instance]:
    """The instances of a TOML file; ``ValueError`` naming the problem (an unknown key
    names it and lists the known ones)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"instances file {path}: {e.strerror}") from None
    try:
        spec = msgspec.toml.decode(raw, type=_File)
    except msgspec.ValidationError as e:
        msg = str(e)
        if "unknown field" in msg.lower():
            known = {"top level": ROLES, "an instance": tuple(_Entry.__struct_fields__)}
            msg += f" (known keys: top level {', '.join(known['top level'])}; an instance " \
                   f"{', '.join(known['an instance'])})"
        raise ValueError(f"instances file {path}: {msg}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"instances file {path}: not TOML: {e}") from None
    out = []
    for role in ROLES:
        for e in getattr(spec, role):
            out.append(make(role, e.url, e.bootstrap, e.events, e.replay, source="file"))
    return out


class Pool:
    """The instances by role; :meth:`replace_file` applies a reloaded file (in-flight
    requests on a removed instance finish; it just gets no new ones)."""

    def __init__(self, instances: list[Instance]):
        self.all: list[Instance] = []
        for i in instances:
            self._add(i)

    def _add(self, inst: Instance) -> None:
        if any(i.url == inst.url for i in self.all):
            raise ValueError(f"instance {inst.url} is listed twice")
        self.all.append(inst)

    def role(self, role: str, healthy_only: bool = True) -> list[Instance]:
        return [i for i in self.all if i.role == role and (i.healthy or not healthy_only)]

    @property
    def disaggregated(self) -> bool:
        return bool(self.role("prefill", False) or self.role("decode", False))

    def replace_file(self, instances: list[Instance]) -> tuple[list[Instance], list[Instance]]:
        """Swap the file's instances for ``instances``: (added, removed)."""
        old = {i.url: i for i in self.all if i.source == "file"}
        new = {i.url: i for i in instances}
        cli = {i.url for i in self.all if i.source == "cli"}
        clash = cli & set(new)
        if clash:
            raise ValueError(f"instances file lists {sorted(clash)}, already given on the command line")
        removed = [old[u] for u in old if u not in new or new[u].role != old[u].role]
        added = [new[u] for u in new if u not in old or new[u].role != old[u].role]
        keep = [i for i in self.all if i not in removed]
        self.all = keep + added
        return added, removed

    def validate(self) -> None:
        if self.disaggregated and not (self.role("prefill", False) and self.role("decode", False)):
            raise ValueError("a P/D deployment needs at least one --prefill and one --decode instance")
        if not self.all:
            raise ValueError("no instances: give --prefill and --decode, --plain, or --instances FILE")


# The engine metrics the router reads. Only their lines are parsed: vLLM's whole /metrics (~55 KB,
# and vLLM 0.32 answers /metrics from its instrumentator, which ignores ``name[]`` filters) took
# 8 ms to parse on an idle core, on the event loop every health interval (0.7 ms filtered first:
# docs/benchmarks/router.md, "health reads").
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"
MAX_METRICS_BYTES = 4 << 20  # a peer's answer: a longer one is not read (the old values stay)


async def read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None when it is longer than ``limit`` bytes (read no further than
    one byte past it; ``read(n)`` alone returns what has arrived so far, which may be one
    chunk of it)."""
    out = bytearray()
    while len(out) <= limit:
        chunk = await stream.read(limit + 1 - len(out))
        if not chunk:
            return bytes(out)
        out += chunk
    return None


def _parse_metrics(text: str) -> dict[str, float | int]:
    """Load and cache size from an instance's Prometheus text: the lines of other families
    are dropped before parsing."""
    wanted = (*LOAD_METRICS, CACHE_INFO)
    lines = "\n".join(ln for ln in text.splitlines() if ln.startswith(wanted))
    out: dict[str, float | int] = {}
    for fam in text_string_to_metric_families(lines):
        for s in fam.samples:
            if s.name in LOAD_METRICS:
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == CACHE_INFO and s.labels.get("num_gpu_blocks", "").isdigit():
                out["blocks"] = int(s.labels["num_gpu_blocks"])
    return out


async def check_health(session: aiohttp.ClientSession, inst: Instance, timeout: float) -> bool:
    """One health check plus a metrics read; updates ``inst`` and returns its health."""
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(inst.url + "/health", timeout=t) as r:
            ok = r.status == 200
        if ok:
            async with session.get(inst.url + "/metrics", timeout=t) as r:
                if r.status == 200:
                    raw = await read_at_most(r.content, MAX_METRICS_BYTES)
                    m = _parse_metrics(raw.decode("utf-8", "replace")) if raw is not None else {}
                    inst.running = m.get("vllm:num_requests_running", inst.running)
                    inst.waiting = m.get("vllm:num_requests_waiting", inst.waiting)
                    inst.kv_usage = m.get("vllm:kv_cache_usage_perc", inst.kv_usage)
                    inst.cache_blocks = m.get("blocks", inst.cache_blocks)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        ok = False
    if not ok:
        inst.engine_id = None  # a prefill may come back as another engine: ask its bootstrap again
    if ok != inst.healthy:
        logger.warning("%s instance %s is %s", inst.role, inst.url, "back in rotation" if ok else "out of rotation")
    inst.healthy, inst.checked = ok, time.monotonic()
    return ok
