"""A quantized decode step with its ends in the kernel call, against the same step with them as modules.

genkit runs a batch-1 decode step of a quantized Llama on the block kernel in one call; since
session 14 that call also takes the token embedding in and gives the logits out (the final norm and
the LM head: :meth:`genkit.models.llama.LlamaForCausalLM.one_call_step`), where before they ran as
torch modules around it, with the CPU caches cold after the layers. This times both ways in one
process, round after round (alternating, so that a machine whose speed drifts moves both alike), on
the demo model (SmolLM2-135M-Instruct Q4_1), and says whether both gave the same greedy tokens.

"modules" is the path every step took before: the model's ``one_call_step`` answers None, so its
forward runs the embedding, the one-call layers, the final norm and the LM head as before.
``--model float32`` times the demo model's float32 conversion instead, whose batch-1 steps run in one
call on the ``gemv`` route (the kernel choice's; ``GENKIT_KERNEL=decode:gemv`` forces it): the same
change for its float32 embedding, final norm and LM head (the dense kernel's product).

Run: ``python bench/ab_step_ends.py --threads 2,1 --rounds 7 --tokens 128 [--model float32]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import genkit
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, ensure_demo_model, genkit_home

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_rounds import alternate  # noqa: E402


def set_ends(model: Any, in_kernel: bool) -> None:
    """Ends in the kernel call (genkit's own method), or as modules (an instance attribute that
    answers None shadows it: the forward's path before the change)."""
    model.__dict__["greedy_step"] = lambda *args: None  # both ways give the logits (ab_greedy_step.py times that)
    if in_kernel:
        model.__dict__.pop("one_call_step", None)
    else:
        model.__dict__["one_call_step"] = lambda *args: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", choices=("q4_1", "float32"), default="q4_1")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    path = demo_gguf_path(f"{genkit_home()}/bench-gguf") if args.model == "q4_1" else ensure_demo_model()
    model = genkit.load_model(path)
    ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(1))
    alternate(model, ids, ("modules", "in-kernel"), set_ends, [int(t) for t in args.threads.split(",")], args.rounds,
              args.tokens, args.model)

if __name__ == "__main__":
    main()
