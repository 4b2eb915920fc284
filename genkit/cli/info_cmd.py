"""``genkit info``: this machine as genkit's kernels see it, and which kernel runs what here.

Prints the CPU (name and the flags the kernels care about), the GPUs torch sees (``--device``),
torch's version and ATen vector capability, whether the CPU has native bfloat16 products, the block kernel's path (AVX-512 VNNI,
AVX2, AMX), and every per-CPU kernel choice cached under ``$GENKIT_HOME`` with the reason it was
made (see :mod:`genkit.models.kernel_choice`). ``--probe`` makes the choices for the demo model
first (loading it, a few seconds), with the threads ``genkit generate`` would run (``--threads N``
to choose)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from .options import add_threads_option, apply_threads_option


def add_parser(subparsers: Any) -> None:
    """Add ``genkit info`` to the ``genkit`` parser."""
    p = subparsers.add_parser("info", help="the CPU, the kernels genkit uses on it, and why",
                              description="Show the CPU's relevant flags, torch's capability, the block kernel's "
                                          "path and the per-CPU kernel choices (GENKIT_KERNEL overrides them).")
    p.add_argument("--probe", action="store_true",
                   help="make the kernel choices for the demo model now (float32 and quantized), then show them")
    add_threads_option(p)
    p.set_defaults(func=cmd_info)


def cpu_lines() -> list[str]:
    """The CPU's name, family and model, and which of the kernels' flags it has."""
    from genkit.models.cpu import KERNEL_FLAGS, kernel_flags, kind

    have = " ".join(kernel_flags()) or "(none of them)"
    return [f"cpu: {kind()}", f"cpu flags (of {', '.join(KERNEL_FLAGS)}): {have}"]


def gpu_line() -> str:
    """The CUDA devices torch sees (what ``--device cuda:N`` can name), or why there are none."""
    import torch

    if not torch.backends.cuda.is_built():
        return "gpu: none (this torch build has no CUDA support; --device cpu)"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return f"gpu: none visible (torch {torch.version.cuda} CUDA build; --device cpu)"
    names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
    return f"gpu: {names} (CUDA {torch.version.cuda}; --device cuda runs the model there, docs/models.md 'On a GPU')"


def _probe() -> None:
    import torch

    import genkit
    from genkit.models.demo import demo_gguf_path, genkit_home

    path = demo_gguf_path(f"{genkit_home()}/bench-gguf")
    ids = torch.tensor([[1, 2, 3, 4]])
    for model in (genkit.load_model(path), genkit.load_model(path, dequantize=True)):
        model.generate(ids, max_new_tokens=2, eos_token_id=None, pad_token_id=0)


def cmd_info(args: argparse.Namespace) -> int:
    if args.probe:
        apply_threads_option(args)  # the probe runs the model: its choices are for the count generate runs with
    elif args.threads is not None:
        raise ConfigError("--threads applies to --probe (the thread count the kernel choices are made for)")
    import torch

    from genkit import __version__
    from genkit.models import block_kernel, dense_kernel, kernel_choice
    from genkit.models.llama_infer import packing_available

    if args.probe:
        _probe()
    lines = [f"genkit {__version__}, torch {torch.__version__} (ATen capability "
             f"{torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads", *cpu_lines(),
             gpu_line()]
    lines.append("bfloat16 products: " + ("native (oneDNN packs bfloat16 weights)" if packing_available(torch.bfloat16)
                                          else "emulated: keep float32 on this CPU"))
    simd = block_kernel.simd() if block_kernel.available() else ""
    kernel = (f"{simd}" + (", AMX int8 tiles for multi-row products" if block_kernel.amx_available() else ", no AMX")
              if simd else "not available (torch's int4 kernel runs quantized layers)")
    lines.append(f"block kernel: {kernel}")
    lines.append("float32 gemv kernel (dense path 'gemv'): " + ("built" if dense_kernel.available() else
                                                                  "not available (no C compiler, or switched off)"))
    lines.extend(kernel_choice.describe())
    print("\n".join(lines))
    return 0
