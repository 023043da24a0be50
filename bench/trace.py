"""Mooncake's published request traces (FAST'25 format): load, cut a window, scale, write.

    .venv/bin/python -m bench.trace stats [--trace conversation|synthetic|FILE]
    .venv/bin/python -m bench.trace scale --trace conversation --sample 80 --len-factor 8 \\
        --out-factor 8 --time-factor 0.1 [--start S --count C] --out /tmp/window.jsonl

A line is ``{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]}``;
``hash_ids`` are the prompt's blocks of ``block`` tokens (512 in the published files), so
two requests that share their first ``k`` ids share their first ``k * block`` tokens. In
both published files every request has exactly ``ceil(N / block)`` ids.

A contiguous window of the conversation trace shares little (150 requests: 3 to 8% of
input tokens reusable, against 37% over the hour): its conversations' turns are minutes
apart. So the scaler first samples whole sharing groups: it keeps every request whose
first ``depth`` ids (2: every request of the conversation trace starts with the same
block, a system prompt; the second id starts its conversation) hash into one of
``every`` buckets (crc32, stable across runs). One in 40 groups keeps 303 requests
with 41% reusable. Then it keeps the sharing structure and divides everything else by
stated factors:

- every hash id stays one block, of ``block' = block / len_factor`` tokens, and the ids
  keep their order (renumbered densely from 0 in order of first appearance, so a window
  reads like a trace of its own): which requests share how many leading blocks, and in
  what order they arrive, is exactly the original's;
- ``N' = ceil(N / len_factor)``, which stays within the same number of blocks
  (``(k-1) * block < N <= k * block`` implies the same for ``N'`` and ``block'``), so the
  reusable fraction of each request changes only by that rounding;
- ``M' = max(1, round(M / out_factor))``;
- arrival times are shifted to start at 0 and multiplied by ``time_factor`` (the
  arrival rate divided by it; with sampling one in ``every`` groups, the rate is the
  original's divided by ``every * time_factor``).

vLLM's client replays a scaled file with ``vllm bench serve --dataset-name timed_trace
--dataset-path FILE --timed-trace-chunk-hash-size BLOCK' --timed-trace-sec-multiplier
0.001``: it draws each block's tokens from the hash id (the same id, the same tokens),
so the shared prefixes are real shared tokens. ``block'`` should be a multiple of the
engines' block size (32 here), or a shared block is not a cacheable one.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

# The published files, xz-compressed, with their README (source and licence).
DATA = Path(__file__).resolve().parent / "data" / "mooncake-traces"
TRACES = {"conversation": "conversation_trace.jsonl.xz", "synthetic": "synthetic_trace.jsonl.xz"}
BLOCK = 512  # tokens per hash id in the published files


@dataclass(frozen=True)
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_path(name: str) -> Path:
    """A published trace by name (``conversation``, ``synthetic``) or any file path."""
    if name in TRACES:
        return DATA / TRACES[name]
    p = Path(name)
    if not p.exists():
        raise FileNotFoundError(f"no trace {name!r}: give one of {', '.join(TRACES)} or a file path")
    return p


def load(name: str, limit: int | None = None) -> list[Request]:
    out = []
    path = trace_path(name)
    with (lzma.open(path, "rt") if path.suffix == ".xz" else open(path)) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                out.append(Request(float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                                   tuple(r["hash_ids"])))
    return out


def write(reqs: list[Request], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.timestamp_ms, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def common_blocks(a: Request, b: Request) -> int:
    """Leading blocks two requests share."""
    k = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        k += 1
    return k


def reusable_tokens(reqs: list[Request], block: int) -> list[int]:
    """Per request, the tokens an unbounded cache could give it: its leading blocks whose ids
    appeared in any earlier request, times ``block``, capped at ``N - 1`` (the last token is
    always computed; the published README caps at ``N`` instead)."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        out.append(min(k * block, r.input_length - 1))
        seen.update(r.hash_ids)
    return out


