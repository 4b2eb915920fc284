"""Continuous batching's plain greedy steps giving the tokens alone, against the same steps giving
every logit.

Since session 20, a continuous-batching step whose requests are all plain greedy (no logits
processor, no stopping criterion but EOS and length, no log-probabilities) and that runs in one
block-kernel call asks the model for their tokens alone (``forward_paged(batch, store,
greedy=True)``): a float32 head is read through the 8-bit copy greedy ``generate`` reads, with only
the rows that can hold each request's maximum computed exactly (``gk_argmax`` in
genkit/models/block_kernel.c). This times both ways on one started manager, round after round
(alternating: a machine whose speed drifts moves both alike), each round ``N`` of the continuous
batching benchmark's prompts added at once with ``--tokens`` new tokens each, and says whether both
gave the same tokens. "logits" is the manager with that path switched off (its ``_paged_greedy``
flag, which the manager sets from the model's ``forward_paged`` signature).

``--model float32``: the demo GGUF de-quantized to float32, on the kernel choice this CPU makes
(``gemv`` for one row; for more rows where ``gemv`` won the ``small`` class: at most 16 rows run in
one call, the rest as torch modules, where both ways are the same); ``--model q4_1``: the GGUF kept
quantized (its 8-bit head has no copy: only the argmax moves into the call).

Run: ``python bench/ab_paged_greedy.py --model float32 --threads 1,2 --requests 1,4,16 --rounds 5``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

import genkit
from genkit.continuous.manager import ContinuousBatchingManager
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, genkit_home

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_continuous_batching import prompts_for  # noqa: E402


def _round(manager: ContinuousBatchingManager, prompts: list[list[int]], tokens: int) -> tuple[float, list[Any]]:
    """Tokens per second of ``prompts`` added at once, and each one's tokens."""
    t = time.perf_counter()
    rids = [manager.add_request(p, max_new_tokens=tokens, eos_token_id=None, do_sample=False) for p in prompts]
    got = [manager.get_result(rid, timeout=600) for rid in rids]
    return len(prompts) * tokens / (time.perf_counter() - t), [o.generated_tokens for o in got]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("float32", "q4_1"), default="float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    print(describe(), flush=True)
    path = demo_gguf_path(genkit_home())
    model = genkit.load_model(path, dequantize=args.model == "float32")
    prompts = prompts_for(genkit.load_tokenizer(path))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        with ContinuousBatchingManager(model) as manager:
            for n in (int(r) for r in args.requests.split(",")):
                rates: dict[bool, list[float]] = {False: [], True: []}
                out: dict[bool, list[Any]] = {}
                for rnd in range(args.rounds + 1):  # round 0 warms up (and makes the head's copy)
                    for greedy in (False, True):
                        manager._paged_greedy = greedy
                        rate, out[greedy] = _round(manager, prompts[:n], args.tokens if rnd else 4)
                        if rnd:
                            rates[greedy].append(rate)
                a, b = (statistics.median(rates[g]) for g in (False, True))
                print(f"{args.model}, {threads} thread(s), {n} request(s), medians of {args.rounds} (tok/s): logits "
                      f"{a:.1f}  greedy tokens {b:.1f} ({b / a:.3f}x); "
                      f"{'same tokens' if out[False] == out[True] else 'TOKENS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
