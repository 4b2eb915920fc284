"""Time from a fresh process to the first greedy tokens of the demo GGUF (SmolLM2-135M-Instruct Q4_1):
importing genkit and torch, ``genkit.load_tokenizer``, ``genkit.load_model``, a first ``generate``.

    PYTHONPATH=<checkout> python bench/gguf_load_time.py LABEL [--tokens 8]

Run it once per process, alternating the checkouts compared (docs/benchmarks.md, "Loading a GGUF
model"); it prints one line: the stages' seconds and the tokens (the same tokens for every version).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("label", help="printed first: the version measured")
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens of the first generate")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import torch  # noqa: F401 - timed with genkit: what a user's first import costs

    import genkit
    from genkit.models.demo import demo_gguf_path, genkit_home

    t1 = time.perf_counter()
    path = demo_gguf_path(f"{genkit_home()}/bench-gguf")
    t1b = time.perf_counter()
    tok = genkit.load_tokenizer(path)
    t2 = time.perf_counter()
    model = genkit.load_model(path)
    t3 = time.perf_counter()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
    t4 = time.perf_counter()
    print(f"{args.label} import {t1 - t0:.2f} tokenizer {t2 - t1b:.2f} model {t3 - t2:.2f} "
          f"first-generate {t4 - t3:.2f} total {t4 - t0 - (t1b - t1):.2f} {out[0, -args.tokens:].tolist()}")


if __name__ == "__main__":
    main()
