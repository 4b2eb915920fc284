"""Greedy steps that give the token alone, against the same steps giving every logit.

Since session 15, greedy search with nothing else reading a step's scores asks the model for the
argmax alone (:meth:`genkit.strategy.Stepper.forward_greedy`, the model's ``greedy_step``): the
one-call step takes the argmax in the kernel call, and a float32 head (the ``gemv`` route) is read
through an 8-bit copy, with only the rows that can hold the maximum computed exactly
(``gk_decode_argmax`` in genkit/models/block_kernel.c). This times both ways in one process, round
after round (alternating, so that a machine whose speed drifts moves both alike), and says whether
both gave the same greedy tokens.

"logits" is the path every step took before: an instance attribute ``greedy_step`` that answers
None shadows the model's method, so each step runs ``forward`` and the strategy takes the argmax.
``--model float32`` is the demo model's float32 conversion on the ``gemv`` route
(``GENKIT_KERNEL=decode:gemv`` is set for it); ``--model q4_1`` the demo GGUF (SmolLM2-135M-Instruct
Q4_1), whose 8-bit head has no copy (only the argmax moves into the call);
``--model llama-124m`` bench_kernel_choice's random 12-layer, 768-hidden Llama (float32, gemv).

Run: ``python bench/ab_greedy_step.py --model float32 --threads 1,2 --rounds 7 --tokens 128``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import genkit
from genkit.models import kernel_choice
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, ensure_demo_model, genkit_home

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_rounds import alternate  # noqa: E402
from bench_kernel_choice import _models  # noqa: E402


def set_greedy(model: Any, token_alone: bool) -> None:
    """Greedy steps through the model's ``greedy_step`` (its own method), or through the logits
    (an instance attribute that answers None shadows it: the path before the change)."""
    if token_alone:
        model.__dict__.pop("greedy_step", None)
    else:
        model.__dict__["greedy_step"] = lambda *args: None


def load(name: str) -> Any:
    if name == "q4_1":
        return genkit.load_model(demo_gguf_path(f"{genkit_home()}/bench-gguf"))
    os.environ[kernel_choice.ENV] = "decode:gemv"  # the route whose head has the 8-bit copy
    folder = ensure_demo_model() if name == "float32" else _models("llama-124m")[1]
    return genkit.load_model(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", choices=("q4_1", "float32", "llama-124m"), default="float32")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    model = load(args.model)
    ids = torch.randint(3, 30000, (1, 12), generator=torch.Generator().manual_seed(1))
    alternate(model, ids, ("logits", "token alone"), set_greedy, [int(t) for t in args.threads.split(",")],
              args.rounds, args.tokens, args.model)

if __name__ == "__main__":
    main()
