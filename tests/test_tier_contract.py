"""The composite drives its tiers only through ``kvcore.tier``: fake tiers (three of
them, one a remote-prefill tier) stand in for real ones, without vLLM engines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcore.tier import DEADLINE_SLACK, LoadPrior, LoadReport, LoadReports, Tier, blocks_of, load_deadline_s
from kvcore.vllm_glue import KVConnectorTransferResults
from multi.config import load_config
from multi.policy import (
    CostModel,
    ForwardSample,
    LoadSample,
    PolicyConfig,
    decode_samples,
    encode_samples,
    requested_source,
)
from multi.scheduler import TieredScheduler
from multi.worker import TieredWorker

pytestmark = pytest.mark.unit

BS = 32


class FakeTier(Tier):
    """Every hook the composite may forward, recording what it was asked."""

    # Slow enough that splitting a prompt between tiers pays.
    load_prior = LoadPrior(latency_s=0.01, bandwidth_gbps=0.1)

    def __init__(self, name: str, reach: int, remote: bool = False):
        self.name, self.reach, self.remote_prefill = name, reach, remote
        self.planned, self.released, self.calls, self.expected = [], [], [], []
        self.results = KVConnectorTransferResults()
        self.errors: set[int] = set()
        self.reports = LoadReports()
        self.worker_metas, self.events, self.added = [], [], []
        self.reset_ok, self.worker_meta = True, None

    def lookup(self, request, local_tokens=0):
        return self.reach

    def plan_load(self, request, start_token, end_token, block_ids, expected_s=None):
        self.planned.append((request.request_id, start_token, end_token, blocks_of(start_token, end_token, BS,
                                                                                  block_ids)))
        self.expected.append(expected_s)

    def release(self, request):
        self.released.append(request.request_id)

    def take_load_reports(self):
        return self.reports.take()

    # vLLM hooks (kvcore.tier.FORWARDED_HOOKS)
    def build_connector_meta(self, scheduler_output):
        return f"meta:{self.name}"

    def request_finished(self, request, block_ids):
        return self.name == "store", {f"{self.name}_param": 1}

    def update_connector_output(self, out):
        self.calls.append(("update", out.kv_connector_stats))
        self.worker_metas.append(getattr(out, "kv_connector_worker_meta", None))

    def take_events(self):
        out, self.events = self.events, []
        return out

    def reset_cache(self):
        return self.reset_ok

    def on_new_request(self, request):
        self.added.append(request.request_id)

    def build_connector_worker_meta(self):
        return self.worker_meta

    def has_pending_push_work(self):
        return False

    def get_kv_connector_stats(self):
        return None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None

    def bind_connector_metadata(self, meta):
        self.calls.append(("bind", meta))

    def get_transfer_results(self, finished_req_ids):
        out, self.results = self.results, KVConnectorTransferResults()
        return out

    def get_block_ids_with_load_errors(self):
        out, self.errors = self.errors, set()
        return out

    def get_finished(self, finished_req_ids):
        return None, None

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait_layer", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.calls.append(("save_layer", layer_name))


def request(rid: str, n: int, **params):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=n, kv_transfer_params=params or None)


def blocks(n: int):
    ids = list(range(100, 100 + -(-n // BS)))
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(rid: str, n: int):
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           num_scheduled_tokens={rid: n})


def three_tiers(remote: bool = True):
    return {"store": FakeTier("store", 1536), "disk": FakeTier("disk", 2560), "p2p": FakeTier("p2p", 4096, remote)}


def test_plan_over_three_tiers_in_order_of_cheapness():
    tiers = three_tiers(remote=False)
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    req = request("r1", 4096)
    assert s.get_num_new_matched_tokens(req, 0) == (4095, True)
    s.update_state_after_alloc(req, blocks(4096), 4095)
    assert [p[1:3] for t in tiers.values() for p in t.planned] == [(0, 1536), (1536, 2560), (2560, 4095)]
    assert tiers["disk"].planned[0][3] == list(range(148, 180))
    meta = s.build_connector_meta(step("r1", 1))
    assert meta.tiers == {"store": "meta:store", "disk": "meta:disk", "p2p": "meta:p2p"}
    assert set(meta.loads["r1"]) == {"store", "disk", "p2p"}
    hold, params = s.request_finished(req, [])
    assert hold and params["kv_plan_estimates"]["chosen"] == "store+disk+p2p"
    assert [r["source"] for r in params["kv_plan"]] == ["store", "disk", "p2p", "recompute"]
    assert params["store_param"] == params["p2p_param"] == 1
    # Each tier's load is given the plan's estimate of it (its deadline follows it).
    assert [round(t.expected[0], 6) for t in tiers.values()] == [params["kv_plan_estimates"]["parts"][f"{n}_s"]
                                                                  for n in tiers]


def test_a_tier_still_looking_up_makes_the_composite_ask_again_later():
    """A tier whose lookup is out (the store's non-blocking lookup answers None) makes vLLM ask
    again later; the plan is made once every tier answered, from those answers."""
    tiers = three_tiers(remote=False)
    tiers["store"].reach = None
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    req = request("r1", 4096)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert not any(t.planned or t.released for t in tiers.values())
    tiers["store"].reach = 1536  # answered at a later step
    assert s.get_num_new_matched_tokens(req, 0) == (4095, True)
    s.update_state_after_alloc(req, blocks(4096), 4095)
    assert [p[1:3] for t in tiers.values() for p in t.planned] == [(0, 1536), (1536, 2560), (2560, 4095)]


class _Meta:
    """A tier's worker metadata: joined across workers by concatenation."""

    def __init__(self, *items):
        self.items = list(items)

    def aggregate(self, other):
        self.items += other.items
        return self


def test_events_worker_metadata_new_requests_and_resets_reach_every_tier():
    from multi.protocol import TieredWorkerMeta

    tiers = three_tiers(remote=False)
    tiers["store"].worker_meta, tiers["p2p"].worker_meta = _Meta("s1"), _Meta("p1")
    w = TieredWorker(tiers)
    joined = w.worker_meta().aggregate(TieredWorkerMeta({"store": _Meta("s2")}))  # a second worker's
    assert {k: v.items for k, v in joined.tiers.items()} == {"store": ["s1", "s2"], "p2p": ["p1"]}
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    out = SimpleNamespace(kv_connector_stats=None, kv_connector_worker_meta=joined)
    s.update_connector_output(out)
    assert [m.items if m else None for t in tiers.values() for m in t.worker_metas] == [["s1", "s2"], None, ["p1"]]
    assert out.kv_connector_worker_meta is joined  # vLLM's record restored
    tiers["store"].events, tiers["p2p"].events = ["stored"], ["removed"]
    assert list(s.take_events()) == ["stored", "removed"]
    req = request("r1", 4096)
    s.on_new_request(req)
    assert all(t.added == ["r1"] for t in tiers.values())
    assert s.get_num_new_matched_tokens(req, 0)[0] > 0 and "r1" in s._decisions
    assert s.reset_cache() is True and "r1" not in s._decisions  # planned, no load started: forgotten
    tiers["disk"].reset_ok = False
    assert s.reset_cache() is False


def test_load_deadline_follows_expected_work():
    assert load_deadline_s(30.0, None) == 30.0  # no estimate: the configured deadline
    assert load_deadline_s(30.0, 5.0) == 30.0  # a quick load never gets less than configured
    assert load_deadline_s(30.0, 20.0) == 20.0 * DEADLINE_SLACK  # a slow one gets slack times its estimate
    assert load_deadline_s(30.0, 400.0, cap_s=480.0) == 480.0  # never past what the other side holds
    assert load_deadline_s(30.0, 5.0, cap_s=10.0) == 30.0  # nor below what was configured


def test_own_compute_is_weighed_by_the_other_requests_held():
    # Only the handoff tier has KV: with nobody else in the engine a 1,025-token prompt is
    # computed here (its own time, under idle_compute_s); with one request held, that
    # compute would stall it (weighted 1.5x) and the handoff wins. A finished request no
    # longer counts.
    def sched():
        return TieredScheduler({"p2p": FakeTier("p2p", 1025, remote=True)}, PolicyConfig(), BS, 8192.0)

    s = sched()
    first = request("a", 1025)
    assert s.get_num_new_matched_tokens(first, 0) == (0, False)
    assert s._decisions["a"].busy == 0 and s._decisions["a"].plan.name == "recompute"
    second = request("b", 1025)
    assert s.get_num_new_matched_tokens(second, 0) == (1024, True)
    assert s._decisions["b"].busy == 1 and s._decisions["b"].plan.name == "p2p"
    _, params = s.request_finished(first, [])
    assert params["kv_plan_estimates"]["busy"] == 0
    s.request_finished(second, [])
    third = request("c", 1025)
    s.get_num_new_matched_tokens(third, 0)
    assert s._decisions["c"].busy == 0 and s._decisions["c"].plan.name == "recompute"


def test_forced_tier_and_release_of_unused_ones():
    tiers = three_tiers()
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    req = request("r2", 4096, kv_source="disk")
    assert s.get_num_new_matched_tokens(req, 0) == (2560, True)
    s.update_state_after_alloc(req, blocks(4096), 2560)
    assert tiers["disk"].planned and not tiers["store"].planned and not tiers["p2p"].planned
    assert tiers["store"].released == tiers["p2p"].released == ["r2"]
    assert requested_source({"kv_source": "nvme"}, "auto", tiers)[1] is not None


def test_worker_joins_tiers_and_keeps_what_arrived():
    tiers = three_tiers()
    w = TieredWorker(tiers)
    from multi.protocol import TieredMetadata

    loads = {"r": {"store": [1, 2], "disk": [3], "p2p": [4, 5]}}
    w.bind(TieredMetadata({n: f"m{n}" for n in tiers}, loads=loads, step_tokens=[(64, 0)]))
    assert [c for c in tiers["disk"].calls if c[0] == "bind"] == [("bind", "mdisk")]
    w.wait_for_save()  # times the forward
    tiers["store"].results.finished_recving = {"r"}
    assert not w.transfer_results(set()).finished_recving  # disk and p2p still loading
    tiers["disk"].results.finished_recving = {"r"}
    tiers["p2p"].results = KVConnectorTransferResults(finished_recving={"r"}, failed_recving={"r"})
    out = w.transfer_results(set())
    assert out.finished_recving == {"r"} and not out.failed_recving
    assert w.block_ids_with_load_errors() == {4, 5}
    tiers["disk"].reports.add(LoadReport("disk", "r", 1 << 20, 0.002, True))
    tiers["p2p"].reports.add(LoadReport("p2p", "r", 0, 0.5, False))
    stats = w.take_stats()
    samples = decode_samples(stats.data["samples"])
    assert samples[0] == ForwardSample([64], [0], samples[0].seconds)
    assert samples[1:] == [LoadSample("disk", 1 << 20, 0.002, "r")]
    assert stats.data["own"]["counters"]["load_failures:p2p"] == 1


def test_samples_round_trip_and_learning():
    m = CostModel(PolicyConfig())
    raw = encode_samples([LoadSample("disk", 10**8, 0.5), ForwardSample([100, 20], [0, 500], 0.05)])
    decoded = decode_samples(raw)
    kind, est, seconds = m.learn(decoded[0])
    assert kind == "disk" and seconds == 0.5 and est > 0
    assert m.learn(decoded[1])[0] == "forward"
    assert m.load_fit("disk").samples == 1 and m.prefill.samples == 1


def test_a_handoff_is_learned_whole_less_the_remote_compute():
    # A forced p2p plan of 4096 tokens: the plan says what it expects the prefill instance
    # to compute; the worker timed the read alone (0.01 s). Learned: from the load being
    # planned to the sample's arrival (0.5 s later) less that remote compute estimate.
    tiers = three_tiers()
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    req = request("r3", 4096, kv_source="p2p")
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, blocks(4096), 4095)
    t0, remote = s._planned["r3"]["p2p"]
    assert remote == s._decisions["r3"].plan.parts["p2p_remote_s"] > 0
    sample = LoadSample("p2p", 4095 * 8192, 0.01, "r3")
    assert s.load_seconds(sample, now=t0 + remote + 0.5) == pytest.approx(0.5)
    # Consumed once; a sample of no planned load (another request) keeps its seconds.
    s._planned["r3"] = {"p2p": (t0, remote)}
    s._learn(encode_samples([sample, LoadSample("store", 10**6, 0.02, "r9")]))
    assert "r3" not in s._planned and s.model.load_fit("p2p").samples == 1
    assert s.model.load_fit("store").samples == 1
    # Never less than the read itself (a remote compute estimate above what it took).
    s._planned["r4"] = {"p2p": (t0, 10.0)}
    assert s.load_seconds(LoadSample("p2p", 1, 0.01, "r4"), now=t0 + 1.0) == 0.01
    # With the wait for READY measured: an estimate above it gives way to it, so the fit
    # learns the handoff's own overhead (1.0 - 0.9 s); one below it is kept.
    s._planned["r6"] = {"p2p": (t0, 10.0)}
    assert s.load_seconds(LoadSample("p2p", 1, 0.01, "r6", waited_s=0.9), now=t0 + 1.0) == pytest.approx(0.1)
    s._planned["r7"] = {"p2p": (t0, 0.5)}
    assert s.load_seconds(LoadSample("p2p", 1, 0.01, "r7", waited_s=0.9), now=t0 + 1.0) == pytest.approx(0.5)
    s._planned["r5"] = {"p2p": (t0, 0.0)}
    s.request_finished(request("r5", 10), [])
    assert "r5" not in s._planned  # a failed pull sends no sample: the entry goes with the request


