"""Decode side: pull a request's blocks from the prefill instance, off the forward path.

One job per request, run on a small thread pool. Phases, each bounded:

1. query     bootstrap ``GET /query`` (cached per bootstrap URL and engine id),
             ``bootstrap_timeout_s`` per call; calls that time out are repeated for up
             to ``peer_silence_timeout_s``
2. metadata  side-channel :class:`PullRequest`; the prefill worker answers WAIT
             heartbeats until its request finished, then READY with its regions and
             block ids; silence longer than ``peer_silence_timeout_s`` = dead peer
3. transfer  a read of coalesced page runs (:meth:`TransferEngineHandle.read`) from the Transfer
             Engine the READY reply names (both sides must use the same kind of metadata:
             P2PHANDSHAKE, http or etcd; a mismatch fails as ``protocol``); a failed read
             is tried once more while the deadline leaves a second for it
4. ack       :class:`PullDone` so the prefill frees its blocks (waited for briefly,
             after the result is already reported)

The whole job also has the request's deadline (``transfer_timeout_s``). A release job
(no blocks) only does 1, 2 with ``num_blocks=0``. Results are kept per request
(:meth:`Puller.take_results`). A prefill of another layout (TP size or stage count) fails
the pull at 1 and is released through all of its workers (:func:`p2p.release.release_hold`).

Trust: every message is signed with the deployment's secret when there is one, and a reply
that is not is refused (``protocol``); the READY reply must carry this engine's KV
fingerprint (else ``protocol``, nothing read). A prefill's addresses are cached per bootstrap
URL and engine id (at most :data:`MAX_ENTRIES`), and dropped after a ``peer``, ``protocol``
or ``timeout`` failure: a restarted prefill is asked again. When the engine id is no longer
registered at its bootstrap server (the prefill restarted; found by the pull, or by the release
sent after a pull that failed against its old addresses), the transfer is released on the
engines registered there instead, so that a hold the new engine opened for it ends now.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zmq

from kvcore import iocpus
from kvcore.errors import MooncakeError
from kvcore.geometry import KVGeometry
from kvcore.log import DegradeWatch, get_logger
from kvcore.metrics import TierStats
from kvcore.mooncake_json import P2PHANDSHAKE, metadata_kind
from p2p import bootstrap
from p2p.groups import pair_groups
from p2p.protocol import MAX_TO_DECODE, REFUSALS, BlockRange, EngineEntry, PullRequest, Status, encode, sign
from p2p.release import release_hold
from p2p.sidecall import PullFailed, await_reply, send_done
from p2p.transfer import TransferEngineHandle

logger = get_logger("p2p.puller")

MAX_ENTRIES = 64  # prefill engines whose addresses are cached (bootstrap URLs come with requests)
# Failures after which a prefill's cached addresses are asked again: it may have restarted.
_FORGET_AFTER = frozenset({"peer", "protocol", "timeout"})


@dataclass
class PullJob:
    req_id: str
    transfer_id: str
    bootstrap_url: str
    engine_id: str
    start_block: int  # index (within the request) of the first block to pull
    block_ids: list[int]  # local destination blocks; empty = release only
    deadline: float  # time.monotonic()
    prompt: str = ""  # p2p.protocol.prompt_digest of the request's prompt
    # With KV cache groups (p2p.groups): (start block, local block ids) of each group, in group
    # order; block_ids is then every group's ids, one group after the other. None: one group.
    groups: list[tuple[int, list[int]]] | None = None


@dataclass
class PullResult:
    req_id: str
    ok: bool
    block_ids: list[int]
    cause: str = ""
    detail: str = ""
    timings: dict | None = None  # seconds per phase (query, metadata, transfer, ack, handoff)
    nbytes: int = 0  # bytes written into block_ids (a successful pull)
    other_layout: bool = False  # the prefill has another TP size or stage count
    registered: tuple[str, ...] = ()  # see PullFailed


class Puller:
    def __init__(self, geometry: KVGeometry, engine: TransferEngineHandle, stats: TierStats,
                 stats_lock: threading.Lock, *,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, num_workers: int = 4,
                 bootstrap_timeout_s: float = 5.0, peer_silence_timeout_s: float = 10.0,
                 corrupt: bool = False, secret: bytes | None = None, fingerprint: str = "",
                 group_geometries: list[KVGeometry] | None = None, corrupt_groups: list[int] | None = None,
                 io_cpus: set[int] | None = None):
        self.geometry, self.engine = geometry, engine
        # With KV cache groups: the page geometry of each group's layers (a block id means a
        # page of that group's layers only), in group order; corrupt_groups: the groups (their
        # positions) debug corruption touches (None: all).
        self.group_geometries = group_geometries
        self.corrupt_groups = corrupt_groups
        self._stats, self._stats_lock = stats, stats_lock
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.silence_s = peer_silence_timeout_s
        self.corrupt = corrupt
        self.secret, self.fingerprint = secret, fingerprint
        # Started on the first submit, from the worker's thread: placed off its compute core
        # by the initializer (kvcore.iocpus).
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="p2p-pull",
                                        initializer=iocpus.pin_this_thread, initargs=(io_cpus, "p2p"))
        # Every handoff failing (a bootstrap server nobody reaches, say) is otherwise only a
        # warning per request: tokens stay right, the tier silently does nothing.
        self._watch = DegradeWatch(logger, f"P2P handoffs (decode rank {tp_rank})")
        self._ctx = zmq.Context.instance()
        self._entries: OrderedDict[tuple[str, str], EngineEntry] = OrderedDict()  # LRU, MAX_ENTRIES
        self._lock = threading.Lock()
        self._results: list[PullResult] = []
        self._inflight: set[str] = set()

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._inflight.add(job.req_id)
        self._pool.submit(self._run, job)

    def take_results(self) -> list[PullResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def idle(self) -> bool:
        """No pull running and no result to take (read unlocked, from the worker thread)."""
        return not (self._inflight or self._results)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- job --
    def _inc(self, key: str, n: float = 1) -> None:
        with self._stats_lock:
            self._stats.inc(key, n)

    def _finish(self, res: PullResult) -> None:
        with self._lock:
            self._inflight.discard(res.req_id)
            self._results.append(res)

    def _run(self, job: PullJob) -> None:
        try:
            res = self.pull(job)
        except Exception as e:  # noqa: BLE001 - a bug here must fail the request, not hang it
            logger.exception("P2P pull %s crashed", job.req_id)
            res = PullResult(job.req_id, False, job.block_ids, "internal", str(e))
        if res is _ALREADY:
            return
        if job.block_ids:
            self._watch.record(None if res.ok else res.cause)
        if not res.ok:
            self._inc("pulls:failed")
            self._inc(f"failures:{res.cause}")
            logger.warning("P2P handoff %s (transfer %s) failed [%s]: %s; %s", job.req_id, job.transfer_id,
                           res.cause, res.detail, "recomputing locally" if job.block_ids else "release not delivered")
        if not res.ok and res.cause in _FORGET_AFTER:
            with self._lock:
                self._entries.pop((job.bootstrap_url, job.engine_id), None)
        self._finish(res)
        if not res.ok and job.block_ids and res.cause in _RELEASE_AFTER:
            self._release_after_failure(job)
        elif res.registered and self.tp_rank == 0 and self.pp_rank == 0:
            self._release_on_registered(job, res.registered)
        elif res.other_layout and self.tp_rank == 0 and self.pp_rank == 0:
            # Its side channels refuse our pulls (another tp_size), releases included, and
            # no decode rank of ours maps to each of its ranks: release through all of its
            # workers as a router does, once per request.
            n = release_hold(job.bootstrap_url, job.engine_id, job.transfer_id, timeout=_RELEASE_AFTER_S,
                             secret=self.secret)
            logger.info("released %s on %d prefill worker(s) of another layout", job.transfer_id, n)

    def _release_on_registered(self, job: PullJob, engines: tuple[str, ...]) -> None:
        """Our engine id is gone from its bootstrap server (the prefill restarted): a hold for this
        transfer, if any, is on an engine registered there now (at most 4 asked)."""
        n = sum(release_hold(job.bootstrap_url, e, job.transfer_id, timeout=_RELEASE_AFTER_S,
                             secret=self.secret) for e in engines[:4])
        logger.info("released %s on %d worker(s) of the engines now registered at %s", job.transfer_id, n,
                    job.bootstrap_url)

    def _release_after_failure(self, job: PullJob) -> None:
        """The prefill side may still finish this request after we gave up on it (a slow or
        stalled peer): without a word from us it would hold the blocks until its abort
        timeout. A release makes it free them as soon as its hold opens (early release)."""
        rel = PullJob(job.req_id, job.transfer_id, job.bootstrap_url, job.engine_id, 0, [],
                      time.monotonic() + _RELEASE_AFTER_S)
        try:
            res = self.pull(rel)
        except Exception as e:  # noqa: BLE001 - best effort; the abort timeout still applies
            logger.info("release of %s after a failed pull not delivered: %s", job.transfer_id, e)
            return
        if res is not None and not res.ok and res.registered and self.tp_rank == 0 and self.pp_rank == 0:
            self._release_on_registered(job, res.registered)  # the peer we pulled from restarted meanwhile
        elif res is not None and not res.ok:
            logger.info("release of %s after a failed pull not delivered (%s): %s; the prefill side frees "
                        "its blocks at its abort timeout", job.transfer_id, res.cause, res.detail)

    def _entry(self, job: PullJob) -> EngineEntry:
        key = (job.bootstrap_url, job.engine_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
        workers = self._query(job)
        entry = bootstrap.find_engine(workers, job.engine_id)
        if entry is None:
            known = tuple(sorted({e.engine_id for e in workers.values()}))
            raise PullFailed("bootstrap", f"engine {job.engine_id!r} not registered at {job.bootstrap_url} "
                                          f"(known: {list(known)[:8]})", registered=known)
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)
        return entry

    def _query(self, job: PullJob) -> dict:
        """``/query``, each call bounded by ``bootstrap_timeout_s``. A call that times out is
        repeated while the server has been silent less than ``peer_silence_timeout_s`` (the
        same rule as the side channel's heartbeats): a busy prefill process answers late,
        a refused connection or an HTTP error fails at once."""
        give_up = min(job.deadline, time.monotonic() + max(self.silence_s, self.bootstrap_timeout_s))
        while True:
            timeout = min(self.bootstrap_timeout_s, max(0.05, give_up - time.monotonic()))
            try:
                return bootstrap.query(job.bootstrap_url, timeout)
            except bootstrap.BootstrapError as e:
                if not e.timed_out or time.monotonic() >= give_up - 0.05:
                    raise PullFailed("bootstrap", str(e)) from None
                logger.info("bootstrap %s did not answer in %.1fs; asking again", job.bootstrap_url, timeout)

    def pull(self, job: PullJob) -> PullResult:
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        release = not job.block_ids
        sock = None
        ready = False
        try:
            entry = self._entry(job)
            t1 = time.monotonic()
            timings["query"] = t1 - t0
            if len(entry.worker_addr) != self.tp_size:
                raise PullFailed("protocol", f"prefill has {len(entry.worker_addr)} TP ranks, decode has "
                                             f"{self.tp_size}", other_layout=True)
            # Stage s pulls stage s's layers: both sides must split the model the same way
            # (a differing split fails pair_ranges: other layer names in the regions).
            stages = len(entry.worker_addr.get(self.tp_rank, {}))
            if stages != self.pp_size:
                raise PullFailed("protocol", f"prefill has {stages} pipeline stages, decode has {self.pp_size}",
                                 other_layout=True)
            try:
                addr = entry.worker_addr[self.tp_rank][self.pp_rank]
            except KeyError:
                raise PullFailed("protocol", f"no prefill worker tp={self.tp_rank} pp={self.pp_rank}") from None
            sock = self._ctx.socket(zmq.DEALER)
            # A release must reach a peer that is only slow (or stalled, mid-handshake) even
            # after we stop waiting for its answer: ZMQ keeps delivering it after close.
            sock.setsockopt(zmq.LINGER, 0 if job.block_ids else _RELEASE_LINGER_MS)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_TO_DECODE)
            sock.connect(addr)
            wait_s = max(0.0, job.deadline - time.monotonic())
            ranges = [BlockRange(start, len(ids)) for start, ids in job.groups or ()]
            if release or job.groups is None:
                ranges = []
            elif self.group_geometries is None or len(job.groups) != len(self.group_geometries):
                raise PullFailed("protocol", f"a pull of {len(job.groups)} KV cache group(s) on a worker of "
                                             f"{len(self.group_geometries or ())}")
            sock.send(encode(sign(PullRequest(job.transfer_id, job.req_id, self.tp_rank, self.tp_size,
                                              0 if ranges else job.start_block, len(job.block_ids), wait_s,
                                              fingerprint=self.fingerprint, prompt=job.prompt, ranges=ranges),
                                  self.secret)))
            reply = await_reply(sock, job.transfer_id, addr, job.deadline, self.silence_s, self.secret)
            t2 = time.monotonic()
            timings["metadata"] = t2 - t1
            if release:
                self._inc("pulls:release")
                return PullResult(job.req_id, True, [], timings=timings)
            if reply.status != Status.READY:
                cause = "protocol" if reply.error.startswith(REFUSALS) else "remote"
                raise PullFailed(cause, reply.error[:300] or f"status {reply.status!r}")
            ready = True
            if reply.fingerprint != self.fingerprint:
                raise PullFailed("protocol", f"the prefill's KV fingerprint {reply.fingerprint[:16] or '(none)'} is "
                                             f"not this engine's {self.fingerprint[:16]}: other weights, config, "
                                             f"dtype or layout")
            theirs, ours = reply.te_metadata or P2PHANDSHAKE, self.engine.metadata_server
            if metadata_kind(theirs) != metadata_kind(ours):
                raise PullFailed("protocol", f"the prefill's Transfer Engine {reply.te_addr} is named through "
                                             f"{theirs}, this one through {ours}: set the same metadata_server "
                                             f"on both sides")
            try:
                local, remote, lens, spans = self._pairs(job, reply)
            except ValueError as e:
                raise PullFailed("protocol", str(e)) from None
            self._read(job, reply.te_addr, local, remote, lens,
                       f" (the prefill registered it in {theirs}, this engine reads {ours})" if theirs != ours else "")
            t3 = time.monotonic()
            timings["transfer"] = t3 - t2
            if time.monotonic() > job.deadline:
                raise PullFailed("timeout", f"transfer finished after the deadline ({t3 - t0:.1f}s)")
            if self.corrupt is True or (isinstance(self.corrupt, str) and os.path.exists(self.corrupt)):
                for gi, (a, b) in enumerate(spans):
                    if self.corrupt_groups is None or gi in self.corrupt_groups:
                        _flip_signs(local[a:b], lens[a:b])
            nbytes = sum(lens)
            self._inc("bytes:pulled", nbytes)
            self._inc("descriptors:pulled", len(lens))
            self._inc("pulls:ok")
            # Report the blocks as loaded first; the acknowledgement only frees P.
            res = PullResult(job.req_id, True, job.block_ids, timings=timings, nbytes=nbytes)
            self._finish_ok_early(res)
            send_done(sock, job.transfer_id, job.req_id, True, "", self.secret)
            ready = False
            timings["ack"] = time.monotonic() - t3
            timings["handoff"] = time.monotonic() - t0
            with self._stats_lock:
                for op, s in timings.items():
                    self._stats.observe(op, s)
            logger.debug("pulled %s: %d blocks, %d bytes, %d descriptors, %s", job.req_id, len(job.block_ids),
                         nbytes, len(lens), {k: round(v * 1e3, 2) for k, v in timings.items()})
            return _ALREADY
        except PullFailed as e:
            return PullResult(job.req_id, False, job.block_ids, e.cause, e.detail, timings,
                              other_layout=e.other_layout, registered=e.registered)
        finally:
            if sock is not None:
                if ready:  # P answered READY but we failed: let it free its blocks now
                    send_done(sock, job.transfer_id, job.req_id, False, "decode-side failure", self.secret)
                sock.close(0)

    def _pairs(self, job: PullJob, reply) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
        """(local addrs, remote addrs, lengths, each group's span of them) of the pull: with KV
        cache groups each group's local blocks paired with the prefill's blocks of that group,
        over that group's layers only. ValueError when the reply does not fit the request."""
        if len(reply.block_ids) != len(job.block_ids):
            raise ValueError(f"the prefill sent {len(reply.block_ids)} block ids for {len(job.block_ids)} asked")
        if job.groups is None:
            local, remote, lens = self.geometry.pair_ranges(job.block_ids, reply.regions, reply.block_ids)
            return local, remote, lens, [(0, len(lens))]
        return pair_groups(self.group_geometries, [ids for _, ids in job.groups], reply.regions, reply.block_ids)

    def _read(self, job: PullJob, peer: str, local: list[int], remote: list[int], lens: list[int],
              hint: str) -> None:
        """The Transfer Engine read, tried a second time when the first fails and the
        handoff's deadline leaves at least ``_RETRY_MIN_LEFT_S``. A read only fills this
        engine's own blocks and the prefill side still holds its blocks (no PullDone was
        sent yet), so repeating it is safe. Why: a read can fail for a passing cause (Mooncake's
        client drops a read that made no progress for 30 s, as while the prefill's process got
        no CPU), and the second read then completes (docs/benchmarks/p2p.md). A read failing for
        a lasting cause (a dead peer) fails again at once."""
        t0 = time.monotonic()
        try:
            self.engine.read(peer, local, remote, lens)
            return
        except MooncakeError as e:
            first = e
        left = job.deadline - time.monotonic()
        if left < _RETRY_MIN_LEFT_S:
            raise PullFailed("transfer", f"{first}{hint}")
        self._inc("retries:transfer")
        logger.warning("P2P transfer of %s (transfer %s) failed after %.1fs: %s; reading again (%.0fs left "
                       "to its deadline)", job.req_id, job.transfer_id, time.monotonic() - t0, first, left)
        try:
            self.engine.read(peer, local, remote, lens)
        except MooncakeError as e:
            raise PullFailed("transfer", f"{e} (also the first try: {first}){hint}") from None

    def _finish_ok_early(self, res: PullResult) -> None:
        self._finish(res)


# Sentinel: the successful result was already reported by _finish_ok_early.
_ALREADY = None
# Failures after which the prefill side may still open a hold for the transfer (it did not
# answer READY in time, or answered ERROR "did not finish in time"): tell it to let go.
_RELEASE_AFTER = frozenset({"timeout", "peer", "remote"})
_RELEASE_AFTER_S = 3.0
_RETRY_MIN_LEFT_S = 1.0  # a second read with less time left would only delay the recomputation
_RELEASE_LINGER_MS = 10_000


def _flip_signs(addrs: list[int], lens: list[int]) -> None:
    """TEST ONLY (debug_corrupt_received_kv): negate every 16-bit value just received."""
    for a, n in zip(addrs, lens):
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a))
        buf[1::2] ^= 0x80
