"""The router's choice, instances and command line, without engines
(``multi.router.choose``, ``multi.router.instances``, ``multi.router.cli``). The routes on
real engines are in ``tests/test_router_e2e.py``."""

from __future__ import annotations

import time

import pytest

from multi.policy import PolicyConfig
from multi.router.choose import Chooser
from multi.router.cli import _instances, parse_args
from multi.router.index import BlockIndex, chain
from multi.router.instances import Pool, load_file, make

pytestmark = pytest.mark.unit

BS = 32
BPT = 4096.0  # KV bytes per token


def pd_pool(prefills=2, decodes=1) -> Pool:
    return Pool([make("prefill", f"http://127.0.0.1:81{i:02d}") for i in range(prefills)]
                + [make("decode", f"http://127.0.0.1:82{i:02d}") for i in range(decodes)])


def chooser(policy="kv", **cfg) -> Chooser:
    return Chooser(policy, BPT, PolicyConfig(calibrate=False, **cfg))


def pd_chooser(**cfg) -> Chooser:
    """A chooser that weighs all of the decode instance's compute (``idle_compute_s=0``), as
    when it serves a batch: for the tests of which prefill instance a handoff takes, whose
    prompts an idle decode instance would otherwise compute itself."""
    return chooser(idle_compute_s=0.0, **cfg)


def matcher(index: BlockIndex, tokens):
    hashes = chain(tokens, BS)
    return lambda inst: index.match(inst.url, hashes) * BS


def prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 2000 + 4 for i in range(n)]


def test_prefix_in_one_prefill_cache_picks_that_instance():
    pool, index = pd_pool(), BlockIndex(BS)
    a, b = pool.role("prefill")
    tokens = prompt(32 * 40 + 1)
    index.record(b.url, chain(tokens[:32 * 36], BS))
    r = chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert (r.kind, r.prefill) == ("pd", b) and r.cached_prefill == 32 * 36
    assert r.reason == "prefill instance's cache"
    # The same request with the prefix on A goes to A: the choice follows the index.
    index2 = BlockIndex(BS)
    index2.record(a.url, chain(tokens[:32 * 36], BS))
    assert chooser().choose(pool, len(tokens), matcher(index2, tokens), 0, None).prefill is a


def test_queue_ahead_outweighs_a_cache_hit():
    pool, index = pd_pool(), BlockIndex(BS)
    a, b = pool.role("prefill")
    tokens = prompt(32 * 40 + 1, 1)
    index.record(b.url, chain(tokens[:32 * 20], BS))
    now = time.monotonic()
    b.inflight["x"] = (30.0, now)  # 30 s of prefill work queued on B
    r = pd_chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert r.prefill is a and r.seconds < 30


def test_queued_work_is_worked_through_in_the_order_sent():
    inst = make("plain", "http://127.0.0.1:8300")
    inst.inflight["a"] = (10.0, 100.0)
    inst.inflight["b"] = (10.0, 100.0)  # sent at the same time: it waits for a
    assert inst.queue_s(105.0) == pytest.approx(15.0)  # not 5 + 5: one engine, one prefill at a time
    assert inst.queue_s(125.0) == 0.0
    inst.inflight["c"] = (1.0, 130.0)  # sent after both were predicted done: starts at once
    assert inst.queue_s(130.5) == pytest.approx(0.5)


def test_handoff_leaves_the_prefill_instance_when_its_prefill_ends():
    pool, c = pd_pool(), chooser()
    p, d = pool.role("prefill")[0], pool.role("decode")[0]
    route = c.choose(pool, 2000, lambda i: 0, 0, None)
    assert (route.kind, route.prefill, route.target) == ("pd", p, d)
    assert c.begin(route, p, 2000, 0, "r1", time.monotonic()) is True  # nothing else in flight
    assert (p.outstanding, d.outstanding, list(p.inflight)) == (1, 1, ["r1"])
    assert c.prefill_done(p, "r1") is True  # ran alone
    # The decode goes on elsewhere: P has nothing queued and nothing outstanding.
    assert (p.outstanding, d.outstanding, p.inflight) == (0, 1, {})
    c.end(route, p, "r1")
    assert (p.outstanding, d.outstanding) == (0, 0)
    # A failed handoff (no prefill_done) is cleared by end alone.
    c.begin(route, p, 2000, 0, "r2", time.monotonic())
    c.begin(route, p, 2000, 0, "r3", time.monotonic())
    assert c.prefill_done(p, "r2") is False  # r3 still in flight: not alone
    c.end(route, p, "r3")
    c.end(route, p, "r2")
    assert (p.outstanding, d.outstanding, p.inflight) == (0, 0, {})


