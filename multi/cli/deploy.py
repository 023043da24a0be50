"""Launching a deployment on one machine: engines, a P/D pair behind the proxy, the store.

The demo, the benchmarks and the tests start every vLLM engine through
:func:`engine_argv` and :func:`engine_env`, so all of them get the same flags, the
CPU class's dtype (:mod:`kvcore.platform`) and, under ``MCTIER_SIMULATE_CPU=avx2``,
the AVX2 simulation. Every process runs in its own process group and is stopped by
PID.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from kvcore import platform
from kvcore.procs import Proc, free_port
from mcstore.server import StoreCluster, client_env


def engine_env(core: int | None = None, host: str = "127.0.0.1") -> dict[str, str]:
    """Environment of an engine pinned to ``core`` on the address ``host``: vLLM's settings
    and the CPU-class simulation (:func:`kvcore.platform.engine_env`), ``VLLM_HOST_IP`` (the
    store tier's default advertised address), ``VLLM_LOOPBACK_IP`` (where vLLM's own
    torch.distributed rendezvous listens: loopback by default, even on a host given another
    address), plus the Mooncake client's."""
    return {**platform.engine_env(core), "VLLM_HOST_IP": host, "VLLM_LOOPBACK_IP": host, **client_env(host)}


def engine_argv(model: str, port: int, *, python: str = sys.executable, served_name: str = "m",
                max_model_len: int = 8192, max_num_seqs: int | None = None, kv_config: dict | None = None,
                extra: list[str] | None = None, host: str = "127.0.0.1") -> list[str]:
    """``mctier serve`` on ``host`` as every engine of this project runs: eager, block size
    32, seed 0, prompt-token details on, and the CPU class's dtype unless ``extra`` names one."""
    argv = [python, "-m", "multi.cli", "serve", model, "--host", host, "--port", str(port),
            "--enforce-eager", "--block-size", "32", "--max-model-len", str(max_model_len), "--seed", "0",
            "--served-model-name", served_name, "--enable-prompt-tokens-details"]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    extra = list(extra or [])
    return argv + extra + platform.dtype_args(extra)


def tiered_config(role: str, master: str, bootstrap_port: int) -> dict:
    return {"kv_connector": "TieredConnector", "kv_connector_module_path": "multi", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": {"master": master, "chunk_tokens": 256},
                                          "p2p": {"bootstrap_port": bootstrap_port}}}


class Deployment:
    """Processes of a deployment (the demo's, the benchmarks'), stopped in reverse order of start."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.started: list[int] = []  # every PID ever started, for leak checks after stop()
        self.cluster: StoreCluster | None = None

    def track(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        self.started.append(proc.popen.pid)
        return proc

    def engine(self, name: str, model: str, core: int, kv_config: dict | None, *,
               python: str = sys.executable, env: dict[str, str] | None = None,
               extra: list[str] | None = None, cwd: str | None = None,
               cpus: set[int] | None = None) -> tuple[str, Proc]:
        """An OpenAI server pinned whole to ``core`` (or, with ``cpus``, its processes on those
        CPUs and its forward's OpenMP threads on ``core``); ``python`` may be another virtualenv's
        interpreter (the benchmarks run peers such as LMCache that way); ``extra`` are more
        ``vllm serve`` flags (e.g. ``--num-gpu-blocks-override`` to size the prefix cache);
        ``cwd``: the directory it runs in, whose packages it imports (default: this one's; a
        benchmark runs an earlier commit's export beside the current one that way)."""
        port = free_port()
        argv = engine_argv(model, port, python=python, served_name="demo", kv_config=kv_config, extra=extra)
        proc = self.track(Proc(name, argv, self.log_dir / f"{name}.log", env={**engine_env(core), **(env or {})},
                               cwd=cwd, cpus=cpus or {core}))
        return f"http://127.0.0.1:{port}", proc

    def pd_pair(self, model: str, p_cfg: dict, d_cfg: dict, bootstrap_port: int,
                extra: list[str] | None = None, prefill_env: dict[str, str] | None = None) -> tuple[str, str, str]:
        """A prefill engine on core 0 (with ``prefill_env`` added to its environment), a decode
        engine on core 1 (both with ``extra`` flags) and the proxy in front of them: their
        (prefill, decode, proxy) URLs."""
        n = len(self.procs)
        p_url, p_proc = self.engine(f"prefill-{n}", model, 0, p_cfg, extra=extra, env=prefill_env)
        d_url, d_proc = self.engine(f"decode-{n}", model, 1, d_cfg, extra=extra)
        self.wait_http(p_url, p_proc)
        self.wait_http(d_url, d_proc)
        return p_url, d_url, self.proxy(p_url, f"http://127.0.0.1:{bootstrap_port}", d_url)

    def proxy(self, prefill: str, bootstrap: str, decode: str, policy: str = "least-outstanding") -> str:
        """``mctier proxy`` in front of one P/D pair. ``least-outstanding`` always hands off
        (what the demo and the P/D benchmarks show); ``kv`` may serve a request on the decode
        instance alone when the handoff does not pay (:mod:`multi.router.choose`)."""
        port = free_port()
        proc = Proc("proxy", [sys.executable, "-m", "multi.cli", "proxy", "--port", str(port), "--policy", policy,
                              "--prefill", f"{prefill}@{bootstrap}", "--decode", decode],
                    self.log_dir / "proxy.log")
        self.track(proc)
        proc.wait_port(port, 30)
        url = f"http://127.0.0.1:{port}"
        self.wait_router(url, proc)
        return url

    @classmethod
    def wait_router(cls, url: str, proc: Proc, timeout: float = 120) -> None:
        """Until ``mctier proxy`` at ``url`` is healthy and has settled its tokenizer: loading it
        takes seconds of CPU (transformers), which a benchmark's first timed requests would
        otherwise share their cores with."""
        cls.wait_http(url, proc, timeout, ready=lambda r: r.json().get("tokenizer") != "loading",
                      what="healthy, tokenizer loaded")

    @staticmethod
    def wait_http(url: str, proc: Proc, timeout: float = 300, ready=None, what: str = "") -> None:
        """Until ``url``'s ``/health`` answers 200 (and ``ready(response)``, if given, is true)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited; log tail:\n{proc.tail()}")
            try:
                r = requests.get(url + "/health", timeout=2)
                if r.status_code == 200 and (ready is None or ready(r)):
                    return
            except (requests.RequestException, ValueError):  # ValueError: a body that is not JSON
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{proc.name} not ready{f' ({what})' if what else ''} after {timeout}s; "
                           f"see {proc.log_path}")

    def stop(self, procs: list[Proc] | None = None) -> None:
        """Stop ``procs`` (default: all, and the store cluster) in reverse order of start."""
        for p in reversed(list(self.procs if procs is None else procs)):
            p.stop(grace=15)
            self.procs.remove(p)
        if procs is not None:
            return
        if self.cluster is not None:
            self.started += [p.popen.pid for p in (self.cluster.master, self.cluster.server) if p is not None]
            self.cluster.stop()
            self.cluster = None


def metrics(url: str, names: tuple[str, ...] | None = None, timeout: float = 10) -> dict[tuple[str, str], float]:
    """``(sample name, kind label) -> value`` of an engine's series named in ``names``
    (default: every ``vllm:mctier_`` series)."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=timeout).text):
        for s in fam.samples:
            if (s.name in names) if names is not None else s.name.startswith("vllm:mctier_"):
                key = (s.name, s.labels.get("kind", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out
