"""The tier contract: everything the composite (``multi``) uses of a KV tier.

A tier is a complete vLLM KV connector (a ``KVConnectorBase_V1`` that also works
on its own, or as a child of vLLM's ``MultiConnector``) that also derives from
:class:`Tier`. The composite builds each configured tier as a child connector and
uses of it only what this module names: the methods and class attributes of
:class:`Tier`, and the vLLM hooks in :data:`FORWARDED_HOOKS`, which it forwards
unchanged (each child gets its own metadata back; see ``multi.protocol``).

Units. Token positions index the prompt. ``block_ids`` is always the request's
whole block list (first KV cache group), indexed by block position within the
request; tokens ``[start, end)`` live in ``block_ids[start // bs : ceil(end / bs)]``
(:func:`blocks_of`, ``bs`` = vLLM's block size).

Scheduler side (``EngineCore`` process):

``lookup(request) -> int | None``
    ``n`` such that the tier can supply prompt tokens ``[0, n)`` now. 0 when it has
    nothing, is unreachable, or is not asked (wrong role). None while the tier is still
    finding out (a lookup it runs off the scheduler's thread): the caller asks again at a
    later step, as vLLM does when ``get_num_new_matched_tokens`` answers None. Never
    blocks on a round trip for longer than the tier's own lookup deadline; the answer may
    be cached per request.
``plan_load(request, start_token, end_token, block_ids, expected_s=None) -> None``
    Load tokens ``[start_token, end_token)`` (``end_token <= lookup(request)``) into
    ``blocks_of(start_token, end_token, bs, block_ids)``; a block only partly inside
    the range is filled whole. ``expected_s`` is the caller's estimate of the load in
    seconds (for a ``remote_prefill`` tier, the wait for the prefill included): the
    load's deadline is :func:`load_deadline_s` of the tier's configured deadline and
    that estimate, so a slow machine (another CPU class, a bigger model) extends it
    instead of failing every load. Asynchronous: the worker side ends it in
    ``get_transfer_results`` (``finished_recving``; on failure either the request in
    ``failed_recving`` too, or the blocks it could not fill in
    ``get_block_ids_with_load_errors``) and in one :class:`LoadReport`.
    At most one load per request.
``release(request) -> None``
    The request will not load from this tier (or no more than planned): free what
    is held for it elsewhere (P2P: the prefill instance's blocks). No-op for a tier
    that holds nothing on a request's behalf.
``reserve_sync(request, start_token, end_token) -> bool``
    Asked before ``plan_load`` each time vLLM asks about the request: True when this tier's
    load of that range may end inside the step that schedules the request (vLLM's
    synchronous load, ``load_async=False``), counted in the tier's budget for the step;
    the load then planned is synchronous: the worker side ends it in ``start_load_kv``,
    before the forward, reports its unfilled blocks in that step's
    ``get_block_ids_with_load_errors`` and never reports the request in
    ``finished_recving``. Default False (always in the background).

Worker side (``Worker`` process):

``take_load_reports() -> list[LoadReport]``
    One report per load that ended since the last call (success or not), in end
    order. Reports are kept even when nobody asks (a tier used alone), up to
    :data:`MAX_UNREAD_REPORTS`; older ones are dropped.
``quiet_step(meta) -> bool``
    Asked when a step's metadata is bound, with the tier's own metadata of the step: True
    when none of the tier's worker hooks of this step would do or report anything (``meta``
    asks nothing, nothing is queued, unreported or held, and nothing it was told of waits for
    a finished request). The composite then skips them all for the step, from
    ``bind_connector_metadata`` to ``clear_connector_metadata`` (``handle_preemptions``
    excepted), and asks again at the next step; a load or hold it planned and has not seen
    end makes it call the tier whatever this answers. Something that happens on another thread
    between the answer and the step's end (a count, a load ending) is reported at the next
    step the tier is called. Default False: always called. Why: each hook costs a few
    microseconds at every step (docs/benchmarks/no-reuse.md, the per-step cost).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Annotated, ClassVar

import msgspec

# vLLM connector hooks the composite forwards to every tier. On the scheduler side
# it never calls a tier's get_num_new_matched_tokens or update_state_after_alloc:
# lookup / plan_load / release replace them. update_connector_output gets the
# composite's joined results with kv_connector_stats set to the tier's own stats
# (rebuilt by its build_kv_connector_stats) and kv_connector_worker_meta set to what its
# own workers built (build_connector_worker_meta); request_finished results are joined
# (the request's blocks are held until every tier that asked let go); take_events
# yields every tier's events; reset_cache succeeds when no tier's failed. The per-layer hooks
# (wait_for_layer_load, save_kv_layer) skip a tier whose Tier.layer_hooks is False.
FORWARDED_HOOKS = (
    # scheduler side
    "bind_kv_cache_manager", "build_connector_meta", "update_connector_output", "request_finished",
    "has_pending_push_work", "get_kv_connector_stats", "take_events", "reset_cache", "on_new_request",
    # worker side
    "register_kv_caches", "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors", "build_connector_worker_meta",
    # both, and the class-level telemetry hooks
    "shutdown", "build_kv_connector_stats", "build_prom_metrics",
)

MAX_UNREAD_REPORTS = 1024
# A load's deadline covers this many times the caller's estimate of it: estimates come
# from fits calibrated on this instance, and a prefill instance may be busier than it.
DEADLINE_SLACK = 3.0


def load_deadline_s(configured_s: float, expected_s: float | None, cap_s: float | None = None) -> float:
    """Seconds a load may take: the tier's configured deadline, or ``DEADLINE_SLACK``
    times the expected time when that is longer, never beyond ``cap_s`` (e.g. how long
    the other side holds the data) nor below the configured value."""
    s = max(configured_s, DEADLINE_SLACK * expected_s) if expected_s else configured_s
    return max(configured_s, min(s, cap_s)) if cap_s is not None else s


class LoadPrior(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Where the composite's load-time fit for a tier starts before calibration:
    ``seconds(bytes) = latency_s + bytes / (bandwidth_gbps * 1e9)``."""

    latency_s: Annotated[float, msgspec.Meta(description="A load's fixed cost (seconds).")] = 0.03
    bandwidth_gbps: Annotated[float, msgspec.Meta(description="Bandwidth in GB (1e9 bytes) per second.")] = 1.0


