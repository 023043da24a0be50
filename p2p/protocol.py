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
         request ``transfer_id``; ``num_blocks == 0`` means "release, I will not pull")
  P -> D :class:`PullReply`    WAIT (heartbeat while P still prefills), READY (P's regions,
         block ids, and the name of its Transfer Engine with the metadata server that
         name is registered in, "" for P2PHANDSHAKE: see p2p.transfer), RELEASED, or ERROR
  D -> P :class:`PullDone`     the read finished (``ok``) or failed; P drops the hold (one
         consumer per hold: same TP size on both sides, see p2p.holds)
  P -> D :class:`DoneAck`
"""

from __future__ import annotations

import enum

import msgspec

from kvcore.geometry import Region


class RegisterPayload(msgspec.Struct):
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str  # "tcp://host:port" of the worker's side channel


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
    transfer_id: str
    req_id: str  # the decode side's request id (for logs)
    tp_rank: int
    tp_size: int
    start_block: int = 0
    num_blocks: int = 0  # 0: release only
    wait_s: float = 30.0  # how long P may wait for the prefill to finish


class PullReply(msgspec.Struct, tag="reply", omit_defaults=True):
    status: Status
    transfer_id: str
    te_addr: str = ""
    regions: list[Region] = []
    block_ids: list[int] = []
    error: str = ""
    te_metadata: str = ""  # the metadata server te_addr is registered in; "" = P2PHANDSHAKE


class PullDone(msgspec.Struct, tag="done", omit_defaults=True):
    transfer_id: str
    req_id: str
    ok: bool
    cause: str = ""


class DoneAck(msgspec.Struct, tag="ack"):
    transfer_id: str


ToPrefill = PullRequest | PullDone
ToDecode = PullReply | DoneAck

_enc = msgspec.msgpack.Encoder()
_dec_p = msgspec.msgpack.Decoder(ToPrefill)
_dec_d = msgspec.msgpack.Decoder(ToDecode)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> PullRequest | PullDone:
    return _dec_p.decode(data)


def decode_to_decode(data: bytes) -> PullReply | DoneAck:
    return _dec_d.decode(data)


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
