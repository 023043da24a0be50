"""Wire messages of the P2P tier (msgspec structs).

Two channels. Only the first is vLLM's MooncakeConnector's own:

* HTTP bootstrap (prefill side), the same routes and JSON as vLLM's
  ``MooncakeBootstrapServer``: ``POST /register`` takes :class:`RegisterPayload`,
  ``GET /query`` answers ``{dp_rank: EngineEntry}`` (JSON object keys are strings). So
  vLLM's Mooncake proxy and anything else that reads ``/query`` work unchanged, as do
  the requests' ``kv_transfer_params`` (``do_remote_prefill``/``do_remote_decode``,
  ``transfer_id``, ``remote_engine_id``, ``remote_bootstrap_addr``).
* ZMQ side channel (ROUTER on the prefill worker, DEALER on the decode worker, as in
  vLLM), but with this project's messages, msgpack-encoded tagged structs, and the
  opposite direction: vLLM's prefill *writes* the KV into the decode's blocks, here the
  decode side *pulls* (reads the prefill's pages). A vLLM ``MooncakeConnector`` on one
  side and a ``P2PConnector`` on the other do not interoperate. The messages:

  D -> P :class:`PullRequest`  (blocks ``[start_block, start_block+num_blocks)`` of the
         request ``transfer_id``, or with KV cache groups one :class:`BlockRange` per group;
         ``num_blocks == 0`` means "release, I will not pull")
  P -> D :class:`PullReply`    WAIT (heartbeat while P still prefills), READY (P's regions,
         block ids, and the name of its Transfer Engine with the metadata server that
         name is registered in, "" for P2PHANDSHAKE: see p2p.transfer), RELEASED, or ERROR
  D -> P :class:`PullDone`     the read finished (``ok``) or failed; P drops the hold (one
         consumer per hold: same TP size on both sides, see p2p.holds)
  P -> D :class:`DoneAck`

Every message carries ``ts`` and ``mac``: with the deployment's secret (:mod:`kvcore.trust`)
the sender signs it (:func:`sign`) and the receiver drops it unless :func:`refusal` finds
nothing wrong (signed with the secret, no older than ``kvcore.trust.MAX_AGE_S``); without a
secret both are left empty and not checked. :class:`RegisterPayload` is signed the same way
(:func:`sign_registration`). ``PullRequest`` and ``PullReply`` carry each side's KV
fingerprint (``kvcore.identity``): a pull between engines of different weights, config,
dtype or layout is refused before any byte moves; ``PullRequest.prompt`` must match the
held request's prompt (:func:`prompt_digest`): transfer parameters replayed onto another prompt
never load that prompt's KV. Each socket refuses messages longer than
:data:`MAX_TO_PREFILL` / :data:`MAX_TO_DECODE` bytes (ZMQ ``MAXMSGSIZE``).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import time
from typing import Annotated, NamedTuple

import msgspec

from kvcore import trust
from kvcore.geometry import Region

# ZMQ MAXMSGSIZE of each side's socket: a request or completion is a few hundred bytes; a
# READY reply lists the prefill's regions (a few per layer) and the block ids asked for.
MAX_TO_PREFILL = 64 << 10
MAX_TO_DECODE = 16 << 20

# Bounds on what a peer may send: ids are the keys of the prefill side's tables.
Id = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
MAX_GROUPS = 64  # KV cache groups a pull may name (p2p.groups.MAX_GROUPS)
# A READY reply's block ids: at most what MAX_TO_DECODE can carry anyway (5 bytes each).
BlockIds = Annotated[list[Count], msgspec.Meta(max_length=MAX_TO_DECODE // 5)]


class BlockRange(NamedTuple):
    """Blocks ``[start, start + count)`` of one KV cache group of the held request (on the wire a
    two-element array: any other length is refused)."""

    start: Count
    count: Count


class RegisterPayload(msgspec.Struct, omit_defaults=True):
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str  # "tcp://host:port" of the worker's side channel
    ts: float = 0.0  # wall-clock seconds when signed (0: unsigned)
    mac: str = ""  # hex HMAC with the deployment's secret ("": unsigned)


class EngineEntry(msgspec.Struct):
    engine_id: str
    # {tp_rank: {pp_rank: side channel addr}}
    worker_addr: dict[int, dict[int, str]]


class Status(enum.IntEnum):
    READY = 0
    WAIT = 1
    ERROR = 2
    RELEASED = 3


class PullRequest(msgspec.Struct, tag="pull", omit_defaults=True):
    transfer_id: Id
    req_id: Id  # the decode side's request id (for logs)
    tp_rank: Rank
    tp_size: Rank
    start_block: Count = 0
    num_blocks: Count = 0  # 0: release only
    wait_s: float = 30.0  # how long P may wait for the prefill to finish (capped: p2p.holds.MAX_WAIT_S)
    fingerprint: Id = ""  # the decode engine's KV fingerprint (kvcore.identity)
    prompt: Id = ""  # prompt_digest of the decode request's prompt ("": a release)
    # With KV cache groups (p2p.groups): each group's blocks, in group order; ``start_block`` is 0
    # and ``num_blocks`` their total. Empty: one group, ``[start_block, start_block+num_blocks)``.
    ranges: Annotated[list[BlockRange], msgspec.Meta(max_length=MAX_GROUPS)] = []
    ts: float = 0.0
    mac: bytes = b""


class PullReply(msgspec.Struct, tag="reply", omit_defaults=True):
    status: Status
    transfer_id: str
    te_addr: str = ""
    regions: list[Region] = []
    block_ids: BlockIds = []  # with groups: each group's, one group after the other
    error: str = ""
    te_metadata: str = ""  # the metadata server te_addr is registered in; "" = P2PHANDSHAKE
    fingerprint: str = ""  # the prefill engine's KV fingerprint (READY)
    ts: float = 0.0
    mac: bytes = b""


class PullDone(msgspec.Struct, tag="done", omit_defaults=True):
    transfer_id: Id
    req_id: Id
    ok: bool
    cause: Text = ""
    ts: float = 0.0
    mac: bytes = b""


class DoneAck(msgspec.Struct, tag="ack", omit_defaults=True):
    transfer_id: str
    ts: float = 0.0
    mac: bytes = b""


ToPrefill = PullRequest | PullDone
ToDecode = PullReply | DoneAck

_enc = msgspec.msgpack.Encoder()
_dec_p = msgspec.msgpack.Decoder(ToPrefill)
_dec_d = msgspec.msgpack.Decoder(ToDecode)


# An ERROR reply whose error starts with one of these is a refusal of the message itself, not
# of the transfer: the decode side fails it as "protocol" and sends no release for it.
REFUSALS = ("message refused", "KV fingerprint mismatch", "prompt mismatch")


def prompt_digest(token_ids) -> str:
    """What a pull and its hold must agree on: a digest of the request's prompt token ids."""
    try:
        data = _enc.encode(token_ids)
    except TypeError:  # int-likes (numpy integers)
        data = _enc.encode([int(t) for t in token_ids])
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> PullRequest | PullDone:
    return _dec_p.decode(data)


