"""One vLLM engine's KV-cache events, fed into a ``BlockIndex`` under the instance's name.

vLLM publishes with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ..., "replay_endpoint": ...}'``; the wire format, decoded without
importing vLLM, and where to subscribe are in :mod:`multi.router.eventwire`.

API: ``EventSubscriber(instance, endpoint, index, replay_endpoint=None, topic="", bind=False,
store=None)``,
``.start()``, ``.stop(timeout)``, ``.stats()``, ``.stale``. A daemon thread polls the SUB
socket every 100 ms (``stop()`` returns within ~0.2 s); every wait, replay included
(``replay_timeout`` s), has a deadline. Failures never raise: they are counted in
``stats()`` and, when the exact view can no longer be trusted, reported by ``stale`` (the
router then uses its approximate view).

Mapping. The engine names blocks by its own hashes (bytes, or ints with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). An LRU dict ``engine hash -> router hash``
(at most twice the instance's capacity, ~210 bytes an entry with 32-byte hashes; kept
after a removal, as a later child may name the block as parent) places ``BlockStored``
blocks in the router's chain (``H(parent's router hash, block tokens)``; parent ``None``:
the seed of the request's ``cache_salt``, which vLLM publishes in the first block's
``extra_keys``) and resolves ``BlockRemoved``. What is not placed:

- a parent the subscriber never saw (it joined after the engine started and no replay
  covered it): counted in ``unknown_parent`` (blocks) and skipped;
- blocks whose KV depends on more than tokens and salt (LoRA, multimodal, prompt
  embeddings): the router's token chain cannot name them; counted in ``unrepresentable``;
  their descendants too;
- another medium than ``media`` (default ``None``/``"GPU"``; vLLM's CPU build publishes
  ``"GPU"`` for its prefix cache too; host/offload tiers publish ``"CPU"``/``"STORAGE"``
  with the SAME engine hashes, so their removals must not delete the GPU entry; the store
  tier's ``mooncake`` goes to the store view, below);
- another KV cache group than the first full-attention one (hybrid models publish the
  same engine hash once per group); events without ``group_idx`` are taken;
- a ``block_size`` other than the index's (``block_size_mismatch``): the router's
  ``block_size`` must be the engine's ``--block-size``.

Sequence numbers. On first contact with ``seq > 0`` the subscriber replays from 0 (best
effort: history missing from vLLM's buffer only leaves blocks out, never in). A jump
``seq != last + 1`` is a gap: replay from ``last + 1``; if replay is not configured, fails
or the buffer no longer holds ``last + 1``, the exact view is cleared and ``stale`` set,
until the engine clears its cache (``AllBlocksCleared``) or restarts. A SUB ``seq`` not
above the previous SUB ``seq`` means the publisher restarted: the view and the mapping
are reset. Stopping and starting again keeps the state, so missed batches are replayed.
``cleared()`` wipes everything the index holds under the instance's name, so the router's
approximate view (``record``) belongs in another ``BlockIndex``.

The store tier's events (medium ``mooncake``, :mod:`mcstore.events`), with ``store=`` (one
``BlockIndex`` that every instance's subscriber shares, view :data:`~multi.router.index.STORE`:
the store is one for all): placed there as the engine's own blocks are (same mapping and
checks; group 0 or none), a removal taking them out for every instance (``store_unmapped``:
one no mapping resolves). Stale or restarted streams and ``AllBlocksCleared`` leave that view
alone: the objects outlive them. Its use: :mod:`multi.router.storeview`.

Bounds: a message longer than :data:`MAX_MSG_BYTES` is refused by ZMQ (``MAXMSGSIZE``), which
drops the connection that sent it and never reconnects it by itself; a connecting subscriber
then opens its socket again (``reconnects``) and replays the gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq

from multi.router.eventwire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, decode_batch
from multi.router.index import STORE, BlockIndex, block_hash, seed

log = logging.getLogger("mctier.router.kvevents")


FULL_ATTENTION_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
STORE_MEDIUM = "mooncake"  # the store tier's events (mcstore.events.MEDIUM)
_POLL_MS = 100
# Largest event batch taken (ZMQ MAXMSGSIZE): a batch lists each stored block's token ids, a few
# MiB for a step that stores a long prompt's blocks.
MAX_MSG_BYTES = 64 << 20


class EventSubscriber:
    """Subscribes to ONE engine's (one DP rank's) KV events; see the module docstring."""

    def __init__(self, instance: str, endpoint: str, index: BlockIndex,
                 replay_endpoint: str | None = None, topic: str = "", *,
                 replay_timeout: float = 2.0, media: tuple[str | None, ...] = (None, "GPU"), bind: bool = False,
                 store: BlockIndex | None = None, store_media: tuple[str, ...] = (STORE_MEDIUM,)):
        self.instance, self.endpoint, self.index, self.bind = instance, endpoint, index, bind
        self.store, self.store_media = store, store_media if store is not None else ()
        self.replay_endpoint, self.topic = replay_endpoint, topic.encode("utf-8")
        self.replay_timeout, self.media = replay_timeout, media
        self._ctx = zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the counters read by stats()
        self._map: OrderedDict[EngineHash, int | None] = OrderedDict()  # None: unrepresentable
        self._group: int | None = None  # the full-attention group followed, once seen
        self._last: int | None = None  # last applied seq
        self._last_sub: int | None = None  # last seq seen on SUB (restart detection)
        self._stale = False
        self._n = dict.fromkeys(
            ("events", "batches", "gaps", "replays", "replay_failures", "unknown_parent",
             "unrepresentable", "ignored_medium", "ignored_group", "block_size_mismatch",
             "malformed", "decode_errors", "unknown_events", "restarts", "reconnects",
             "store_stored", "store_removed", "store_unmapped"), 0)
        self._lag_s: float | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start (or restart, keeping the state) the receiving thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvevents-{self.instance}")
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread; True if it ended within ``timeout`` s."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    @property
    def stale(self) -> bool:
        return self._stale

    def stats(self) -> dict:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
            out.update(lag_s=self._lag_s, stale=self._stale, last_seq=self._last,
                       mapped=len(self._map), group=self._group)
        return out

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    # -- receive loop -----------------------------------------------------------------
    def _open(self):
        """The SUB socket, and (connecting) a monitor of its connection: ZMQ drops a connection
        that sent a message over MAXMSGSIZE and, as for any protocol error, never reconnects it."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)  # longer: the publisher's connection is dropped
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        mon = None if self.bind else sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.bind(self.endpoint) if self.bind else sock.connect(self.endpoint)
        except zmq.ZMQError:
            self._close(sock, mon)
            raise
        return sock, mon

    @staticmethod
    def _close(sock, mon) -> None:
        if mon is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:  # already closed
                pass
            mon.close(0)
        sock.close(0)

    def _run(self) -> None:
        try:
            sock, mon = self._open()
        except zmq.ZMQError as e:  # a malformed endpoint or a port in use: nothing will ever arrive
            return self._mark_stale(f"cannot {'bind' if self.bind else 'connect to'} {self.endpoint}: {e}")
        try:
            while not self._stop.is_set():
                if mon is not None and mon.poll(0):  # the connection was dropped: a new socket
                    self._close(sock, mon)
                    self._bump("reconnects")
                    log.warning("kv events of %s: connection to %s dropped; connecting again", self.instance,
                                self.endpoint)
                    sock, mon = self._open()  # the next batch's seq shows the gap: replayed
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or frames[0] != self.topic:  # SUBSCRIBE is a prefix
                    self._bump("malformed")
                    continue
                try:
                    self._on_sub(int.from_bytes(frames[1], "big"), frames[2])
                except Exception:  # a bug here must not kill the thread silently
                    log.exception("kv events of %s: batch not applied", self.instance)
                    self._mark_stale("exception")
        except zmq.ZMQError as e:
            self._mark_stale(f"socket error: {e}")
        finally:
            self._close(sock, mon)

    def _on_sub(self, seq: int, payload: bytes) -> None:
        if self._last_sub is not None and seq <= self._last_sub:
            self._restart(seq)
        self._last_sub = seq
        if self._last is None:
            if seq > 0 and self.replay_endpoint:  # catch up on what came before us
                got = self._replay(0)
                if self._stop.is_set():
                    return  # stopped mid-replay: a restart finds the gap again
                for s, p in got or ():
                    if s < seq:
                        self._apply(s, p)
        elif seq <= self._last:
            return  # already applied from a replay
        elif seq != self._last + 1:
            self._bump("gaps")
            start = self._last + 1
            got = self._replay(start) if self.replay_endpoint else None
            if self._stop.is_set():
                return  # stopped mid-replay: a restart finds the gap again
            if got and got[0][0] == start and got[-1][0] >= seq - 1:
                self._bump("replays")
                for s, p in got:
                    if start <= s < seq:
                        self._apply(s, p)
            else:
                if self.replay_endpoint:
                    self._bump("replay_failures")
                self._mark_stale(f"gap {start}..{seq - 1} not replayed")
        self._apply(seq, payload, live=True)

    def _restart(self, seq: int) -> None:
        log.info("kv events of %s: publisher restarted (seq %s after %s)",
                 self.instance, seq, self._last_sub)
        self._bump("restarts")
        self.index.cleared(self.instance)
        self._map.clear()
        self._group, self._last, self._last_sub = None, None, None
        with self._lock:
            self._stale = False

    def _mark_stale(self, why: str) -> None:
        log.warning("kv events of %s: exact view cleared and stale (%s)", self.instance, why)
        self.index.cleared(self.instance)
        with self._lock:
            self._stale = True

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches ``>= start`` in order, or None (deadline, stop, bad frames).

        A fresh DEALER per request, so late answers to an abandoned one never mix in."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        sock.setsockopt(zmq.SNDTIMEO, int(self.replay_timeout * 1000))
        deadline = time.monotonic() + self.replay_timeout
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not sock.poll(min(_POLL_MS, int(left * 1000) + 1)):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 4 or frames[0] != b"":
                    break
                s = int.from_bytes(frames[2], "big", signed=True)
                if s == -1:  # vLLM's END_SEQ
                    return got
                if frames[1] == self.topic:
                    got.append((s, frames[3]))
            log.warning("kv events of %s: replay from %s unfinished after %d batches",
                        self.instance, start, len(got))
            return None
        except zmq.ZMQError as e:
            log.warning("kv events of %s: replay from %s failed: %s", self.instance, start, e)
            return None
        finally:
            sock.close(0)

    # -- applying a batch ---------------------------------------------------------------
    def _apply(self, seq: int, payload: bytes, live: bool = False) -> None:
        self._last = seq
        try:
            ts, events = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._bump("decode_errors")
            self._mark_stale(f"batch {seq} undecodable: {e}")  # its events are lost
            return
        with self._lock:
            self._n["batches"] += 1
            self._n["events"] += len(events)
            if live:
                self._lag_s = max(0.0, time.time() - ts)
        for ev in events:
            if isinstance(ev, BlockStored):
                self._on_store_stored(ev) if ev.medium in self.store_media else self._on_stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._on_store_removed(ev) if ev.medium in self.store_media else self._on_removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.index.cleared(self.instance)
                with self._lock:
                    self._stale = False  # the engine's cache is empty: exact again
            else:
                self._bump("unknown_events")

    def _follows(self, medium: str | None, group: int | None, kind: str | None = None,
                 stored: bool = False) -> bool:
        if medium not in self.media:
            self._bump("ignored_medium")
            return False
        if group is None:
            return True
        if self._group is None and stored and (kind is None or kind in FULL_ATTENTION_KINDS):
            self._group = group  # the first full-attention group: the lowest one in practice
        if group != self._group:
            self._bump("ignored_group")
            return False
        return True

    def _remember(self, eh: EngineHash, rh: int | None, cap: int) -> None:
        self._map[eh] = rh
        self._map.move_to_end(eh)
        while len(self._map) > cap:
            self._map.popitem(last=False)

    def _on_stored(self, ev: BlockStored) -> None:
        if not self._follows(ev.medium, ev.group_idx, ev.kv_cache_spec_kind, stored=True):
            return
        placed = self._place(ev)
        if placed:
            self.index.stored(self.instance, placed)

    def _on_store_stored(self, ev: BlockStored) -> None:
        """The store tier's confirmed save: its blocks into the shared store view."""
        if ev.group_idx not in (None, 0):
            self._bump("ignored_group")
            return
        placed = self._place(ev)
        if placed:
            self.store.stored(STORE, placed)
            self._bump("store_stored", len(placed))

    def _on_store_removed(self, ev: BlockRemoved) -> None:
        """A chunk the store tier announced is gone (for every instance: the store is one)."""
        if ev.group_idx not in (None, 0):
            self._bump("ignored_group")
            return
        gone = [rh for eh in ev.block_hashes if (rh := self._map.get(eh)) is not None]
        if len(gone) < len(ev.block_hashes):
            self._bump("store_unmapped", len(ev.block_hashes) - len(gone))
        if gone:
            self.store.removed(STORE, gone)
            self._bump("store_removed", len(gone))

    def _place(self, ev: BlockStored) -> list[int]:
        """The router hashes of ``ev``'s blocks (remembered in the mapping), in order; none
        for an event that does not fit (counted)."""
        bs, n = ev.block_size, len(ev.block_hashes)
        if bs != self.index.block_size:
            self._bump("block_size_mismatch")
            return []
        if len(ev.token_ids) != n * bs:
            self._bump("malformed")
            return []
        extra = ev.extra_keys or []
        tainted = ev.lora_name is not None or ev.lora_id is not None
        if ev.parent_block_hash is None:
            salt = None  # vLLM: (cache_salt,) in the first block's extra keys, alone
            if not tainted and extra and extra[0] and len(extra[0]) == 1 and isinstance(
                    extra[0][0], str):
                salt, extra = extra[0][0], [None] + list(extra[1:])
            parent: int | None = seed(salt)
        elif ev.parent_block_hash in self._map:
            parent = self._map[ev.parent_block_hash]
            tainted = tainted or parent is None
        else:
            self._bump("unknown_parent", n)
            return []
        cap = 2 * max(1, self.index.capacity(self.instance))
        placed: list[int] = []
        for i, eh in enumerate(ev.block_hashes):
            tainted = tainted or bool(extra[i] if i < len(extra) else None)
            if tainted:  # LoRA / multimodal / embeddings: not a function of tokens alone
                self._remember(eh, None, cap)
                self._bump("unrepresentable")
                continue
            parent = block_hash(parent, ev.token_ids[i * bs:(i + 1) * bs])
            self._remember(eh, parent, cap)
            placed.append(parent)
        return placed

    def _on_removed(self, ev: BlockRemoved) -> None:
        if not self._follows(ev.medium, ev.group_idx):
            return
        gone = [rh for eh in ev.block_hashes if (rh := self._map.get(eh)) is not None]
        if gone:
            self.index.removed(self.instance, gone)