class LoadReport(msgspec.Struct, frozen=True):
    """One load of one request by one tier worker (one TP rank), when it ended.

    ``bytes`` were written into KV blocks; ``seconds`` is the time spent moving
    them, from the start of the tier's work on the load to the bytes in place,
    without any wait for a remote prefill to finish (the composite models that
    wait separately). ``waited_s``: that wait, measured (a ``remote_prefill`` tier: from
    asking the prefill instance for the KV until it answered that the KV is ready; 0
    for other tiers). ``ok`` is False when any part of the load failed; such a report
    is not a timing sample."""

    tier: str
    req_id: str
    bytes: int
    seconds: float
    ok: bool
    waited_s: float = 0.0


class LoadReports:
    """Thread-safe buffer of :class:`LoadReport` (tier workers end loads on their own threads)."""

    def __init__(self, maxlen: int = MAX_UNREAD_REPORTS):
        self._lock = threading.Lock()
        self._q: deque[LoadReport] = deque(maxlen=maxlen)

    def __bool__(self) -> bool:
        """Whether a report waits to be taken (read unlocked: one added now counts at the next look)."""
        return bool(self._q)

    def add(self, report: LoadReport) -> None:
        with self._lock:
            self._q.append(report)

    def take(self) -> list[LoadReport]:
        if not self._q:  # asked every step, most steps have none
            return []
        with self._lock:
            out = list(self._q)
            self._q.clear()
        return out


class Tier:
    """Mixin of a tier's connector class: the part of the contract beyond vLLM's hooks.

    Class attributes:

    ``name``
        The tier's name in plans (``kv_plan`` sources, ``kv_source`` values) and
        in the composite's metric labels.
    ``remote_prefill``
        True when the tier's KV is computed by another instance that started
        prefilling this prompt when the request arrived (the P2P handoff): a load
        from it first waits for that prefill.
    ``load_prior``
        Start of the composite's load-time fit for this tier.
    ``layer_hooks``
        False when the tier's ``wait_for_layer_load`` and ``save_kv_layer`` never do anything:
        the composite then does not forward them (they run at every layer of every step).
    """

    name: ClassVar[str]
    remote_prefill: ClassVar[bool] = False
    load_prior: ClassVar[LoadPrior] = LoadPrior()
    layer_hooks: ClassVar[bool] = True

    @classmethod
    def composite_role(cls, kv_role: str, write_back: bool) -> str:
        """The ``kv_role`` this tier gets inside a composite whose own role is
        ``kv_role``; ``write_back`` asks decode instances to save too. Default:
        the composite's role."""
        return kv_role

    # -- scheduler side ---------------------------------------------------------------

    def lookup(self, request, local_tokens: int = 0) -> int | None:
        """Prompt tokens ``[0, n)`` the tier can supply, or None while its answer is not in (ask
        again at a later step). ``local_tokens``: what the engine's own prefix cache holds; a
        tier may answer 0 at once rather than make the request wait for little past them."""
        raise NotImplementedError

    def plan_load(self, request, start_token: int, end_token: int, block_ids: list[int],
                  expected_s: float | None = None) -> None:
        raise NotImplementedError

    def release(self, request) -> None:
        raise NotImplementedError

    def reserve_sync(self, request, start_token: int, end_token: int) -> bool:
        return False

    # -- worker side ------------------------------------------------------------------

    def take_load_reports(self) -> list[LoadReport]:
        raise NotImplementedError

    def quiet_step(self, meta) -> bool:
        return False


def blocks_of(start_token: int, end_token: int, block_size: int, block_ids: list[int]) -> list[int]:
    """The blocks that hold tokens ``[start_token, end_token)``: ``block_ids[start // bs : ceil(end / bs)]``."""
    if end_token <= start_token:
        return []
    return list(block_ids[start_token // block_size:-(-end_token // block_size)])
