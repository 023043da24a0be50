"""The benchmarks' HTTP client: one streamed completion, timed, with its greedy token ids.

Token ids come from vLLM's ``return_token_ids``; the cached-token count (local
prefix cache plus connector hits) from the usage chunk, which needs the server's
``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import requests

TIMEOUT_S = 600.0
MODEL_NAME = "demo"  # --served-model-name of every bench engine


@dataclass
class Completion:
    ttft: float
    total: float
    token_ids: list[int] = field(default_factory=list)
    cached: int = 0
    prompt_tokens: int = 0


async def sse_events(session, url: str, body: dict):
    """The JSON events of one streamed ``/v1/completions`` on an ``aiohttp`` session (the
    async benchmarks' client); an HTTP error status or an error event raises."""
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("error"):
                raise RuntimeError(f"stream error: {ev['error']}")
            yield ev


def ids(n: int, rng: random.Random) -> list[int]:
    """``n`` random token ids of the bench model's vocabulary (no specials)."""
    return [rng.randrange(4, 2048) for _ in range(n)]


def stream(url: str, prompt: list[int], max_tokens: int = 8, kv: dict | None = None) -> Completion:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if kv:
        body["kv_transfer_params"] = kv
    t0 = time.monotonic()
    ttft = None
    out = Completion(0.0, 0.0)
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if ttft is None:
                    ttft = time.monotonic() - t0
                out.token_ids += choice.get("token_ids") or []
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                out.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if ttft is None:
        raise RuntimeError(f"{url}: no token streamed")
    out.ttft, out.total = ttft, time.monotonic() - t0
    return out


def complete(url: str, prompt: list[int], max_tokens: int = 1, kv: dict | None = None) -> dict:
    """A plain (non-streamed) completion, e.g. a prefill-only request that makes an engine store a
    prefix; ``kv``: its ``kv_transfer_params`` (a composite's answer carries its plan there)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if kv:
        body["kv_transfer_params"] = kv
    r = requests.post(url + "/v1/completions", timeout=TIMEOUT_S, json=body)
    r.raise_for_status()
    return r.json()


def reset_prefix_cache(url: str, deadline_s: float = 30.0, external: bool = False) -> None:
    """Empty an engine's local prefix cache (vLLM's dev-mode ``POST /reset_prefix_cache``; the
    engine runs with ``VLLM_SERVER_DEV_MODE=1``), with ``external`` its connector's too
    (``?reset_external=true``: vLLM's ``reset_cache`` hook). vLLM refuses while blocks are still
    held (a finishing request, a store save still reading them) or when the connector's reset
    fails, so this retries until ``deadline_s``, then raises ``TimeoutError``. The benchmarks'
    and the tests' engines (``tests/harness.py``) both reset through here."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r = requests.post(url + "/reset_prefix_cache", params={"reset_external": "true"} if external else None,
                          timeout=10)
        r.raise_for_status()
        if r.json().get("success"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url}: prefix cache not reset within {deadline_s:.0f} s (blocks still held)")
