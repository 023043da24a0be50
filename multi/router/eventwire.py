"""vLLM's KV-cache event wire format, mirrored without importing vLLM, and where to subscribe.

vLLM publishes them with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ..., "replay_endpoint": ...}'`` (``vllm.distributed.kv_events``,
``ZmqEventPublisher``). Wire format, read from vLLM 0.32.0 and decoded here WITHOUT
importing vLLM (msgspec structs mirroring vLLM's, same tags and field order):

- PUB multipart ``(topic, seq, payload)``: ``seq`` 8 bytes big-endian, from 0, +1 per
  batch; ``payload`` msgpack of ``KVEventBatch`` = array ``[ts, events, dp_rank]`` with
  ``ts`` the engine's ``time.time()``; events are tagged maps ``{"type": "BlockStored",
  ...}`` with default-valued fields omitted (legacy vLLM: tagged arrays; both decode).
- Replay: a ROUTER that vLLM always binds. The request is ``(b"", start_seq)`` from a
  DEALER (the ROUTER expects identity, empty delimiter, 8-byte seq; a REQ would drop all
  replies but the first); the answers are ``(b"", topic, seq, payload)`` for every
  buffered batch with ``seq >= start`` and then ``(b"", b"", seq=-1, b"")``.
- vLLM's PUB only BINDS for a wildcard (``tcp://*:P``), ``::`` or ``ipc://``/``inproc://``
  endpoint; for ``tcp://HOST:P`` it CONNECTS, to a subscriber listening there.
  :func:`subscriber_address` applies the same rule from the subscriber's side: for an
  engine endpoint ``tcp://HOST:P`` this subscriber binds ``tcp://HOST:P`` (the operator
  gave the engine the router's address; nothing listens on the wildcard); for a
  binding form it connects (``tcp://*:P`` becomes ``tcp://ENGINE_HOST:P``).
  The subscriber is :class:`multi.router.events.EventSubscriber`.
"""

from __future__ import annotations

from typing import Any

import msgspec

EngineHash = int | bytes


# -- vLLM's event structs (vllm/distributed/kv_events.py), mirrored ----------------------
# vLLM 0.32 encodes events as tagged MAPS ({"type": "BlockStored", ...}, defaults omitted;
# only the batch is array_like); older vLLM encoded them as tagged ARRAYS. Both decode
# here: map structs first, then array_like twins. Unknown map keys (fields a newer vLLM
# adds) are ignored, and so are array elements beyond the declared fields; every field
# after ``block_size`` has a default, so older, shorter events decode too.
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass  # the legacy layout, and its two siblings below


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]  # one by one, so an unknown event kind skips only itself
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_event_decoders = (
    msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared),
    msgspec.msgpack.Decoder(_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray),
)


def decode_event(raw: bytes) -> BlockStored | BlockRemoved | AllBlocksCleared | None:
    """One event, map or legacy array layout (the array twins are subclasses, so
    ``isinstance(ev, BlockStored)`` holds for both); None for an unknown kind."""
    for dec in _event_decoders:
        try:
            return dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return None


def decode_batch(payload: bytes) -> tuple[float, list[Any]]:
    """``(ts, events)`` of one payload, events as :func:`decode_event`. Raises
    ``msgspec.DecodeError``/``ValidationError`` for a payload that is not a batch."""
    batch = _batch_decoder.decode(payload)
    return batch.ts, [decode_event(raw) for raw in batch.events]


def _engine_binds(endpoint: str) -> bool:
    # vLLM's ZmqEventPublisher._is_bind_endpoint
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_address(endpoint: str, engine_host: str) -> tuple[str, bool]:
    """Where to subscribe to an engine whose ``--kv-events-config`` endpoint is ``endpoint``:
    ``(address, bind)``. A binding form (wildcard, ``ipc://``) is connected to, with the
    wildcard replaced by ``engine_host``; ``tcp://HOST:P`` is where the engine connects,
    so the subscriber binds it."""
    if _engine_binds(endpoint):
        return endpoint.replace("*", engine_host).replace("[::]", engine_host), False
    return endpoint, True


def replay_address(endpoint: str | None, engine_host: str) -> str | None:
    """The replay ROUTER (always bound by the engine), with a wildcard replaced by ``engine_host``."""
    return endpoint.replace("*", engine_host).replace("[::]", engine_host) if endpoint else None
