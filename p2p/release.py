"""Release a prefill instance's hold from outside the decode engine (a proxy or router).

When the decode side of a request fails after its prefill succeeded, nothing will ever
pull the prefill's blocks: the prefill instance keeps them until its abort timeout
(``abort_timeout_s``, 480 s by default). :func:`release_hold` frees them at once. It
sends every worker of the prefill engine (all TP ranks and pipeline stages, from the
bootstrap server's ``/query``) the protocol's release message, a :class:`PullRequest`
with ``num_blocks=0`` (``p2p.protocol``), and waits for their ``RELEASED`` replies.
A release that arrives before the hold opens is remembered by the prefill side and
frees the hold as soon as it opens (``p2p.holds``), so this is safe to send early.

Blocking (ZMQ and an HTTP query); call it from a thread. Returns how many workers
answered ``RELEASED``; never raises for an unreachable or silent peer (the abort
timeout still frees the blocks then), the reason is in the log.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from p2p import bootstrap
from p2p.protocol import MAX_TO_DECODE, PullReply, PullRequest, Status, decode_to_decode, encode, refusal, sign

# A plain logger: proxies are standalone processes (kvcore.log would import vLLM).
logger = logging.getLogger("mctier.p2p.release")

_LINGER_MS = 2000  # a release still reaches a slow peer after we stop waiting
_MAX_WORKERS = 1024  # TP x PP of the largest engine a release is sent to


def release_hold(bootstrap_url: str, engine_id: str, transfer_id: str, timeout: float = 2.0,
                 ctx: zmq.Context | None = None, secret: bytes | None = None) -> int:
    """Release the hold of ``transfer_id`` on every worker of ``engine_id``; the number of
    workers that confirmed (0 when none could be reached within ``timeout`` seconds). With the
    deployment's ``secret`` the release is signed and only signed confirmations count."""
    deadline = time.monotonic() + timeout
    try:
        workers = bootstrap.query(bootstrap_url, timeout)
    except bootstrap.BootstrapError as e:
        logger.info("release of %s not sent: %s", transfer_id, e)
        return 0
    entry = bootstrap.find_engine(workers, engine_id)
    if entry is None:
        logger.info("release of %s not sent: engine %s is not registered at %s", transfer_id, engine_id,
                    bootstrap_url)
        return 0
    ctx = ctx or zmq.Context.instance()
    tp_size = len(entry.worker_addr)
    if sum(len(stages) for stages in entry.worker_addr.values()) > _MAX_WORKERS:
        logger.info("release of %s not sent: %s lists more than %d workers", transfer_id, bootstrap_url, _MAX_WORKERS)
        return 0
    socks = []
    try:
        for tp_rank, stages in entry.worker_addr.items():
            for addr in stages.values():
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, _LINGER_MS)
                s.setsockopt(zmq.MAXMSGSIZE, MAX_TO_DECODE)
                s.connect(addr)
                s.send(encode(sign(PullRequest(transfer_id, "router-release", tp_rank, tp_size, 0, 0, 0.0), secret)))
                socks.append((addr, s))
        confirmed = 0
        for addr, s in socks:
            left = deadline - time.monotonic()
            if left > 0 and s.poll(int(left * 1000) + 1):
                try:
                    reply = decode_to_decode(s.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.info("release of %s: bad reply from %s: %s", transfer_id, addr, e)
                    continue
                if isinstance(reply, PullReply) and reply.status == Status.RELEASED and refusal(reply, secret) is None:
                    confirmed += 1
                    continue
            logger.info("release of %s: no confirmation from %s within %.1fs", transfer_id, addr, timeout)
        return confirmed
    finally:
        for _, s in socks:
            s.close()
