"""``mctier inspect``: the inspection API on the command line (human tables, ``--json``).

Every operation needs only the master (``--master``, else ``$MCTIER_MASTER``) and, where an
engine's key space matters, the engine's URL (``--engine``) or its model (``--model``): the
rest is what the engine published when it started (:mod:`mcstore.tools.published`).
``summary`` then shows that model's key spaces only, ``lookup`` tokenizes with the model the
engine loaded, ``keys`` lists that key space's objects and ``remove`` removes them. Several
key spaces for one model are an error listing them, with the flag that picks one.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec

from kvcore.errors import ConfigError
from mcstore.keys import KEY_VERSION, foreign_version
from mcstore.tools.engine import add_engine_args, check_engine_args
from mcstore.tools.format import fmt_bytes, table
from mcstore.tools.inspect import Inspector, NotFound, Unavailable
from mcstore.tools.results import KeyList, Lookup, RemoveResult, Stats, Summary

# -- rendering --------------------------------------------------------------------------------------------


_ALWAYS = ("master_key_count", "master_allocated_bytes", "master_total_capacity_bytes", "master_soft_pin_key_count",
           "master_active_clients")


def _version(v: str | None) -> str:
    """``this`` for this mctier's key version, the version for another, ``?`` when not published."""
    return "?" if v is None else "this" if v == KEY_VERSION else v


def render(obj) -> str:
    if isinstance(obj, Summary):
        rows = [[f.fingerprint, f.model or "?", f.chunk_tokens or "?", _version(f.key_version), f.chunks, f.objects,
                 fmt_bytes(f.bytes), f"{f.memory.objects} / {fmt_bytes(f.memory.bytes)}",
                 f"{f.disk.objects} / {fmt_bytes(f.disk.bytes)}", f"{f.parts.objects} / {fmt_bytes(f.parts.bytes)}",
                 f.directories.objects]
                for f in obj.fingerprints]
        out = [table(["fingerprint", "model", "chunk", "keys", "chunks", "objects", "bytes", "memory", "disk",
                      "tails", "directories"], rows)]
        old = [f.fingerprint for f in obj.fingerprints if foreign_version(f.key_version)]
        if old:
            out.append(f"\n{len(old)} key space(s) of another mctier key version (this one: {KEY_VERSION}); their "
                       f"objects are not read by engines of this version: `mctier inspect remove <fingerprint>` "
                       f"frees them once no engine of that version runs: " + ", ".join(old))
        out.append(f"\n{obj.keys} keys, {fmt_bytes(obj.bytes)}; not ours: {obj.other_keys} keys, "
                   f"{fmt_bytes(obj.other_bytes)}")
        out.append(table(["segment", "used", "capacity"],
                         [[s.name, fmt_bytes(s.used_bytes), fmt_bytes(s.capacity_bytes)] for s in obj.segments]))
        return "\n".join(out)
    if isinstance(obj, Lookup):
        rows = [[c.index, f"[{c.start}, {c.end})", "yes" if c.present else "no", c.tier, fmt_bytes(c.bytes)]
                for c in obj.chunks]
        p = obj.partial
        if p is not None:  # leading blocks of another stored object, past the whole chunks
            rows.append([f"{p.index} ({p.matched} of {p.blocks} blocks)", f"[{p.start}, {p.end})",
                         "yes" if p.present else "no", p.tier, fmt_bytes(p.bytes)])
        head = (f"fingerprint {obj.fingerprint}: {obj.hit_tokens}/{obj.prompt_tokens} prompt tokens stored "
                f"({obj.loadable_tokens} loadable), {obj.chunk_tokens}-token chunks")
        tail = f"\n({obj.note})" if obj.note else ""
        return head + "\n" + table(["chunk", "tokens", "present", "tier", "bytes"], rows) + tail
    if isinstance(obj, KeyList):
        rows = [[k.key, fmt_bytes(k.bytes), "+".join(k.tiers) or "-", k.replicas] for k in obj.keys]
        tail = f"\n{obj.total} keys under {obj.prefix!r}" + (f", first {len(obj.keys)} shown" if obj.truncated else "")
        return table(["key", "bytes", "tiers", "replicas"], rows) + tail
    if isinstance(obj, RemoveResult):
        return (f"fingerprint {obj.fingerprint}: {obj.removed}/{obj.matched} objects removed, {obj.busy} still leased"
                + (f", failures {obj.failed}" if obj.failed else ""))
    if isinstance(obj, Stats):
        shown = {k: v for k, v in obj.master.items() if v or k in _ALWAYS}
        out = ["master:", table(["metric", "value"], [[k, f"{v:g}"] for k, v in sorted(shown.items())])]
        if len(shown) < len(obj.master):
            out.append(f"({len(obj.master) - len(shown)} zero-valued master metrics hidden; --json shows all)")
        if obj.engine is not None:
            out += [f"\nengine {obj.engine_url}:",
                    table(["metric", "value"], [[k, f"{v:g}"] for k, v in sorted(obj.engine.items())])]
        return "\n".join(out)
    return json.dumps(msgspec.to_builtins(obj), indent=2)


def _read_tokens(path: str) -> list[int]:
    text = sys.stdin.read() if path == "-" else open(path).read()
    try:
        data = json.loads(text)
    except ValueError:
        data = text.split()
        try:
            data = [int(t) for t in data]
        except ValueError:
            raise ValueError(f"--tokens {path}: not a JSON list nor whitespace-separated integers") from None
    if isinstance(data, dict):
        data = data.get("tokens") or data.get("prompt_token_ids")
    if not isinstance(data, list):
        raise ValueError(f"--tokens {path}: expected a list of token ids")
    return data


