"""``mctier``: the command line front door. The only module that knows every subcommand.

Every subcommand registers itself the same way: a function ``add_parser(sub)`` (listed in
:data:`COMMANDS`, loaded on first use) adds its subparser and sets ``func(args, rest) ->
int``; ``raw=True`` hands the whole tail of the command line to the command's own parser,
``passthrough=True`` lets unknown arguments through as ``rest``. ``python -m multi.cli``
runs :func:`main` too (``__main__.py``). The benchmarks are not a subcommand: the
product never imports ``bench/`` (``make bench`` runs ``python -m bench.suite``).
"""

from __future__ import annotations

import argparse
import functools
import sys


@functools.cache
def _commands() -> tuple:
    """:data:`COMMANDS`: every subcommand's ``add_parser``, in ``--help`` order."""
    # Imported here, not at the top: ``multi.cli.deploy`` and ``multi.cli.models`` (which the
    # tests and benchmarks import) must not drag in every subcommand's dependencies.
    from mcstore.tools import inspect_cli, warmup_cli
    from multi.cli import commands, demo

    return (
        commands.add_serve,
        commands.add_master,
        commands.add_store_server,
        commands.add_proxy,
        demo.add_parser,
        warmup_cli.add_parser,
        inspect_cli.add_parser,
        commands.add_model,
        commands.add_cpu,
    )


def __getattr__(name: str):
    if name == "COMMANDS":
        return _commands()
    raise AttributeError(f"module 'multi.cli' has no attribute {name!r}")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    p = argparse.ArgumentParser(prog="mctier", description="Mooncake-backed tiered KV cache for vLLM")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in _commands():
        add(sub)
    return p, sub.choices


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands_ = build_parser()
    cmd = commands_.get(argv[0]) if argv else None
    if cmd is not None and cmd.get_default("raw"):
        # Its own parser owns every flag, --help included.
        return cmd.get_default("func")(argparse.Namespace(), argv[1:])
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args, rest)
