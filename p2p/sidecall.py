"""The decode side's half of one side-channel exchange (``p2p.protocol``), on one DEALER
socket per pull: the wait for the prefill worker's answer, and the completion that frees its
blocks. Every message is signed with the deployment's secret when there is one, and an
answer that is not is refused."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvcore.log import get_logger
from p2p.protocol import DoneAck, PullDone, PullReply, Status, decode_to_decode, encode, refusal, sign

logger = get_logger("p2p.puller")


class PullFailed(Exception):
    """A pull that ended without its KV: ``cause`` is the metric label (``failures:<cause>``)."""

    def __init__(self, cause: str, detail: str, other_layout: bool = False, registered: tuple[str, ...] = ()):
        super().__init__(f"{cause}: {detail}")
        self.cause, self.detail, self.other_layout = cause, detail, other_layout
        self.registered = registered  # engine ids at the bootstrap server when ours was not among them


def await_reply(sock, transfer_id: str, addr: str, deadline: float, silence_s: float,
                secret: bytes | None) -> PullReply:
    """The first answer for ``transfer_id`` that is not a WAIT heartbeat. ``PullFailed``:
    ``timeout`` at ``deadline`` (monotonic), ``peer`` after ``silence_s`` without any message,
    ``protocol`` for an undecodable or refused (unsigned, badly signed, stale) message."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PullFailed("timeout", f"no READY from {addr} before the deadline")
        if not sock.poll(int(min(left, silence_s) * 1000) + 1):
            if time.monotonic() >= deadline:
                raise PullFailed("timeout", f"no READY from {addr} before the deadline")
            raise PullFailed("peer", f"prefill worker {addr} silent for {silence_s:.0f}s (dead?)")
        try:
            msg = decode_to_decode(sock.recv())
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise PullFailed("protocol", f"bad reply from {addr}: {str(e)[:200]}") from None
        if (why := refusal(msg, secret)) is not None:
            raise PullFailed("protocol", f"reply from {addr} refused: {why} (the deployment's secret differs?)")
        if isinstance(msg, PullReply) and msg.transfer_id == transfer_id and msg.status != Status.WAIT:
            return msg


def send_done(sock, transfer_id: str, req_id: str, ok: bool, cause: str, secret: bytes | None) -> None:
    """Tell the prefill worker the pull ended (it frees its blocks); wait for its acknowledgement
    briefly. Never raises: without an answer the prefill frees the blocks at its abort timeout."""
    try:
        sock.send(encode(sign(PullDone(transfer_id, req_id, ok, cause), secret)), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                break
            if isinstance(decode_to_decode(sock.recv()), DoneAck):
                return
        logger.info("prefill side did not acknowledge %s; it frees the blocks at its abort timeout", transfer_id)
    except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.info("completion for %s not delivered: %s", transfer_id, e)
