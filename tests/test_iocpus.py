"""Where a tier's I/O threads run (kvcore.iocpus): the CPU list parser, the ``auto`` rule
(the engine's CPUs minus vLLM's OpenMP compute lists) and the config check."""

from __future__ import annotations

import os
import threading

import pytest

from kvcore import iocpus
from kvcore.errors import ConfigError

pytestmark = pytest.mark.unit


def test_cpu_lists_parse_ranges_and_singles():
    assert iocpus.parse_cpu_list("0,2-3, 7") == {0, 2, 3, 7}
    for bad in ("a", "3-1", "1-2-3", "-1"):
        with pytest.raises(ValueError):
            iocpus.parse_cpu_list(bad)


def test_auto_is_the_engines_cpus_minus_every_ranks_openmp_list():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    assert iocpus.resolve("auto", env=env, started_on=set(range(10))) == {8, 9}
    # This rank's OMP_PLACES (vLLM's auto binding) counts as compute too.
    assert iocpus.resolve("auto", env={"OMP_PLACES": "{0,1,2}"}, started_on={0, 1, 2, 3}) == {3}


def test_auto_leaves_threads_alone_when_the_engine_has_only_compute_cores():
    assert iocpus.resolve("auto", env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, started_on={1}) is None
    assert iocpus.resolve("none", env={}, started_on={0, 1}) is None


def test_an_explicit_list_is_taken_as_is_and_checked_against_the_host():
    assert iocpus.resolve("0", env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, started_on={0}) == {0}
    with pytest.raises(ConfigError, match="does not have"):
        iocpus.resolve(str(os.cpu_count() + 3))


@pytest.mark.parametrize("bad", ["", "x", "0-", "cores"])
def test_a_bad_io_cpus_is_a_config_error_naming_the_key(bad):
    from mcstore.config import load_config

    with pytest.raises(ConfigError, match="io_cpus must be"):
        load_config({"master": "h:1", "io_cpus": bad}, env={})


def test_threads_started_inside_inherit_the_io_cpus_and_the_caller_is_restored():
    cpus = {sorted(os.sched_getaffinity(0))[-1]}
    before = os.sched_getaffinity(0)
    seen = {}
    with iocpus.threads_started_on(cpus, "test"):
        t = threading.Thread(target=lambda: seen.setdefault("cpus", os.sched_getaffinity(0)))
        t.start()
        t.join(timeout=10)
    assert seen["cpus"] == cpus
    assert os.sched_getaffinity(0) == before
