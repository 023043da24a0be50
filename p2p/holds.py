"""Prefill side: held blocks and the ZMQ ROUTER side channel that serves pulls.

A *hold* is one finished prefill request whose blocks the scheduler keeps
(``request_finished`` returned True) until the decode side has read them. The
server thread owns all hold state; the worker thread talks to it through
:meth:`SideChannel.add_hold` / :meth:`abort` and drains :meth:`take_finished`.

Lifecycle of a hold: opened -> (its consumer sent PullDone) released, or (a release
request) released early, or (``abort_timeout_s`` passed) expired. A pull that arrives
before its hold waits (WAIT heartbeats every second) at most the ``wait_s`` the decode
side allowed; a pull for a transfer whose prefill was aborted is answered ERROR at
once. Holds are never re-read after release.

With KV cache groups a hold keeps each group's block ids (null where vLLM freed a sliding
group's blocks) and a pull names a range per group: it is served only when every block it names
is held and not null (:func:`p2p.groups.serve_ranges`), else answered ERROR and the hold let go.

A hold has exactly one consumer: prefill and decode must have the same TP size (a pull
with another ``tp_size`` is refused), so decode rank r reads only from prefill rank r's
side channel, and the first PullDone ends the hold. Heterogeneous TP (several decode
ranks reading parts of one prefill rank's pages) would need an acknowledgement per
decode rank; it is not supported.

Nothing a peer sends is trusted. With the deployment's secret every message must be signed
(``p2p.protocol.refusal``; otherwise dropped and counted ``rejected:<why>``, a pull answered
ERROR); a pull served from a hold must carry this engine's KV fingerprint (else ERROR,
``rejected:fingerprint``, and the hold is let go: that consumer cannot use it); ``wait_s`` is capped at
:data:`MAX_WAIT_S`. Every table a peer's ids reach is bounded: pulls waiting for their hold
(:data:`MAX_WAITING`, beyond it ERROR and ``rejected:overload``), remembered aborted and
early-released transfer ids (:data:`MAX_REMEMBERED`, oldest forgotten first). A second hold
under a transfer id already held is released at once (``holds:duplicate``): the first keeps
its consumer, and no hold is ever orphaned by another.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq

from kvcore.geometry import Region
from kvcore.log import Throttle, get_logger
from kvcore.metrics import TierStats
from kvcore.mooncake_json import P2PHANDSHAKE
from p2p.groups import serve_ranges
from p2p.protocol import (
    MAX_TO_PREFILL,
    DoneAck,
    PullDone,
    PullReply,
    PullRequest,
    Status,
    decode_to_prefill,
    encode,
    refusal,
    sign,
)

logger = get_logger("p2p.holds")

HEARTBEAT_S = 1.0
FORGET_S = 600.0  # how long aborted / early-released transfer ids are remembered
MAX_WAITING = 1024  # pulls waiting for their hold at once (a decode instance has a few in flight)
MAX_WAIT_S = FORGET_S  # the longest a pull waits for its hold, whatever wait_s its peer asked for
MAX_REMEMBERED = 65536  # aborted / early-released transfer ids kept (each at most 256 characters)


@dataclass
class Hold:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    opened: float
    expires: float
    fence: object = None
    prompt: str = ""  # p2p.protocol.prompt_digest of its prompt
    # With KV cache groups (p2p.groups): each group's block ids of the prompt (null where vLLM
    # freed them); block_ids is then the first group's. None: one group.
    groups: list[list[int]] | None = None


@dataclass
class _Waiting:
    ident: bytes
    req: PullRequest
    until: float
    next_beat: float = field(default=0.0)


class SideChannel:
    """ROUTER socket + hold table, served by one daemon thread."""

    def __init__(self, regions: list[Region], te_addr: str, stats: TierStats, stats_lock: threading.Lock,
                 host: str = "127.0.0.1", abort_timeout_s: float = 480.0, tp_size: int = 1,
                 te_metadata: str = P2PHANDSHAKE, secret: bytes | None = None, fingerprint: str = ""):
        self.regions = regions
        self.te_addr = te_addr
        self.te_metadata = "" if te_metadata == P2PHANDSHAKE else te_metadata
        self.abort_timeout_s = abort_timeout_s
        self.tp_size = tp_size
        self.secret, self.fingerprint = secret, fingerprint
        self._stats, self._stats_lock = stats, stats_lock
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_TO_PREFILL)  # a longer message drops its peer's connection
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{port}"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Wakes the server thread when the worker adds to the inbox: it would otherwise see a
        # new hold only at its next poll timeout, and a decode side already waiting for it
        # would get READY up to that long after the prefill ended.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._finished: set[str] = set()
        self._fin_lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._waiting: list[_Waiting] = []
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self._early_release: OrderedDict[str, float] = OrderedDict()
        self._throttle = Throttle()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2p-sidechannel", daemon=True)
        self._thread.start()

    # -- called from the worker thread --
    def add_hold(self, req_id: str, transfer_id: str, block_ids: list[int], fence=None, prompt: str = "",
                 groups: list[list[int]] | None = None) -> None:
        """``groups``: with KV cache groups, each group's block ids (``block_ids`` is ignored)."""
        groups = [list(g) for g in groups] if groups is not None else None
        self._inbox.put(("hold", req_id, transfer_id, groups[0] if groups else list(block_ids), fence, prompt,
                         groups))
        self._wake()

    def abort(self, transfer_id: str) -> None:
        self._inbox.put(("abort", transfer_id))
        self._wake()

    def _wake(self) -> None:
        try:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")
        except OSError:
            pass  # a full pipe already wakes the thread; a closed one means it has stopped

    def take_finished(self) -> set[str]:
        with self._fin_lock:
            out, self._finished = self._finished, set()
        return out

    def idle(self) -> bool:
        """No hold added, held or ended but not taken (read unlocked, from the worker thread)."""
        return not (self._holds or self._finished) and self._inbox.empty()

    def held(self) -> int:
        return len(self._holds)

    def table_sizes(self) -> dict[str, int]:
        """Entries of every table a peer's messages reach (for tests and debugging)."""
        return {"holds": len(self._holds), "waiting": len(self._waiting), "aborted": len(self._aborted),
                "early_release": len(self._early_release)}

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._sock.close(0)
        if not self._thread.is_alive() and self._wake_w >= 0:  # close may be called twice
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # -- server thread --
    def _inc(self, key: str, n: float = 1) -> None:
        with self._stats_lock:
            self._stats.inc(key, n)

    def _observe(self, op: str, s: float) -> None:
        with self._stats_lock:
            self._stats.observe(op, s)

    def _send(self, ident: bytes, msg: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([ident, encode(sign(msg, self.secret))], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("side channel: reply to a decode worker dropped: %s", e)

    @staticmethod
    def _remember(table: OrderedDict, tid: str, now: float) -> None:
        table[tid] = now
        table.move_to_end(tid)
        while len(table) > MAX_REMEMBERED:
            table.popitem(last=False)

    def _release(self, hold: Hold, outcome: str) -> None:
        # Stats first: the step that reports the request finished must carry them (the engine
        # may go idle right after it); the hold last, so idle() never sees it gone and not finished.
        self._inc(f"holds:{outcome}")
        self._observe("hold", time.monotonic() - hold.opened)
        with self._fin_lock:
            self._finished.add(hold.req_id)
        if self._holds.get(hold.transfer_id) is hold:
            del self._holds[hold.transfer_id]
        log = logger.warning if outcome == "expired" else logger.debug
        log("hold %s (%s, %d blocks) %s after %.1fs", hold.transfer_id, hold.req_id, len(hold.block_ids),
            outcome, time.monotonic() - hold.opened)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                # The timeout paces heartbeats and expiries only: messages and holds wake it.
                events = dict(poller.poll(50))
            except zmq.ZMQError:
                break
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            now = time.monotonic()
            self._drain_inbox(now)
            if self._sock in events:
                while True:
                    try:
                        ident, data = self._sock.recv_multipart(flags=zmq.NOBLOCK)[:2]
                    except zmq.Again:
                        break
                    except ValueError:
                        continue
                    self._handle(ident, data, now)
            self._tick(time.monotonic())

    def _drain_inbox(self, now: float) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "hold":
                _, req_id, tid, blocks, fence, prompt, groups = item
                hold = Hold(req_id, tid, blocks, now, now + self.abort_timeout_s, fence, prompt, groups)
                self._inc("holds:opened")
                if tid in self._holds:
                    # Another request already holds this transfer id: it keeps its consumer, and
                    # this one, which no consumer can name apart, is not held at all.
                    logger.warning("request %s: transfer id %s is already held for %s; not holding it twice",
                                   req_id, tid, self._holds[tid].req_id)
                    self._release(hold, "duplicate")
                    continue
                self._holds[tid] = hold
                if self._early_release.pop(tid, None) is not None:
                    self._release(hold, "early_release")
            else:
                self._remember(self._aborted, item[1], now)

    def _handle(self, ident: bytes, data: bytes, now: float) -> None:
        try:
            msg = decode_to_prefill(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._inc("rejected:undecodable")
            if (held := self._throttle.ready("undecodable")) is not None:
                logger.warning("side channel: undecodable message dropped: %s (%d more since the last such line)",
                               str(e)[:200], held)
            return
        why = refusal(msg, self.secret)
        if why is not None:
            self._inc(f"rejected:{why}")
            if (held := self._throttle.ready(why)) is not None:
                logger.warning("side channel: %s %s for %s dropped (%s; %d more since the last such line)", why,
                               type(msg).__name__, msg.transfer_id,
                               "not signed with the deployment's secret" if why == "unsigned" else why, held)
            if isinstance(msg, PullRequest):
                self._send(ident, PullReply(Status.ERROR, msg.transfer_id, error=f"message refused: {why}"))
            return
        if isinstance(msg, PullDone):
            hold = self._holds.get(msg.transfer_id)
            if hold is not None:
                if not msg.ok:
                    logger.info("decode side failed to pull %s (%s): %s", msg.transfer_id, msg.req_id, msg.cause)
                self._release(hold, "released")  # its only consumer is done with it
            else:
                self._inc("rejected:unknown_transfer")
            self._send(ident, DoneAck(msg.transfer_id))
            return
        if msg.tp_size != self.tp_size:
            self._inc("rejected:tp_mismatch")
            why = f"TP mismatch: prefill tp_size={self.tp_size}, decode tp_size={msg.tp_size}"
            self._send(ident, PullReply(Status.ERROR, msg.transfer_id, error=why))
            return
        if msg.num_blocks == 0:  # a release never waits
            self._let_go(msg.transfer_id, now)
            self._send(ident, PullReply(Status.RELEASED, msg.transfer_id))
            return
        wait_s = msg.wait_s if math.isfinite(msg.wait_s) else MAX_WAIT_S
        w = _Waiting(ident, msg, now + min(max(0.0, wait_s), MAX_WAIT_S))
        if self._serve(w, now):  # its hold is there (or aborted): answered without queueing
            return
        if len(self._waiting) >= MAX_WAITING:
            # The oldest waiter goes: a flood of waits that never end cannot keep new pulls out.
            old = self._waiting.pop(0)
            self._inc("rejected:overload")
            self._send(old.ident, PullReply(Status.ERROR, old.req.transfer_id, error="too many pulls waiting"))
        self._waiting.append(w)

    def _let_go(self, tid: str, now: float) -> None:
        hold = self._holds.get(tid)
        if hold is not None:
            self._release(hold, "released")
        elif tid not in self._aborted:
            self._remember(self._early_release, tid, now)

    def _tick(self, now: float) -> None:
        still: list[_Waiting] = []
        for w in self._waiting:
            if not self._serve(w, now):
                still.append(w)
        self._waiting = still
        for hold in [h for h in self._holds.values() if h.expires <= now]:
            self._release(hold, "expired")
        for d in (self._aborted, self._early_release):  # oldest first: _remember keeps the order
            while d and now - next(iter(d.values())) > FORGET_S:
                d.popitem(last=False)

    def _serve(self, w: _Waiting, now: float) -> bool:
        """Answer a pending pull if possible; True when it is done with."""
        req, tid = w.req, w.req.transfer_id
        hold = self._holds.get(tid)
        if hold is None:
            if tid in self._aborted:
                self._send(w.ident, PullReply(Status.ERROR, tid, error="prefill request was aborted"))
                return True
            if now >= w.until:
                # No hold for this transfer id within the wait the decode side allowed.
                self._inc("rejected:unknown_transfer")
                self._send(w.ident, PullReply(Status.ERROR, tid, error="prefill did not finish in time"))
                return True
            if now >= w.next_beat:
                self._send(w.ident, PullReply(Status.WAIT, tid))
                w.next_beat = now + HEARTBEAT_S
            return False
        if req.fingerprint != self.fingerprint:
            # Another model, config, dtype or layout: its KV is not this engine's. The consumer
            # cannot use the hold, so it is let go.
            self._inc("rejected:fingerprint")
            if self._throttle.ready("fingerprint") is not None:
                logger.warning("side channel: pull of %s refused: the decode engine's KV fingerprint %s is not this "
                               "engine's %s (other weights, config, dtype or layout)", tid,
                               req.fingerprint[:16] or "(none)", self.fingerprint[:16])
            self._send(w.ident, PullReply(Status.ERROR, tid, fingerprint=self.fingerprint,
                                          error="KV fingerprint mismatch: the engines differ in weights, config, "
                                                "dtype or layout"))
            self._release(hold, "released")
            return True
        if req.prompt and hold.prompt and req.prompt != hold.prompt:
            # The transfer id of one request, named by a request for another prompt (parameters
            # replayed onto another body): its KV would be wrong there. The hold waits for its own.
            self._inc("rejected:prompt_mismatch")
            self._send(w.ident, PullReply(Status.ERROR, tid, error="prompt mismatch: the held request has another "
                                                                   "prompt"))
            return True
        blocks = self._blocks_for(req, hold)
        if isinstance(blocks, str):
            self._send(w.ident, PullReply(Status.ERROR, tid, error=blocks))
            self._inc("rejected:bad_range")
            self._release(hold, "released")  # that consumer will not come back for it
            return True
        if hold.fence is not None:
            hold.fence.synchronize()  # CUDA: the prefill's KV writes are complete
            hold.fence = None
        self._send(w.ident, PullReply(Status.READY, tid, te_addr=self.te_addr, te_metadata=self.te_metadata,
                                      regions=self.regions, block_ids=blocks, fingerprint=self.fingerprint))
        return True

    @staticmethod
    def _blocks_for(req: PullRequest, hold: Hold) -> list[int] | str:
        """The held block ids a pull asks for (with groups, each group's in turn), or why it
        cannot have them."""
        if hold.groups is not None or req.ranges:
            if hold.groups is None or not req.ranges:
                return (f"KV cache groups mismatch: the pull names {len(req.ranges)} group range(s), the prefill "
                        f"holds {len(hold.groups) if hold.groups is not None else 'one un-grouped'} block list(s)")
            if req.start_block or req.num_blocks != sum(r.count for r in req.ranges):
                return "a pull by group ranges has start_block 0 and num_blocks their total"
            return serve_ranges(hold.groups, [(r.start, r.count) for r in req.ranges])
        end = req.start_block + req.num_blocks
        if req.start_block < 0 or end > len(hold.block_ids):
            return f"asked for blocks [{req.start_block}, {end}) but the prefill holds {len(hold.block_ids)}"
        return hold.block_ids[req.start_block:end]
