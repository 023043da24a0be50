"""``StoreConnector``: the store tier as a vLLM KV connector (facade).

Load it with::

    {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"master": "HOST:PORT", "chunk_tokens": 256}}

alone or as a child of vLLM's ``MultiConnector``. ``kv_role`` picks the data
paths: ``kv_producer`` saves only, ``kv_consumer`` loads only, ``kv_both`` does
both. Scheduler-side work lives in :mod:`mcstore.scheduler`, worker-side work in
:mod:`mcstore.worker`; this class only dispatches by role. It is also the store
tier of a composite (``kvcore.tier.Tier``: lookup, plan_load, release, load reports).
"""

from __future__ import annotations

import time
from typing import Any

from kvcore import shmspin
from kvcore.kvgroups import kv_groups, named
from kvcore.log import get_logger
from kvcore.platform import current as current_platform
from kvcore.tier import LoadReport, Tier
from kvcore.vllm_events import kv_events_enabled
from kvcore.vllm_glue import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    block_hash_scheme,
    block_size_of,
    bytes_per_token,
    kv_fingerprint_fields,
    pp_rank,
    register_connector_name,
    tp_rank,
    warn_pipeline_parallel,
)
from mcstore.config import LOAD_PRIOR, StoreConfig, composite_role, load_config
from mcstore.groups import StoreGroups
from mcstore.keys import KeySpace, VllmBlockHashes, fingerprint
from mcstore.metrics import StorePromMetrics, StoreStats
from mcstore.protocol import StoreMetadata
from mcstore.publish import publish_engine_meta
from mcstore.scheduler import StoreScheduler
from mcstore.worker import StoreWorker

logger = get_logger("mcstore.connector")
register_connector_name("StoreConnector", "mcstore.connector", "StoreConnector")


def key_space(cfg: StoreConfig, vllm_config, kv_cache_config) -> KeySpace:
    """The engine's key space, the same in every one of its processes (TP and PP sizes and the
    stage split are in the fingerprint); a worker names its own stage's objects with it. Its
    keys name the KV cache group unless the layout is one full-attention group
    (:func:`kvcore.kvgroups.named`); a layout no tier moves is refused (ConfigError)."""
    groups = kv_groups(vllm_config, kv_cache_config, "mcstore StoreConnector")
    fields = kv_fingerprint_fields(vllm_config, kv_cache_config)
    if cfg.model_id:
        fields["model"] = cfg.model_id
        fields["revision"] = None
    fields["chunk_tokens"] = cfg.chunk_tokens
    fields["object_format"] = "pages+xxh3(key,pages)" if cfg.verify_checksums else "pages"
    scheme = block_hash_scheme(vllm_config, kv_cache_config, cfg.chunk_tokens)
    if scheme is not None:  # links from vLLM's block hashes (mcstore.keys): another key space
        fields["block_hashes"] = scheme
    # Our own chain hashes one KV block at a time (the block size is in the fingerprint).
    return KeySpace(fingerprint(fields), cfg.chunk_tokens, fields["tp_size"], cfg.key_prefix,
                    pp_size=fields["pp_size"], block_tokens=block_size_of(kv_cache_config),
                    block_hashes=None if scheme is None else VllmBlockHashes(**scheme),
                    groups=len(groups) if named(groups) else 0)


