"""Contrastive search, DoLa and early exit against genkit's own greedy search, same run.

On SmolLM2-135M-Instruct (the demo model, ``genkit.load_model("smollm2")``), batch 1, 128 new
tokens (``eos_token_id=None``, so every run makes all of them). Each strategy is timed alternately
with greedy search (best of ``--repeats`` runs each, after a warm-up), and reported as milliseconds
per new token and as a ratio to greedy's time per token measured next to it.

* contrastive search: ``penalty_alpha=0.6, top_k=4`` (and with ``low_memory=True``);
* DoLa: ``dola_layers="high"`` and ``"low"`` (and ``"high"`` with ``repetition_penalty=1.2``,
  against greedy with the same penalty);
* early exit: ``assistant_early_exit`` = 6, 10 and 15 (of 30 layers) on three prompts, with the
  default draft policy (up to 20 tokens, confidence threshold 0.4): acceptance rate (accepted /
  drafted tokens), full-model passes and speed against greedy. Early exit's tokens are checked to
  be greedy's.

Run: ``python bench/bench_strategies.py [--threads N] [--repeats R] [--new-tokens T]``.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

import genkit

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


class _Stats(logging.Handler):
    """Keeps the counts early-exit decoding logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, "early_exit", None)
        if stats is not None:
            self.last = stats


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _pair(model: Any, ids: Any, new: int, repeats: int, base: dict[str, Any], kwargs: dict[str, Any]) -> tuple[
        float, float, Any, Any]:
    """Best times (greedy with ``base``, strategy with ``base`` + ``kwargs``), alternating; and their outputs."""
    common = dict(max_new_tokens=new, eos_token_id=None, pad_token_id=0, **base)
    run_greedy = lambda: model.generate(**ids, **common)  # noqa: E731
    run_strategy = lambda: model.generate(**ids, **common, **kwargs)  # noqa: E731
    run_greedy()
    run_strategy()
    t_greedy = t_strategy = float("inf")
    out_greedy = out_strategy = None
    for _ in range(repeats):
        t, out_greedy = _best(run_greedy, 1)
        t_greedy = min(t_greedy, t)
        t, out_strategy = _best(run_strategy, 1)
        t_strategy = min(t_strategy, t)
    return t_greedy, t_strategy, out_greedy, out_strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--only", default=None, help="run only the table rows whose name contains this text, "
                                                     "and no early-exit table (e.g. --only DoLa)")
    parser.add_argument("--early-exit-only", action="store_true", help="only the early-exit table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = genkit.load_model("smollm2")
    tok = genkit.load_tokenizer("smollm2")
    new = args.new_tokens
    print(f"SmolLM2-135M-Instruct ({model.config.num_hidden_layers} layers, {model.dtype}), batch 1, {new} new "
          f"tokens, {args.threads} thread(s), best of {args.repeats}; torch {torch.__version__}")

    ids = tok(PROMPTS[0], return_tensors="pt")
    print("\n| strategy | ms/token | greedy ms/token (same run) | ratio |\n|---|---|---|---|")
    cases = [
        ("contrastive search, penalty_alpha=0.6, top_k=4", {}, {"penalty_alpha": 0.6, "top_k": 4}),
        ("contrastive search, top_k=4, low_memory=True", {}, {"penalty_alpha": 0.6, "top_k": 4, "low_memory": True}),
        ('DoLa, dola_layers="high"', {}, {"dola_layers": "high"}),
        ('DoLa, dola_layers="low"', {}, {"dola_layers": "low"}),
        ('DoLa, "high", repetition_penalty=1.2 (greedy with the same penalty)', {"repetition_penalty": 1.2},
         {"dola_layers": "high"}),
    ]
    for name, base, kwargs in cases:
        if (args.only and args.only not in name) or args.early_exit_only:
            continue
        t_greedy, t_strategy, _, _ = _pair(model, ids, new, args.repeats, base, kwargs)
        print(f"| {name} | {1e3 * t_strategy / new:.2f} | {1e3 * t_greedy / new:.2f} | {t_strategy / t_greedy:.2f}x |")

    if args.only:
        return
    stats = _Stats()
    logger = logging.getLogger("genkit.early_exit")
    logger.addHandler(stats)
    logger.setLevel(logging.INFO)
    print("\n| exit layer | prompt | acceptance | full passes | ms/token | greedy ms/token | speed vs greedy | "
          "same tokens |\n|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for layer in (6, 10, 15):
        for p, prompt in enumerate(PROMPTS):
            ids = tok(prompt, return_tensors="pt")
            t_greedy, t_strategy, out_greedy, out_strategy = _pair(model, ids, new, args.repeats, {},
                                                                   {"assistant_early_exit": layer})
            s = stats.last
            rate = s["accepted"] / max(1, s["drafted"])
            totals.setdefault(layer, []).append(t_greedy / t_strategy)
            print(f"| {layer} | {p + 1} | {rate:.0%} ({s['accepted']}/{s['drafted']}) | {s['full_passes']} | "
                  f"{1e3 * t_strategy / new:.2f} | {1e3 * t_greedy / new:.2f} | {t_greedy / t_strategy:.2f}x | "
                  f"{torch.equal(out_greedy, out_strategy)} |")
    best = max(totals, key=lambda k: sum(totals[k]) / len(totals[k]))
    print("\nmean speed vs greedy: " + ", ".join(f"layer {k}: {sum(v) / len(v):.2f}x" for k, v in totals.items())
          + f"; best exit layer: {best}")


if __name__ == "__main__":
    main()
