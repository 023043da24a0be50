"""``mctier warmup``: the command line of :mod:`mcstore.tools.warmup`.

The master (``--master``, default ``$MCTIER_MASTER``, else 127.0.0.1:50051) and one of:

* ``--engine URL`` (or ``--server``): a live engine computes the KV. Its ``/v1/models``
  names its model (whose tokenizer renders the prefixes) and the key space is the one its
  connector published when it started.
* ``--model NAME``: an offline engine in a child process computes it, started with the
  settings the model's engine published (model path, block size, dtype, TP and PP sizes,
  chunk size, key prefix), checked to store under the published fingerprint.

Several key spaces published for the model are an error that lists them; ``--fingerprint``
or an engine flag (``--tensor-parallel-size``, ``--block-size``...) picks one. With
``--kv-config`` (and ``--model`` and the engine flags) the key space is derived from the
engine's settings instead of read from the store.
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
    add_engine_args,
    check_engine_args,
    derive_meta,
    engine_settings,
    query_from_args,
    read_kv_config,
    rebuild_engine,
    store_config,
)
from mcstore.tools.format import table
from mcstore.tools.published import ServerModel, find_meta, same_model
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
    if not a.server and not a.model:
        return ("name the engine: --engine URL (a live engine computes the KV) or --model NAME (an offline engine "
                "with the settings the model's engine published, or with --kv-config and the engine flags)")
    return check_engine_args(a)


def _cmd(a, rest) -> int:
    why = _check(a)
    if why:
        print(f"mctier warmup: {why}", file=sys.stderr)
        return 2
    client = None
    try:
        server = ServerModel(a.server) if a.server else None
        settings = engine_settings(a)
        if a.kv_config:  # the key space from the engine's settings
            kv = read_kv_config(a.kv_config)
            model = a.model or server.root
            if server is not None and not any(same_model(model, n) for n in (server.name, server.root)):
                raise ValueError(f"--model {model} is not the model of engine {server.url} ({server.root})")
            master = a.master or store_config(kv).master
            client = StoreClient.for_tool(master, "warmup")
            meta = derive_meta(model, kv, **settings)
        else:  # the key space the engine published
            master = a.master or os.environ.get("MCTIER_MASTER") or DEFAULT_MASTER
            client = StoreClient.for_tool(master, "warmup")
            meta = find_meta(client, client.admin(a.admin), query_from_args(a), server)
            if server is not None:
                model = server.root
            else:  # an offline engine as the published settings say
                model, kv, settings = rebuild_engine(meta, master)
        renderer = Renderer(a.tokenizer or model)
        prefixes = read_prefixes(a.file, renderer, a.format)
        if not prefixes:
            raise ValueError(f"{a.file}: no prefixes")
        if server is not None:
            runner = ServerRunner(server.url, a.concurrency, model_name=server.name)
        else:
            runner = OfflineRunner(model, kv, block_size=settings["block_size"], dtype=settings["dtype"],
                                   kv_cache_dtype=settings["kv_cache_dtype"], tp=settings["tensor_parallel_size"],
                                   pp=settings["pipeline_parallel_size"],
                                   hash_algo=settings["prefix_caching_hash_algo"],
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
    p.add_argument("--engine", "--server", dest="server", metavar="URL",
                   help="live engine base URL; without it an offline engine runs in a child process")
    p.add_argument("--master", help=f"master HOST:PORT (default: --kv-config's, else $MCTIER_MASTER, else "
                                    f"{DEFAULT_MASTER})")
    p.add_argument("--admin", default=os.environ.get("MCTIER_MASTER_ADMIN"),
                   help="master admin URL, to list the published key spaces (default: as `mctier inspect`)")
    p.add_argument("--key-prefix", default="mct", help="with --fingerprint: the connector's key_prefix")
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
