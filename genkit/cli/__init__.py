"""The ``genkit`` command line. Each sub-command lives in its own module exposing
``add_parser(subparsers)``; no module imported here may import torch at import time, so
``genkit --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .. import __version__
from ..errors import GenkitError

# modules that contribute sub-commands, in help order
COMMAND_MODULES = (
    "genkit.cli.generate_cmd",
    "genkit.cli.recipe_cmds",
    "genkit.cli.plugin_cmds",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genkit",
        description="Text generation for PyTorch language models, with pluggable decoding strategies.",
    )
    parser.add_argument("--version", action="version", version=f"genkit {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (GenkitError, ValueError, FileNotFoundError, ImportError, PermissionError, RuntimeError) as exc:
        print(f"genkit: error: {exc}", file=sys.stderr)
        return 2