def _read_messages(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ValueError(f"--messages {path}: expected a JSON list of messages (or {{\"messages\": [...]}})")
    return data


def _run(a, rest) -> int:
    why = check_engine_args(a)
    if why:
        print(f"mctier inspect {a.cmd_inspect}: {why}", file=sys.stderr)
        return 2
    try:
        insp = Inspector.from_args(a)
    except (ConfigError, ValueError) as e:
        print(f"mctier inspect {a.cmd_inspect}: {e}", file=sys.stderr)
        return 2
    if a.cmd_inspect == "serve":
        from mcstore.tools.inspect_http import serve

        return serve(insp, a.host, a.port, a.token or os.environ.get("MCTIER_INSPECT_TOKEN") or None)
    try:
        if a.cmd_inspect == "summary":  # a named engine: its model's key spaces only
            out = insp.summary({m.fingerprint[:16] for m in insp.published()} if insp.query else None)
        elif a.cmd_inspect == "lookup":
            toks = insp.tokens_of(
                prompt=a.prompt, tokens=_read_tokens(a.tokens) if a.tokens else None,
                messages=_read_messages(a.messages) if a.messages else None,
                add_generation_prompt=not a.no_generation_prompt, fingerprint=a.fingerprint)
            out = insp.lookup(toks, fingerprint=a.fingerprint, cache_salt=a.cache_salt)
        elif a.cmd_inspect == "keys":
            prefix = a.prefix
            if prefix is None and a.fingerprint:
                prefix = insp.fingerprint_prefix(a.fingerprint)
            elif prefix is None and insp.engine_meta() is not None:  # the named engine's
                prefix = insp.fingerprint_prefix(insp.engine_meta().fingerprint)
            out = insp.keys(prefix, a.limit)
        elif a.cmd_inspect == "remove":
            if not a.fingerprint and insp.engine_meta() is None:
                raise ValueError("what to remove: --fingerprint, or the engine (--engine URL or --model)")
            out = insp.remove(a.fingerprint or insp.engine_meta().fingerprint, force=a.force, timeout=a.timeout)
        else:
            out = insp.stats()
    except (ValueError, NotFound, OSError) as e:
        print(f"mctier inspect {a.cmd_inspect}: {e}", file=sys.stderr)
        return 2
    except (Unavailable, ConfigError) as e:
        print(f"mctier inspect {a.cmd_inspect}: {e}", file=sys.stderr)
        return 3
    finally:
        insp.close()
    print(msgspec.json.encode(out).decode() if a.json else render(out))
    if isinstance(out, RemoveResult) and (out.busy or out.failed):
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="what the store holds: summary, lookup, keys, remove, stats, serve (HTTP)")
    ops = p.add_subparsers(dest="cmd_inspect", required=True)

    def common(q, engine_help: str, engine_args: bool = True, fingerprint: bool = True):
        q.add_argument("--master", default=os.environ.get("MCTIER_MASTER"),
                       help="mooncake_master RPC address HOST:PORT (env MCTIER_MASTER; default: from "
                            "--kv-config, else 127.0.0.1:50051)")
        q.add_argument("--admin", default=os.environ.get("MCTIER_MASTER_ADMIN"),
                       help="master HTTP admin/metrics URL (env MCTIER_MASTER_ADMIN; default: the address the "
                            "store server published, else http://MASTER_HOST:9003)")
        q.add_argument("--key-prefix", default="mct")
        q.add_argument("--json", action="store_true", help="one JSON object on stdout")
        q.add_argument("--engine", metavar="URL", help=engine_help)
        if engine_args:
            add_engine_args(q, fingerprint=fingerprint)
        q.set_defaults(func=_run, passthrough=False)

    named = "a live engine's base URL: its model's published key spaces"
    common(ops.add_parser("summary", help="objects and bytes per fingerprint and tier, segments (with --engine or "
                                          "--model: that model's key spaces only)"), named, fingerprint=False)
    lk = ops.add_parser("lookup", help="a prompt's hit depth chunk by chunk")
    common(lk, named + " (the one it stores under)")
    src = lk.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="completion prompt text (tokenized with the engine's model's tokenizer)")
    src.add_argument("--tokens", help="file (or -) with token ids: JSON list or whitespace-separated")
    src.add_argument("--messages", help="JSON file with chat messages (rendered with the chat template)")
    lk.add_argument("--no-generation-prompt", action="store_true", help="render messages without the assistant header")
    lk.add_argument("--cache-salt")
    ks = ops.add_parser("keys", help="list keys with size and tiers")
    common(ks, named + " (default --prefix: the key space it stores under)")
    ks.add_argument("--prefix", help="key prefix (default: the named engine's or --fingerprint's key space, else "
                                     "all of ours)")
    ks.add_argument("--limit", type=int, default=1000)
    rm = ops.add_parser("remove", help="remove every object of a key space (--fingerprint, or the named engine's)")
    common(rm, named + " (removes the key space it stores under)")
    rm.add_argument("--force", action="store_true", help="also remove objects being read (leased)")
    rm.add_argument("--timeout", type=float, default=12.0, help="retry leased objects this long")
    st = ops.add_parser("stats", help="the master's metrics and an engine's connector counters")
    common(st, "engine base URL whose /metrics to scrape (vllm:mctier_*)", engine_args=False)
    sv = ops.add_parser("serve", help="HTTP JSON server for the same operations (+ /health, /docs, /openapi.json)")
    common(sv, "engine base URL for /stats, and whose published key space /lookup uses by default",
           fingerprint=False)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=9400)
    sv.add_argument("--token", default=None, help="bearer token for destructive calls (env MCTIER_INSPECT_TOKEN)")
