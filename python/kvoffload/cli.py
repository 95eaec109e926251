"""The ``kvoffload`` command line: ``kvoffload bench`` (more subcommands to come)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoffload import __version__, bench

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
