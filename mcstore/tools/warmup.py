"""Warmup: store the KV of prefixes that will recur, so the first real request hits
(``mctier warmup``, :mod:`mcstore.tools.warmup_cli`).

Input (``FILE``, ``-`` for stdin):

* text: if the file has a blank line, every blank-line separated paragraph is one
  prefix (newlines inside a paragraph kept); otherwise every non-empty line is.
  Text is tokenized like a completion prompt (special tokens added);
* JSONL (``*.jsonl``/``*.ndjson`` or ``--format jsonl``): one object per line,
  ``{"prompt": str}``, ``{"messages": [...]}`` (rendered with the model's chat
  template, no generation prompt unless ``"add_generation_prompt": true``) or
  ``{"tokens": [...]}``; each may carry ``"cache_salt"``.

Two ways to compute the KV (:mod:`mcstore.tools.warmup_runners`): ``--engine URL``
sends each prefix (as token ids) to a live engine whose store connector saves it
(``max_tokens=1``); without it, an offline vLLM engine in a child process does the same,
with the settings the model's engine published (``--model NAME``) or those given
(``--kv-config`` and the engine flags). Either way the engine's connector writes the
chunks (and dedups them). The tool knows the engine's key space (the one it published,
or derived from its settings: :mod:`mcstore.tools.published`, :mod:`mcstore.tools.engine`)
so that it can

* skip prefixes whose blocks are all stored (re-running is cheap),
* wait until the engine's asynchronous saves landed and verify the hit depth (the engine's
  own lookup, :mod:`mcstore.lookup`: whole chunks, then the full blocks past the last one,
  which the engine saves as a part object),
* publish ``{prefix}/{fp16}/meta`` (the key space, for ``mctier inspect``).

Pinning (``--pin soft|hard``, ``--pin-ttl``, ``--replicas``): the store tier
saves with the engine-wide replicate config, so the tool re-writes each chunk of
the prefix with the requested one through its own store client: read the bytes, remove
the object once no reader holds a lease on it (never forced: a reader in flight
keeps it), put it back with the pin. During that short window an engine lookup
misses the chunk and recomputes. Mooncake's ``upsert`` keeps the old pin state,
hence remove + put.

Exit status: 0 when every prefix is fully stored (and pinned if asked), 1 otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgspec

from kvcore.errors import is_leased, is_no_space, is_not_found
from kvcore.log import get_logger
from mcstore.client import StoreClient, replicate_config
from mcstore.keys import EngineMeta, KeySpace, meta_key
from mcstore.lookup import Probe, Reach, reach
from mcstore.tools.engine import Renderer
from mcstore.tools.warmup_runners import OfflineRunner, Prefix, ServerRunner

__all__ = ["OfflineRunner", "Prefix", "PrefixResult", "ServerRunner", "WarmupReport", "read_prefixes", "repin",
           "split_text", "warmup"]

logger = get_logger("mcstore.tools.warmup")

_REPIN_BATCH_BYTES = 64 << 20


class PrefixResult(msgspec.Struct, kw_only=True):
    index: int
    label: str
    tokens: int
    chunks: int
    present_before: int
    stored: int
    pinned: int
    hit_tokens: int
    status: str  # ok | present | failed
    error: str | None = None


class WarmupReport(msgspec.Struct, kw_only=True):
    fingerprint: str
    chunk_tokens: int
    mode: str
    seconds: float
    failed: int
    prefixes: list[PrefixResult]


# -- input ---------------------------------------------------------------------------------


def _label(text: str) -> str:
    one = " ".join(text.split())
    return one if len(one) <= 40 else one[:37] + "..."


def split_text(text: str) -> list[str]:
    """Blank-line separated paragraphs if the text has a blank line, else non-empty lines."""
    lines = text.splitlines()
    if any(not ln.strip() for ln in lines[1:-1]) or "\n\n" in text.strip("\n"):
        paras, cur = [], []
        for ln in lines:
            if ln.strip():
                cur.append(ln)
            elif cur:
                paras.append("\n".join(cur))
                cur = []
        if cur:
            paras.append("\n".join(cur))
        return paras
    return [ln for ln in lines if ln.strip()]


def read_prefixes(path: str, renderer: Renderer, fmt: str = "auto") -> list[Prefix]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".ndjson")) else "text"
    if fmt == "text":
        return [Prefix(_label(p), renderer.text(p)) for p in split_text(text)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected an object")
        salt = obj.get("cache_salt")
        if isinstance(obj.get("prompt"), str):
            out.append(Prefix(_label(obj["prompt"]), renderer.text(obj["prompt"]), salt))
        elif isinstance(obj.get("messages"), list):
            toks = renderer.messages(obj["messages"], bool(obj.get("add_generation_prompt", False)))
            first = next((m.get("content") for m in obj["messages"] if isinstance(m, dict)), "")
            out.append(Prefix(_label(f"[chat] {first}"), toks, salt))
        elif isinstance(obj.get("tokens"), list) and all(isinstance(t, int) and t >= 0 for t in obj["tokens"]):
            out.append(Prefix(f"[{len(obj['tokens'])} token ids]", obj["tokens"], salt))
        else:
            raise ValueError(f"{path}:{n}: expected \"prompt\" (string), \"messages\" (list) or \"tokens\" (ids)")
    return out


# -- the warmup ---------------------------------------------------------------------------------


def _present(client, ks: KeySpace, links: list[str]) -> list[bool]:
    rcs = client.exists(ks.all_rank_keys(links))
    n = ks.parts  # every TP rank of every pipeline stage
    return [all(rc == 1 for rc in rcs[i * n:(i + 1) * n]) for i in range(len(links))]


def _reach(client, ks: KeySpace, p: Prefix) -> Reach:
    return reach(client, Probe(ks, ks.hashes(p.tokens, cache_salt=p.cache_salt), len(p.tokens)))


def _target(meta: EngineMeta, ks: KeySpace, p: Prefix) -> int:
    """The tokens the engine stores of a prefix: its full blocks (whole chunks only where a
    key space has no finer block or the engine keeps whole chunks only)."""
    unit = ks.block_tokens if meta.partial_hits else ks.chunk_tokens
    return len(p.tokens) // unit * unit


def repin(client: StoreClient, keys: list[str], rc, lease_wait_s: float) -> dict[str, str | None]:
    """Re-write ``keys`` with replicate config ``rc``; per key None or why it failed."""
    import numpy as np

    out: dict[str, str | None] = {}
    sizes = dict(zip(keys, client.sizes(keys)))
    for k, s in sizes.items():
        if s <= 0:
            out[k] = f"get_size {s}"
    todo = [k for k in keys if sizes[k] > 0]
    while todo:
        batch, total = [], 0
        while todo and (not batch or total + sizes[todo[0]] <= _REPIN_BATCH_BYTES):
            batch.append(todo.pop(0))
            total += sizes[batch[-1]]
        buf = np.empty(total, dtype=np.uint8)
        base = buf.ctypes.data
        client.register(base, total)
        try:
            ptrs, off = [], 0
            for k in batch:
                ptrs.append(base + off)
                off += sizes[k]
            got = client.get_many(batch, ptrs, [sizes[k] for k in batch])
            held = []
            for k, p, g in zip(batch, ptrs, got):
                if g == sizes[k]:
                    held.append((k, p))
                else:
                    out[k] = f"read {g}"
            # Never forced: an engine reading the object holds a lease; wait it out.
            removable = {k for k, _ in held}
            pending, deadline = sorted(removable), time.monotonic() + lease_wait_s
            while pending:
                leased = []
                for k, r in zip(pending, client.remove(pending, force=False)):
                    if is_leased(r):
                        leased.append(k)
                    elif r != 0 and not is_not_found(r):
                        out[k] = f"remove {r}"
                        removable.discard(k)
                pending = leased
                if pending and time.monotonic() > deadline:
                    for k in pending:
                        out[k] = "still leased (being read); not re-pinned"
                        removable.discard(k)
                    break
                if pending:
                    time.sleep(0.2)
            to_put = [(k, p) for k, p in held if k in removable]
            deadline = time.monotonic() + 5.0
            while to_put:
                rcs = client.put_many([k for k, _ in to_put], [p for _, p in to_put], [sizes[k] for k, _ in to_put],
                                      replicate=rc)
                retry = []
                for (k, p), r in zip(to_put, rcs):
                    if r == 0:
                        out[k] = None
                    elif is_no_space(r) and time.monotonic() < deadline:  # eviction catches up
                        retry.append((k, p))
                    else:
                        out[k] = f"put {r} (chunk lost; warm up again)"
                to_put = retry
                if to_put:
                    time.sleep(0.05)
        finally:
            client.unregister(base)
    return out


def warmup(prefixes: list[Prefix], meta: EngineMeta, master: str, runner, *, pin: str | None = None,
           pin_ttl_ms: int | None = None, replicas: int = 1, verify_timeout: float = 30.0,
           lease_wait_s: float = 12.0, progress: bool = True, client: StoreClient | None = None) -> WarmupReport:
    """Warm ``prefixes`` through ``runner`` into the store at ``master`` (through ``client``
    if given, else a client of its own) under ``meta``'s key space, which it also publishes."""
    from tqdm import tqdm

    t0 = time.monotonic()
    ks = meta.key_space()
    own = client is None
    client = client if client is not None else StoreClient.for_tool(master, "warmup")
    try:
        client.upsert(meta_key(ks), msgspec.json.encode(meta), replicate_config(hard_pin=True))
        links = [ks.links(p.tokens, cache_salt=p.cache_salt) for p in prefixes]
        targets = [_target(meta, ks, p) for p in prefixes]
        results = []
        for i, (p, ls) in enumerate(zip(prefixes, links)):
            before = sum(_present(client, ks, ls)) if ls else 0
            results.append(PrefixResult(index=i, label=p.label, tokens=len(p.tokens), chunks=len(ls),
                                        present_before=before, stored=0, pinned=0, hit_tokens=0, status="pending"))
        todo = [i for i, r in enumerate(results) if targets[i] and (
            r.present_before < r.chunks or _reach(client, ks, prefixes[i]).tokens < targets[i])]
        for i, r in enumerate(results):
            if not targets[i]:
                r.status, r.error = "failed", (f"shorter than one {ks.chunk_tokens}-token chunk and one "
                                               f"{ks.block_tokens}-token block: nothing to store")
        bar = tqdm(total=len(todo), desc="warmup", unit="prefix", disable=not progress or not todo, file=sys.stderr)
        try:
            errors = runner.run([prefixes[i] for i in todo], bar) if todo else []
            for i, e in zip(todo, errors):
                if e:
                    results[i].status, results[i].error = "failed", e
            # Saves are asynchronous: wait until every chunk of the prefixes sent landed.
            waiting = [i for i in todo if results[i].status == "pending"]
            deadline = time.monotonic() + verify_timeout
            bar.set_postfix_str("verifying")
            while waiting:
                waiting = [i for i in waiting if _reach(client, ks, prefixes[i]).tokens < targets[i]]
                if not waiting or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            runner.finish()
            bar.close()
        if pin or replicas > 1:
            rc = replicate_config(replicas=replicas, hard_pin=pin == "hard", soft_pin=pin == "soft",
                                  soft_pin_ttl_ms=pin_ttl_ms)
            keys = []
            for i, r in enumerate(results):
                if r.status != "failed":
                    keys += [k for link, ok in zip(links[i], _present(client, ks, links[i])) if ok
                             for k in ks.all_rank_keys([link])]
                    part = _reach(client, ks, prefixes[i]).partial  # the tail past the whole chunks
                    if part is not None:
                        keys += ks.all_rank_keys([part.link])
            outcome = repin(client, list(dict.fromkeys(keys)), rc, lease_wait_s)
        else:
            outcome = {}
        for i, r in enumerate(results):
            if r.status == "failed":
                continue
            ok = _present(client, ks, links[i])
            r.hit_tokens = _reach(client, ks, prefixes[i]).tokens
            r.stored = max(0, sum(ok) - r.present_before) if i in todo else 0
            if pin or replicas > 1:
                r.pinned = sum(all(outcome.get(k, "missing") is None for k in ks.all_rank_keys([link]))
                               for link in links[i])
            bad = [outcome.get(k, "missing") for k in ks.all_rank_keys(links[i]) if outcome.get(k, "missing")]
            if r.hit_tokens < targets[i]:
                r.status = "failed"
                r.error = (f"only {r.hit_tokens} of {targets[i]} tokens stored after "
                           f"{verify_timeout:.0f}s: the engine saved elsewhere or not at all (check that it "
                           f"uses master {master}, that --model/--block-size/--dtype match its settings "
                           f"(fingerprint {ks.fp[:16]}, see `mctier inspect summary`), and its "
                           f"save failures in /metrics)")
            elif (pin or replicas > 1) and bad:
                r.status, r.error = "failed", f"re-pin: {bad[0]}"
            else:
                r.status = "ok" if i in todo else "present"
    finally:
        if own:
            client.close()
    return WarmupReport(fingerprint=ks.fp[:16], chunk_tokens=ks.chunk_tokens, mode=runner.mode,
                        seconds=round(time.monotonic() - t0, 2),
                        failed=sum(r.status == "failed" for r in results), prefixes=results)
