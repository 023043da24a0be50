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

A hold has exactly one consumer: prefill and decode must have the same TP size (a pull
with another ``tp_size`` is refused), so decode rank r reads only from prefill rank r's
side channel, and the first PullDone ends the hold. Heterogeneous TP (several decode
ranks reading parts of one prefill rank's pages) would need an acknowledgement per
decode rank; it is not supported.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from kvcore.geometry import Region
from kvcore.log import get_logger
from kvcore.metrics import TierStats
from kvcore.mooncake_json import P2PHANDSHAKE
from p2p.protocol import (
    DoneAck,
    PullDone,
    PullReply,
    PullRequest,
    Status,
    decode_to_prefill,
    encode,
)

logger = get_logger("p2p.holds")

HEARTBEAT_S = 1.0
FORGET_S = 600.0  # how long aborted / early-released transfer ids are remembered


@dataclass
class Hold:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    opened: float
    expires: float
    fence: object = None


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
                 te_metadata: str = P2PHANDSHAKE):
        self.regions = regions
        self.te_addr = te_addr
        self.te_metadata = "" if te_metadata == P2PHANDSHAKE else te_metadata
        self.abort_timeout_s = abort_timeout_s
        self.tp_size = tp_size
        self._stats, self._stats_lock = stats, stats_lock
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
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
        self._aborted: dict[str, float] = {}
        self._early_release: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2p-sidechannel", daemon=True)
        self._thread.start()

    # -- called from the worker thread --
    def add_hold(self, req_id: str, transfer_id: str, block_ids: list[int], fence=None) -> None:
        self._inbox.put(("hold", req_id, transfer_id, list(block_ids), fence))
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

    def held(self) -> int:
        return len(self._holds)

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
            self._sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("side channel: reply to a decode worker dropped: %s", e)

    def _release(self, hold: Hold, outcome: str) -> None:
        self._holds.pop(hold.transfer_id, None)
        # Stats first: the step that reports the request finished must carry them
        # (the engine may go idle right after it).
        self._inc(f"holds:{outcome}")
        self._observe("hold", time.monotonic() - hold.opened)
        with self._fin_lock:
            self._finished.add(hold.req_id)
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
                _, req_id, tid, blocks, fence = item
                hold = Hold(req_id, tid, blocks, now, now + self.abort_timeout_s, fence)
                self._holds[tid] = hold
                self._inc("holds:opened")
                if self._early_release.pop(tid, None) is not None:
                    self._release(hold, "early_release")
            else:
                self._aborted[item[1]] = now

    def _handle(self, ident: bytes, data: bytes, now: float) -> None:
        try:
            msg = decode_to_prefill(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("side channel: undecodable message dropped: %s", e)
            self._inc("rejected:undecodable")
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
        self._waiting.append(_Waiting(ident, msg, now + max(0.0, msg.wait_s)))

    def _tick(self, now: float) -> None:
        still: list[_Waiting] = []
        for w in self._waiting:
            if not self._serve(w, now):
                still.append(w)
        self._waiting = still
        for hold in [h for h in self._holds.values() if h.expires <= now]:
            self._release(hold, "expired")
        for d in (self._aborted, self._early_release):
            for tid in [t for t, at in d.items() if now - at > FORGET_S]:
                del d[tid]

    def _serve(self, w: _Waiting, now: float) -> bool:
        """Answer a pending pull if possible; True when it is done with."""
        req, tid = w.req, w.req.transfer_id
        hold = self._holds.get(tid)
        if req.num_blocks == 0:  # release only
            if hold is not None:
                self._release(hold, "released")
            elif tid not in self._aborted:
                self._early_release[tid] = now
            self._send(w.ident, PullReply(Status.RELEASED, tid))
            return True
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
        end = req.start_block + req.num_blocks
        if req.start_block < 0 or end > len(hold.block_ids):
            self._send(w.ident, PullReply(Status.ERROR, tid, error=(
                f"asked for blocks [{req.start_block}, {end}) but the prefill holds {len(hold.block_ids)}")))
            self._inc("rejected:bad_range")
            self._release(hold, "released")  # that consumer will not come back for it
            return True
        if hold.fence is not None:
            hold.fence.synchronize()  # CUDA: the prefill's KV writes are complete
            hold.fence = None
        self._send(w.ident, PullReply(Status.READY, tid, te_addr=self.te_addr, te_metadata=self.te_metadata,
                                      regions=self.regions, block_ids=hold.block_ids[req.start_block:end]))
        return True
