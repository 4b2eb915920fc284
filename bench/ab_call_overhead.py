"""Per-call overhead of ``genkit.generate``: a 1-token call on a tiny random Llama, two trees alternating.

What a call costs besides the model's own work (merging and checking the config, choosing the
strategy, checking the prepared weights, the prefill's bookkeeping), for the tree given and, with
``--base``, another checkout of genkit timed in alternation in fresh processes (so a machine whose
speed drifts moves both alike). ``--layers`` sets the depth (the weights check walks every layer).

Run: ``python bench/ab_call_overhead.py --base /path/to/other/checkout --layers 2,30 --rounds 2``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def time_calls(layers: int, calls: int = 300, repeats: int = 7) -> float:
    """Best milliseconds per 1-token call (run inside the tree under test)."""
    import torch

    import genkit
    from genkit.models.tiny import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(seed=0, num_hidden_layers=layers)
    ids = torch.tensor([[1, 5, 9, 12]])

    def call() -> None:
        genkit.generate(model, ids, max_new_tokens=1, do_sample=False)

    for _ in range(calls):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1000)
    return best


def run_in(tree: Path, layers: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    code = f"import sys; sys.path.insert(0, {str(HERE / 'bench')!r}); import ab_call_overhead as b; print(b.time_calls({layers}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="another genkit checkout to time in alternation")
    parser.add_argument("--layers", default="2,30")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = ([("base", args.base.resolve())] if args.base else []) + [("this", HERE)]
    for layers in (int(v) for v in args.layers.split(",")):
        for r in range(args.rounds):
            figures = {name: run_in(tree, layers) for name, tree in trees}
            line = ", ".join(f"{name} {ms:.3f} ms" for name, ms in figures.items())
            ratio = f" (this/base {figures['this'] / figures['base']:.3f})" if "base" in figures else ""
            print(f"{layers} layers, round {r + 1}: {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()
