"""The shipped Grafana dashboard: its PromQL reads only names that exist, the project's
``vllm:mctier_*`` declarations and a live mooncake_master's ``/metrics``.

The check against a live engine's ``/metrics`` lives with the engine tests
(``kvcore.dashboard.missing(load(), text, "vllm")``)."""

from __future__ import annotations

import copy
import fnmatch
import time
import tomllib
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from kvcore.dashboard import (
    MASTER,
    VLLM,
    dashboard_path,
    exposed_names,
    exprs,
    load,
    metric_names,
    missing,
    panels,
    queried_metrics,
)

ROOT = Path(__file__).resolve().parent.parent


def _dash(*exprs_, nested: bool = False) -> dict:
    targets = [{"refId": chr(65 + i), "expr": e} for i, e in enumerate(exprs_)]
    panel = {"type": "timeseries", "title": "t", "targets": targets}
    if nested:
        return {"panels": [{"type": "row", "title": "r", "collapsed": True, "panels": [panel]}]}
    return {"panels": [panel]}


# -- the PromQL reader --------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.9, sum by (le) (rate(vllm:mctier_store_load_seconds_bucket{model_name=~"$model_name"}'
     '[$__rate_interval])))', {"vllm:mctier_store_load_seconds_bucket"}),
    ('sum by (kind) (rate(vllm:mctier_p2p_pulls_total{kind=~"ok|failed",engine="0"}[1m]))',
     {"vllm:mctier_p2p_pulls_total"}),
    ("sum(rate(x_total[5m])) by (instance) / on(instance) group_left(job) sum(up_like) offset 5m",
     {"x_total", "up_like"}),
    ("sum(rate(total_get_nums_[1m])) - sum(rate(valid_get_nums_[1m])) > bool 1e3",
     {"total_get_nums_", "valid_get_nums_"}),
    ('label_replace(master_key_count, "dst", "$1", "instance", "(.*):.*") and ignoring(dst) foo2',
     {"master_key_count", "foo2"}),
    ("sum(master_allocated_bytes) / sum(master_total_capacity_bytes) * 100", {"master_allocated_bytes",
                                                                              "master_total_capacity_bytes"}),
    ("rate(a_total[1h30m] offset 1h30m) * 0x10 + .5 # b_total in a comment\n + c", {"a_total", "c"}),
    ('count(vllm:x_total{kind!~"h.*"}) > 1.5e-3', {"vllm:x_total"}),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == names


@pytest.mark.unit
def test_queried_metrics_groups_and_histogram_families():
    d = _dash(
        "histogram_quantile(0.5, sum by (le) (rate(vllm:mctier_store_load_seconds_bucket[1m])))",
        "rate(vllm:mctier_store_load_seconds_sum[1m]) / rate(vllm:mctier_store_load_seconds_count[1m])",
        "rate(vllm:mctier_p2p_bytes_total[1m])",
        "master_key_count + master_evicted_key_count",  # gauges/counters named *_count stay as they are
        "rate(my_hist_count[1m]) + rate(my_hist_bucket[1m])",
        nested=True,
    )
    q = queried_metrics(d)
    assert q == {
        VLLM: {"vllm:mctier_store_load_seconds", "vllm:mctier_p2p_bytes_total"},
        MASTER: {"master_key_count", "master_evicted_key_count", "my_hist"},
    }


EXPOSITION = """\
# HELP vllm:mctier_store_lookups_total Store lookups
# TYPE vllm:mctier_store_lookups_total counter
vllm:mctier_store_lookups_total{engine="0",kind="hit",model_name="m"} 3.0
vllm:mctier_store_lookups_created{engine="0",kind="hit",model_name="m"} 1.7e9
# HELP vllm:mctier_store_load_seconds Store load
# TYPE vllm:mctier_store_load_seconds histogram
# HELP vllm:mctier_p2p_bytes_total P2P bytes
# TYPE vllm:mctier_p2p_bytes_total counter
# HELP mem_cache_hit_nums_ Mooncake counter without the _total suffix
# TYPE mem_cache_hit_nums_ counter
mem_cache_hit_nums_ 7
# HELP master_key_count Keys
# TYPE master_key_count gauge
master_key_count 12
"""


@pytest.mark.unit
def test_exposed_names_undo_the_parsers_counter_renaming():
    names = exposed_names(EXPOSITION)
    assert {"vllm:mctier_store_lookups_total", "vllm:mctier_p2p_bytes_total", "mem_cache_hit_nums_",
            "master_key_count", "vllm:mctier_store_load_seconds",
            "vllm:mctier_store_load_seconds_bucket"} <= names
    # Family names the parser invents are not series anyone can query.
    assert "vllm:mctier_store_lookups" not in names
    assert "mem_cache_hit_nums__total" not in names