def test_a_store_load_is_learned_whole_like_a_handoff():
    # A forced store plan: the worker timed its batch get alone (0.02 s); the fit learns the
    # load from its planning to the scheduler learning it finished (0.3 s later), nothing
    # taken off (no prefill instance computes for it). Each tier's load of one request is
    # its own entry: the store's sample leaves the p2p entry of a store+p2p plan in place.
    tiers = three_tiers()
    s = TieredScheduler(tiers, PolicyConfig(), BS, 8192.0)
    req = request("r1", 4096, kv_source="store")
    assert s.get_num_new_matched_tokens(req, 0)[0] > 0
    s.update_state_after_alloc(req, blocks(4096), s._decisions["r1"].end)
    t0, remote = s._planned["r1"]["store"]
    assert remote == 0.0
    s._planned["r1"]["p2p"] = (t0, 0.1)
    assert s.load_seconds(LoadSample("store", 10**6, 0.02, "r1"), now=t0 + 0.3) == pytest.approx(0.3)
    assert s._planned["r1"] == {"p2p": (t0, 0.1)}
    before = s.model.load_fit("store").samples
    s._planned["r1"]["store"] = (t0, 0.0)
    s._learn(encode_samples([LoadSample("store", 10**6, 0.02, "r1")]))
    assert s.model.load_fit("store").samples == before + 1 and "store" not in s._planned["r1"]