def test_prefill_samples_leave_out_the_predicted_store_load():
    # A handoff whose prefill instance loaded [512, 1536) from the store before computing:
    # the forward sample is the prefill's time minus the store tier's predicted load.
    class Recorder(Chooser):
        def learn_prefill(self, inst, n, cached, seconds, alone):
            got.append((n, cached, seconds, alone))

    got: list = []
    pool = pd_pool()
    c = Recorder("kv", BPT, PolicyConfig(calibrate=False, idle_compute_s=0.0))
    route = c.choose(pool, 2000, lambda i: 512 if i.role == "prefill" else 0, 1536, None)
    p = route.prefill
    load = c.model(p).load_s(c._store_tiers(1536)[0], 1024 * BPT)
    assert load > 0.02  # the store prior's latency at least
    c.learn_request(route, p, 2000, 1536, True, ttft_s=2.5, prefill_s=2.0)
    assert got == [(2000, 1536, pytest.approx(2.0 - load), True)]
    # Without a store part (the store reaches no further than the instance's cache) nothing is taken out.
    got.clear()
    route = c.choose(pool, 2000, lambda i: 512 if i.role == "prefill" else 0, 256, None)
    c.learn_request(route, route.prefill, 2000, 512, True, ttft_s=2.5, prefill_s=2.0)
    assert got == [(2000, 512, 2.0, True)]


def test_decode_and_store_covering_the_prompt_skip_the_prefill():
    pool, index = pd_pool(), BlockIndex(BS)
    tokens = prompt(32 * 64 + 1, 2)
    c = chooser()
    # Nothing anywhere: a long prompt is handed off (its compute on the decode instance costs 1.5x).
    r = c.choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert r.kind == "pd"
    # The store holds all but the last token: the decode instance loads and computes one token.
    r = c.choose(pool, len(tokens), matcher(index, tokens), 32 * 64, None)
    assert (r.kind, r.target, r.plan) == ("direct", pool.role("decode")[0], "store")
    assert r.reason == "decode instance and store cover the prompt"


def test_short_prompt_goes_direct_when_the_handoff_costs_more():
    # The handoff's fixed latency (0.03 s prior) is more than a 40-token recomputation saves.
    pool, index = pd_pool(), BlockIndex(BS)
    tokens = prompt(40, 3)
    r = chooser(prefill_token_s=1e-5, prefill_step_s=0.002).choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert r.kind == "direct" and r.reason == "handoff does not pay"


def test_idle_decode_instance_computes_a_short_prompt_itself():
    # 1,025 tokens, nothing cached (priors: ~0.33 s of compute). An idle decode instance
    # stalls nobody by computing it, sooner than a handoff; one with a request in flight
    # would stall it, and its compute counts 1.5x: the handoff wins.
    pool, index = pd_pool(), BlockIndex(BS)
    tokens = prompt(32 * 32 + 1, 7)
    r = chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert (r.kind, r.reason) == ("direct", "handoff does not pay"), r.candidates
    pool.role("decode")[0].outstanding = 1
    r = chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert r.kind == "pd", r.candidates


def test_admission_rejects_with_retry_after():
    pool, index = pd_pool(), BlockIndex(BS)
    tokens = prompt(32 * 64 + 1, 4)
    c = chooser()
    est = c.choose(pool, len(tokens), matcher(index, tokens), 0, None).seconds
    r = c.choose(pool, len(tokens), matcher(index, tokens), 0, est / 2)
    assert r.kind == "reject" and r.retry_after >= 1
    assert c.choose(pool, len(tokens), matcher(index, tokens), 0, est * 2).kind == "pd"
    # Work queued everywhere (the decode instance too, or recomputing there would win).
    for p in pool.all:
        p.inflight["q"] = (est + 7.5, time.monotonic())
    r = c.choose(pool, len(tokens), matcher(index, tokens), 0, est * 1.01)
    assert r.kind == "reject" and r.retry_after >= 7


def test_round_robin_and_least_outstanding():
    pool = pd_pool(prefills=2, decodes=2)
    idx = BlockIndex(BS)
    m = matcher(idx, prompt(100))
    rr = chooser("round-robin")
    picks = [rr.choose(pool, 100, m, 0, None) for _ in range(4)]
    assert [p.prefill.url for p in picks] == [pool.role("prefill")[i % 2].url for i in range(4)]
    assert all(p.kind == "pd" for p in picks)
    lo = chooser("least-outstanding")
    pool.role("prefill")[0].outstanding = 3
    pool.role("decode")[0].outstanding = 1
    r = lo.choose(pool, 100, m, 0, None)
    assert (r.prefill, r.target) == (pool.role("prefill")[1], pool.role("decode")[1])


