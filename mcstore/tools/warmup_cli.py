"""``mctier warmup``: the command line of :mod:`mcstore.tools.warmup`.

``mctier warmup --server URL FILE`` needs nothing else when the engine's store tier uses
the master at ``--master`` (default ``$MCTIER_MASTER``, else 127.0.0.1:50051): the
server's ``/v1/models`` names its model (whose tokenizer renders the prefixes) and the
key space is the one the engine's connector published when it started. With
``--kv-config`` (and ``--model`` and the engine flags) the key space is derived from the
settings instead, which the offline mode (no ``--server``) always does.
"""

from __future__ import annotations

import os
import sys

import msgspec

from kvcore.errors import ConfigError
from mcstore.admin import Unavailable
from mcstore.client import StoreClient
from mcstore.tools.engine import (
    Renderer,
    ServerModel,
    add_engine_args,
    derive_meta,
    engine_settings,
    meta_for_server,
    read_kv_config,
    store_config,
)
from mcstore.tools.text import table
from mcstore.tools.warmup import OfflineRunner, ServerRunner, WarmupReport, read_prefixes, warmup

DEFAULT_MASTER = "127.0.0.1:50051"


def render(rep: WarmupReport) -> str:
    rows = [[r.index, r.label, r.tokens, r.chunks, r.present_before, r.stored, r.pinned, r.hit_tokens,
             r.status if not r.error else f"{r.status}: {r.error}"] for r in rep.prefixes]
    head = ["#", "prefix", "tokens", "chunks", "present before", "stored", "pinned", "hit tokens", "status"]
    return (table(head, rows) + f"\n{len(rep.prefixes)} prefixes, {rep.failed} failed, fingerprint "
            f"{rep.fingerprint}, {rep.chunk_tokens}-token chunks, {rep.mode} mode, {rep.seconds:.1f}s")


def _check(a) -> str | None:
    if a.pin_ttl is not None and a.pin != "soft":
        return "--pin-ttl needs --pin soft"
    if a.replicas < 1 or a.concurrency < 1:
        return "--replicas and --concurrency must be >= 1"
    if not a.server and not (a.model and a.kv_config):
        return "without --server (offline engine) --model and --kv-config are required"
    if a.model and not a.kv_config and not a.tokenizer:
        return "--model goes with --kv-config (the engine settings); for the tokenizer alone use --tokenizer"
    return None


def _cmd(a, rest) -> int:
    why = _check(a)
    if why:
        print(f"mctier warmup: {why}", file=sys.stderr)
        return 2
    client = None
    try:
        server = ServerModel(a.server) if a.server else None
        if a.kv_config:  # the key space from the engine's settings
            kv = read_kv_config(a.kv_config)
            model = a.model or server.root
            master = a.master or store_config(kv).master
            client = StoreClient.for_tool(master, "warmup")
            meta = derive_meta(model, kv, **engine_settings(a))
        else:  # the key space the live engine published
            master = a.master or os.environ.get("MCTIER_MASTER") or DEFAULT_MASTER
            client = StoreClient.for_tool(master, "warmup")
            meta = meta_for_server(server, client, client.admin(a.admin), a.fingerprint, a.key_prefix)
            model = server.root
        renderer = Renderer(a.tokenizer or model)
        prefixes = read_prefixes(a.file, renderer, a.format)
        if not prefixes:
            raise ValueError(f"{a.file}: no prefixes")
        if server is not None:
            runner = ServerRunner(server.url, a.concurrency, model_name=server.name)
        else:
            runner = OfflineRunner(a.model, kv, block_size=a.block_size, dtype=a.dtype,
                                   kv_cache_dtype=a.kv_cache_dtype, tp=a.tensor_parallel_size,
                                   max_model_len=a.max_model_len, log=a.engine_log)
        rep = warmup(prefixes, meta, master, runner, pin=a.pin, pin_ttl_ms=a.pin_ttl, replicas=a.replicas,
                     verify_timeout=a.verify_timeout, lease_wait_s=a.lease_wait, progress=not a.no_progress,
                     client=client)
    except (ConfigError, ValueError, OSError) as e:
        print(f"mctier warmup: {e}", file=sys.stderr)
        return 2
    except Unavailable as e:
        print(f"mctier warmup: {e}", file=sys.stderr)
        return 3
    finally:
        if client is not None:
            client.close()
    print(msgspec.json.encode(rep).decode() if a.json else render(rep))
    return 1 if rep.failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("warmup", help="pre-compute and store the KV of recurring prefixes (optionally pinned)",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("file", help="prefixes: text (paragraphs or lines) or JSONL; - for stdin")
    p.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto")
    p.add_argument("--server", help="live engine base URL; without it an offline engine runs in a child process")
    p.add_argument("--master", help=f"master HOST:PORT (default: --kv-config's, else $MCTIER_MASTER, else "
                                    f"{DEFAULT_MASTER})")
    p.add_argument("--admin", default=os.environ.get("MCTIER_MASTER_ADMIN"),
                   help="master admin URL, to list the published key spaces (default: as `mctier inspect`)")
    p.add_argument("--fingerprint", help="--server without --kv-config: use the key space published under this "
                                         "fingerprint (when several engines of the model published one)")
    p.add_argument("--key-prefix", default="mct", help="with --fingerprint: the connector's key_prefix")
    p.add_argument("--tokenizer", help="tokenizer to render the prefixes (default: the engine's model)")
    add_engine_args(p)
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
