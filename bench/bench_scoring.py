"""Benchmark: scoring prompts (each token's log-probability given the tokens before it, the best
alternative, the rank), what an evaluation harness's loglikelihood tasks cost, on SmolLM2-135M
(the demo model), CPU.

Engines (same process, interleaved rounds, median reported):
  genkit        -- ``genkit.score_prompt(model, ids, top_n=1)`` on the native float32 model
  genkit-q4     -- the same on the Q4_1 GGUF as genkit loads it (4-bit weights, the block kernel)
  transformers  -- what lm-evaluation-harness's ``hf`` model does per request: one forward of
                   transformers' LlamaForCausalLM (float32, from the same GGUF) over the prompt,
                   ``log_softmax``, the tokens' log-probabilities and the greedy check (argmax)
Prompt lengths 128 and 512 tokens (a slice of a fixed text, repeated as needed). The ratio printed
is transformers' time over genkit's. The float32 log-probabilities of genkit and transformers are
compared (the largest difference is printed) so the speed is that of the same answer.

    python bench/bench_scoring.py --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import demo_paths  # noqa: E402

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. ")


def transformers_score(model, ids: torch.Tensor) -> torch.Tensor:
    """lm-eval's hf loglikelihood of one request: log-probabilities of ids[1:], and whether each is the argmax."""
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        own = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        greedy = lp.argmax(-1) == ids[0, 1:]
    return torch.where(greedy, own, own)  # (the check computed, as lm-eval does; the values unchanged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="128,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import genkit

    gguf, folder = demo_paths()
    tokenizer = genkit.load_tokenizer(folder)
    ours = genkit.load_model(folder, dtype=torch.float32)
    quant = genkit.load_model(gguf)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                               dtype=torch.float32).eval()
    text_ids = tokenizer.encode(TEXT * 40)
    engines = {
        "genkit": lambda ids: torch.tensor([s.logprob for s in genkit.score_prompt(ours, ids, top_n=1).tokens]),
        "genkit-q4": lambda ids: torch.tensor([s.logprob for s in genkit.score_prompt(quant, ids, top_n=1).tokens]),
        "transformers": lambda ids: transformers_score(theirs, ids),
    }
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {args.threads}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    for length in (int(x) for x in args.lengths.split(",")):
        ids = torch.tensor([text_ids[:length]])
        answers = {name: run(ids) for name, run in engines.items()}  # warm-up, and the answers compared
        diff = (answers["genkit"] - answers["transformers"]).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, run in engines.items():
                start = time.perf_counter()
                run(ids)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        ref = med["transformers"]
        cells = ", ".join(f"{name} {med[name] * 1e3:.1f} ms ({ref / med[name]:.2f}x)" for name in engines)
        print(f"prompt {length} tokens: {cells}; float32 max |genkit - transformers| log-prob {diff:.2e}")


if __name__ == "__main__":
    main()