def ideal_reuse(reqs: list[Request], block: int) -> float:
    """Fraction of all input tokens an unbounded cache saves (:func:`reusable_tokens`)."""
    total = sum(r.input_length for r in reqs)
    return sum(reusable_tokens(reqs, block)) / total if total else 0.0


def window(reqs: list[Request], start: int = 0, count: int | None = None) -> list[Request]:
    """Requests ``[start, start + count)`` in arrival order."""
    if start < 0 or start >= len(reqs):
        raise ValueError(f"start {start} outside the trace's {len(reqs)} requests")
    return reqs[start:] if count is None else reqs[start:start + count]


def sample(reqs: list[Request], every: int, depth: int = 2, bucket: int = 0) -> list[Request]:
    """The requests of one in ``every`` sharing groups, a group being the requests with the
    same first ``depth`` hash ids (module docstring); ``bucket`` picks which one."""
    if every < 1 or not 0 <= bucket < every:
        raise ValueError(f"need every >= 1 and 0 <= bucket < every, got {every}, {bucket}")
    return [r for r in reqs if zlib.crc32(repr(r.hash_ids[:depth]).encode()) % every == bucket]


def scale(reqs: list[Request], *, len_factor: int = 1, out_factor: float = 1.0, time_factor: float = 1.0,
          block: int = BLOCK) -> list[Request]:
    """The scaled requests (module docstring); their block size is ``block // len_factor``."""
    if len_factor < 1 or block % len_factor:
        raise ValueError(f"len_factor must divide the block size {block}, got {len_factor}")
    if out_factor <= 0 or time_factor <= 0:
        raise ValueError("out_factor and time_factor must be > 0")
    if not reqs:
        return []
    t0 = reqs[0].timestamp_ms
    ids: dict[int, int] = {}
    out = []
    for r in reqs:
        nb = len(r.hash_ids)
        if not (nb - 1) * block < r.input_length <= nb * block:
            raise ValueError(f"request at {r.timestamp_ms} ms: {r.input_length} tokens in {nb} blocks "
                             f"of {block}: not the published format")
        new = tuple(ids.setdefault(h, len(ids)) for h in r.hash_ids)
        out.append(replace(r, timestamp_ms=(r.timestamp_ms - t0) * time_factor,
                           input_length=math.ceil(r.input_length / len_factor),
                           output_length=max(1, round(r.output_length / out_factor)), hash_ids=new))
    return out


def describe(reqs: list[Request], block: int) -> dict:
    n = len(reqs)
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1e3 if n > 1 else 0.0
    return {"requests": n, "span_s": round(span, 3), "rate_per_s": round(n / span, 4) if span else None,
            "avg_input": round(sum(r.input_length for r in reqs) / n, 1) if n else 0,
            "avg_output": round(sum(r.output_length for r in reqs) / n, 1) if n else 0,
            "block": block, "ideal_reuse": round(ideal_reuse(reqs, block), 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stats", help="requests, span, rate, mean lengths, ideal reuse")
    st.add_argument("--trace", default="conversation")
    st.add_argument("--block", type=int, default=BLOCK)
    sc = sub.add_parser("scale", help="cut a window and scale it (module docstring)")
    sc.add_argument("--trace", default="conversation")
    sc.add_argument("--sample", type=int, default=1, help="keep one in SAMPLE sharing groups")
    sc.add_argument("--depth", type=int, default=2, help="leading ids that name a sharing group")
    sc.add_argument("--start", type=int, default=0)
    sc.add_argument("--count", type=int, default=None)
    sc.add_argument("--len-factor", type=int, default=8)
    sc.add_argument("--out-factor", type=float, default=8.0)
    sc.add_argument("--time-factor", type=float, default=1.0, help="multiplies every arrival time")
    sc.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "stats":
        print(json.dumps(describe(load(a.trace), a.block)))
        return
    reqs = scale(window(sample(load(a.trace), a.sample, a.depth), a.start, a.count), len_factor=a.len_factor,
                 out_factor=a.out_factor, time_factor=a.time_factor)
    write(reqs, a.out)
    print(json.dumps({**describe(reqs, BLOCK // a.len_factor), "out": a.out}))


if __name__ == "__main__":
    main()