def test_plain_instances_by_cache_then_queue():
    pool = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    e0, e1 = pool.role("plain")
    index = BlockIndex(BS)
    tokens = prompt(32 * 30 + 1, 5)
    index.record(e1.url, chain(tokens[:32 * 30], BS))
    r = chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert (r.kind, r.target) == ("direct", e1)
    e1.inflight["busy"] = (20.0, time.monotonic())
    assert chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None).target is e0


def test_unhealthy_instances_are_not_routed_to():
    pool = pd_pool()
    a, b = pool.role("prefill")
    b.healthy = False
    index = BlockIndex(BS)
    tokens = prompt(32 * 40 + 1, 6)
    index.record(b.url, chain(tokens[:32 * 36], BS))
    assert pd_chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None).prefill is a
    pool.role("decode")[0].healthy = False
    assert pd_chooser().choose(pool, len(tokens), matcher(index, tokens), 0, None) is None


def test_learning_moves_the_instance_estimate():
    pool = pd_pool()
    a, _ = pool.role("prefill")
    c = Chooser("kv", BPT, PolicyConfig())
    before = c.prefill_work(a, 2000, 0)
    for _ in range(30):
        c.learn_prefill(a, 2000, 0, before * 4, alone=True)
    assert c.prefill_work(a, 2000, 0) > 2 * before
    other = pool.role("prefill")[1]
    assert c.prefill_work(other, 2000, 0) == pytest.approx(before)  # per-instance models
    c.learn_prefill(other, 2000, 0, before * 4, alone=False)  # queued: not a speed sample
    assert c.prefill_work(other, 2000, 0) == pytest.approx(before)


def test_instances_file_and_reload(tmp_path):
    f = tmp_path / "inst.toml"
    f.write_text('[[prefill]]\nurl = "http://127.0.0.2:8100"\nevents = "tcp://127.0.0.2:5557"\n'
                 '[[decode]]\nurl = "127.0.0.3:8200"\n')
    got = load_file(str(f))
    assert [(i.role, i.url, i.bootstrap, i.events) for i in got] == [
        ("prefill", "http://127.0.0.2:8100", "http://127.0.0.2:8998", "tcp://127.0.0.2:5557"),
        ("decode", "http://127.0.0.3:8200", None, None)]
    pool = Pool([make("decode", "http://127.0.0.1:8200")] + got)
    f.write_text('[[prefill]]\nurl = "http://127.0.0.4:8100"\n[[decode]]\nurl = "http://127.0.0.3:8200"\n')
    added, removed = pool.replace_file(load_file(str(f)))
    assert [i.url for i in added] == ["http://127.0.0.4:8100"]
    assert [i.url for i in removed] == ["http://127.0.0.2:8100"]
    assert sorted(i.url for i in pool.all) == ["http://127.0.0.1:8200", "http://127.0.0.3:8200",
                                               "http://127.0.0.4:8100"]
    f.write_text('[[prefill]]\nurl = "http://x:1"\nweight = 3\n')
    with pytest.raises(ValueError, match=r"weight.*known keys.*url, bootstrap, events, replay"):
        load_file(str(f))
    f.write_text('[[prefil]]\nurl = "http://x:1"\n')
    with pytest.raises(ValueError, match=r"prefil.*known keys: top level prefill, decode, plain"):
        load_file(str(f))


