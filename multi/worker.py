"""Composite, worker side: fan the hooks out to every tier and join their results.

A request planned over several tiers is reported finished-receiving once every
one of them ended its load. A synchronous load (``TieredMetadata.sync``) ends inside the
step's ``start_load_kv``: vLLM expects no finished-receiving for it, and the blocks it could
not fill are that step's load errors. When some tiers' loads fail, the blocks those tiers
were to fill are reported invalid (vLLM then recomputes from the first invalid
block) and the request finished, keeping what the others delivered; a failed
tier whose blocks are unknown fails the whole request (``failed_recving``). A
request whose blocks several tiers hold after it finished (store saves, P2P
handoff) is reported finished-sending once all of them let go.

Calibration samples are measured here: forward passes are timed
(:class:`multi.policy.ForwardSample`), and every successful ``LoadReport`` of a
tier becomes a :class:`multi.policy.LoadSample`; both ride on the stats record,
encoded by :func:`multi.policy.encode_samples`. A pass is timed when its metadata carries
``step_tokens``: the scheduler picks them (every pass that computes prompt tokens, at most
``multi.scheduler.DECODE_SAMPLES_PER_S`` decode-only passes a second).

Every hook here runs at every step (the per-layer ones at every layer): a step that moves
nothing must cost next to nothing (docs/benchmarks/no-reuse.md, the per-step cost). A tier
whose per-layer hooks do nothing (``Tier.layer_hooks`` False) is not called per layer, and a
tier quiet for the step (``Tier.quiet_step``, asked in ``bind``) is not called from
``bind_connector_metadata`` to ``clear_connector_metadata`` unless a load or hold planned on
it has not ended (``_loading``, ``_holders``): those end as soon as the tier reports them.
"""

from __future__ import annotations

import time

from kvcore.log import get_logger
from kvcore.tier import Tier
from kvcore.vllm_glue import KVConnectorTransferResults
from multi.metrics import TieredStats
from multi.policy import ForwardSample, LoadSample, encode_samples
from multi.protocol import TieredMetadata, TieredWorkerMeta

logger = get_logger("multi.worker")


