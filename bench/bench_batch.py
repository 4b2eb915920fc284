"""``genkit batch`` rows/s on SmolLM2-135M-Instruct: the local engine vs Ray Data with 1 and 2
actors, same rows, same run (issue 17).

Rows: 64 prompts (the demo sentences, repeated), 16 new tokens each, greedy; batch size 16; one
chunk. Ray runs on a local cluster of the machine's cores (``ray.init(num_cpus=...)``); each actor
loads the model once (included in its time, as in a real job). Output rows are checked identical.
Run: ``python bench/bench_batch.py [--rows N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import BATCH_PROMPTS, demo_paths  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    import ray
    import torch

    import genkit
    from genkit.batch import LocalEngine, run_batch
    from genkit.ray import RayEngine

    _gguf, folder = demo_paths()
    work = tempfile.mkdtemp()
    src = os.path.join(work, "in.jsonl")
    with open(src, "w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": i, "prompt": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]}) + "\n")
    kwargs = {"max_new_tokens": args.new, "do_sample": False, "eos_token_id": None}
    results = {}
    t = time.perf_counter()
    engine = LocalEngine(genkit.load_model(folder), genkit.load_tokenizer(folder), kwargs, batch_size=16)
    with torch.inference_mode():
        run_batch(src, os.path.join(work, "local.jsonl"), engine, chunk_size=args.rows)
    results["local"] = time.perf_counter() - t
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    for workers in (1, 2):
        t = time.perf_counter()
        run_batch(src, os.path.join(work, f"ray{workers}.jsonl"),
                  RayEngine(folder, kwargs, batch_size=16, workers=workers), chunk_size=args.rows)
        results[f"ray, {workers} actor{'s' if workers > 1 else ''}"] = time.perf_counter() - t
    ray.shutdown()
    ref = open(os.path.join(work, "local.jsonl")).read()
    same = {w: open(os.path.join(work, f"ray{w}.jsonl")).read() == ref for w in (1, 2)}
    print(f"SmolLM2-135M-Instruct fp32, {os.cpu_count()} cores, torch {torch.__version__}, ray {ray.__version__}; "
          f"{args.rows} rows, {args.new} new tokens each, greedy, batch 16 (model loading included)")
    print(f"{'engine':<16} {'seconds':>8} {'rows/s':>7} {'vs local':>9}")
    for name, secs in results.items():
        print(f"{name:<16} {secs:>8.1f} {args.rows / secs:>7.2f} {results['local'] / secs:>8.2f}x")
    print(f"ray output identical to local: 1 actor {same[1]}, 2 actors {same[2]}")


if __name__ == "__main__":
    main()
