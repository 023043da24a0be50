"""Shared fixtures: the tiny model, a no-connector baseline engine, Mooncake masters."""

from __future__ import annotations

import pytest

from tests.harness import LOGS, Engine, model_dir, reference_tokens, start_engines, top_logprobs


@pytest.fixture(scope="session")
def tiny_model():
    return model_dir("tiny")


class Baseline:
    """Greedy token ids of a vLLM engine without any connector, memoised per prompt."""

    def __init__(self, dtype: str | None = None, core: int = 0):
        self.dtype, self.core = dtype, core
        self._engine: Engine | None = None
        self._starting: Engine | None = None  # started, not yet waited for
        self._memo: dict[tuple, list[int]] = {}

    def tokens(self, prompt: list[int], max_tokens: int = 8, cached_prefix: int = 0,
               writers: list[list[int]] | None = None) -> list[int]:
        """``cached_prefix``: the no-connector run computes ``prompt[:cached_prefix]`` first (or
        replays ``writers``, the prompts that produced the stored KV) and serves it from its own
        prefix cache, the same split as a connector hit of that length (see ``reference_tokens``)."""
        key = (tuple(prompt), max_tokens, cached_prefix, tuple(map(tuple, writers or ())))
        if key not in self._memo:
            self._memo[key] = reference_tokens(self.engine(), prompt, max_tokens, cached_prefix, writers)
        return self._memo[key]

    def start(self) -> None:
        """Start the reference engine's process without waiting for it (:meth:`engine` waits):
        a fixture calls this first, so that it boots beside the fixture's own engines."""
        if self._engine is None and self._starting is None:
            name = "baseline" if self.dtype is None else f"baseline-{self.dtype}"
            self._starting = Engine(name, core=self.core, dev_mode=True, dtype=self.dtype, pinned=False)

    def engine(self) -> Engine:
        """The reference engine (started on first use), for a test module that drives it with
        :func:`tests.harness.reference_tokens` itself: one engine start fewer than its own."""
        if self._engine is None:
            self.start()
            starting, self._starting = self._starting, None
            self._engine = start_engines(starting)[0]
        return self._engine

    def top_logprobs(self, prompt: list[int], max_tokens: int, k: int = 5) -> list[dict[int, float]]:
        """Per generated position, the ``k`` most likely token ids and their logprobs, from a cold
        one-pass run (see :func:`tests.harness.top_logprobs`)."""
        self.tokens(prompt[:32], 1)  # starts the engine
        self._engine.reset_prefix_cache()
        return top_logprobs(self._engine.complete(prompt, max_tokens, logprobs=k, return_tokens_as_token_ids=True))

    def close(self):
        for e in (self._engine, self._starting):
            if e is not None:
                e.stop()


@pytest.fixture(scope="session")
def baseline(tiny_model):
    b = Baseline()
    yield b
    b.close()


@pytest.fixture(scope="session")
def tp2_ref():
    """The no-connector TP 2 reference (tiny, ranks on cores 0 and 1, dev mode) of both TP 2
    modules: its process starts here, and the first module's ``start_engines`` waits for it
    beside its own engines; the second finds it ready (one TP 2 start fewer). Modules must not
    stop it."""
    e = Engine("tp2-ref", 0, tp=2, dev_mode=True)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def store_cluster(tmp_path_factory):
    """A real mooncake_master plus a store server (256 MiB segment), short leases and TTLs."""
    from mcstore.server import StoreCluster

    cluster = StoreCluster(
        log_dir=LOGS,
        segment_size=256 << 20,
        extra_flags=["--default_kv_lease_ttl=500", "--client_ttl=5"],
    ).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def raw(store_cluster):
    """A pure Mooncake client of ``store_cluster`` in the test process (no segment), one per
    module. Modules with their own cluster (``test_tp2_e2e``, ``test_faults_store``) define
    their own ``raw``."""
    from tests.store_util import raw_client

    s = raw_client(store_cluster.master_addr)
    yield s
    s.close()