def test_config_generic_tiers_and_short_form():
    cfg = load_config({"store": {}, "p2p": {}, "tiers": [{"name": "disk", "connector": "mcstore.connector:X"}]})
    assert [t.name for t in cfg.tier_specs()] == ["store", "p2p", "disk"]
    assert load_config({"tiers": [{"name": "store"}], "default_source": "store"}).tier_specs()[0].config == {}
    for bad in ({"tiers": [{"name": "nvme"}]}, {"tiers": [{"name": "recompute", "connector": "a:B"}]},
                {"store": {}, "tiers": [{"name": "store"}]}):
        with pytest.raises(Exception, match="tier"):
            load_config(bad)


def store_worker(store_cluster, monkeypatch, namespace: str):
    """A real store worker of ``store_cluster`` (chunks of 2 blocks) over 16 blocks of 2 bf16 layers."""
    import torch

    from mcstore.config import load_config as store_config
    from mcstore.keys import KeySpace, fingerprint
    from mcstore.server import CLIENT_ENV
    from mcstore.worker import StoreWorker

    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    cfg = store_config({"master": store_cluster.master_addr, "chunk_tokens": 2 * BS}, env={})
    w = StoreWorker(cfg, KeySpace(fingerprint({"t": namespace}), 2 * BS), BS, 16, 0, load=True, save=True)
    buf = torch.zeros(2, 16, 2, BS, 64, dtype=torch.bfloat16)
    w.register_kv_caches({f"layer{i}": buf[i] for i in range(2)})
    return w


