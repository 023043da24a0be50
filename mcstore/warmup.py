"""``mctier warmup``: store the KV of prefixes that will recur, so the first real request hits.

Input (``FILE``, ``-`` for stdin):

* text: if the file has a blank line, every blank-line separated paragraph is one
  prefix (newlines inside a paragraph kept); otherwise every non-empty line is.
  Text is tokenized like a completion prompt (special tokens added);
* JSONL (``*.jsonl``/``*.ndjson`` or ``--format jsonl``): one object per line,
  ``{"prompt": str}``, ``{"messages": [...]}`` (rendered with the model's chat
  template, no generation prompt unless ``"add_generation_prompt": true``) or
  ``{"tokens": [...]}``; each may carry ``"cache_salt"``.

Two ways to compute the KV: ``--server URL`` sends each prefix (as token ids) to a
live engine whose store connector saves it (``max_tokens=1``); without it, an
offline vLLM engine in a child process does the same against the store named in
``--kv-config``. Either way the engine's connector writes the chunks (and dedups
them). The tool derives the engine's key space from ``--model``/``--kv-config``
and the engine flags (:mod:`mcstore.toolkeys`) so that it can

* skip prefixes whose chunks are all present (re-running is cheap),
* wait until the engine's asynchronous saves landed and verify the hit depth,
* publish ``{prefix}/{fp16}/meta`` (the key space, for ``mctier inspect``).

Pinning (``--pin soft|hard``, ``--pin-ttl``, ``--replicas``): the store tier
saves with the engine-wide replicate config, so the tool re-writes each chunk of
the prefix with the requested one through its own client: read the bytes, remove
the object once no reader holds a lease on it (never forced: a reader in flight
keeps it), put it back with the pin. During that short window an engine lookup
misses the chunk and recomputes. Mooncake's ``upsert`` keeps the old pin state,
hence remove + put.

Exit status: 0 when every prefix is fully stored (and pinned if asked), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec

from kvcore.errors import ConfigError
from kvcore.log import get_logger
from mcstore.keys import KeySpace
from mcstore.toolkeys import EngineMeta, Renderer, add_engine_args, meta_key, read_kv_config, store_config
from mcstore.warmup_runners import OfflineRunner, Prefix, ServerRunner

logger = get_logger("mcstore.warmup")

_NO_SPACE, _LEASED, _NOT_FOUND = -200, -706, -704
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
    tp = ks.tp_size
    return [all(rc == 1 for rc in rcs[i * tp:(i + 1) * tp]) for i in range(len(links))]


def replicate_config(pin: str | None, pin_ttl_ms: int | None, replicas: int):
    from mooncake.store import ReplicateConfig, SoftPinAction

    rc = ReplicateConfig()
    rc.replica_num = replicas
    if pin == "hard":
        rc.with_hard_pin = True
    elif pin == "soft":
        rc.soft_pin_action = SoftPinAction.ENABLE
        if pin_ttl_ms is not None:
            rc.soft_pin_ttl_ms = pin_ttl_ms
    return rc


def repin(client, keys: list[str], rc, lease_wait_s: float) -> dict[str, str | None]:
    """Re-write ``keys`` with replicate config ``rc``; per key None or why it failed."""
    import numpy as np

    store = client.store
    out: dict[str, str | None] = {}
    sizes = {k: store.get_size(k) for k in keys}
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
        store.register_buffer(base, total)
        try:
            ptrs, off = [], 0
            for k in batch:
                ptrs.append(base + off)
                off += sizes[k]
            got = list(store.batch_get_into(batch, ptrs, [sizes[k] for k in batch]))
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
                rcs = list(store.batch_remove(pending, False))
                leased = []
                for k, r in zip(pending, rcs):
                    if r == _LEASED:
                        leased.append(k)
                    elif r not in (0, _NOT_FOUND):
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
                rcs = list(store.batch_put_from([k for k, _ in to_put], [p for _, p in to_put],
                                                [sizes[k] for k, _ in to_put], rc))
                retry = []
                for (k, p), r in zip(to_put, rcs):
                    if r == 0:
                        out[k] = None
                    elif r == _NO_SPACE and time.monotonic() < deadline:
                        retry.append((k, p))
                    else:
                        out[k] = f"put {r} (chunk lost; warm up again)"
                to_put = retry
                if to_put:
                    time.sleep(0.05)
        finally:
            store.unregister_buffer(base)
    return out


def warmup(prefixes: list[Prefix], meta: EngineMeta, master: str, runner, *, pin: str | None = None,
           pin_ttl_ms: int | None = None, replicas: int = 1, verify_timeout: float = 30.0,
           lease_wait_s: float = 12.0, progress: bool = True) -> WarmupReport:
    from tqdm import tqdm

    from mcstore.client import StoreClient
    from mcstore.config import StoreConfig

    t0 = time.monotonic()
    ks = meta.key_space()
    client = StoreClient(StoreConfig(master=master, local_buffer_size="4MB"), "warmup", segment=False)
    try:
        client.store.upsert(meta_key(ks), msgspec.json.encode(meta))
        links = [ks.links(p.tokens, cache_salt=p.cache_salt) for p in prefixes]
        results = []
        for i, (p, ls) in enumerate(zip(prefixes, links)):
            before = sum(_present(client, ks, ls)) if ls else 0
            results.append(PrefixResult(index=i, label=p.label, tokens=len(p.tokens), chunks=len(ls),
                                        present_before=before, stored=0, pinned=0, hit_tokens=0, status="pending"))
        todo = [i for i, r in enumerate(results) if r.chunks and r.present_before < r.chunks]
        for r in results:
            if not r.chunks:
                r.status, r.error = "failed", f"shorter than one {ks.chunk_tokens}-token chunk: nothing to store"
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
                waiting = [i for i in waiting if not all(_present(client, ks, links[i]))]
                if not waiting or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            runner.finish()
            bar.close()
        if pin or replicas > 1:
            rc = replicate_config(pin, pin_ttl_ms, replicas)
            keys = []
            for i, r in enumerate(results):
                if r.status != "failed":
                    keys += [k for link, ok in zip(links[i], _present(client, ks, links[i])) if ok
                             for k in ks.all_rank_keys([link])]
            outcome = repin(client, list(dict.fromkeys(keys)), rc, lease_wait_s)
        else:
            outcome = {}
        for i, r in enumerate(results):
            if r.status == "failed":
                continue
            ok = _present(client, ks, links[i])
            r.hit_tokens = (ok.index(False) if False in ok else len(ok)) * ks.chunk_tokens
            r.stored = max(0, sum(ok) - r.present_before) if i in todo else 0
            if pin or replicas > 1:
                r.pinned = sum(all(outcome.get(k, "missing") is None for k in ks.all_rank_keys([link]))
                               for link in links[i])
            bad = [outcome.get(k, "missing") for k in ks.all_rank_keys(links[i]) if outcome.get(k, "missing")]
            if r.hit_tokens < r.chunks * ks.chunk_tokens:
                r.status = "failed"
                r.error = (f"only {r.hit_tokens} of {r.chunks * ks.chunk_tokens} tokens stored after "
                           f"{verify_timeout:.0f}s: the engine saved elsewhere or not at all (check that it "
                           f"uses master {master}, that --model/--block-size/--dtype match its settings "
                           f"(tool fingerprint {ks.fp[:16]}, see `mctier inspect summary`), and its "
                           f"save failures in /metrics)")
            elif (pin or replicas > 1) and bad:
                r.status, r.error = "failed", f"re-pin: {bad[0]}"
            else:
                r.status = "ok" if i in todo else "present"
    finally:
        client.close()
    return WarmupReport(fingerprint=ks.fp[:16], chunk_tokens=ks.chunk_tokens, mode=runner.mode,
                        seconds=round(time.monotonic() - t0, 2),
                        failed=sum(r.status == "failed" for r in results), prefixes=results)


# -- CLI --------------------------------------------------------------------------------------


def render(rep: WarmupReport) -> str:
    from mcstore.inspect_cli import table

    rows = [[r.index, r.label, r.tokens, r.chunks, r.present_before, r.stored, r.pinned, r.hit_tokens,
             r.status if not r.error else f"{r.status}: {r.error}"] for r in rep.prefixes]
    head = ["#", "prefix", "tokens", "chunks", "present before", "stored", "pinned", "hit tokens", "status"]
    return (table(head, rows) + f"\n{len(rep.prefixes)} prefixes, {rep.failed} failed, fingerprint "
            f"{rep.fingerprint}, {rep.chunk_tokens}-token chunks, {rep.mode} mode, {rep.seconds:.1f}s")


def _cmd(a, rest) -> int:
    from mcstore.toolkeys import derive_meta

    if a.pin_ttl is not None and a.pin != "soft":
        print("mctier warmup: --pin-ttl needs --pin soft", file=sys.stderr)
        return 2
    if a.replicas < 1 or a.concurrency < 1:
        print("mctier warmup: --replicas and --concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        kv = read_kv_config(a.kv_config)
        master = a.master or store_config(kv).master
        renderer = Renderer(a.model)
        prefixes = read_prefixes(a.file, renderer, a.format)
        if not prefixes:
            raise ValueError(f"{a.file}: no prefixes")
        meta = derive_meta(a.model, kv, block_size=a.block_size, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
                           tensor_parallel_size=a.tensor_parallel_size)
        if a.server:
            runner = ServerRunner(a.server, a.concurrency)
        else:
            runner = OfflineRunner(a.model, kv, block_size=a.block_size, dtype=a.dtype,
                                   kv_cache_dtype=a.kv_cache_dtype, tp=a.tensor_parallel_size,
                                   max_model_len=a.max_model_len, log=a.engine_log)
        rep = warmup(prefixes, meta, master, runner, pin=a.pin, pin_ttl_ms=a.pin_ttl, replicas=a.replicas,
                     verify_timeout=a.verify_timeout, lease_wait_s=a.lease_wait, progress=not a.no_progress)
    except (ConfigError, ValueError, OSError) as e:
        print(f"mctier warmup: {e}", file=sys.stderr)
        return 2
    print(msgspec.json.encode(rep).decode() if a.json else render(rep))
    return 1 if rep.failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("warmup", help="pre-compute and store the KV of recurring prefixes (optionally pinned)")
    p.add_argument("file", help="prefixes: text (paragraphs or lines) or JSONL; - for stdin")
    p.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto")
    p.add_argument("--server", help="live engine base URL; without it an offline engine runs in a child process")
    add_engine_args(p, required=True)
    p.add_argument("--master", help="master HOST:PORT (default: from --kv-config)")
    p.add_argument("--max-model-len", type=int, help="offline engine only (default: longest prefix + 16)")
    p.add_argument("--engine-log", help="offline engine only: append its log here")
    p.add_argument("--pin", choices=["soft", "hard"], help="pin the prefixes' chunks against eviction")
    p.add_argument("--pin-ttl", type=int, metavar="MS", help="soft-pin TTL in ms (master default otherwise)")
    p.add_argument("--replicas", type=int, default=1, help="replicas per chunk (re-written like --pin)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (server mode)")
    p.add_argument("--verify-timeout", type=float, default=30.0, help="how long to wait for the saves to land")
    p.add_argument("--lease-wait", type=float, default=12.0,
                   help="re-pin: how long to wait for readers' leases (>= the master's default_kv_lease_ttl)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_cmd, passthrough=False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m mcstore.warmup")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(["warmup", *sys.argv[1:]])
    sys.exit(args.func(args, []))