@pytest.mark.unit
def test_missing_reports_absent_names_per_source():
    d = _dash(
        "sum by (kind) (rate(vllm:mctier_store_lookups_total[1m]))",
        "histogram_quantile(0.9, sum by (le) (rate(vllm:mctier_store_load_seconds_bucket[1m])))",
        "rate(vllm:mctier_p2p_bytes_total[1m])",
        "rate(mem_cache_hit_nums_[1m])",
        "master_key_count",
    )
    assert missing(d, EXPOSITION) == set()
    d2 = copy.deepcopy(d)
    d2["panels"][0]["targets"] += [
        {"refId": "X", "expr": "rate(vllm:mctier_store_lookups[1m])"},  # the family, not the series
        {"refId": "Y", "expr": "rate(vllm:mctier_store_nope_seconds_bucket[1m])"},
        {"refId": "Z", "expr": "master_nope_bytes"},
    ]
    assert missing(d2, EXPOSITION) == {"vllm:mctier_store_lookups", "vllm:mctier_store_nope_seconds",
                                       "master_nope_bytes"}
    assert missing(d2, EXPOSITION, VLLM) == {"vllm:mctier_store_lookups", "vllm:mctier_store_nope_seconds"}
    assert missing(d2, EXPOSITION, [MASTER]) == {"master_nope_bytes"}


# -- the shipped dashboard ------------------------------------------------------------------------------


@pytest.mark.unit
def test_shipped_dashboard_is_a_grafana_dashboard_that_ships():
    path = dashboard_path()
    assert path.is_file() and path.parent.parent == ROOT / "kvcore"
    d = load()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    ds = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert [v["query"] for v in ds] == ["prometheus"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t.get("expr") for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    q = queried_metrics(d)
    assert q[VLLM] and q[MASTER]
    assert all(n.startswith("vllm:mctier_") for n in q[VLLM]), q[VLLM]
    # package-data ships it in the wheel
    pkg_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    rel = path.relative_to(ROOT / "kvcore").as_posix()
    assert any(fnmatch.fnmatch(rel, pat) for pat in pkg_data["kvcore"]), (rel, pkg_data)
    # docs point at the shipped file rather than keeping a copy that could drift
    assert not (ROOT / "docs" / "grafana-mctier.json").exists()
    assert "kvcore/assets/grafana-mctier.json" in (ROOT / "docs" / "deploy.md").read_text()


def _declared_exposition() -> str:
    """What an engine with TieredConnector over the store and P2P tiers registers: the
    project's own Prometheus classes, built as vLLM builds them, into a private registry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from mcstore.metrics import StorePromMetrics
    from multi.metrics import TieredPromMetrics
    from p2p.metrics import P2PPromMetrics

    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    args = (SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    tiers = {"store": StorePromMetrics(*args), "p2p": P2PPromMetrics(*args)}
    TieredPromMetrics(*args, tiers=tiers)
    return generate_latest(reg).decode()


@pytest.mark.unit
def test_every_vllm_name_the_dashboard_queries_is_declared():
    text = _declared_exposition()
    assert missing(load(), text, VLLM) == set()
    # and the check can fail
    bad = copy.deepcopy(load())
    bad["panels"][-1]["targets"].append({"refId": "Q", "expr": "rate(vllm:mctier_store_not_declared_total[1m])"})
    assert missing(bad, text, VLLM) == {"vllm:mctier_store_not_declared_total"}


@pytest.mark.unit
def test_every_declared_metric_has_a_panel():
    """A metric added to a tier's MetricSpec needs a panel (or a reason here)."""
    from prometheus_client.parser import text_string_to_metric_families

    declared = set()
    for fam in text_string_to_metric_families(_declared_exposition()):
        declared.add(f"{fam.name}_total" if fam.type == "counter" else fam.name)
    assert declared - queried_metrics(load())[VLLM] == set()


@pytest.mark.integration
def test_every_master_name_the_dashboard_queries_exists_on_a_live_master():
    from mcstore.server import StoreCluster
    from tests.harness import LOGS

    cluster = StoreCluster(LOGS, store_server=False).start()
    try:
        url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
        deadline = time.monotonic() + 15
        while True:
            try:
                r = requests.get(url, timeout=2)
                r.raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert "master_key_count" in exposed_names(r.text)
        assert missing(load(), r.text, MASTER) == set()
    finally:
        cluster.stop()


@pytest.mark.unit
def test_exprs_cover_every_target():
    d = load()
    n = sum(len(p.get("targets") or ()) for p in panels(d))
    assert len(exprs(d)) == n > 40


@pytest.mark.unit
def test_phase_histogram_takes_its_label_from_the_key():
    """``"phase:<name>"`` observes ``vllm:mctier_store_phase_seconds{phase=<name>}``; a phase
    without its label, or a label on an unlabelled op, is dropped rather than mislabelled."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from mcstore.metrics import StorePromMetrics

    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    m = StorePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    m.observe({"ops": {"phase:load_transfer": [0.02, 0.04], "phase:save_exists": [0.001],
                       "phase": [9.0], "load:x": [9.0], "load": [0.05]},
               "counters": {"io_ranges:load": 24, "io_chunks:load": 2}})
    text = generate_latest(reg).decode()
    assert 'vllm:mctier_store_phase_seconds_count{engine="0",model_name="m",phase="load_transfer"} 2.0' in text
    assert 'vllm:mctier_store_phase_seconds_count{engine="0",model_name="m",phase="save_exists"} 1.0' in text
    assert 'vllm:mctier_store_load_seconds_count{engine="0",model_name="m"} 1.0' in text
    assert 'vllm:mctier_store_io_ranges_total{engine="0",kind="load",model_name="m"} 24.0' in text
    assert 'vllm:mctier_store_load_seconds_sum{engine="0",model_name="m"} 0.05' in text
    assert len([ln for ln in text.splitlines() if ln.startswith("vllm:mctier_store_phase_seconds_count")]) == 2