@pytest.mark.integration
def test_store_worker_reports_each_load(store_cluster, monkeypatch):
    """A real store worker ends every load with one LoadReport: bytes and seconds, or not ok."""
    import time

    from mcstore.protocol import ChunkIO, LoadJob, SaveJob, StoreMetadata

    w = store_worker(store_cluster, monkeypatch, "tier-contract")
    try:
        link = f"mct/tier/{time.monotonic_ns()}"
        w.wait_for_save(StoreMetadata(saves=[SaveJob("s", [ChunkIO(link, 0, [1, 2])])]))
        deadline = time.monotonic() + 15
        while (w.get_finished({"s"})[0] or set()) != {"s"}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        w.start_load_kv(StoreMetadata(loads=[LoadJob("hit", [ChunkIO(link, 0, [5, 6])], timeout_s=10),
                                             LoadJob("miss", [ChunkIO(link + "-gone", 0, [7, 8])], timeout_s=10)]))
        reports = []
        while len(reports) < 2:
            assert time.monotonic() < deadline + 15
            reports += w.reports.take()
            time.sleep(0.02)
        hit, miss = sorted(reports, key=lambda r: r.req_id)
        assert hit.tier == "store" and hit.ok and hit.bytes == 2 * w.geo.block_bytes and hit.seconds > 0
        assert not miss.ok and miss.bytes == 0
    finally:
        w.close()


