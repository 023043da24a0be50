"""The benchmarks' order and interval helpers (bench.common) and the store phases' rates
(bench.store_phases), by hand: the decision matrix (bench.tiered_bench) runs its repetitions
in ``balanced_orders`` and reports ``ratio_interval``; the benchmarks themselves run in
``make bench``, their harness in ``make test-bench``."""

from __future__ import annotations

import collections
import random
import statistics

import pytest

from bench.common import balanced_orders, ratio_interval


def test_the_interval_of_equal_or_scaled_repetitions_is_a_point():
    den = [0.31, 0.45, 0.40, 0.52]
    assert ratio_interval(den, den) == (1.0, 1.0)
    lo, hi = ratio_interval([2 * x for x in den], den)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_the_interval_holds_the_cells_ratio_and_narrows_with_more_repetitions():
    # Two sources of the same plan, each request +-20% around 100 ms (the spread of one plan
    # on the 2-core host): the interval holds the cell's ratio; with three repetitions it is
    # wider than the 10% a target turns on, with sixty it is narrower.
    rnd = random.Random(1)

    def reqs(k):
        return [0.1 * rnd.uniform(0.8, 1.2) for _ in range(k)]

    widths = []
    for k in (3, 60):
        a, b = reqs(k), reqs(k)
        lo, hi = ratio_interval(a, b)
        point = statistics.median(a) / statistics.median(b)
        assert lo <= point <= hi
        widths.append(hi - lo)
    assert widths[0] > 0.1 > widths[1], widths


def test_the_interval_is_seeded_and_refuses_unpaired_repetitions():
    a, b = [0.1, 0.2, 0.15], [0.12, 0.11, 0.2]
    assert ratio_interval(a, b) == ratio_interval(a, b)
    with pytest.raises(ValueError, match="3 and 2 repetitions"):
        ratio_interval(a, b[:2])
    with pytest.raises(ValueError):
        ratio_interval([], [])