class StoreConnector(KVConnectorBase_V1, SupportsHMA, Tier):
    """Declares vLLM's ``SupportsHMA``: with the hybrid allocator on, every KV cache group is saved,
    looked up and loaded at its own block ids, a sliding-window group's blocks inside the window
    only (:mod:`mcstore.groups`); Mamba state is refused at start-up (:mod:`kvcore.kvgroups`)."""

    name = "store"
    # A load parks the request for at least one extra engine step; that is most of
    # its fixed cost on loopback.
    load_prior = LOAD_PRIOR

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("StoreConnector needs kv_cache_config (vLLM >= 0.32)")
        groups = kv_groups(vllm_config, kv_cache_config, "mcstore StoreConnector")
        grouped = named(groups)  # keys name the group: any layout but one full-attention group
        ktc = vllm_config.kv_transfer_config
        cfg = load_config(ktc.kv_connector_extra_config)
        block_size = block_size_of(kv_cache_config)
        cfg.check_block_size(block_size)
        keys = key_space(cfg, vllm_config, kv_cache_config)
        load = ktc.kv_role in ("kv_consumer", "kv_both")
        save = ktc.kv_role in ("kv_producer", "kv_both")
        events = kv_events_enabled(vllm_config)  # KV events of what the tier stores (mcstore.events)
        self._sched: StoreScheduler | None = None
        self._worker: StoreWorker | None = None
        self._spin: shmspin.LoadSpin | None = None
        # A load keeps the engine stepping with nothing to compute; on TP/PP > 1 CPU engines
        # every rank busy-waits after each such step (kvcore.shmspin): on two cores a TP 2
        # engine waiting for a load starved the master's RPC until the load timed out
        # (docs/benchmarks/idle-steps.md).
        # A one-rank engine spins through such steps too, on the core its load runs on: a
        # short pause sped the load up (StoreConfig.idle_step_s).
        multi_rank = shmspin.cpu_ranks(vllm_config)
        if multi_rank:
            shmspin.shorten()
        self._idle_step_s = cfg.idle_step_s(multi_rank)
        if role == KVConnectorRole.SCHEDULER:
            warn_pipeline_parallel(vllm_config, "mcstore StoreConnector", logger)
            self._sched = StoreScheduler(cfg, keys, block_size, load=load, save=save,
                                         block_bytes=round(bytes_per_token(kv_cache_config) * block_size),
                                         events=events, workers=keys.tp_size * keys.pp_size,
                                         groups=StoreGroups(groups, cfg.chunk_tokens // block_size) if grouped else None)
            publish_engine_meta(cfg, keys, vllm_config, kv_cache_config, self._sched.client)  # for mctier tools
        else:
            # The worker's key space names its own stage's objects (its layers only).
            self._worker = StoreWorker(cfg, keys.stage(pp_rank()), block_size, kv_cache_config.num_blocks,
                                       tp_rank(), load=load, save=save, events=events and save,
                                       groups=groups if grouped else None)
            # One rank on CPU with the I/O off the compute core: the worker's busy-wait is cut
            # while a background load is in flight (kvcore.shmspin.LoadSpin says why).
            self._spin = (shmspin.LoadSpin() if load and not multi_rank and self._worker.io_cpus
                          and current_platform().device_type == "cpu" else None)

    # -- tier contract (kvcore.tier) ------------------------------------------------

    @classmethod
    def composite_role(cls, kv_role: str, write_back: bool) -> str:
        return composite_role(kv_role, write_back)

    def lookup(self, request, local_tokens: int = 0) -> int | None:
        return self._sched.lookup(request, local_tokens)

    def plan_load(self, request, start_token: int, end_token: int, block_ids: list[int],
                  expected_s: float | None = None) -> None:
        self._sched.plan_load(request, start_token, end_token, block_ids, expected_s)

    def release(self, request) -> None:
        return None  # nothing is held elsewhere on a request's behalf

    def reserve_sync(self, request, start_token: int, end_token: int) -> bool:
        return self._sched.reserve_sync(request, start_token, end_token)

    def take_load_reports(self) -> list[LoadReport]:
        return self._worker.reports.take() if self._worker is not None else []

    def quiet_step(self, meta) -> bool:
        return self._worker is not None and self._worker.quiet(meta)

    # -- scheduler side ------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request) -> None:
        self._sched.on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StoreMetadata:
        meta = self._sched.build_connector_meta(scheduler_output)
        # A step that computes nothing pauses (see __init__), unless it starts a load: the
        # pause would only delay the load (2 ms of a hit's TTFT on a one-rank engine).
        # Nor while lookups are out: the step after it uses their answers.
        if (self._idle_step_s and not meta.loads and not self._sched.lookups_waiting()
                and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0):
            time.sleep(self._idle_step_s)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Saves still hold sliding-window blocks (:class:`mcstore.groups.Pins`): keep stepping."""
        return self._sched is not None and self._sched.pins is not None and self._sched.pins.pending()

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def take_events(self):
        return self._sched.take_events() if self._sched is not None else ()

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None

    # -- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.next_step()  # the saves of earlier steps may start

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, StoreMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        self._worker.start_load_kv(meta)
        if self._spin is not None and (bg := [j for j in meta.loads if not j.sync]):
            self._spin.begin([j.req_id for j in bg], time.monotonic() + max(j.timeout_s for j in bg))

    def _loads_ended(self, *req_ids) -> None:
        if self._spin is not None:
            self._spin.end(set().union(*(r or () for r in req_ids)), time.monotonic())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)  # a no-op unless this step loads layer-wise

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished(finished_req_ids)
        self._loads_ended(recving)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        out = self._worker.get_transfer_results(finished_req_ids)
        self._loads_ended(out.finished_recving, out.failed_recving)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.worker_meta() if self._worker is not None else None

    # -- both ------------------------------------------------------------------------

    def get_kv_connector_stats(self):
        part = self._sched or self._worker
        return part.take_stats() if part is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return StoreStats(data=data) if data is not None else StoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for part in (self._worker, self._sched):
            if part is not None:
                part.close()
        self._worker = self._sched = None