class SyncTier(FakeTier):
    """A fake tier that grants synchronous loads while ``grant`` says so, recording what it was asked."""

    def __init__(self, name: str, reach: int, grant: bool):
        super().__init__(name, reach)
        self.grant, self.asked = grant, []

    def reserve_sync(self, request, start_token, end_token):
        self.asked.append((request.request_id, start_token, end_token))
        return self.grant


@pytest.mark.parametrize("grant", [True, False])
def test_a_single_tier_plan_is_synchronous_when_that_tier_grants_it(grant):
    """The composite answers vLLM ``load_async=False`` for a plan that loads from one tier
    that granted it, asking again at every step vLLM asks (a grant lasts one step); the
    worker then expects no finished-receiving for the request, and its failed blocks still
    come as that step's load errors."""
    store = SyncTier("store", 1024, grant)
    s = TieredScheduler({"store": store}, PolicyConfig(), BS, 8192.0)
    req = request("r1", 2048, kv_source="store")
    assert s.get_num_new_matched_tokens(req, 0) == (1024, not grant)
    assert s.get_num_new_matched_tokens(req, 0) == (1024, not grant)  # not scheduled, asked again
    assert store.asked == [("r1", 0, 1024)] * 2
    s.update_state_after_alloc(req, blocks(2048), 1024)
    meta = s.build_connector_meta(step("r1", 1024))
    assert meta.sync == (["r1"] if grant else []) and set(meta.loads["r1"]) == {"store"}
    w_store = FakeTier("store", 0)
    w = TieredWorker({"store": w_store})
    w.bind(meta)
    w_store.errors = {105}
    if not grant:
        w_store.results = KVConnectorTransferResults(finished_recving={"r1"})
    out = w.transfer_results(set())
    assert out.finished_recving == (set() if grant else {"r1"})
    assert w.block_ids_with_load_errors() == {105}
    assert "r1" not in w._loading


def test_a_plan_over_two_tiers_or_a_remote_prefill_is_never_synchronous():
    store, p2p = SyncTier("store", 1024, True), SyncTier("p2p", 4096, True)
    p2p.remote_prefill = True
    s = TieredScheduler({"store": store, "p2p": p2p}, PolicyConfig(), BS, 8192.0)
    assert s.get_num_new_matched_tokens(request("both", 4096), 0)[1] is True
    assert s.get_num_new_matched_tokens(request("p2p", 4096, kv_source="p2p"), 0)[1] is True
    assert store.asked == [] and p2p.asked == []


def test_per_layer_hooks_skip_a_tier_whose_layer_hooks_are_off():
    tiers = three_tiers()
    tiers["p2p"].layer_hooks = False  # as p2p.connector.P2PConnector declares
    w = TieredWorker(tiers)
    for layer in ("l0", "l1"):
        w.wait_for_layer_load(layer)
        w.save_kv_layer(layer, None, None)
    per_layer = {n: [c for c in t.calls if c[0] in ("wait_layer", "save_layer")] for n, t in tiers.items()}
    assert per_layer["store"] == per_layer["disk"] == [("wait_layer", "l0"), ("save_layer", "l0"),
                                                       ("wait_layer", "l1"), ("save_layer", "l1")]
    assert per_layer["p2p"] == []


def decode_step(rids: list[str]):
    return SimpleNamespace(scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=rids, num_computed_tokens=[300] * len(rids)),
                           num_scheduled_tokens=dict.fromkeys(rids, 1))


def test_the_scheduler_asks_for_every_prefill_step_timed_and_decode_steps_at_most_20_a_second():
    from multi.scheduler import DECODE_SAMPLES_PER_S

    s = TieredScheduler(three_tiers(), PolicyConfig(), BS, 8192.0)
    timed = [bool(s.build_connector_meta(decode_step(["a", "b"])).step_tokens) for _ in range(100)]
    # A burst of DECODE_SAMPLES_PER_S, then one more for every 50 ms these 100 steps took.
    assert DECODE_SAMPLES_PER_S == 20 and all(timed[:20]) and 20 <= sum(timed) <= 22
    assert s.build_connector_meta(step("c", 256)).step_tokens == [(256, 0)]  # prompt tokens: always
    s._decode_budget, s._budget_at = 0.0, s._budget_at - 0.1  # spent, and 100 ms later: two more
    assert s.build_connector_meta(decode_step(["a", "b"])).step_tokens == [(1, 300), (1, 300)]
    assert s.build_connector_meta(decode_step(["a", "b"])).step_tokens
    assert not s.build_connector_meta(decode_step(["a", "b"])).step_tokens
