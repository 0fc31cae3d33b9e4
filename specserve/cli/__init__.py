"""The `specserve` command: generate | serve | bench latency | bench serve | doctor |
train-eagle3 | eval-accept.

Parsing and checking every flag imports no torch (each command imports its engine only once
its flags are known good), so `--help` and a bad flag answer at once. Every user error is
one line on stderr naming the flag, and exit status 2; Ctrl-C is exit status 130.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specserve import __version__
from specserve.config_flags import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error that points at --help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from specserve.cli import bench, commands, train

    parser = ArgumentParser(
        prog="specserve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register(sub)
    bench.register(sub)
    train.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"error: {exc.cli_message()}", file=sys.stderr)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2
