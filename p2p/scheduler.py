"""Scheduler-process side of the P2P tier (in ``VLLM::EngineCore``).

The tier's half of the scheduler-side contract (``kvcore.tier``), used by the
connector facade and by a composite that splits a request's prompt between sources:

* :meth:`P2PScheduler.lookup` ``(request) -> int``: prompt tokens the prefill
  instance can supply (the whole prompt when the request carries valid
  ``do_remote_prefill`` params, else 0). No side effects.
* :meth:`P2PScheduler.plan_load` ``(request, start_token, end_token, block_ids)``: pull
  the blocks holding tokens ``[start_token, end_token)`` (``block_ids`` indexed by block
  position in the request; the block holding ``start_token`` is pulled whole) from the
  prefill instance (asynchronously; the result arrives in the worker's
  ``finished_recving`` / ``failed_recving`` for this request id, and as a
  ``LoadReport``). One transfer per request.
* :meth:`P2PScheduler.release` ``(request)``: tell the prefill instance to free its
  blocks without pulling.

With KV cache groups (vLLM's hybrid allocator on; :mod:`p2p.groups`) ``block_ids`` are one list
per group: the pull covers each group's blocks at that group's ids (a sliding group's window
only), the prefill holds each group's, and pins the window blocks of a prefill request that
runs on after its prompt (:class:`p2p.groups.SendPins`).

Prefill side: :meth:`request_finished` holds the blocks of a finished
``do_remote_decode`` request (returns ``True``) until the worker reports the request in
``finished_sending``; an aborted prefill is not held and its transfer id is marked so a
waiting decode side gets an error at once.

Transfer parameters are checked before any is used (:meth:`P2PScheduler.params`): the required
fields as strings of at most 256 characters, an http(s) bootstrap URL, a transfer id not
pulled or released before on this engine, and, with the deployment's secret, the router's
signature (``kvcore.trust.verify_params``; the API server's middleware, ``p2p.guard``, has
already refused such a request with a 403 when it is installed). Refused parameters are
counted (``refused:<why>``) and logged once per request; the request is computed locally
(decode side) or its blocks are not held (prefill side).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import msgspec

from kvcore import trust
from kvcore.kvgroups import KVGroup
from kvcore.log import get_logger
from kvcore.tier import blocks_of, load_deadline_s
from kvcore.vllm_glue import KVConnectorMetadata, first_group_block_ids, request_finished_normally
from p2p.bootstrap import check_url
from p2p.config import P2PConfig, normalize_url
from p2p.groups import SendPins, held, plan as group_plan
from p2p.metrics import P2PStats
from p2p.protocol import prompt_digest

logger = get_logger("p2p.scheduler")

REQUIRED = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
MAX_ID = 256  # characters of a transfer or engine id (p2p.protocol.Id)
_LOGGED = 4096  # request ids whose refused parameters were logged, remembered


class RecvSpec(msgspec.Struct):
    req_id: str
    transfer_id: str
    bootstrap_url: str
    engine_id: str
    start_block: int
    block_ids: list[int]
    timeout_s: float  # the pull's deadline, prefill wait included (kvcore.tier.load_deadline_s)
    prompt: str = ""  # p2p.protocol.prompt_digest of the request's prompt ("": a release)
    # With KV cache groups (p2p.groups): each group's (start block, local block ids); block_ids
    # is then all of them, group after group. None: one group.
    groups: list[tuple[int, list[int]]] | None = None
    error: str = ""  # the handoff cannot be planned: the worker fails the request at once


class P2PMetadata(KVConnectorMetadata):
    def __init__(self):
        self.recvs: list[RecvSpec] = []
        # (req_id, transfer_id, block_ids, prompt digest, each group's block ids or None: one group)
        self.holds: list[tuple[str, str, list[int], str, list[list[int]] | None]] = []
        self.aborted: list[str] = []  # transfer ids of prefills that will not be held


def remote_prefill_params(params: dict | None) -> tuple[dict | None, str]:
    """``(params, "")`` when ``params`` ask for a well-formed remote prefill, else ``(None, why)``."""
    if not params or not params.get("do_remote_prefill"):
        return None, ""
    bad = [k for k in REQUIRED if not isinstance(params.get(k), str) or not params.get(k)
           or len(params[k]) > (2048 if k == "remote_bootstrap_addr" else MAX_ID)]
    if bad:
        return None, f"missing, non-string or too long {', '.join(bad)}"
    if (why := check_url(normalize_url(params["remote_bootstrap_addr"]))) is not None:
        return None, f"remote_bootstrap_addr: {why}"
    return params, ""


class P2PScheduler:
    def __init__(self, vllm_config, cfg: P2PConfig, role_name: str, idle_step_s: float = 0.0,
                 groups: list[KVGroup] | None = None):
        self.cfg = cfg
        # KV cache groups (p2p.groups), None: one full-attention group (blocks as before groups).
        self.groups = groups
        # Prefill side: sliding-window blocks still to send, held past vLLM freeing them.
        self.pins = SendPins(groups) if groups is not None and role_name in ("kv_producer", "kv_both") else None
        self._kv_cache_manager = None
        # Pause of a step that schedules no tokens (the engine only waits for KV or for
        # pulls of its holds); see P2PConnector for when it is not 0.
        self.idle_step_s = idle_step_s
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = role_name in ("kv_producer", "kv_both")
        self.is_consumer = role_name in ("kv_consumer", "kv_both")
        self._meta = P2PMetadata()
        self._held: dict[str, float] = {}  # req_id -> hold start
        self._invalid_logged: OrderedDict[str, None] = OrderedDict()  # bounded: _LOGGED
        self.stats = P2PStats()
        self._done_tids: OrderedDict[str, None] = OrderedDict()
        self.secret = cfg.secret()
        # Signed parameters stay good while a request may wait in the engine's queue and its
        # prefill's hold lasts; the API server's middleware checks freshness at arrival.
        self.max_age_s = trust.MAX_AGE_S + (cfg.abort_timeout_s or 0.0)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _pool(self):
        return getattr(self._kv_cache_manager, "block_pool", None)

    def _refuse_once(self, request, counter: str, message: str) -> None:
        """Count and log refused parameters once per request (vLLM asks again after a preemption)."""
        if request.request_id in self._invalid_logged:
            return
        self._invalid_logged[request.request_id] = None
        while len(self._invalid_logged) > _LOGGED:
            self._invalid_logged.popitem(last=False)
        self.stats.inc(counter)
        logger.warning("request %s: %s", request.request_id, message)

    def params(self, request) -> dict | None:
        """The request's remote-prefill parameters when they may be acted on, else None (refusals
        counted and logged once per request: see the module docstring)."""
        p = request.kv_transfer_params
        params, why = remote_prefill_params(p)
        if params is None:
            if why:
                self._refuse_once(request, "failures:invalid_params",
                                  f"invalid kv_transfer_params for a remote prefill ({why}); computing it locally")
            return None
        if self.secret is not None:
            try:
                trust.verify_params(self.secret, params, None, self.max_age_s)
            except trust.Refused as e:
                self._refuse_once(request, f"refused:{e.kind}", f"transfer parameters refused ({e}); computing it "
                                                                f"locally")
                return None
        if params["transfer_id"] in self._done_tids:
            self._refuse_once(request, "refused:replayed", f"transfer {params['transfer_id'][:MAX_ID]} was already "
                                                           f"pulled or released here; computing it locally")
            return None
        return params

    # -- decode side --
    def lookup(self, request) -> int:
        params = self.params(request)
        if params is None:
            return 0
        if not self.is_consumer:
            logger.warning("request %s asks for a remote prefill but this engine is a kv_producer; computing locally",
                           request.request_id)
            return 0
        return len(request.prompt_token_ids or ())

    def plan_load(self, request, start_token: int, end_token: int, block_ids,
                  expected_s: float | None = None) -> None:
        """``block_ids``: the request's block ids; with KV cache groups one list per group (the
        pull then runs to the prompt's end: :meth:`plan_groups`)."""
        if self.groups is not None:
            self.plan_groups(request, start_token // self.block_size, block_ids, expected_s, end_token)
            return
        p = request.kv_transfer_params
        self._handled(p["transfer_id"])
        first = start_token // self.block_size
        blocks = blocks_of(start_token, end_token, self.block_size, block_ids)
        # Never past the prefill side's hold: after abort_timeout_s it frees the blocks.
        timeout = load_deadline_s(self.cfg.transfer_timeout_s, expected_s, cap_s=self.cfg.abort_timeout_s)
        self._meta.recvs.append(RecvSpec(request.request_id, p["transfer_id"],
                                         normalize_url(p["remote_bootstrap_addr"]), p["remote_engine_id"], first,
                                         blocks, timeout, prompt_digest(request.prompt_token_ids or ())))
        p["do_remote_prefill"] = False  # one transfer per request

    def release(self, request, reason: str = "") -> None:
        p = self.params(request)
        if p is None:
            return
        p["do_remote_prefill"] = False
        if self._handled(p["transfer_id"]):
            return  # the same handoff seen through another request object (vLLM aliases)
        logger.info("request %s: not pulling transfer %s (%s); telling the prefill instance to free its blocks",
                    request.request_id, p["transfer_id"], reason or "caller's decision")
        self._meta.recvs.append(RecvSpec(request.request_id, p["transfer_id"],
                                         normalize_url(p["remote_bootstrap_addr"]), p["remote_engine_id"], 0, [],
                                         self.cfg.transfer_timeout_s))

    def _handled(self, transfer_id: str) -> bool:
        """Record a transfer id as pulled or released; True if it already was."""
        if transfer_id in self._done_tids:
            return True
        self._done_tids[transfer_id] = None
        if len(self._done_tids) > 100_000:
            self._done_tids.popitem(last=False)
        return False

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        n = self.lookup(request)
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.pins is not None and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self.pins.watch(request)  # its window blocks are pinned once its prompt is computed
        if not self.is_consumer or self.params(request) is None:
            return
        if num_external_tokens <= 0:
            self.release(request, "no external tokens allocated")
            return
        n = len(request.prompt_token_ids or ())
        total = -(-n // self.block_size)
        first = total - -(-num_external_tokens // self.block_size)
        if self.groups is not None:
            self.plan_groups(request, first, blocks.get_block_ids())
            return
        ids = first_group_block_ids(blocks)
        # Blocks below `first` came from the local prefix cache; pull only the rest.
        self.plan_load(request, first * self.block_size, n, ids)

    def plan_groups(self, request, first: int, block_ids, expected_s: float | None = None,
                    end_token: int | None = None) -> None:
        """Pull each KV cache group's blocks from block ``first`` up to token ``end_token`` (the
        prompt's end by default; a sliding group's inside the window only: :func:`p2p.groups.plan`)
        at that group's block ids."""
        p = request.kv_transfer_params
        self._handled(p["transfer_id"])
        prompt = request.prompt_token_ids or ()
        error = ""
        try:
            per_group = group_plan(self.groups, block_ids, first, len(prompt) if end_token is None else end_token)
        except ValueError as e:
            per_group, error = [], str(e)
            self.stats.inc("failures:layout")
            logger.warning("request %s: cannot plan the handoff (%s); recomputing it locally", request.request_id, e)
        timeout = load_deadline_s(self.cfg.transfer_timeout_s, expected_s, cap_s=self.cfg.abort_timeout_s)
        self._meta.recvs.append(RecvSpec(request.request_id, p["transfer_id"],
                                         normalize_url(p["remote_bootstrap_addr"]), p["remote_engine_id"], 0,
                                         [b for _, ids in per_group for b in ids], timeout, prompt_digest(prompt),
                                         groups=per_group or None, error=error))
        p["do_remote_prefill"] = False  # one transfer per request

    # -- prefill side --
    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's block ids; with KV cache groups, one list per group
        (vLLM's ``request_finished_all_groups``)."""
        hold, params = self._request_finished(request, block_ids)
        if self.pins is not None:
            self.pins.finished(request.request_id, hold, self._pool())
        return hold, params

    def _request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill") and self.is_consumer:
            # Never allocated (aborted while waiting): the prefill still holds blocks for us.
            self.release(request, f"finished before its KV was loaded ({request.status.name})")
            return False, None
        if not p.get("do_remote_decode") or not self.is_producer:
            return False, None
        tid = p.get("transfer_id")
        if not isinstance(tid, str) or not tid or len(tid) > MAX_ID:
            self._refuse_once(request, "failures:invalid_params", f"do_remote_decode without a transfer_id of at "
                                                                  f"most {MAX_ID} characters; blocks not held")
            return False, None
        if self.secret is not None:
            try:
                trust.verify_params(self.secret, p, None, self.max_age_s)
            except trust.Refused as e:
                self._refuse_once(request, f"refused:{e.kind}", f"transfer parameters refused ({e}); blocks not held")
                return False, None
        if not request_finished_normally(request) or not (any(block_ids) if self.groups is not None else block_ids):
            self._meta.aborted.append(tid)
            self.stats.inc("holds:aborted")
            return False, None
        n = len(request.prompt_token_ids or ())
        n_blocks = -(-n // self.block_size)
        digest = prompt_digest(request.prompt_token_ids or ())
        if self.groups is not None:
            per_group = held(block_ids, n, self.block_size)
            if self.pins is not None:
                per_group = self.pins.fill(request.request_id, per_group)
            self._meta.holds.append((request.request_id, tid, per_group[0], digest, per_group))
        else:
            self._meta.holds.append((request.request_id, tid, list(block_ids[:n_blocks]), digest, None))
        self._held[request.request_id] = time.monotonic()
        return True, None

    def finished_sending(self, req_ids) -> None:
        for r in req_ids or ():
            self._held.pop(r, None)
            if self.pins is not None:
                self.pins.sent(r, self._pool())

    def has_pending_push_work(self) -> bool:
        if not self._held:
            return False
        # The engine only steps while this is True (no live requests); stepping is
        # what delivers acknowledgements, so keep it alive but don't spin a core.
        time.sleep(0.002)
        return True

    def build_connector_meta(self, idle: bool = False) -> P2PMetadata:
        """This step's metadata; ``idle``: the step schedules no tokens (it pauses
        ``idle_step_s``, unless it starts a pull, which the pause would only delay)."""
        if self.pins is not None:
            self.pins.step(self._kv_cache_manager)
        meta, self._meta = self._meta, P2PMetadata()
        if idle and self.idle_step_s and not meta.recvs:
            time.sleep(self.idle_step_s)
        return meta
