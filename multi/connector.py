"""``TieredConnector``: one connector over the store tier and the P2P tier (facade).

Load it with::

    {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi",
     "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": {"master": "HOST:PORT"}, "p2p": {}}}

It builds the two tiers as children (each a full connector) and plans every request
over them (:mod:`multi.scheduler`), joining their worker-side results
(:mod:`multi.worker`). A request may force a source with
``kv_transfer_params.kv_source``; the plan comes back in ``kv_transfer_params.kv_plan``.
"""

from __future__ import annotations

import copy
from typing import Any

from kvcore.log import get_logger
from kvcore.vllm_glue import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVTransferConfig,
    block_size_of,
    register_connector_name,
)
from multi.config import load_config
from multi.metrics import TieredPromMetrics, TieredStats
from multi.protocol import P2P, STORE, TieredMetadata
from multi.scheduler import TieredScheduler
from multi.worker import TieredWorker

logger = get_logger("multi.connector")
register_connector_name("TieredConnector", "multi.connector", "TieredConnector")


def _child(vllm_config, name: str, module: str, role: str, extra: dict):
    ktc = vllm_config.kv_transfer_config
    cfg = copy.copy(vllm_config)
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector=name, kv_connector_module_path=module, kv_role=role, engine_id=ktc.engine_id,
        kv_connector_extra_config=extra, kv_load_failure_policy=ktc.kv_load_failure_policy,
    )
    return cfg


def bytes_per_token(kv_cache_config) -> float:
    total = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return total / block_size_of(kv_cache_config)


class TieredConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = load_config(ktc.kv_connector_extra_config)
        store = p2p = None
        if self.cfg.store is not None:
            from mcstore.connector import StoreConnector

            store = StoreConnector(_child(vllm_config, "StoreConnector", "mcstore", self.cfg.store_role(ktc.kv_role),
                                          self.cfg.store), role, kv_cache_config)
        if self.cfg.p2p is not None:
            from p2p.connector import P2PConnector

            p2p = P2PConnector(_child(vllm_config, "P2PConnector", "p2p", ktc.kv_role, self.cfg.p2p),
                               role, kv_cache_config)
        self._store, self._p2p = store, p2p
        self._sched: TieredScheduler | None = None
        self._worker: TieredWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = TieredScheduler(
                store.scheduler if store is not None else None,
                p2p.scheduler if p2p is not None else None,
                self.cfg.policy, block_size_of(kv_cache_config), bytes_per_token(kv_cache_config),
                self.cfg.default_source,
            )
        else:
            self._worker = TieredWorker(store, p2p)

    # -- scheduler side ------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._store is not None:
            self._store.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> TieredMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        children = {}
        if self._store is not None:
            children[STORE] = self._store.request_finished(request, block_ids)
        if self._p2p is not None:
            children[P2P] = self._p2p.request_finished(request, block_ids)
        return self._sched.request_finished(request, block_ids, children)

    def has_pending_push_work(self) -> bool:
        return self._p2p is not None and self._p2p.has_pending_push_work()

    # -- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for c in self._worker.children.values():
            c.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._store is not None and isinstance(kv_connector_metadata, TieredMetadata):
            self._store.handle_preemptions(kv_connector_metadata.store)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for c in self._worker.children.values():
            c.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._worker.children.values():
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        for c in self._worker.children.values():
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._worker.forward_done()
        for c in self._worker.children.values():
            c.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    # -- both ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> TieredStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        stats = self._sched.take_stats() or TieredStats()
        # Scheduler-side counters of both children (store lookups; P2P invalid params and
        # aborted holds), not only the store's.
        for name, child in ((STORE, self._store), (P2P, self._p2p)):
            if child is not None:
                s = child.get_kv_connector_stats()
                if s is not None and not s.is_empty():
                    stats.data[name] = s.data
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> TieredStats:
        return TieredStats(data=data) if data is not None else TieredStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from mcstore.metrics import StorePromMetrics
        from p2p.metrics import P2PPromMetrics

        return TieredPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                 children={STORE: StorePromMetrics, P2P: P2PPromMetrics})

    def shutdown(self) -> None:
        for c in (self._store, self._p2p):
            if c is not None:
                c.shutdown()
