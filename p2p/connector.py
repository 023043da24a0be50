"""``P2PConnector``: the vLLM-facing facade of the P2P tier.

Load with ``{"kv_connector": "P2PConnector", "kv_connector_module_path": "p2p",
"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config":
{...}}`` (keys in :mod:`p2p.config`), alone or as a child of vLLM's MultiConnector.
Dispatches by role to :class:`p2p.scheduler.P2PScheduler` (EngineCore process) and
:class:`p2p.worker.P2PWorker` (Worker process). It is also the P2P tier of a
composite (``kvcore.tier.Tier``: lookup, plan_load, release, load reports).

It declares vLLM's ``SupportsHMA``: with the hybrid allocator on, the handoff moves each KV
cache group's blocks at that group's block ids, a sliding-window group's inside the window only
(:mod:`p2p.groups`); Mamba/SSM state and chunked-local attention are refused at start-up by
name (:func:`kvcore.kvgroups.kv_groups`).
"""

from __future__ import annotations

from typing import Any

from kvcore import shmspin
from kvcore.kvgroups import kv_groups, named
from kvcore.log import get_logger
from kvcore.tier import LoadReport, Tier
from kvcore.vllm_glue import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    register_connector_name,
    warn_pipeline_parallel,
)
from p2p.config import LOAD_PRIOR, load_config
from p2p.metrics import P2PPromMetrics, P2PStats
from p2p.scheduler import P2PMetadata, P2PScheduler

logger = get_logger("p2p.connector")

# A step with no tokens to compute, on a TP/PP > 1 CPU engine, waits this long first: at
# most this much later a new request is scheduled, or an ended pull or hold noticed.
IDLE_STEP_S = shmspin.IDLE_STEP_S


class P2PConnector(KVConnectorBase_V1, SupportsHMA, Tier):
    name = "p2p"
    remote_prefill = True  # the prefill instance computes the KV after the request arrives
    load_prior = LOAD_PRIOR
    layer_hooks = False  # its wait_for_layer_load and save_kv_layer do nothing: a pull is whole

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # KV cache groups (p2p.groups); None: one full-attention group, moved as before groups.
        self.groups = None
        if kv_cache_config is not None:
            groups = kv_groups(vllm_config, kv_cache_config, "p2p P2PConnector")
            self.groups = groups if named(groups) else None
        ktc = vllm_config.kv_transfer_config
        role_name = ktc.kv_role
        self.cfg = load_config(ktc.kv_connector_extra_config, role_name)
        self.engine_id = ktc.engine_id
        self.scheduler: P2PScheduler | None = None
        self.worker = None
        # Holds and remote waits keep an engine stepping with nothing to compute. With
        # TP/PP > 1 on CPU each such step wakes every rank, and all of them busy-wait
        # after it (kvcore.shmspin): paced at IDLE_STEP_S and without the busy-wait, a
        # waiting engine leaves the cores to its API server and its neighbours.
        cpu_ranks = shmspin.cpu_ranks(vllm_config)
        if cpu_ranks:
            shmspin.shorten()
        if role == KVConnectorRole.SCHEDULER:
            warn_pipeline_parallel(vllm_config, "p2p P2PConnector", logger)
            self.scheduler = P2PScheduler(vllm_config, self.cfg, role_name,
                                          idle_step_s=IDLE_STEP_S if cpu_ranks else 0.0, groups=self.groups)
        else:
            from p2p.worker import P2PWorker

            self.worker = P2PWorker(vllm_config, self.cfg, self.engine_id, kv_cache_config, role_name,
                                    groups=self.groups)

    # ---------------- tier contract (kvcore.tier) ----------------
    def lookup(self, request, local_tokens: int = 0) -> int:
        return self.scheduler.lookup(request)  # a handoff's KV is pulled whole, whatever is cached here

    def plan_load(self, request, start_token: int, end_token: int, block_ids: list[int],
                  expected_s: float | None = None) -> None:
        self.scheduler.plan_load(request, start_token, end_token, block_ids, expected_s)

    def release(self, request) -> None:
        self.scheduler.release(request, "the composite's plan does not pull from the prefill instance")

    def take_load_reports(self) -> list[LoadReport]:
        return self.worker.reports.take() if self.worker is not None else []

    def quiet_step(self, meta) -> bool:
        return self.worker is not None and self.worker.quiet(meta)

    # ---------------- scheduler side ----------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:  # pins of sliding-window blocks still to send (p2p.groups)
            self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> P2PMetadata:
        return self.scheduler.build_connector_meta(
            idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.finished_sending(connector_output.finished_sending)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        """vLLM calls this (not request_finished) on a connector that declares SupportsHMA."""
        return self.scheduler.request_finished(request, block_ids if self.groups is not None else block_ids[0])

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A handoff fills every KV cache group (the request's own blocks, a sliding group's
        window), not only the prefix-cacheable ones vLLM assumes by default."""
        cfg = getattr(self, "_kv_cache_config", None)
        if cfg is None:
            return super().get_loaded_kv_cache_group_ids(request)
        ids = getattr(cfg, "transfer_group_ids", None)  # vLLM's KVCacheConfig: groups that transfer KV
        return tuple(ids) if ids is not None else tuple(range(len(cfg.kv_cache_groups)))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Failures are reported per request (failed_recving), which fails or recomputes
        # the whole request; block-level reports would double-handle it.
        return set()

    def get_kv_connector_stats(self) -> P2PStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return self.scheduler.stats.take()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ---------------- telemetry ----------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> P2PStats | None:
        return P2PStats(data=data) if data is not None else P2PStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return P2PPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


register_connector_name("P2PConnector", "p2p.connector", "P2PConnector")
