"""Two (or more) versions of the block kernel's C source, timed against each other in one process.

Each source is compiled with genkit's own flags for this CPU; the demo model (SmolLM2-135M-Instruct
Q4_1) then decodes with each build in turn, round after round (builds alternating, so that a machine
whose speed drifts moves all of them alike), and the median tokens/s per build is printed with
whether every build gave the same greedy tokens. A kernel change is kept or dropped on such an A/B,
not on two runs minutes apart: on the shared machines this project meets, speed moves 20-30 % from
one minute to the next.

Run: ``python bench/ab_block_kernel.py old=/tmp/block_kernel_before.c new=genkit/models/block_kernel.c
--threads 2,1 --rounds 7 --tokens 128`` (``git show HEAD:genkit/models/block_kernel.c >
/tmp/block_kernel_before.c`` gives the committed version).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import genkit
from genkit.models import block_kernel
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, genkit_home


def build(label: str, source: str, folder: str, mode: str) -> Any:
    cc = block_kernel._compiler()
    if cc is None:
        raise SystemExit("no C compiler found: the block kernel cannot be built here")
    out = Path(folder) / f"ab_{label}.so"
    subprocess.run([cc, *block_kernel._flags(mode), source, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    block_kernel.declare(lib)
    return lib


def use(lib: Any) -> None:
    """Make ``lib`` the block kernel every later product and decode step calls."""
    block_kernel._lib, block_kernel._tried = lib, True


def tokens_per_second(model: Any, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    """Decode speed of ``new`` tokens (the prompt's share taken out by a 1-token run) and the tokens."""
    kw = {"eos_token_id": None, "pad_token_id": 0, "do_sample": False}
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new + 1, **kw)
    whole = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    return new / (whole - (time.perf_counter() - t)), out[0].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="label=path of a block_kernel.c version (two or more)")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mode", default="native", help="genkit's build mode: native (this CPU) or avx2")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    pairs = [s.split("=", 1) for s in args.sources]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        raise SystemExit("give two or more sources as label=path")
    with tempfile.TemporaryDirectory() as folder:
        libs = {label: build(label, path, folder, args.mode) for label, path in pairs}
        model = genkit.load_model(demo_gguf_path(f"{genkit_home()}/bench-gguf"))
        ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(1))
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for lib in libs.values():  # warm-up: first calls fault the weights in
                use(lib)
                tokens_per_second(model, ids, 4)
            rates: dict[str, list[float]] = {label: [] for label in libs}
            tokens: dict[str, list[int]] = {}
            for _ in range(args.rounds):
                for label, lib in libs.items():
                    use(lib)
                    rate, tokens[label] = tokens_per_second(model, ids, args.tokens)
                    rates[label].append(rate)
            same = len({tuple(t) for t in tokens.values()}) == 1
            cells = "  ".join(f"{label} {statistics.median(r):.1f}" for label, r in rates.items())
            print(f"{threads} thread(s), {args.mode}, medians of {args.rounds} (tok/s): {cells}; "
                  f"{'same tokens' if same else 'TOKENS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
