"""The quiet-step contract (``kvcore.tier.Tier.quiet_step``): the composite skips a tier's worker
hooks for a step the tier says it has nothing to do in, unless a load or hold planned on it has
not ended; the store worker's and the P2P side channel's answers, on the real things."""

from __future__ import annotations

import threading
import time

import pytest

from kvcore.metrics import TierStats
from kvcore.vllm_glue import KVConnectorTransferResults
from multi.protocol import TieredMetadata
from multi.worker import TieredWorker
from tests.test_tier_contract import FakeTier, store_worker

pytestmark = pytest.mark.unit

PER_STEP = ("bind", "start", "wait_layer", "save_layer", "wait_for_save", "results", "errors", "stats",
            "reports", "worker_meta", "clear")


class QuietTier(FakeTier):
    """A fake tier answering ``quiet_step`` with ``quiet``, recording every worker hook it gets."""

    def __init__(self, name: str, quiet: bool):
        super().__init__(name, 0)
        self.quiet = quiet

    def quiet_step(self, meta):
        return self.quiet

    def handle_preemptions(self, meta):
        self.calls.append(("preempt",))

    def start_load_kv(self, forward_context, **kwargs):
        self.calls.append(("start",))

    def get_transfer_results(self, finished_req_ids):
        self.calls.append(("results",))
        return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        self.calls.append(("errors",))
        return super().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self):
        self.calls.append(("stats",))

    def take_load_reports(self):
        self.calls.append(("reports",))
        return super().take_load_reports()

    def build_connector_worker_meta(self):
        self.calls.append(("worker_meta",))

    def clear_connector_metadata(self):
        self.calls.append(("clear",))


def run_step(w: TieredWorker, meta: TieredMetadata):
    """The worker hooks of one step, in vLLM's order (kv_connector_model_runner_mixin)."""
    w.handle_preemptions(meta)
    w.bind(meta)
    w.start_load_kv(None)
    w.wait_for_layer_load("l0")
    w.save_kv_layer("l0", None, None)
    w.wait_for_save()
    out = w.transfer_results(set())
    w.block_ids_with_load_errors()
    w.take_stats()
    w.worker_meta()
    w.clear()
    return out


def hooks(tier: QuietTier) -> list[str]:
    out, tier.calls = [c[0] for c in tier.calls], []
    return out


def meta(**kw) -> TieredMetadata:
    return TieredMetadata({"store": "m-store", "p2p": "m-p2p"}, **kw)


def test_a_quiet_tier_gets_no_hook_of_the_step_but_handle_preemptions():
    tiers = {"store": QuietTier("store", quiet=True), "p2p": QuietTier("p2p", quiet=False)}
    w = TieredWorker(tiers)
    run_step(w, meta())
    assert hooks(tiers["store"]) == ["preempt"]
    assert hooks(tiers["p2p"]) == ["preempt", *PER_STEP]
    # Outside bind .. clear (a caller that asks for results without a step) every tier is asked.
    w.transfer_results(set())
    assert hooks(tiers["store"]) == hooks(tiers["p2p"]) == ["results", "errors"]
    tiers["store"].quiet = False
    run_step(w, meta())
    assert hooks(tiers["store"]) == ["preempt", *PER_STEP]


def test_a_tier_with_a_planned_load_is_called_until_it_reports_the_load_ended():
    tiers = {"store": QuietTier("store", quiet=True), "p2p": QuietTier("p2p", quiet=True)}
    w = TieredWorker(tiers)
    run_step(w, meta(loads={"r": {"store": [1, 2]}}))
    assert hooks(tiers["store"]) == ["preempt", *PER_STEP] and hooks(tiers["p2p"]) == ["preempt"]
    run_step(w, meta())  # still loading: called although it answers quiet
    assert hooks(tiers["store"]) == ["preempt", *PER_STEP]
    tiers["store"].results = KVConnectorTransferResults(finished_recving={"r"})
    assert run_step(w, meta()).finished_recving == {"r"}
    hooks(tiers["store"])
    run_step(w, meta())
    assert hooks(tiers["store"]) == ["preempt"]


def test_a_tier_holding_a_finished_request_is_called_until_it_lets_go():
    tiers = {"store": QuietTier("store", quiet=True), "p2p": QuietTier("p2p", quiet=True)}
    w = TieredWorker(tiers)
    run_step(w, meta(sends={"r": ["p2p"]}))
    run_step(w, meta())
    assert hooks(tiers["p2p"]) == ["preempt", *PER_STEP] * 2 and hooks(tiers["store"]) == ["preempt"] * 2
    tiers["p2p"].results = KVConnectorTransferResults(finished_sending={"r"})
    assert run_step(w, meta()).finished_sending == {"r"}
    hooks(tiers["p2p"])
    run_step(w, meta())
    assert hooks(tiers["p2p"]) == ["preempt"]


def wait_until(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.integration
def test_the_store_worker_is_quiet_only_with_nothing_queued_running_or_untaken(store_cluster, monkeypatch):
    from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata

    w = store_worker(store_cluster, monkeypatch, "quiet-steps")

    def drained() -> bool:  # what the composite's result hooks take at a step's end
        w.get_transfer_results(set())
        w.get_block_ids_with_load_errors()
        w.take_stats()
        w.reports.take()
        w.worker_meta()
        return w.quiet(StoreMetadata())

    try:
        assert drained()
        link = f"mct/quiet/{time.monotonic_ns()}"
        save = StoreMetadata(saves=[SaveJob("s", [ChunkIO(link, 0, [1, 2])])])
        assert not w.quiet(save) and not w.quiet(StoreMetadata(preempted=["x"]))
        w.wait_for_save(save)
        time.sleep(0.3)  # the save ends on its thread; its request has not finished
        assert not drained()
        got = set()
        wait_until(lambda: got.update(w.get_finished({"s"} if not got else set())[0] or ()) or "s" in got,
                   "the save reported finished")
        assert drained()
        load = StoreMetadata(loads=[LoadJob("hit", [ChunkIO(link, 0, [5, 6])], timeout_s=10)])
        assert not w.quiet(load)
        w.start_load_kv(load)
        wait_until(lambda: w.reports or w._done_loads, "the load ended")
        assert not w.quiet(StoreMetadata())  # its result waits to be taken
        wait_until(drained, "a quiet worker once the load's result was taken")
    finally:
        w.close()


def test_a_side_channel_is_idle_only_with_nothing_added_held_or_untaken():
    from p2p import holds

    stats, lock = TierStats(), threading.Lock()
    # No consumer comes: the hold expires after abort_timeout_s and is released.
    side = holds.SideChannel([], "127.0.0.1:1", stats, lock, abort_timeout_s=1.0, fingerprint="fp")
    try:
        assert side.idle()
        side.add_hold("r", "xfer", [1, 2])
        assert not side.idle()  # in its inbox or held: never idle in between
        wait_until(lambda: side.held() == 1, "the hold")
        assert not side.idle()
        got: set[str] = set()
        wait_until(lambda: side.idle() is False and (got.update(side.take_finished()) or got == {"r"}),
                   "the expired hold reported finished")
        wait_until(lambda: side.held() == 0, "the hold gone")
        assert side.idle()
    finally:
        side.close()