@pytest.mark.parametrize("sources", [["recompute", "store", "auto"], ["recompute", "store", "p2p", "auto"]])
def test_each_source_follows_every_other_equally_often_over_a_cycle(sources):
    n = len(sources)
    cycle = n if n % 2 == 0 else 2 * n
    orders = balanced_orders(sources, 2 * cycle, seed=5)
    assert all(sorted(o) == sorted(sources) for o in orders)
    assert orders[cycle:] == orders[:cycle]  # past a cycle, the orders repeat
    follows = collections.Counter((a, b) for o in orders[:cycle] for a, b in zip(o, o[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows
    positions = collections.Counter((s, o.index(s)) for o in orders[:cycle] for s in sources)
    assert len(positions) == n * n and len(set(positions.values())) == 1, positions


def test_the_seed_shuffles_the_roles_and_the_same_seed_gives_the_same_orders():
    sources = ["recompute", "store", "p2p", "auto"]
    assert balanced_orders(sources, 4, seed=3) == balanced_orders(sources, 4, seed=3)
    assert len({tuple(balanced_orders(sources, 1, seed=k)[0]) for k in range(20)}) > 1


def test_a_staged_loads_rate_counts_its_staging_call():
    # bench.store_phases over the metrics of a 32K-token hit on the AMX host (2026-12-04):
    # 400 MB, 28 ms fetched straight into pages, 501 ms into host staging.
    from bench.store_phases import summarise

    ph = "vllm:mctier_store_phase_seconds_sum"

    def key(name, **labels):  # a bench.engine_metrics.scrape sample
        return name, frozenset(labels.items())

    d = {key("vllm:mctier_store_loaded_bytes_total", kind=""): 4.0e8, key(ph, phase="load_transfer"): 0.028,
         key(ph, phase="load_staging"): 0.501, key(ph, phase="load_copy"): 0.239,
         key("vllm:mctier_store_saved_bytes_total", kind=""): 4.0e8, key(ph, phase="save_transfer"): 2.0}
    row = summarise(d, 1)
    assert row["load_transfer_gbps"] == pytest.approx(4.0e8 / 0.529 / 1e9)
    assert row["save_transfer_gbps"] == pytest.approx(0.2)


@pytest.mark.unit
def test_no_reuse_has_a_null_connector_arm_and_an_a_a_arm():
    """``bench.no_reuse``'s floors: ``null`` (vLLM's connector path with a connector that does
    nothing: what vLLM itself charges an engine for having a connector) and ``plain2`` (a second
    plain engine: the run's noise floor). The default arms stay the four of the published table."""
    from bench import no_reuse

    assert no_reuse.ARMS == ("plain", "store", "p2p", "tiered")
    assert no_reuse.kv_config("plain2", "m") is None and no_reuse.kv_config("plain", "m") is None
    null = no_reuse.kv_config("null", "m")
    assert null["kv_connector"] == "NullConnector" and null["kv_connector_module_path"] == "bench.nullconn"
    with pytest.raises(ValueError):
        no_reuse.kv_config("nope", "m")


@pytest.mark.unit
def test_no_reuse_variants_set_the_store_config_the_role_and_the_connector_config():
    """``--variant NAME=ARM:JSON``: JSON goes to the arm's store config, but its ``kv_role`` sets
    the role and its ``connector`` merges into kv_connector_extra_config (``{"store": null}``: a
    tiered arm without its store tier)."""
    from bench import no_reuse

    try:
        p2p_only = no_reuse.kv_config(no_reuse.add_variant('t1=tiered:{"connector": {"store": null}}'), "m:1")
        assert p2p_only["kv_connector"] == "TieredConnector" and p2p_only["kv_role"] == "kv_consumer"
        assert p2p_only["kv_connector_extra_config"]["store"] is None and "p2p" in p2p_only["kv_connector_extra_config"]
        cons = no_reuse.kv_config(no_reuse.add_variant('s1=store:{"kv_role": "kv_consumer", "lookup_wait_ms": 0}'),
                                  "m:1")
        assert cons["kv_role"] == "kv_consumer"
        assert cons["kv_connector_extra_config"]["lookup_wait_ms"] == 0
        assert "kv_role" not in cons["kv_connector_extra_config"]
        with pytest.raises(SystemExit):
            no_reuse.add_variant('p=plain:{}')
    finally:
        no_reuse.VARIANTS.pop("t1", None), no_reuse.VARIANTS.pop("s1", None)


@pytest.mark.unit
def test_the_null_connector_implements_every_hook_and_does_nothing():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    from bench.nullconn import NullConnector

    assert not NullConnector.__abstractmethods__  # vLLM can instantiate it
    c = NullConnector.__new__(NullConnector)  # no vLLM config needed for the hooks themselves
    assert c.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert type(c.build_connector_meta(object())) is KVConnectorMetadata
    assert c.start_load_kv(None) is None and c.wait_for_save() is None
    assert c.save_kv_layer("l", None, None) is None and c.wait_for_layer_load("l") is None


@pytest.mark.unit
def test_the_reserved_core_layout_starts_an_engine_on_every_cpu_and_the_default_pins_it():
    """``--reserve-core`` of the store benchmarks and ``bench.no_reuse`` (``bench.common.engine_cpus``):
    the engine's processes on every CPU of the host (its forward still bound to its core by
    ``VLLM_CPU_OMP_THREADS_BIND``, so ``io_cpus: auto`` finds the others free); without it no
    keyword, and ``Deployment.engine`` pins the engine whole to its core."""
    import os

    from bench.common import engine_cpus

    assert engine_cpus(False) == {}
    assert engine_cpus(True) == {"cpus": set(range(os.cpu_count()))}


@pytest.mark.unit
def test_with_a_reserved_core_every_engines_forward_runs_on_the_last_core():
    """``bench.common.forward_core``: with ``--reserve-core`` the writer's forward joins the
    readers' on the host's last core (``io_cpus: auto`` subtracts only its own engine's list:
    a writer computing on core 0 would share it with the readers' I/O); without it each
    engine keeps the core it was given."""
    import os

    from bench.common import forward_core

    last = os.cpu_count() - 1
    assert [forward_core(c, True) for c in (0, 1)] == [last, last]
    assert [forward_core(c, False) for c in (0, 1)] == [0, 1]
