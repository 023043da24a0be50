"""This machine's engine speeds for the cluster simulator (``bench/sim``), measured on live
engines by ``bench/trace_replay.py``: the prefill and decode fits, the host contention
between two engines, the router's overhead, a handoff's fixed cost (docstring of
``bench/trace_replay.py``)."""

from __future__ import annotations

import math
import random
import statistics
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.client import ids, stream

CHUNK = 2048  # --max-num-batched-tokens: one prefill step per chunk


def fit(xs: list[list[float]], ys: list[float], names: tuple[str, ...]) -> dict:
    x, y = np.array(xs, float), np.array(ys, float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return {**{n: float(c) for n, c in zip(names, coef)},
            "rms_error_s": float(np.sqrt(np.mean((x @ coef - y) ** 2))), "samples": len(ys)}


def prefill_speeds(url: str, quick: bool, rng: random.Random) -> dict:
    """TTFT of max_tokens=1 streams: fresh prompts, then suffixes after a sent prefix."""
    def ttft(prompt: list[int]) -> tuple[int, int, float]:
        r = stream(url, prompt, max_tokens=1)
        return len(prompt) - r.cached, r.cached, r.ttft

    lengths = (128, 512, 1024, 2048, 3072)
    for n in lengths:  # untimed: a shape's first pass is slower
        ttft(ids(n, rng))
    pts = [ttft(ids(n, rng)) for _ in range(1 if quick else 2) for n in lengths]
    for c, n in ((1024, 256), (2048, 512)) if quick else ((1024, 256), (1024, 1024), (2048, 512), (3072, 1024)):
        prefix = ids(c, rng)
        pts += [ttft(prefix), ttft(prefix + ids(n, rng))]  # the prefix is a fresh sample too
    xs = [[math.ceil(n / CHUNK), n, n * (c + n / 2)] for n, c, _ in pts]
    return {**fit(xs, [t for *_, t in pts], ("step_s", "token_s", "attn_s")), "chunk_tokens": CHUNK,
            "points": [{"new": n, "cached": c, "ttft_s": round(t, 4)} for n, c, t in pts]}


def decode_speeds(url: str, quick: bool, rng: random.Random) -> dict:
    """Mean TPOT of b streams started together."""
    out_tokens = 32 if quick else 64

    def tpot(b: int) -> float:
        with ThreadPoolExecutor(b) as ex:
            rs = list(ex.map(lambda p: stream(url, p, max_tokens=out_tokens), [ids(256, rng) for _ in range(b)]))
        return sum((r.total - r.ttft) / (len(r.token_ids) - 1) for r in rs) / b

    tpot(8)  # untimed: a batch shape's first steps are slower
    pts = [{"b": b, "tpot_s": round(tpot(b), 5)} for _ in range(1 if quick else 2) for b in (1, 2, 4, 8)]
    return {**fit([[1, p["b"]] for p in pts], [p["tpot_s"] for p in pts], ("step_s", "per_seq_s")),
            "prompt_tokens": 256, "output_tokens": out_tokens, "points": pts}


def overhead(router_url: str, engine_url: str, rng: random.Random, n: int = 6) -> float:
    """What the router's path adds to a request (HTTP hop, tokenization, the store lookup):
    median TTFT of fresh 64-token prompts (one token out) through the router minus
    straight to ``engine_url``, alternating, on idle engines."""
    via, direct = [], []
    for _ in range(n):
        via.append(stream(router_url, ids(64, rng), max_tokens=1).ttft)
        direct.append(stream(engine_url, ids(64, rng), max_tokens=1).ttft)
    return max(0.0, statistics.median(via) - statistics.median(direct))


def contention(urls: list[str], rng: random.Random, n: int = 3) -> dict:
    """How much slower engine 0 prefills while engine 1 prefills too (their API servers and
    engine cores are not pinned, so two busy engines share more than their own cores): TTFT
    of a fresh 2,048-token prompt on engine 0 alone, and sent at the same moment as one to
    engine 1; ``factor`` = median(together) / median(alone) - 1."""
    alone, together = [], []
    for _ in range(n):
        alone.append(stream(urls[0], ids(2048, rng), max_tokens=1).ttft)
        with ThreadPoolExecutor(2) as ex:
            a, _ = ex.map(lambda u: stream(u, ids(2048, rng), max_tokens=1), urls[:2])
        together.append(a.ttft)
    return {"factor": max(0.0, statistics.median(together) / statistics.median(alone) - 1),
            "alone_s": alone, "together_s": together}


def handoff_overhead(log: list[dict], bpt: int, gbps: float | None) -> dict:
    """What a handoff costs beyond moving its bytes, from the router's decision log of the
    idle probe's handoffs (each alone; the decode instance held nothing of the prompt):
    ``ttft_s - prefill_s`` is the time from the prefill's answer to the decode's first token
    (bootstrap query, the pull, the acknowledgement, the decode engine noticing the pulled
    request and computing its last token); less ``(n - 1) * bpt / gbps`` it is the fixed
    part, whose median is ``overhead_s``. The Transfer Engine's own phases on ``/metrics``
    (``latency_s``) see only the query and acknowledgement inside it."""
    gaps = [(x["n"], x["ttft_s"] - x["prefill_s"]) for x in log
            if x.get("kind") == "pd" and x.get("ttft_s") is not None and x.get("prefill_s") is not None]
    fixed = [g - (n - 1) * bpt / (gbps * 1e9) for n, g in gaps] if gbps else []
    return {"gaps": [{"n": n, "gap_s": round(g, 5)} for n, g in gaps],
            "overhead_s": statistics.median(fixed) if fixed else None}