class TieredWorker:
    def __init__(self, tiers: dict[str, Tier]):
        self.tiers = tiers  # name -> tier connector (worker role)
        self.stats = TieredStats()
        self._loading: dict[str, set[str]] = {}  # req -> tiers still loading it
        self._failed: dict[str, set[str]] = {}  # req -> tiers whose load failed
        self._load_start: dict[str, dict[str, float]] = {}
        self._load_blocks: dict[str, dict[str, list[int]]] = {}  # req -> tier -> blocks it fills
        self._holders: dict[str, set[str]] = {}  # req -> tiers holding its blocks
        self._released: dict[str, set[str]] = {}  # req -> tiers that let go
        self._invalid: set[int] = set()
        self._forward_start = 0.0
        self._step_tokens: list[tuple[int, int]] = []
        self._active: dict[str, Tier] = tiers  # the tiers called in this step (bind .. clear)
        self._layer_hooks(tiers)

    def _layer_hooks(self, active: dict[str, Tier]) -> None:
        self._layered_for = tuple(active)  # the tiers whose per-layer hooks these are
        layered = [t for t in active.values() if t.layer_hooks]
        self._layer_loads = [t.wait_for_layer_load for t in layered]
        self._layer_saves = [t.save_kv_layer for t in layered]

    # -- hooks forwarded to every tier -------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        for tier in self.tiers.values():
            tier.register_kv_caches(kv_caches)

    def bind(self, meta: TieredMetadata) -> None:
        now = time.monotonic()
        # Loads and holds planned (this step's too) and not ended: called whatever the tier answers.
        busy = (set().union(*self._loading.values(), *self._holders.values(), *meta.loads.values(), *meta.sends.values())
                if self._loading or self._holders or meta.loads or meta.sends else ())
        active = {}
        for name, tier in self.tiers.items():
            m = meta.tiers.get(name)
            if name in busy or not tier.quiet_step(m):
                active[name] = tier
                tier.bind_connector_metadata(m)
        if tuple(active) != self._layered_for:
            self._layer_hooks(active)
        self._active = active
        for rid, per_tier in meta.loads.items():
            if rid in meta.sync:
                continue  # ends in this step's start_load_kv; its failed blocks come as load errors
            self._loading[rid] = set(per_tier)
            self._load_start[rid] = {k: now for k in per_tier}
            self._load_blocks[rid] = per_tier
        for rid, names in meta.sends.items():
            self._holders[rid] = set(names)
        self._step_tokens = meta.step_tokens
        self._forward_start = now

    def clear(self) -> None:
        for tier in self._active.values():
            tier.clear_connector_metadata()
        self._active = self.tiers  # a hook outside bind .. clear reaches every tier

    def handle_preemptions(self, meta) -> None:
        if isinstance(meta, TieredMetadata):
            for name, tier in self.tiers.items():
                tier.handle_preemptions(meta.tiers.get(name))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for tier in self._active.values():
            tier.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for wait in self._layer_loads:
            wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        for save in self._layer_saves:
            save(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._forward_done()
        for tier in self._active.values():
            tier.wait_for_save()

    def shutdown(self) -> None:
        for tier in self.tiers.values():
            tier.shutdown()

    # -- joined results ----------------------------------------------------------------

    def _forward_done(self) -> None:
        if self._step_tokens and self._forward_start:
            seconds = time.monotonic() - self._forward_start
            self.stats.data["samples"].extend(encode_samples([ForwardSample(
                [n for n, _ in self._step_tokens], [c for _, c in self._step_tokens], seconds)]))
            self.stats.own_observe("forward", seconds)
        self._step_tokens = []
        self._forward_start = 0.0

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults(finished_sending=set(), finished_recving=set(), failed_recving=set())
        for name, tier in self._active.items():
            res = tier.get_transfer_results(finished_req_ids)
            if res.failed_recving or res.finished_recving or res.finished_sending:  # most steps: none
                self._join(name, res, out)
            errors = tier.get_block_ids_with_load_errors()
            if errors:
                self._invalid |= errors
        if not self._released:
            return out
        # The holders of a request are announced in the metadata of the step after
        # request_finished, before any tier can let go of it.
        for rid, released in list(self._released.items()):
            holders = self._holders.get(rid)
            if holders is not None and holders <= released:
                out.finished_sending.add(rid)
                del self._holders[rid], self._released[rid]
        return out

    def _join(self, name: str, res: KVConnectorTransferResults, out: KVConnectorTransferResults) -> None:
        """One tier's results of this step into ``out``."""
        now = time.monotonic()
        failed = res.failed_recving or set()
        for rid in failed:
            self._tier_done(name, rid, now, out, failed=True)
        for rid in res.finished_recving or ():
            if rid not in failed:
                self._tier_done(name, rid, now, out, failed=False)
        for rid in res.finished_sending or ():
            self._released.setdefault(rid, set()).add(name)

    def _tier_done(self, name: str, rid: str, now: float, out: KVConnectorTransferResults, failed: bool) -> None:
        pending = self._loading.get(rid)
        if pending is None:
            # A load we did not plan (a tier used on its own): pass it through.
            (out.failed_recving if failed else out.finished_recving).add(rid)
            return
        pending.discard(name)
        start = self._load_start.get(rid, {}).pop(name, None)
        if failed:
            self._failed.setdefault(rid, set()).add(name)
            self.stats.own_inc(f"load_failures:{name}")
        elif start is not None:
            self.stats.own_observe(f"load_{name}", now - start)
        if pending:
            return
        del self._loading[rid]
        self._load_start.pop(rid, None)
        failed_tiers = self._failed.pop(rid, set())
        blocks = self._load_blocks.pop(rid, {})
        if failed_tiers and not all(blocks.get(t) for t in failed_tiers):
            # Also finished: vLLM releases a request from its wait for KV only by finished_recving.
            out.failed_recving.add(rid)
            out.finished_recving.add(rid)
            return
        for t in failed_tiers:
            # Keep what the other tiers delivered: vLLM recomputes from the first invalid block.
            self._invalid.update(blocks[t])
        out.finished_recving.add(rid)

    def worker_meta(self) -> TieredWorkerMeta | None:
        """Each tier's worker -> scheduler metadata of this step, by tier (None when no tier has any)."""
        metas = {name: m for name, tier in self._active.items() if (m := tier.build_connector_worker_meta()) is not None}
        return TieredWorkerMeta(metas) if metas else None

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> TieredStats | None:
        """Our counters and samples since the last call, with each tier's worker-side stats."""
        for name, tier in self._active.items():
            s = tier.get_kv_connector_stats()
            if s is not None and not s.is_empty():
                self.stats.data["tiers"][name] = s.data
            loads = [LoadSample(name, r.bytes, r.seconds, r.req_id, r.waited_s) for r in tier.take_load_reports()
                     if r.ok and r.bytes > 0]
            if loads:
                self.stats.data["samples"].extend(encode_samples(loads))
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, TieredStats()
        return out
