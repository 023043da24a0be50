"""``mctier``: the command line front door. The only module that knows every subcommand."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from kvcore.vllm_glue import vllm_main

    return vllm_main(["serve", *rest])


def _cmd_model(args: argparse.Namespace, rest: list[str]) -> int:
    from multi.models import build

    out = build(
        args.preset, args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed,
    )
    print(out)
    return 0


def _cmd_master(args: argparse.Namespace, rest: list[str]) -> int:
    from kvcore.config import parse_size
    from mcstore.server import StoreCluster

    cluster = StoreCluster(
        log_dir=args.log_dir,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        segment_size=parse_size(args.segment_size),
        ssd_dir=args.ssd,
        store_server=not args.no_store_server,
        extra_flags=rest,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster.start()
    try:
        a = cluster.addrs()
        print(f"mooncake master  rpc      {a.rpc}   (kv_connector_extra_config: {{\"master\": \"{a.rpc}\"}})")
        print(f"                 metrics  {a.metrics}")
        if a.http_metadata:
            print(f"                 metadata {a.http_metadata}")
        if a.store_server:
            print(f"store server     {a.store_server}, segment {args.segment_size}" + (f", SSD {args.ssd}" if args.ssd else ""))
        print(f"logs in {args.log_dir}; Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            if not cluster.master.alive():
                print("mooncake_master exited", file=sys.stderr)
                return 1
    finally:
        cluster.stop()
    return 0


def _cmd_proxy(args: argparse.Namespace, rest: list[str]) -> int:
    from p2p.proxy import main as proxy_main

    return proxy_main(rest)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "suite.py").is_file():
        print("mctier bench runs from a source checkout (bench/ sits beside the packages); "
              "install with `pip install -e .[bench]`", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from bench.suite import main as bench_main

    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mctier", description="Mooncake-backed tiered KV cache for vLLM")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="vLLM's OpenAI server: `mctier serve ARGS` == `vllm serve ARGS`", add_help=False)
    s.set_defaults(func=_cmd_serve, passthrough=True)

    m = sub.add_parser("master", help="a mooncake_master plus a store server owning the pool")
    m.add_argument("--port", type=int, default=50051, help="master RPC port")
    m.add_argument("--metrics-port", type=int, default=9003)
    m.add_argument("--http-port", type=int, default=0, help="embedded HTTP metadata server (off by default)")
    m.add_argument("--segment-size", default="4GB", help="DRAM the store server contributes")
    m.add_argument("--ssd", help="directory for SSD offload (enables it)")
    m.add_argument("--no-store-server", action="store_true", help="master only; engines must contribute segments")
    m.add_argument("--log-dir", default="./mctier-logs")
    m.set_defaults(func=_cmd_master, passthrough=True)

    b = sub.add_parser("bench", help="benchmarks against the peers (LMCache, stock vLLM, raw Mooncake)",
                       add_help=False)
    b.set_defaults(func=_cmd_bench, passthrough=True)

    px = sub.add_parser("proxy", help="OpenAI-compatible P/D proxy (vLLM Mooncake proxy contract)", add_help=False)
    px.set_defaults(func=_cmd_proxy, passthrough=True)

    from multi.demo import add_parser as add_demo

    add_demo(sub)

    from mcstore.inspect_cli import add_parser as add_inspect
    from mcstore.warmup import add_parser as add_warmup

    add_warmup(sub)
    add_inspect(sub)

    md = sub.add_parser("model", help="build a deterministic random-weight Llama (no hub)")
    md.add_argument("preset", choices=["tiny", "small"])
    md.add_argument("dir")
    for flag in ("layers", "hidden", "heads", "kv-heads", "vocab", "seed"):
        md.add_argument(f"--{flag}", type=int)
    md.set_defaults(func=_cmd_model, passthrough=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    own_parser = {"serve": _cmd_serve, "proxy": _cmd_proxy, "bench": _cmd_bench}
    if argv and argv[0] in own_parser:
        # Their own parsers own every flag, --help included.
        return own_parser[argv[0]](argparse.Namespace(), argv[1:])
    args, rest = parser.parse_known_args(argv)
    if rest and not args.passthrough:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args, rest)


if __name__ == "__main__":
    sys.exit(main())
