"""``TieredConnector``: one connector over any configured tiers (facade).

Load it with::

    {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi",
     "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": {"master": "HOST:PORT"}, "p2p": {}}}

(tiers and keys in :mod:`multi.config`). It builds each configured tier as a child
connector (a ``kvcore.tier.Tier``), plans every request over them
(:mod:`multi.scheduler`) and joins their worker-side results (:mod:`multi.worker`);
this class only dispatches by role. A request may force a source with
``kv_transfer_params.kv_source``; the plan comes back in ``kv_transfer_params.kv_plan``.

``TieredConnector`` does not declare vLLM's ``SupportsHMA``: with it vLLM turns its hybrid
allocator off, and it refuses what it then cannot move whole
(:func:`kvcore.vllm_glue.require_full_attention`). ``TieredHMAConnector`` (``"kv_connector":
"TieredHMAConnector"``, same module and keys) is the same composite declaring ``SupportsHMA``
(vLLM checks the class): its built-in tiers (store, P2P) both move KV cache groups, so with the
hybrid allocator on each group is loaded at its own block ids, a sliding-window group inside its
window. With a sliding-window group a plan loads from one
tier at most (:meth:`multi.scheduler.TieredScheduler._decide`: a store range ending before the
prompt's end would need sliding blocks vLLM allocated as null), and a failed load fails the
whole request (``failed_recving``). A grouped layout with a tier that does not declare
``SupportsHMA`` is refused at start-up by name (``--disable-hybrid-kv-cache-manager`` then
promotes a mixed model's sliding layers to full attention); Mamba/SSM and chunked-local groups
are refused as by the tiers (:func:`kvcore.kvgroups.kv_groups`).
"""

from __future__ import annotations

import copy
from typing import Any

from kvcore.errors import ConfigError
from kvcore.kvgroups import kv_groups, named
from kvcore.log import get_logger
from kvcore.vllm_glue import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVTransferConfig,
    SupportsHMA,
    block_size_of,
    bytes_per_token,
    register_connector_name,
    require_full_attention,
    warn_pipeline_parallel,
)
from multi.config import TieredConfig, TierSpec, load_config
from multi.metrics import TieredPromMetrics, TieredStats
from multi.protocol import TieredMetadata
from multi.scheduler import TieredScheduler
from multi.worker import TieredWorker

logger = get_logger("multi.connector")
register_connector_name("TieredConnector", "multi.connector", "TieredConnector")
register_connector_name("TieredHMAConnector", "multi.connector", "TieredHMAConnector")


def _tier_config(vllm_config, spec: TierSpec, cfg: TieredConfig):
    """A copy of ``vllm_config`` whose KV transfer config is the tier's own."""
    ktc = vllm_config.kv_transfer_config
    module, cls_name = spec.connector_path()
    role = spec.connector_class().composite_role(ktc.kv_role, cfg.write_back)
    out = copy.copy(vllm_config)
    out.kv_transfer_config = KVTransferConfig(
        kv_connector=cls_name, kv_connector_module_path=module, kv_role=role, engine_id=ktc.engine_id,
        kv_connector_extra_config=spec.config, kv_load_failure_policy=ktc.kv_load_failure_policy,
    )
    return out


class TieredConnector(KVConnectorBase_V1):
    who = "multi TieredConnector"
    hma = False  # declares SupportsHMA (TieredHMAConnector)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = load_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.grouped = False  # KV cache groups (kvcore.kvgroups.named): block ids per group
        groups = []
        if kv_cache_config is not None and not self.hma:  # before the tiers: one error naming the composite
            require_full_attention(vllm_config, kv_cache_config, self.who)
        elif kv_cache_config is not None:
            groups = kv_groups(vllm_config, kv_cache_config, self.who)
            self.grouped = named(groups)
            plain = [s.name for s in self.cfg.tier_specs() if not issubclass(s.connector_class(), SupportsHMA)]
            if self.grouped and plain:
                raise ConfigError(f"{self.who}: model {vllm_config.model_config.model!r} has KV cache "
                                  f"groups (vLLM's hybrid allocator) and tier(s) {plain} do not declare SupportsHMA: "
                                  f"serve it with --disable-hybrid-kv-cache-manager or without those tiers")
        if role == KVConnectorRole.SCHEDULER:
            warn_pipeline_parallel(vllm_config, "multi TieredConnector", logger)
        # Cheapest first: the order plans fill a prompt in.
        tiers = {spec.name: spec.connector_class()(_tier_config(vllm_config, spec, self.cfg), role, kv_cache_config)
                 for spec in self.cfg.tier_specs()}
        self._sched: TieredScheduler | None = None
        self._worker: TieredWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = TieredScheduler(tiers, self.cfg.policy, block_size_of(kv_cache_config),
                                          bytes_per_token(kv_cache_config), self.cfg.default_source,
                                          grouped=self.grouped,
                                          sliding=self.grouped and any(g.window is not None for g in groups))
        else:
            self._worker = TieredWorker(tiers)

    # -- scheduler side ------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request) -> None:
        self._sched.on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> TieredMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        """vLLM calls this (not request_finished) on a connector that declares SupportsHMA: the
        tiers get each group's block ids with KV cache groups, else the one group's."""
        return self._sched.request_finished(request, block_ids if self.grouped else block_ids[0])

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """The groups the planned load restores: those of the tier it loads from (the P2P tier:
        every group), vLLM's default when it loads from none."""
        tier = self._sched.loading_tier(request) if self._sched is not None else None
        return (tier or super()).get_loaded_kv_cache_group_ids(request)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def take_events(self):
        return self._sched.take_events() if self._sched is not None else ()

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None

    # -- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear()

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.worker_meta() if self._worker is not None else None

    # -- both ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> TieredStats | None:
        return (self._worker or self._sched).take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> TieredStats:
        return TieredStats(data=data) if data is not None else TieredStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        cfg = load_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        # One Prometheus object per tier class (two would register the same metric names).
        by_class: dict[type, Any] = {}
        tiers = {}
        for spec in cfg.tier_specs():
            tier_cls = spec.connector_class()
            if tier_cls not in by_class:
                by_class[tier_cls] = tier_cls.build_prom_metrics(_tier_config(vllm_config, spec, cfg), metric_types,
                                                                 labelnames, per_engine_labelvalues)
            tiers[spec.name] = by_class[tier_cls]
        return TieredPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, tiers=tiers)

    def shutdown(self) -> None:
        (self._worker or self._sched).shutdown()


class TieredHMAConnector(TieredConnector, SupportsHMA):
    """``TieredConnector`` declaring vLLM's ``SupportsHMA`` (module docstring): load it with
    ``"kv_connector": "TieredHMAConnector"``; every tier it is configured with must declare it too
    for a model with KV cache groups."""

    who = "multi TieredHMAConnector"
    hma = True
