"""The ``genkit`` command line. Each sub-command lives in its own module exposing
``add_parser(subparsers)``; no module imported here may import torch at import time, so
``genkit --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from .. import __version__
from ..errors import GenkitError

# modules that contribute sub-commands, in help order
COMMAND_MODULES = (
    "genkit.cli.generate_cmd",
    "genkit.cli.recipe_cmds",
    "genkit.cli.plugin_cmds",
    "genkit.cli.serve_cmd",
    "genkit.cli.batch_cmd",
    "genkit.cli.info_cmd",
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
    for command in sub.choices.values():  # -v works after the sub-command too: genkit generate -v ...
        command.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0,
                             help="more log output and tracebacks on errors (-vv for debug)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.verbose + getattr(args, "sub_verbose", 0)
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return rc
    except BrokenPipeError:
        return quiet_broken_pipe()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every error a user can cause is one line; -v adds the traceback
        return report_error(exc, verbose)


def quiet_broken_pipe() -> int:
    """The reader of our output went away (``genkit inspect --json | head -1``): exit quietly, as
    a command killed by SIGPIPE does (status 141), with nothing left to flush into the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured in tests)
        pass
    return 141


def report_error(exc: BaseException, verbose: int) -> int:
    """Print ``exc`` as one line (``genkit: error: ...``), with the traceback first under ``-v``.

    genkit's own errors (:class:`~genkit.errors.GenkitError`) and the builtin errors bad input
    causes (``ValueError``, ``OSError``, ``ImportError``) exit with 2; anything else is a bug in
    genkit or a plugin: still one line, exit 1, and a hint to rerun with ``-v``.
    """
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    text = str(exc).strip() or type(exc).__name__
    user_error = isinstance(exc, (GenkitError, ValueError, OSError, ImportError))
    if not user_error:
        text = f"{type(exc).__name__}: {text}"
    hint = "" if verbose else " (run with -v for the traceback)"
    print(f"genkit: error: {text}" + ("" if user_error else hint), file=sys.stderr)
    return 2 if user_error else 1
