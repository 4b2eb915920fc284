"""Where a quantized decode step's time goes: the block kernel built with ``-DGK_PROFILE`` (wall
time per operation inside the one-call decode step ``gk_decode``, and in the LM head's product),
against the step's total as ``generate`` sees it.

Run: ``python bench/profile_block_kernel.py [--threads 1,2] [--tokens 128]`` (the demo GGUF,
SmolLM2-135M-Instruct Q4_1, batch-1 greedy after a 12-token prompt). Prints ms per token per
operation; "outside the kernel" is the rest of ``generate`` (Python, embedding, logits processing).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import genkit
from genkit.models import block_kernel
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, genkit_home

NAMES = ("rms norms", "activation quantization", "q/k/v product", "rope + cache write", "attention",
         "o product", "residual adds", "gate/up product", "silu * up", "down product", "LM head product",
         "other products (the prompt)")


def profiled_library(folder: str) -> ctypes.CDLL:
    """The kernel built with its per-operation timers, loaded in place of the cached one."""
    cc = block_kernel._compiler()
    assert cc is not None, "no C compiler"
    out = Path(folder) / "genkit_blocks_profile.so"
    cmd = [cc, *block_kernel._flags("native"), "-DGK_PROFILE", str(block_kernel.SOURCE), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    block_kernel.declare(lib)
    lib.gk_profile.argtypes = [ctypes.c_void_p]
    block_kernel._lib, block_kernel._tried = lib, True
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    with tempfile.TemporaryDirectory() as folder:
        lib = profiled_library(folder)
        path = demo_gguf_path(f"{genkit_home()}/bench-gguf")
        model = genkit.load_model(path)
        ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(1))
        kw = {"eos_token_id": None, "pad_token_id": 0}
        times = (ctypes.c_double * len(NAMES))()
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            model.generate(ids, max_new_tokens=8, **kw)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            t_one = time.perf_counter() - t
            lib.gk_profile(times)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.tokens + 1, **kw)
            total = time.perf_counter() - t - t_one
            lib.gk_profile(times)
            n = args.tokens
            print(f"\n{threads} thread(s): {1e3 * total / n:.3f} ms per token ({n / total:.1f} tok/s)")
            for name, secs in zip(NAMES, times):
                print(f"  {name:26s} {1e3 * secs / n:7.3f} ms")
            print(f"  {'outside the kernel':26s} {1e3 * (total - sum(times)) / n:7.3f} ms (incl. the prompt's share)")


if __name__ == "__main__":
    main()
