"""The ``mctier`` subcommands that are thin wrappers: ``serve`` (vLLM's server), ``proxy``
(:mod:`multi.router.cli`), ``master`` (:mod:`mcstore.server`), ``store-server``
(:mod:`mcstore.segment`), ``model`` (:mod:`multi.cli.models`) and ``cpu`` (:mod:`kvcore.platform`).

Each is registered like every other subcommand, by an ``add_parser(sub)``-style function
(listed in :data:`multi.cli.COMMANDS`). ``raw=True`` hands the whole tail of the command
line to the command's own parser (``--help`` included); ``passthrough=True`` passes the
arguments the subparser does not know on as ``rest``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    import os

    from kvcore.vllm_glue import vllm_main
    from p2p.guard import serve_args

    # With the deployment's secret, the API server refuses unsigned transfer parameters (403).
    return vllm_main(["serve", *serve_args(rest, os.environ)])


def add_serve(sub) -> None:
    s = sub.add_parser("serve", help="vLLM's OpenAI server: `mctier serve ARGS` == `vllm serve ARGS` (plus, with "
                                     "a secret, the middleware p2p.guard.TransferGuard)", add_help=False)
    s.set_defaults(func=_serve, raw=True)


def _proxy(args: argparse.Namespace, rest: list[str]) -> int:
    from multi.router.cli import main as router_main

    return router_main(rest)


def add_proxy(sub) -> None:
    px = sub.add_parser("proxy", help="KV-aware router for P/D and data-parallel instances (vLLM Mooncake proxy "
                                      "contract), with SLO admission", add_help=False)
    px.set_defaults(func=_proxy, raw=True)


def _master(args: argparse.Namespace, rest: list[str]) -> int:
    from kvcore.config import parse_size
    from mcstore.server import StoreCluster

    if args.ha and not args.etcd:
        print("mctier master --ha needs --etcd HOST:PORT[;HOST:PORT]", file=sys.stderr)
        return 2
    cluster = StoreCluster(
        log_dir=args.log_dir,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        segment_size=parse_size(args.segment_size),
        ssd_dir=args.ssd,
        store_server=not args.no_store_server,
        extra_flags=rest,
        ha_etcd=args.etcd if args.ha else None,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from kvcore.errors import ConfigError

    try:
        cluster.start()  # its processes get SIGTERM if this one dies, even by SIGKILL (kvcore.procs)
    except ConfigError as e:  # a port still held (an orphan of an earlier master, say)
        print(f"mctier master: {e}", file=sys.stderr)
        return 2
    try:
        a = cluster.addrs()
        print(f"mooncake master  rpc      {a.rpc}   (kv_connector_extra_config: {{\"master\": \"{a.rpc}\"}})")
        if args.ha:
            print(f"                 HA       this master listens on {args.host}:{cluster.port} while it leads")
        print(f"                 metrics  {a.metrics}")
        if a.http_metadata:
            print(f"                 metadata {a.http_metadata}")
        if a.store_server:
            print(f"store server     {a.store_server}, segment {args.segment_size}"
                  + (f", SSD {args.ssd}" if args.ssd else ""))
        print(f"logs in {args.log_dir}; Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            if not cluster.master.alive():
                print("mooncake_master exited", file=sys.stderr)
                return 1
    finally:
        cluster.stop()
    return 0


def add_master(sub) -> None:
    m = sub.add_parser("master", help="a mooncake_master plus a store server owning the pool "
                                      "(unknown flags go to mooncake_master)")
    m.add_argument("--host", default="127.0.0.1",
                   help="address the master (RPC, metrics, HTTP metadata) and its store server listen on "
                        "and other hosts reach")
    m.add_argument("--port", type=int, default=50051, help="master RPC port")
    m.add_argument("--metrics-port", type=int, default=9003, help="admin/metrics HTTP port (published for the tools)")
    m.add_argument("--http-port", type=int, default=0, help="embedded HTTP metadata server (off by default)")
    m.add_argument("--segment-size", default="4GB", help="DRAM the store server contributes")
    m.add_argument("--ssd", help="directory for SSD offload (enables it)")
    m.add_argument("--no-store-server", action="store_true", help="master only; segments come from "
                                                                  "`mctier store-server` or engines")
    m.add_argument("--ha", action="store_true", help="Mooncake HA: elect a leader among masters through etcd; "
                                                     "clients then use master etcd://HOST:PORT")
    m.add_argument("--etcd", help="etcd endpoints for --ha, HOST:PORT[;HOST:PORT]")
    m.add_argument("--log-dir", default="./mctier-logs")
    m.set_defaults(func=_master, passthrough=True)


def _store_server(args: argparse.Namespace, rest: list[str]) -> int:
    from mcstore.segment import run

    return run(args)


def add_store_server(sub) -> None:
    from mcstore.segment import add_arguments

    s = sub.add_parser("store-server", help="contribute a DRAM segment (and SSD) to an existing pool, from any host")
    add_arguments(s)
    s.set_defaults(func=_store_server)


def _model(args: argparse.Namespace, rest: list[str]) -> int:
    from multi.cli.models import build, describe

    out = build(
        args.preset, args.dir, dtype=args.dtype, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed, window=args.window, full_every=args.full_every,
    )
    print(describe(out), file=sys.stderr)
    print(out)  # last line on stdout: scripts take the directory from it
    return 0


def add_model(sub) -> None:
    from multi.cli.models import PRESETS

    md = sub.add_parser("model", help="build a deterministic random-weight Llama (no hub)")
    md.add_argument("preset", choices=sorted(PRESETS))
    md.add_argument("dir")
    md.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                    help="the engines' dtype to size 'small' for (default: this CPU class's, see `mctier cpu`)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "vocab", "seed"):
        md.add_argument(f"--{flag}", type=int, help="fix this part of the shape (skips sizing by measurement)")
    md.add_argument("--window", type=int, help="sliding-window length in tokens (0: full attention)")
    md.add_argument("--full-every", type=int,
                    help="with --window: every Nth layer attends fully (0: every layer slides)")
    md.set_defaults(func=_model)


def _cpu(args: argparse.Namespace, rest: list[str]) -> int:
    from kvcore.platform import cpu_summary

    c = cpu_summary()
    if args.dtype:
        print(c["dtype"])
        return 0
    print(f"cpu       {c['cpu']}")
    print(f"isa       {', '.join(c['isa']) or 'none of ' + ', '.join(('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16'))}"
          + ("   (MCTIER_SIMULATE_CPU=avx2: AVX-512 and AMX hidden)" if c["simulated"] else ""))
    print(f"dtype     {c['dtype']}   (bf16 with avx512_bf16 or amx_bf16, else float32; MCTIER_DTYPE overrides)")
    return 0


def add_cpu(sub) -> None:
    c = sub.add_parser("cpu", help="this machine's CPU class and the dtype the project's engines get")
    c.add_argument("--dtype", action="store_true", help="print only the dtype (for scripts)")
    c.set_defaults(func=_cpu)
