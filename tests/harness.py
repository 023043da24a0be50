"""Real components for tests: vLLM engines (served and offline), prompts, token-id checks.

Every engine is a real ``mctier serve`` process pinned to one core, eager, block
size 32, a 1 GiB KV cache; it is stopped by PID (its whole process group).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import requests

from bench.client import reset_prefix_cache
from kvcore.platform import engine_dtype, kv_bytes_per_token  # noqa: F401 - the tests' import point
from kvcore.procs import Proc, free_port
from multi.cli.deploy import engine_argv, engine_env

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MCTIER_CACHE", ROOT / ".cache"))
LOGS = Path(os.environ.get("MCTIER_TEST_LOGS", ROOT / ".cache" / "test-logs"))
BLOCK = 32
VOCAB = 2048

ENGINE_START_TIMEOUT = float(os.environ.get("MCTIER_ENGINE_START_TIMEOUT", "240"))
REQUEST_TIMEOUT = 120.0


def model_dir(preset: str = "tiny") -> Path:
    """The test model (built once; ``small`` is sized for this machine's CPU class)."""
    from multi.cli.models import build

    return build(preset, CACHE / "models" / preset)


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` pseudo-random token ids (no special tokens), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


class Engine:
    """A ``mctier serve`` OpenAI server on ``host`` (127.0.0.1 by default; ``VLLM_HOST_IP`` too),
    pinned to ``core``, in ``dtype`` (default: the CPU class's, :func:`kvcore.platform.engine_dtype`).

    ``pinned=False`` (no-connector references): only the forward passes are bound to ``core``
    (``VLLM_CPU_OMP_THREADS_BIND``); the start's imports, most of its ~20 s of CPU, run on
    whichever core is free instead of queueing behind a neighbour's on ``core``."""

    def __init__(
        self,
        name: str,
        core: int,
        kv_config: dict | None = None,
        model: str | os.PathLike | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        max_model_len: int = 4096,
        dev_mode: bool = False,
        dtype: str | None = None,
        host: str = "127.0.0.1",
        tp: int = 1,
        pinned: bool = True,
    ):
        if not pinned and kv_config is not None:
            # A connector picks its I/O threads' CPUs from the engine's affinity (kvcore.iocpus).
            raise ValueError("only a no-connector engine may start unpinned")
        self.name, self.host, self.tp = name, host, tp
        self.port = free_port(host)
        self.model = str(model or model_dir("tiny"))
        self.dtype = engine_dtype(explicit=dtype)
        argv = engine_argv(self.model, self.port, max_model_len=max_model_len, max_num_seqs=16,
                           kv_config=kv_config, extra=[*(extra_args or []), "--dtype", self.dtype,
                                                       *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])],
                           host=host)
        full_env = {**engine_env(core, host), **(env or {})}
        # Tensor parallel: one rank per core, ranks 0..tp-1 on cores core..core+tp-1.
        cpus = set(range(core, core + tp))
        if tp > 1:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in sorted(cpus))
        if dev_mode:
            full_env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, for reference engines
        self.proc = Proc(name, argv, LOGS / f"{name}-{self.port}.log", env=full_env, cwd=str(ROOT),
                         cpus=cpus if pinned else None)
        self.url = f"http://{host}:{self.port}"

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT) -> Engine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"engine {self.name} exited; log tail:\n{self.proc.tail(60)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine {self.name} not ready in {timeout}s; log tail:\n{self.proc.tail(60)}")

    def complete(self, prompt: list[int] | str, max_tokens: int = 8, timeout: float = REQUEST_TIMEOUT, **body) -> dict:
        payload = {
            "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **body,
        }
        r = requests.post(self.url + "/v1/completions", json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def tokens(self, prompt, max_tokens: int = 8, **body) -> list[int]:
        return self.complete(prompt, max_tokens, **body)["choices"][0]["token_ids"]

    def reset_prefix_cache(self, timeout: float = 30.0) -> None:
        """Empty the engine's local prefix cache (needs ``dev_mode=True``;
        :func:`bench.client.reset_prefix_cache`, ``TimeoutError`` past ``timeout``)."""
        reset_prefix_cache(self.url, timeout)

    def metrics_text(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for fam in text_string_to_metric_families(self.metrics_text()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def stop(self) -> None:
        self.proc.stop(grace=15)


def reference_tokens(engine: Engine, prompt: list[int], max_tokens: int = 8, cached_prefix: int = 0,
                     writers: list[list[int]] | None = None) -> list[int]:
    """Greedy ids from a no-connector ``engine`` that first served ``writers`` (default:
    ``[prompt[:cached_prefix]]``), one request each, and then serves ``prompt`` with
    ``cached_prefix`` tokens from its own prefix cache.

    A connector that loads ``[0, S)`` must reproduce exactly what vLLM's own prefix cache
    gives for the same computation: computing ``[S, N)`` against cached KV is not
    bit-identical to one pass over ``[0, N)`` (a sensitive random model, and kernels whose
    rounding may depend on how many tokens a pass holds), so a cold one-pass run is the
    wrong reference for a prefix hit. ``writers`` replays the passes that produced the
    stored KV (the writer engine's prompts, in order), so the reference holds even where
    a prefix's KV depends on the length of the pass that computed it."""
    if cached_prefix % BLOCK:
        raise ValueError(f"cached_prefix {cached_prefix} is not a multiple of the block size {BLOCK}")
    # Start from an empty prefix cache: another test's prompt may share a head with this one.
    engine.reset_prefix_cache()
    for w in (writers if writers is not None else [prompt[:cached_prefix]] if cached_prefix else []):
        engine.complete(w, 1)
    resp = engine.complete(prompt, max_tokens)
    got = cached_tokens(resp)
    if got != cached_prefix:
        raise AssertionError(f"reference engine had {got} cached tokens, wanted {cached_prefix}: use a fresh prompt")
    return resp["choices"][0]["token_ids"]


def top_logprobs(resp: dict) -> list[dict[int, float]]:
    """The top logprobs of a completion asked with ``logprobs=k, return_tokens_as_token_ids=True``,
    keyed by token id."""
    lp = resp["choices"][0]["logprobs"]["top_logprobs"]
    return [{int(t.split(":", 1)[1]): v for t, v in pos.items()} for pos in lp]


TIE_NATS = 0.1  # bf16 rounding moves this model's logits by a few hundredths


def close_tokens(got: list[int], got_top: list[dict[int, float]], want: list[int],
                 want_top: list[dict[int, float]], tie: float = TIE_NATS) -> bool:
    """For two runs whose batches differ (a loaded server against a lone reference request):
    the greedy ids are equal, or they agree up to a first divergence that is a near tie, where
    each run's token is among the other's top candidates (vLLM's ``check_logprobs_close`` rule)
    and the reference rates the two within ``tie`` nats. Wrong KV moves the distribution itself
    and fails this."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return a in want_top[i] and b in got_top[i] and abs(want_top[i][a] - want_top[i][b]) < tie
    return len(got) == len(want)


def start_proxy(name: str, prefill: str | list[str], decode: str | list[str], timeout: float,
                connect_timeout: float | None = 2.0, host: str = "127.0.0.1", wait_s: float = 60,
                policy: str = "least-outstanding", extra: list[str] | None = None) -> tuple[Proc, str]:
    """``mctier proxy`` on ``host`` in front of ``prefill`` (``URL@BOOTSTRAP_URL``, one or a list)
    and ``decode``, listening within ``wait_s`` seconds: the process and its base URL.

    The default ``least-outstanding`` policy always hands off (the P/D path these tests
    exercise); the ``kv`` policy may serve a request on the decode instance alone
    (``tests/test_router_e2e.py``)."""
    port = free_port(host)
    prefill = [prefill] if isinstance(prefill, str) else prefill
    decode = [decode] if isinstance(decode, str) else decode
    argv = [sys.executable, "-m", "multi.cli", "proxy", "--host", host, "--port", str(port), "--prefill", *prefill,
            "--decode", *decode, "--timeout", str(timeout), "--policy", policy, *(extra or [])]
    if connect_timeout is not None:
        argv += ["--connect-timeout", str(connect_timeout)]
    proc = Proc(name, argv, LOGS / f"{name}-{port}.log", cwd=str(ROOT))
    try:
        proc.wait_port(port, wait_s, host=host)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://{host}:{port}"


KV_HEADS, HEAD_SIZE = 2, 64  # the tiny presets' (multi.cli.models.PRESETS)


def page_bytes(engine: Engine) -> int:
    """One layer's page of one block in the engine's KV cache, for the tiny presets (CPU: K and
    V rows of every KV head)."""
    return 2 * BLOCK * KV_HEADS * HEAD_SIZE * {"float32": 4, "bfloat16": 2, "float16": 2}[engine.dtype]


def cached_tokens(resp: dict) -> int:
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def start_engines(*engines: Engine) -> list[Engine]:
    """Wait for engines started in parallel; stop all of them if any fails."""
    try:
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return list(engines)


OFFLINE_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.load(sys.stdin)
llm = LLM(model=spec["model"], enforce_eager=True, block_size=spec["block"], max_model_len=spec["max_model_len"],
          seed=0, dtype=spec["dtype"], kv_transfer_config=spec.get("kv"))
sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def offline_generate(prompts: list[list[int]], max_tokens: int = 8, core: int = 0,
                     model: str | None = None, kv: dict | None = None, timeout: float = 300) -> list[list[int]]:
    """Greedy token ids from vLLM's offline ``LLM`` in a child process (spawn needs a main guard)."""
    from kvcore.vllm_glue import _cpu_wheel_version  # noqa: F401  (import check: vLLM present)

    spec = {"model": str(model or model_dir("tiny")), "prompts": prompts, "max_tokens": max_tokens,
            "block": BLOCK, "max_model_len": 4096, "kv": kv, "dtype": engine_dtype()}
    env = {**os.environ, **engine_env(core)}
    r = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], input=json.dumps(spec), capture_output=True,
                       text=True, env=env, timeout=timeout, cwd=str(ROOT), start_new_session=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"offline generation failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
