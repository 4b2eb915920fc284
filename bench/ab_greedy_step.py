"""Greedy steps that give the token alone, against the same steps giving every logit.

Since session 15, greedy search with nothing else reading a step's scores asks the model for the
argmax alone (:meth:`genkit.strategy.Stepper.forward_greedy`, the model's ``greedy_step``): the
one-call step takes the argmax in the kernel call, and a float32 head (the ``gemv`` route) is read
through an 8-bit copy, with only the rows that can hold the maximum computed exactly
(``gk_decode_top`` in genkit/models/block_kernel.c). This times both ways in one process, round
after round (alternating, so that a machine whose speed drifts moves both alike), and says whether
both gave the same greedy tokens.

"logits" is the path every step took before: an instance attribute ``greedy_step`` that answers
None shadows the model's method, so each step runs ``forward`` and the strategy takes the argmax.
``--sample`` times top-k sampling instead (``top_k=50, temperature=0.7, top_p=0.9``, seeded: the
same draws both ways), whose steps give only the logits that can be among the 50 largest
(``top_logits_step``), against the same steps giving every logit.
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
import time
from typing import Any

import torch

import genkit
from genkit.models import kernel_choice
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, ensure_demo_model, genkit_home

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_rounds import alternate  # noqa: E402
from bench_kernel_choice import _models  # noqa: E402


def switch(name: str) -> Any:
    """Steps through the model's own ``name`` (``greedy_step``, ``top_logits_step``), or through the
    logits (an instance attribute that answers None shadows it: the path before the change)."""

    def set_way(model: Any, new_way: bool) -> None:
        if new_way:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = lambda *args: None

    return set_way


def sample(model: Any, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    """ms per token of seeded top-k sampling (a 1-token run's time taken off, as bench_kernel_choice's
    ``_decode``) and the tokens."""
    kw = dict(do_sample=True, top_k=50, temperature=0.7, top_p=0.9, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(0)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new + 1, **kw)
        full = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        one = time.perf_counter() - t
    return (full - one) / new * 1e3, out[0, ids.shape[1]:].tolist()


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
    ap.add_argument("--sample", action="store_true", help="top-k sampling instead of greedy search")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    model = load(args.model)
    ids = torch.randint(3, 30000, (1, 12), generator=torch.Generator().manual_seed(1))
    threads = [int(t) for t in args.threads.split(",")]
    if args.sample:
        alternate(model, ids, ("logits", "top-k logits"), switch("top_logits_step"), threads, args.rounds, args.tokens,
                  f"{args.model}, top-k sampling", decode=sample)
    else:
        alternate(model, ids, ("logits", "token alone"), switch("greedy_step"), threads, args.rounds, args.tokens,
                  args.model)

if __name__ == "__main__":
    main()
