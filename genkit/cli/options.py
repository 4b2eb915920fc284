"""Options several commands share: ``--threads`` (every command that runs a model),
``--activation-digits``, ``--numerics`` and ``--device`` (generate, batch, serve) and the prompt argument. No torch import here: the thread count is applied before torch loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError

THREADS_HELP = ("CPU threads for the model (default: the physical cores available to this process, or "
                "OMP_NUM_THREADS when set; never lowered from the load: a busy machine gets a warning). See "
                "docs/threads.md")


def add_threads_option(p: Any) -> None:
    """``--threads N`` on a command that runs a model."""
    p.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)


def check_threads_option(args: argparse.Namespace) -> None:
    """Refuse a bad ``--threads`` before anything loads."""
    from ..threads import check_threads

    try:
        check_threads(args.threads)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("`threads`=", "--threads ", 1).replace(", or None for the default", "")) from None


def add_chat_template_option(p: Any) -> None:
    """``--chat-template``: a template instead of the tokenizer's (``genkit generate``, ``genkit serve``)."""
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the text itself (it holds a ``{``), else the file it names, read
    before anything loads (an unreadable file is a ConfigError naming the option)."""
    if value is None or "{" in value:
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--chat-template: cannot read {value!r}: {exc.strerror}") from None


ACTIVATION_DIGITS_HELP = ("quantized models: int8 digits per activation value on the block kernel: 2 (default) gives "
                          "the de-quantized float model's tokens, 1 llama.cpp's rounding (faster; llama.cpp's tokens "
                          "where float order allows). See docs/models.md, 'Activation rounding'")


def add_activation_digits_option(p: Any) -> None:
    """``--activation-digits {1,2}`` on a command that loads a model."""
    p.add_argument("--activation-digits", type=int, default=None, metavar="{1,2}", help=ACTIVATION_DIGITS_HELP)


def check_activation_digits_option(args: argparse.Namespace) -> None:
    """Refuse a bad ``--activation-digits`` before anything loads."""
    digits = getattr(args, "activation_digits", None)
    if digits is not None and digits not in (1, 2):
        raise ConfigError(f"--activation-digits must be 1 or 2; got {digits}")


NUMERICS_HELP = ("quantized GGUF models: 'genkit' (default) or 'llama.cpp': every float operation of a step as "
                 "llama.cpp's CPU backend does it (one activation digit, float16 K/V cache, its flash attention), so "
                 "greedy decoding gives llama.cpp's tokens; 'llama.cpp' follows llama.cpp built for this CPU, "
                 "'llama.cpp-avx2', 'llama.cpp-avx512', 'llama.cpp-avx512-fp16' name its build. See docs/models.md, "
                 "'llama.cpp numerics'")
NUMERICS_METAVAR = "{genkit,llama.cpp,llama.cpp-avx2,llama.cpp-avx512,llama.cpp-avx512-fp16}"


def add_numerics_option(p: Any) -> None:
    """``--numerics {genkit,llama.cpp,...}`` on a command that loads a model."""
    p.add_argument("--numerics", default=None, metavar=NUMERICS_METAVAR, help=NUMERICS_HELP)


def check_numerics_option(args: argparse.Namespace) -> None:
    """Refuse a bad ``--numerics`` (or one contradicting ``--activation-digits``) before anything loads."""
    from ..models.numerics import NUMERICS, is_llama_numerics

    numerics = getattr(args, "numerics", None)
    if numerics is not None and numerics not in NUMERICS:
        raise ConfigError(f"--numerics must be one of {', '.join(repr(n) for n in NUMERICS)}; got {numerics!r}")
    if numerics is not None and is_llama_numerics(numerics) and getattr(args, "activation_digits", None) == 2:
        raise ConfigError(f"--numerics {numerics} rounds activations to one digit; --activation-digits 2 contradicts it")


def add_device_option(p: Any) -> None:
    """``--device NAME`` on a command that loads a model."""
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cpu)")


def check_device_option(args: argparse.Namespace) -> None:
    """Refuse a ``--device`` this torch build cannot use, naming the devices it can (the decision is
    :func:`genkit.models.loading.check_device`'s)."""
    name = getattr(args, "device", None)
    if name is None:
        return
    import torch

    from ..models.loading import available_devices, check_device

    available = ", ".join(available_devices())
    try:
        kind = torch.device(name).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name!r} is not a device name; available here: {available}") from None
    try:
        check_device(name)
        usable = kind in ("cpu", "cuda", "mps")  # not meta: a command needs weights to run
    except ConfigError:
        usable = False
    if not usable:
        why = " (this torch build has no CUDA support)" if kind == "cuda" and not torch.backends.cuda.is_built() else ""
        raise ConfigError(f"--device {name!r} is not available{why}; available here: {available}")


def apply_threads_option(args: argparse.Namespace) -> int:
    """Run torch with ``--threads`` (or the default policy, :mod:`genkit.threads`)."""
    from ..threads import apply_threads

    check_threads_option(args)
    return apply_threads(args.threads)


def read_prompt(positional: str | None, option: str | None, stdin: Any = None) -> str:
    """The prompt of ``genkit generate``: the positional argument or ``--prompt`` (not both); ``-``
    reads standard input, as does no prompt at all when standard input is not a terminal."""
    stdin = sys.stdin if stdin is None else stdin
    if positional is not None and option is not None:
        raise ConfigError("give the prompt once: as the PROMPT argument or with --prompt, not both")
    prompt = positional if positional is not None else option
    if prompt is None:
        if stdin is None or stdin.isatty():
            raise ConfigError("no prompt: genkit generate \"PROMPT\" (or '-' to read it from standard input)")
        return stdin.read()
    return stdin.read() if prompt == "-" else prompt
