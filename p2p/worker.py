"""Worker-process side of the P2P tier (one per TP rank, in ``VLLM::Worker``).

``register_kv_caches`` derives the page geometry, registers the KV buffers with the
Transfer Engine and, by role:

* producer (kv_producer / kv_both): starts the bootstrap server (TP0/PP0 of the
  engine, unless ``bootstrap_server_address`` names an external one), binds the ZMQ
  side channel (:mod:`p2p.holds`) and registers it with the bootstrap server;
* consumer (kv_consumer / kv_both): a :class:`p2p.puller.Puller`.

Per step, :meth:`P2PWorker.start_load_kv` hands new holds / aborted transfers to the
side channel and new pulls to the puller (never blocking the forward pass);
:meth:`transfer_results` reports finished sends (holds dropped), finished receives and
failed receives (reported in ``failed_recving`` *and* ``finished_recving``, so
``kv_load_failure_policy`` applies at once), and turns each ended pull into a
``kvcore.tier.LoadReport`` (seconds: the Transfer Engine read, not the wait for the
prefill instance).
"""

from __future__ import annotations

import sys
import threading
import time

from kvcore import iocpus, platform
from kvcore.errors import ConfigError
from kvcore.geometry import KVGeometry
from kvcore.log import get_logger
from kvcore.pages import kv_device
from kvcore.tier import LoadReport, LoadReports
from kvcore.trust import warn_exposed_transfer_engine
from kvcore.vllm_glue import KVConnectorTransferResults, p2p_fingerprint, parallel_ranks, pp_stages
from p2p import bootstrap
from p2p.config import P2PConfig
from p2p.metrics import P2PStats
from p2p.protocol import RegisterPayload
from p2p.transfer import TransferEngineHandle

logger = get_logger("p2p.worker")