def decode_to_decode(data: bytes) -> PullReply | DoneAck:
    return _dec_d.decode(data)


_SIDE_CHANNEL = b"mctier/side-channel/v1"
_REGISTER = b"mctier/register/v1"


def sign(msg, secret: bytes | None):
    """``msg`` signed with ``secret`` (unchanged without one)."""
    if secret is None:
        return msg
    msg = msgspec.structs.replace(msg, ts=round(time.time(), 3), mac=b"")
    return msgspec.structs.replace(msg, mac=trust.mac(secret, _SIDE_CHANNEL, _enc.encode(msg)))


def refusal(msg, secret: bytes | None, max_age_s: float = trust.MAX_AGE_S) -> str | None:
    """Why ``msg`` must be dropped (``unsigned``, ``bad_signature``, ``expired``), None when
    it may be acted on (always without a secret)."""
    if secret is None:
        return None
    if not msg.mac:
        return "unsigned"
    want = trust.mac(secret, _SIDE_CHANNEL, _enc.encode(msgspec.structs.replace(msg, mac=b"")))
    if not hmac.compare_digest(want, msg.mac):
        return "bad_signature"
    return None if trust.fresh(msg.ts, max_age_s) else "expired"


def _registration_mac(p: RegisterPayload, secret: bytes) -> str:
    body = msgspec.to_builtins(msgspec.structs.replace(p, mac=""))
    return trust.mac(secret, _REGISTER, trust.canonical(body)).hex()


def sign_registration(p: RegisterPayload, secret: bytes | None) -> RegisterPayload:
    if secret is None:
        return p
    p = msgspec.structs.replace(p, ts=round(time.time(), 3), mac="")
    return msgspec.structs.replace(p, mac=_registration_mac(p, secret))


def registration_refusal(p: RegisterPayload, secret: bytes | None, max_age_s: float = trust.MAX_AGE_S) -> str | None:
    """As :func:`refusal`, for a bootstrap registration."""
    if secret is None:
        return None
    if not p.mac:
        return "unsigned"
    if not hmac.compare_digest(_registration_mac(p, secret), p.mac):
        return "bad_signature"
    return None if trust.fresh(p.ts, max_age_s) else "expired"


def query_json(workers: dict[int, EngineEntry]) -> dict:
    """The ``/query`` body: vLLM's shape, integer keys rendered as strings."""
    return {
        str(dp): {
            "engine_id": e.engine_id,
            "worker_addr": {str(tp): {str(pp): a for pp, a in pps.items()} for tp, pps in e.worker_addr.items()},
        }
        for dp, e in workers.items()
    }


def parse_query(body: dict) -> dict[int, EngineEntry]:
    """Inverse of :func:`query_json` (accepts string or integer keys)."""
    return msgspec.convert(body, dict[int, EngineEntry], strict=False)
