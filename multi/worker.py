"""Composite, worker side: fan the hooks out to both tiers and join their results.

A request planned over both tiers is reported finished-receiving once both
finished. When the P2P part fails but the store part arrived, the P2P blocks are
reported as invalid (vLLM then recomputes from the end of the store range) instead
of failing the whole request. A request whose blocks both tiers hold after it
finished (store saves, P2P handoff) is reported finished-sending once both let go.
Forward passes are timed here for the prefill-speed calibration.
"""

from __future__ import annotations

import time

from kvcore.log import get_logger
from kvcore.vllm_glue import KVConnectorTransferResults
from multi.metrics import TieredStats
from multi.protocol import P2P, STORE, TieredMetadata

logger = get_logger("multi.worker")


class TieredWorker:
    def __init__(self, store, p2p):
        self.children = {name: c for name, c in ((STORE, store), (P2P, p2p)) if c is not None}
        self.stats = TieredStats()
        self._loading: dict[str, set[str]] = {}  # req -> children still loading it
        self._failed: dict[str, set[str]] = {}  # req -> children whose load failed
        self._load_start: dict[str, dict[str, float]] = {}
        self._p2p_blocks: dict[str, list[int]] = {}
        self._holders: dict[str, set[str]] = {}  # req -> children holding its blocks
        self._released: dict[str, set[str]] = {}  # req -> children that let go
        self._invalid: set[int] = set()
        self._forward_start = 0.0
        self._step_tokens: list[tuple[int, int]] = []

    def register_kv_caches(self, kv_caches) -> None:
        for c in self.children.values():
            c.register_kv_caches(kv_caches)

    def bind(self, meta: TieredMetadata) -> None:
        now = time.monotonic()
        if STORE in self.children:
            self.children[STORE].bind_connector_metadata(meta.store)
        if P2P in self.children:
            self.children[P2P].bind_connector_metadata(meta.p2p)
            for spec in getattr(meta.p2p, "recvs", ()):
                if spec.block_ids:
                    self._p2p_blocks[spec.req_id] = list(spec.block_ids)
        for rid, kids in meta.loads.items():
            self._loading[rid] = set(kids)
            self._load_start[rid] = {k: now for k in kids}
        for rid, kids in meta.sends.items():
            self._holders[rid] = set(kids)
        self._step_tokens = meta.step_tokens
        self._forward_start = now

    def forward_done(self) -> None:
        if self._step_tokens and self._forward_start:
            n = sum(t for t, _ in self._step_tokens)
            attn = sum(t * (c + t / 2) for t, c in self._step_tokens)
            seconds = time.monotonic() - self._forward_start
            self.stats.data["samples"].append(("forward", [1.0, float(n), float(attn)], seconds))
            self.stats.own_observe("forward", seconds)
        self._step_tokens = []
        self._forward_start = 0.0

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults(finished_sending=set(), finished_recving=set(), failed_recving=set())
        now = time.monotonic()
        for name, child in self.children.items():
            res = child.get_transfer_results(finished_req_ids)
            for rid in res.failed_recving or ():
                self._child_done(name, rid, now, out, failed=True)
            for rid in res.finished_recving or ():
                if rid not in (res.failed_recving or ()):
                    self._child_done(name, rid, now, out, failed=False)
            for rid in res.finished_sending or ():
                self._released.setdefault(rid, set()).add(name)
            self._invalid |= child.get_block_ids_with_load_errors()
        # The holders of a request are announced in the metadata of the step after
        # request_finished, before any child can let go of it.
        for rid, released in list(self._released.items()):
            holders = self._holders.get(rid)
            if holders is not None and holders <= released:
                out.finished_sending.add(rid)
                del self._holders[rid], self._released[rid]
        return out

    def _child_done(self, name: str, rid: str, now: float, out: KVConnectorTransferResults, failed: bool) -> None:
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
        failed_kids = self._failed.pop(rid, set())
        p2p_blocks = self._p2p_blocks.pop(rid, [])
        if not failed_kids:
            out.finished_recving.add(rid)
        elif failed_kids == {P2P} and p2p_blocks:
            # Keep what the store delivered: vLLM recomputes from the first invalid block.
            self._invalid.update(p2p_blocks)
            out.finished_recving.add(rid)
        else:
            out.failed_recving.add(rid)

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> TieredStats | None:
        for name, child in self.children.items():
            s = child.get_kv_connector_stats()
            if s is not None and not s.is_empty():
                self.stats.data[name] = s.data
                self._samples_from(name, s.data)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, TieredStats()
        return out

    def _samples_from(self, name: str, data: dict) -> None:
        """(bytes, seconds) of this step's completed loads, from the child's own counters."""
        ops = data.get("ops", {})
        counters = data.get("counters", {})
        if name == STORE:
            secs, nbytes = ops.get("load", []), counters.get("loaded_bytes", 0)
        else:
            secs, nbytes = ops.get("transfer", []), counters.get("bytes:pulled", 0)
        if len(secs) == 1 and nbytes > 0:
            self.stats.data["samples"].append((name, float(nbytes), secs[0]))

    def shutdown(self) -> None:
        for c in self.children.values():
            c.shutdown()
