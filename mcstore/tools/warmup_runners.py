"""The engines that compute warmup's KV: a live OpenAI server, or vLLM's offline engine in a
child process (``python -m mcstore.tools.warmup_runners --offline-child``). Both report per prefix
``None`` or an error; the store connector inside the engine does the saving."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import msgspec
import requests

from kvcore.errors import ConfigError
from mcstore.tools.engine import store_extra

_DONE = "MCTIER-WARMUP-DONE"


class Prefix(msgspec.Struct):
    label: str
    tokens: list[int]
    cache_salt: str | None = None


class ServerRunner:
    """A live engine (OpenAI server) whose store connector saves what it prefills."""

    mode = "server"

    def __init__(self, url: str, concurrency: int = 4, timeout: float = 300.0, model_name: str | None = None):
        self.url, self.concurrency, self.timeout = url.rstrip("/"), max(1, concurrency), timeout
        self.model_name = model_name

    def _model(self) -> str:
        if self.model_name is None:
            try:
                r = requests.get(self.url + "/v1/models", timeout=10)
                r.raise_for_status()
                self.model_name = r.json()["data"][0]["id"]
            except (requests.RequestException, KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"warmup: engine {self.url} does not answer /v1/models: {e}") from None
        return self.model_name

    def _one(self, p: Prefix) -> str | None:
        body = {"model": self._model(), "prompt": p.tokens, "max_tokens": 1, "temperature": 0}
        if p.cache_salt:
            body["cache_salt"] = p.cache_salt
        try:
            r = requests.post(self.url + "/v1/completions", json=body, timeout=self.timeout)
        except requests.RequestException as e:
            return f"request failed: {e}"
        return None if r.ok else f"HTTP {r.status_code}: {r.text[:200]}"

    def run(self, prefixes: list[Prefix], progress) -> list[str | None]:
        self._model()
        errors: list[str | None] = [None] * len(prefixes)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futs = {pool.submit(self._one, p): i for i, p in enumerate(prefixes)}
            for f in as_completed(futs):
                errors[futs[f]] = f.result()
                progress.update(1)
        return errors

    def finish(self) -> None:
        pass


class OfflineRunner:
    """vLLM's offline engine in a child process (its own session), kept alive until the
    saves are verified: the worker drops queued saves when it shuts down."""

    mode = "offline"

    def __init__(self, model: str, kv: dict, *, block_size: int, dtype: str, kv_cache_dtype: str, tp: int,
                 max_model_len: int | None, log: str | None = None, env: dict | None = None, timeout: float = 600.0,
                 pp: int = 1, hash_algo: str = "sha256"):
        child_kv = {
            "kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            # A pure client: chunks must land in the store server's pool, not in a segment that
            # disappears with this process.
            "kv_connector_extra_config": {**store_extra(kv), "global_segment_size": 0},
        }
        # Every setting in the key fingerprint, as the key space was derived or published with.
        self.spec = {"model": model, "kv": child_kv, "block_size": block_size, "dtype": dtype,
                     "kv_cache_dtype": kv_cache_dtype, "tp": tp, "pp": pp, "hash_algo": hash_algo,
                     "max_model_len": max_model_len}
        self.log, self.env, self.timeout = log, env, timeout
        self.proc: subprocess.Popen | None = None

    def run(self, prefixes: list[Prefix], progress) -> list[str | None]:
        spec = {**self.spec, "prompts": [[p.tokens, p.cache_salt] for p in prefixes]}
        if spec["max_model_len"] is None:
            spec["max_model_len"] = max(len(p.tokens) for p in prefixes) + 16
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mcstore.tools.warmup_runners", "--offline-child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            env={**os.environ, **(self.env or {})})
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.finish()
                return [f"offline engine gave no result within {self.timeout:.0f}s"] * len(prefixes)
            if line is None:
                rc = self.proc.wait()
                return [f"offline engine exited (rc {rc}); see {self.log or 'its stderr'}"] * len(prefixes)
            if line.startswith(_DONE):
                progress.update(len(prefixes))
                return json.loads(line[len(_DONE):])

    def finish(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None


def _offline_child() -> int:
    spec = json.loads(sys.stdin.readline())
    from kvcore.vllm_glue import install_version_alias

    install_version_alias()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], block_size=spec["block_size"], dtype=spec["dtype"],
              kv_cache_dtype=spec["kv_cache_dtype"], tensor_parallel_size=spec["tp"],
              pipeline_parallel_size=spec["pp"], prefix_caching_hash_algo=spec["hash_algo"], enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0, kv_transfer_config=spec["kv"])
    prompts = [TokensPrompt(prompt_token_ids=t, **({"cache_salt": s} if s else {})) for t, s in spec["prompts"]]
    errors: list[str | None] = [None] * len(prompts)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - reported per prefix to the parent
        errors = [f"offline generate failed: {e}"] * len(prompts)
    print(_DONE + json.dumps(errors), flush=True)
    sys.stdin.readline()  # the parent verified the saves (or gave up)
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--offline-child"]:
    sys.exit(_offline_child())