def test_command_line_keeps_the_old_proxy_flags():
    a = parse_args(["--prefill", "http://127.0.0.1:8100@http://127.0.0.1:9000", "127.0.0.1:8101",
                    "--decode", "http://127.0.0.1:8200", "--port", "8000", "--timeout", "30",
                    "--kv-events", "http://127.0.0.1:8101=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"])
    got = _instances(a)
    assert [(i.role, i.url, i.bootstrap) for i in got] == [
        ("prefill", "http://127.0.0.1:8100", "http://127.0.0.1:9000"),
        ("prefill", "http://127.0.0.1:8101", "http://127.0.0.1:8998"),
        ("decode", "http://127.0.0.1:8200", None)]
    assert (got[1].events, got[1].replay) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert a.policy == "kv" and a.ttft_slo is None
    with pytest.raises(SystemExit, match="not given"):
        _instances(parse_args(["--plain", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:2=tcp://x:1"]))
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        Pool(_instances(parse_args(["--prefill", "http://127.0.0.1:1"]))).validate()


def test_a_decision_log_that_cannot_be_opened_is_a_clear_error(tmp_path):
    from multi.router.cli import build_app

    a = parse_args(["--plain", "http://127.0.0.1:9", "--kv-bytes-per-token", "1",
                    "--decision-log", str(tmp_path / "missing" / "decisions.jsonl")])
    with pytest.raises(SystemExit, match=r"--decision-log: .*No such file or directory"):
        build_app(a)


def test_wait_fit_learns_what_a_request_in_flight_costs():
    # Each request already in flight on the instance delays the next first token by 0.5 s
    # (decode steps sharing the engine): the fitted wait follows, and admission with it.
    pool = Pool([make("plain", "http://127.0.0.1:8300")])
    e = pool.role("plain")[0]
    m = matcher(BlockIndex(BS), prompt(100, 7))
    c = Chooser("kv", BPT, PolicyConfig())
    idle = c.choose(pool, 100, m, 0, None)
    assert idle.seconds == pytest.approx(idle.base_s)  # nothing ahead, nothing learned yet
    for _ in range(5):
        for k in range(1, 9):
            e.outstanding = k
            r = c.choose(pool, 100, m, 0, None)
            c.learn_wait(r, r.base_s + 0.5 * k)
    e.outstanding = 6
    r = c.choose(pool, 100, m, 0, None)
    assert r.seconds - r.base_s == pytest.approx(3.0, rel=0.15)
    assert c.choose(pool, 100, m, 0, 2.0).kind == "reject"
    e.outstanding = 1
    assert c.choose(pool, 100, m, 0, 2.0).kind == "direct"
    # Not calibrating: the wait stays the prior, each request in flight costs this one's compute.
    frozen = chooser()
    for k in range(1, 9):
        e.outstanding = k
        r = frozen.choose(pool, 100, m, 0, None)
        frozen.learn_wait(r, r.base_s + 0.5 * k)
    r = frozen.choose(pool, 100, m, 0, None)
    assert r.own_s > 0 and r.seconds == pytest.approx(r.base_s + 8 * r.own_s)


def test_equal_estimates_take_turns():
    pool = Pool([make("plain", f"http://127.0.0.1:83{i:02d}") for i in range(2)])
    m = matcher(BlockIndex(BS), prompt(100, 8))
    c = chooser()
    picks = [c.choose(pool, 100, m, 0, None).target.url for _ in range(4)]
    assert picks[0] != picks[1] and picks[0] == picks[2] and picks[1] == picks[3]


def test_decode_instance_by_load_then_by_what_it_holds():
    pool, index = pd_pool(prefills=1, decodes=2), BlockIndex(BS)
    d0, d1 = pool.role("decode")
    tokens = prompt(32 * 64 + 1, 9)
    c = chooser()
    # Both idle; d1 holds the prefix in its cache: the request goes there, and whole
    # (it holds all but the last token, nothing to hand off).
    index.record(d1.url, chain(tokens[:32 * 64], BS))
    r = c.choose(pool, len(tokens), matcher(index, tokens), 0, None)
    assert (r.kind, r.target) == ("direct", d1)
    # d1 busy (requests in flight and waiting): the least loaded decode instance, d0,
    # loads the store's copy instead.
    d1.outstanding, d1.waiting = 3, 2
    r = c.choose(pool, len(tokens), matcher(index, tokens), 32 * 64, None)
    assert (r.kind, r.target, r.plan) == ("direct", d0, "store")


def test_prompts_state_is_loading_until_the_tokenizer_is_settled_either_way(tiny_model, tmp_path):
    """What the router's /health reports as "tokenizer" (benchmarks wait for it to settle)."""
    import asyncio

    import aiohttp

    from multi.router.prompts import Prompts

    async def run():
        async with aiohttp.ClientSession() as session:
            local = Prompts(tokenizer=str(tiny_model))
            assert local.state == "loading"
            assert await local.load(session, None) is not None
            assert local.state == "local"
            assert await local.token_ids(session, None, "/v1/completions", {"prompt": "hello"})
            missing = Prompts(tokenizer=str(tmp_path))  # a directory without a tokenizer
            assert missing.state == "loading"
            assert await missing.load(session, None) is None
            assert missing.state == "instances"

    asyncio.run(run())


class _FakeLookup:
    """The store lookup's answers (:meth:`multi.router.storeview.StoreView.check`), counted."""

    chunk_tokens = 2 * BS

    def __init__(self):
        self.found: int | None = 0
        self.calls = 0

    def check(self, tokens, salt=None):
        self.calls += 1
        return self.found


def test_store_events_filter_the_store_lookup_which_confirms_and_corrects_them():
    import asyncio
    from types import SimpleNamespace

    from multi.router.app import Router
    from multi.router.index import STORE
    from multi.router.prompts import Prompts
    from multi.router.storeview import StoreIndex

    pool = Pool([make("plain", "http://127.0.0.1:8300"), make("plain", "http://127.0.0.1:8301")])
    lookup, store = _FakeLookup(), StoreIndex(BS, 1000)
    r = Router(pool, chooser(), BlockIndex(BS), Prompts(), timeout=10, connect_timeout=1, store_view=lookup,
               store_approx=True, store_index=store)
    r.subscribers = {i.url: SimpleNamespace(stale=False) for i in pool.all}
    p = prompt(3 * 2 * BS + 5, 1)  # three chunks of two blocks, and a partial block
    h = chain(p, BS)

    def reach(tokens=p, hashes=h):
        return asyncio.run(r._store_reach(tokens, hashes, None))

    # Nothing announced: no lookup at all.
    assert reach() == (0, "skipped", 0) and lookup.calls == 0
    # Chunks [0, 2) announced (4 blocks): the lookup confirms what it finds.
    store.index.stored(STORE, h[:4])
    lookup.found = 4 * BS
    assert reach() == (4 * BS, "confirmed", 4 * BS) and lookup.calls == 1
    # A prompt whose 3 blocks name chunk 0 and half of chunk 1: the half is no whole chunk, and
    # the lookup (whole chunks only here) finds chunk 0 alone; nothing is stale.
    lookup.found = 2 * BS
    assert reach(p[:3 * BS + 5], h[:3]) == (2 * BS, "confirmed", 3 * BS) and store.probable(h) == 4
    # A partial object past them that the tier does not announce: the lookup's answer, learned.
    lookup.found = 5 * BS
    assert reach() == (5 * BS, "confirmed", 4 * BS) and store.probable(h) == 5
    # Chunk 1 removed behind the router's back: the lookup's answer, and the view corrected.
    lookup.found = 2 * BS
    assert reach() == (2 * BS, "stale", 5 * BS) and store.probable(h) == 2 and store.blocks() == 2
    # An answer the lookup could not give: the router's approximate record, the view untouched.
    r.index.record(STORE, h[:1])
    lookup.found = None
    assert reach() == (BS, "unanswered", 2 * BS) and store.probable(h) == 2
    # A stale event stream, or an instance without one: every request is looked up.
    calls, other = lookup.calls, prompt(4 * BS, 2)
    lookup.found = 0
    r.subscribers[pool.all[1].url].stale = True
    assert reach(other, chain(other, BS)) == (0, "unfiltered", None) and lookup.calls == calls + 1
    del r.subscribers[pool.all[1].url]
    assert reach(other, chain(other, BS)) == (0, "unfiltered", None) and lookup.calls == calls + 2
    text = r.metrics.render().decode()
    for outcome, n in (("skipped", 1), ("confirmed", 3), ("stale", 1), ("unanswered", 1), ("unfiltered", 2)):
        assert f'mctier_router_store_checks_total{{outcome="{outcome}"}} {n}.0' in text, text
    r._store_pool.shutdown()


def test_store_index_flag_bounds_the_view_and_zero_turns_the_filter_off():
    from multi.router.cli import build_app

    base = ["--plain", "http://127.0.0.1:9", "--kv-bytes-per-token", "1", "--store", "127.0.0.1:1"]
    assert build_app(parse_args(base))["router"].store_index.index.capacity("store") == 1 << 18
    assert build_app(parse_args([*base, "--store-index-blocks", "64"]))["router"].store_index.blocks() == 0
    assert build_app(parse_args([*base, "--store-index-blocks", "0"]))["router"].store_index is None
    assert build_app(parse_args(base[:-2] + ["--store", "approx"]))["router"].store_index is None
    with pytest.raises(SystemExit, match="--store-index-blocks"):
        build_app(parse_args([*base, "--store-index-blocks", "-1"]))


def test_engine_metrics_read_takes_only_the_load_and_cache_lines():
    """The health read parses only the families it uses out of an instance's whole /metrics
    (other families' lines, comments and look-alike names are dropped; running requests of
    two engines in one API server add up)."""
    from multi.router.instances import _parse_metrics

    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="4096"} 1.0',
        'vllm:num_requests_running_total_lookalike{engine="0"} 99.0',
        'vllm:prompt_tokens_total{engine="0"} 123456.0',
        'garbage that is not prometheus {{{',
    ]) + "\n"
    assert _parse_metrics(text) == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0,
                                    "vllm:kv_cache_usage_perc": 0.25, "blocks": 4096}
    assert _parse_metrics("vllm:prompt_tokens_total 1.0\n") == {}
