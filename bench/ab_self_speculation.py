"""Exact self-speculative greedy steps against one token per step, and both against transformers.

Greedy search on a float32 model on the dense one-call decoder (the ``gemv`` route) drafts tokens
with an 8-bit copy of the model and checks them with the model in one step
(:mod:`genkit.models.self_speculation`); ``model.self_speculation = False`` runs one token per step.
This times transformers' ``generate``, genkit one token per step (``self_speculation = False``) and
genkit as it runs by default (``None``: self-speculation where it is measured faster) in one
process, round after round (alternating, so that a machine whose speed drifts moves all alike), prints the medians, the ratios against transformers and against one token per step, whether all
gave the same greedy tokens, and the drafts kept per check.

Models: ``smollm2`` (the demo model's float32 conversion, SmolLM2-135M-Instruct) and
``llama-124m`` (bench_kernel_choice's random 12-layer, 768-hidden Llama). Prompts: ``--prompt
random`` (12 random token ids, bench_kernel_choice's protocol) or ``text`` (a chat-style English
request through the model's tokenizer, or with ``--context N`` the first N tokens of this
repository's README and model docs; smollm2 only: the 124M Llama always gets the random ids).

Run: ``python bench/ab_self_speculation.py --models smollm2,llama-124m --threads 1,2 --rounds 5``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

import genkit
from genkit.models import kernel_choice
from genkit.models.cpu import describe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel_choice import _decode, _models  # noqa: E402

TEXT = ("<|im_start|>user\nWrite a short paragraph about why the sea is salty, for a curious child."
        "<|im_end|>\n<|im_start|>assistant\n")
WAYS = ("transformers", "genkit one token", "genkit self-spec")


def _prompt(kind: str, folder: str, context: int = 0) -> torch.Tensor:
    if kind == "text":
        if context:  # a long prompt: this repository's README and model docs, cut to `context` tokens
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            text = "".join(open(os.path.join(root, f), encoding="utf-8").read() for f in ("README.md", "docs/models.md"))
            ids = genkit.load_tokenizer(folder)(text, return_tensors="pt")["input_ids"]
            if ids.shape[1] < context:
                raise SystemExit(f"--context {context}: the text holds only {ids.shape[1]} tokens")
            return ids[:, :context]
        return genkit.load_tokenizer(folder)(TEXT, return_tensors="pt")["input_ids"]
    return torch.randint(3, 30000, (1, 12), generator=torch.Generator().manual_seed(1))


def _run(engines: dict[str, Any], ids: torch.Tensor, threads: int, rounds: int, tokens: int, label: str) -> None:
    torch.set_num_threads(threads)
    rates: dict[str, list[float]] = {w: [] for w in WAYS}
    out: dict[str, list[int]] = {}
    spec = engines["genkit self-spec"]
    for rnd in range(rounds + 1):  # round 0 warms up (faults the weights in, makes the draft)
        for way in WAYS:
            model = engines[way]
            if way.startswith("genkit"):
                model.self_speculation = None if way == "genkit self-spec" else False  # (None: the default)
            ms, out[way] = _decode(model, ids, tokens if rnd else 4)
            if rnd:
                rates[way].append(1e3 / ms)
    med = {w: statistics.median(rates[w]) for w in WAYS}
    same = len({tuple(t) for t in out.values()}) == 1
    stats = spec.speculation_stats or {}
    kept = stats.get("accepted", 0) / max(1, stats.get("checks", 0))
    print(f"{label}, {threads} thread(s), medians of {rounds} (tok/s): "
          + ", ".join(f"{w} {med[w]:.1f}" for w in WAYS)
          + f"; vs transformers: one token {med[WAYS[1]] / med[WAYS[0]]:.2f}x, self-spec "
          f"{med[WAYS[2]] / med[WAYS[0]]:.2f}x; self-spec / one token {med[WAYS[2]] / med[WAYS[1]]:.3f}x; "
          f"{'same tokens' if same else 'TOKENS DIFFER'}; drafts kept per check {kept:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="smollm2,llama-124m")
    ap.add_argument("--prompt", choices=("random", "text"), default="random",
                    help="random: 12 random ids; text: a chat request (smollm2; the 124M Llama, whose weights "
                         "are random, always gets the random ids)")
    ap.add_argument("--context", type=int, default=0,
                    help="with --prompt text: a prompt of this many tokens of README.md and docs/models.md instead")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    os.environ[kernel_choice.ENV] = "decode:gemv"  # the route self-speculation runs on
    for name in args.models.split(","):
        hf, folder = _models(name)
        engines = {WAYS[0]: hf, WAYS[1]: genkit.load_model(folder)}
        engines[WAYS[2]] = engines[WAYS[1]]  # the same model, switched between rounds
        kind = args.prompt if name == "smollm2" else "random"
        ids = _prompt(kind, folder, args.context)
        label = f"{name} ({kind} prompt, {ids.shape[1]} tokens)"
        for n in [int(t) for t in args.threads.split(",")]:
            _run(engines, ids, n, args.rounds, args.tokens, label)


if __name__ == "__main__":
    main()
