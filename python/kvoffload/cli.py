"""The ``kvoffload`` command line: ``kvoffload bench`` and ``kvoffload sim``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoffload import __version__, bench
from kvoffload.sim import cli as sim_cli

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Build the parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvoffload",
        description="kvoffload: vLLM's scheduler-side CPU KV-offloading manager, in Rust.",
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = commands.add_parser(
        "bench",
        help="the Rust manager vs the pure-Python reference on a synthetic serving workload",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.run)
    sim_parser = commands.add_parser(
        "sim",
        help="replay a workload or trace through the manager: policies, sizes, miss-ratio curves",
        description=sim_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim_parser)
    sim_parser.set_defaults(handler=sim_cli.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