class P2PWorker:
    def __init__(self, vllm_config, cfg: P2PConfig, engine_id: str, kv_cache_config, role_name: str,
                 groups: list | None = None):
        self.cfg = cfg
        # KV cache groups (kvcore.kvgroups.KVGroup, p2p.groups); None: one group of every layer.
        self.groups = groups
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.secret = cfg.secret()
        # What a peer's KV must match (weights, config, dtype, layout): kvcore.identity.
        self.fingerprint = p2p_fingerprint(vllm_config, kv_cache_config) if kv_cache_config is not None else ""
        self.dp_size = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1)
        self.is_producer = role_name in ("kv_producer", "kv_both")
        self.is_consumer = role_name in ("kv_consumer", "kv_both")
        self.dp_rank, self.tp_rank, self.tp_size, self.pp_rank = parallel_ranks(vllm_config)
        self.pp_size = pp_stages()
        if self.tp_size > 1 or self.pp_size > 1:
            # With TP > 1 each rank is its own process whose main thread runs Python between
            # and inside steps: a 0.2 ms switch interval (default 5 ms) gets our pull and
            # side-channel threads the GIL sooner (not measured apart from kvcore.shmspin's
            # fix: docs/benchmarks/idle-steps.md).
            sys.setswitchinterval(0.0002)
        self.stats = P2PStats()
        self.stats_lock = threading.Lock()
        self.reports = LoadReports()
        self.geometry: KVGeometry | None = None
        self.engine: TransferEngineHandle | None = None
        self.server: bootstrap.BootstrapServer | None = None
        self.side = None
        self.puller = None
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_caches: dict) -> None:
        platform.current().prepare_worker()
        num_blocks = getattr(self.kv_cache_config, "num_blocks", None)
        self.geometry = KVGeometry.from_kv_caches(kv_caches, num_blocks)
        # With KV cache groups the groups' layers share KV tensors, and a block id means a page of
        # one group's layers: each group is paired over its own layers (p2p.puller).
        group_geos = None
        if self.groups:
            group_geos = [KVGeometry.from_kv_caches({n: kv_caches[n] for n in g.layers}, num_blocks)
                          for g in self.groups]
        # The transfers off the engine's compute cores when it has others (kvcore.iocpus): the
        # Transfer Engine's threads start with it, the side channel's with SideChannel, the pulls'
        # in the Puller's pool.
        self.io_cpus = iocpus.resolve(self.cfg.io_cpus)
        with iocpus.threads_started_on(self.io_cpus, "p2p"):
            self.engine = TransferEngineHandle(self.cfg.te_hostname, self.cfg.protocol, self.cfg.device_name,
                                               self.cfg.metadata_server)
        warn_exposed_transfer_engine(self.cfg.te_hostname, self.cfg.protocol, "p2p", logger)
        # On the GPU of this worker's KV (its local rank), not a fixed cuda:0.
        self.engine.register(self.geometry.buffers, kv_device(kv_caches))
        logger.info("P2P worker %s tp=%d: TE %s (%s, %s), %d regions, %d blocks x %d bytes", self.engine_id,
                    self.tp_rank, self.engine.addr, self.cfg.protocol, self.cfg.metadata_server,
                    len(self.geometry.regions),
                    self.geometry.num_blocks, self.geometry.block_bytes)
        if self.is_producer:
            with iocpus.threads_started_on(self.io_cpus, "p2p"):
                self._start_producer()
        if self.is_consumer:
            from p2p.puller import Puller

            if self.cfg.debug_corrupt_received_kv and platform.current().device_type != "cpu":
                # It flips bytes through host pointers (p2p.puller._flip_signs).
                raise ConfigError("p2p: debug_corrupt_received_kv needs host-resident KV (the CPU platform)")

            self.puller = Puller(
                self.geometry, self.engine, self.stats, self.stats_lock, tp_rank=self.tp_rank,
                tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size, num_workers=self.cfg.num_workers,
                bootstrap_timeout_s=self.cfg.bootstrap_timeout_s,
                peer_silence_timeout_s=self.cfg.peer_silence_timeout_s,
                corrupt=self.cfg.debug_corrupt_received_kv, secret=self.secret, fingerprint=self.fingerprint,
                group_geometries=group_geos, corrupt_groups=self._corrupt_groups(), io_cpus=self.io_cpus,
            )
            if self.cfg.debug_corrupt_received_kv:
                logger.warning("debug_corrupt_received_kv is ON: received KV is deliberately corrupted (tests only)")

    def _corrupt_groups(self) -> list[int] | None:
        """Positions of the groups ``debug_corrupt_kv_groups`` names (None: every group)."""
        want = self.cfg.debug_corrupt_kv_groups
        if want is None or not self.groups:
            return None
        return [i for i, g in enumerate(self.groups) if g.index in want]

    def _start_producer(self) -> None:
        from p2p.holds import SideChannel

        if self.cfg.bootstrap_server_address is None and self.tp_rank == 0 and self.pp_rank == 0:
            # It believes only this engine's own workers (engine id, ranks within its sizes).
            self.server = bootstrap.BootstrapServer(
                self.cfg.bootstrap_host, self.cfg.bootstrap_port, engine_id=self.engine_id, dp_size=self.dp_size,
                tp_size=self.tp_size, pp_size=self.pp_size, secret=self.secret,
                on_refused=lambda: self._inc("rejected:register")).start()
        self.side = SideChannel(self.geometry.regions, self.engine.addr, self.stats, self.stats_lock,
                                host=self.cfg.side_channel_host, abort_timeout_s=self.cfg.abort_timeout_s,
                                tp_size=self.tp_size, te_metadata=self.cfg.metadata_server, secret=self.secret,
                                fingerprint=self.fingerprint)
        payload = RegisterPayload(self.engine_id, self.dp_rank, self.tp_rank, self.pp_rank, self.side.addr)
        bootstrap.register(self.cfg.bootstrap_url, payload, timeout=self.cfg.bootstrap_timeout_s, secret=self.secret)
        logger.info("P2P producer %s registered side channel %s at %s", self.engine_id, self.side.addr,
                    self.cfg.bootstrap_url)

    def start_load_kv(self, meta) -> None:
        if meta is None or not (meta.holds or meta.aborted or meta.recvs):
            return  # most steps
        if self.side is not None:
            fence = platform.current().kv_ready_fence() if meta.holds else None
            for req_id, tid, blocks, prompt, groups in meta.holds:
                self.side.add_hold(req_id, tid, blocks, fence, prompt, groups=groups)
            for tid in meta.aborted:
                self.side.abort(tid)
        if self.puller is not None:
            from p2p.puller import PullJob

            now = time.monotonic()
            for r in meta.recvs:
                if r.error:
                    # Not planned (p2p.groups.plan): the request fails now and is recomputed; the
                    # prefill side is told to let its blocks go.
                    self._failed.add(r.req_id)
                    self.puller.submit(PullJob(r.req_id, r.transfer_id, r.bootstrap_url, r.engine_id, 0, [],
                                               now + r.timeout_s))
                    continue
                self.puller.submit(PullJob(r.req_id, r.transfer_id, r.bootstrap_url, r.engine_id, r.start_block,
                                           list(r.block_ids), now + r.timeout_s, r.prompt,
                                           [(s, list(ids)) for s, ids in r.groups] if r.groups is not None else None))
        elif meta.recvs:
            logger.error("P2P: %d pulls scheduled on a producer-only worker; ignored", len(meta.recvs))

    def quiet(self, meta) -> bool:
        """:meth:`kvcore.tier.Tier.quiet_step`: ``meta`` asks nothing, and no hold, pull, result,
        report or count waits here (read unlocked: what another thread adds now is seen next step)."""
        return (meta is not None and not (meta.holds or meta.aborted or meta.recvs or self._failed or self.reports)
                and (self.side is None or self.side.idle()) and (self.puller is None or self.puller.idle())
                and self.stats.is_empty())

    def transfer_results(self) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        if self.side is not None:
            res.finished_sending = self.side.take_finished()
        if self.puller is not None:
            for rid in self._failed:  # handoffs that could not be planned
                res.finished_recving.add(rid)
                res.failed_recving.add(rid)
                self.reports.add(LoadReport("p2p", rid, 0, 0.0, False))
            self._failed.clear()
            for r in self.puller.take_results():
                if not r.block_ids:
                    continue  # a release: no request waits for it
                res.finished_recving.add(r.req_id)
                timings = r.timings or {}
                self.reports.add(LoadReport("p2p", r.req_id, r.nbytes, timings.get("transfer", 0.0), r.ok,
                                            waited_s=timings.get("metadata", 0.0)))
                if not r.ok:
                    res.failed_recving.add(r.req_id)
        return res

    def _inc(self, key: str) -> None:
        with self.stats_lock:
            self.stats.inc(key)

    def take_stats(self) -> P2PStats | None:
        if self.stats.is_empty():  # asked every step: read unlocked, a count added now is taken next time
            return None
        with self.stats_lock:
            return self.stats.take()

    def shutdown(self) -> None:
        if self.puller is not None:
            self.puller.close()
        if self.side is not None:
            self.side.close()
        if self.server is not None:
            self.server.stop()
