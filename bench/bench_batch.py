"""``genkit batch`` rows/s on SmolLM2-135M-Instruct: the local engine (continuous batching and
static left-padded batches) vs Ray Data with 1 and 2 actors, same rows, same run (issue 17).

Rows: ``--rows`` prompts (the demo sentences, repeated), ``--new`` new tokens each, greedy, no EOS
(every row makes all its tokens); batch size 16 (rows per step or per ``generate`` call, and rows
per Ray ``map_batches`` call); one job each, committed in chunks of 64. Each engine loads the
model itself (included in its time, as in a real job; the load alone is printed). ``--threads``
torch threads per engine: the local engines set it, each Ray actor gets that many CPUs (Ray sets
its OMP threads to match), and the local Ray cluster has 2 x threads CPUs. Output rows are compared
with the local static engine's.
Run: ``python bench/bench_batch.py [--rows 128] [--new 32] [--threads 1]``.
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
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    import ray
    import torch

    import genkit
    from genkit.batch import make_local_engine, run_batch
    from genkit.ray import RayEngine

    torch.set_num_threads(args.threads)
    _gguf, folder = demo_paths()
    work = tempfile.mkdtemp()
    src = os.path.join(work, "in.jsonl")
    with open(src, "w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": i, "prompt": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]}) + "\n")
    kwargs = {"max_new_tokens": args.new, "do_sample": False, "eos_token_id": None}
    results: dict[str, float] = {}
    t = time.perf_counter()
    genkit.load_model(folder), genkit.load_tokenizer(folder)
    load = time.perf_counter() - t
    for batching in ("continuous", "static"):
        t = time.perf_counter()
        engine = make_local_engine(genkit.load_model(folder), genkit.load_tokenizer(folder), kwargs,
                                   batch_size=args.batch_size, batching=batching)
        with torch.inference_mode():
            run_batch(src, os.path.join(work, f"local-{batching}.jsonl"), engine, chunk_size=64)
        results[f"local, {batching}"] = time.perf_counter() - t
        print(f"local {batching}: {results[f'local, {batching}']:.1f} s", flush=True)
    ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=False)
    for workers in (1, 2):
        t = time.perf_counter()
        engine = RayEngine(folder, kwargs, batch_size=args.batch_size, workers=workers,
                           num_cpus=args.threads)
        run_batch(src, os.path.join(work, f"ray{workers}.jsonl"), engine, chunk_size=64)
        name = f"ray, {workers} actor{'s' if workers > 1 else ''}"
        results[name] = time.perf_counter() - t
        print(f"{name}: {results[name]:.1f} s", flush=True)
    ray.shutdown()
    ref = open(os.path.join(work, "local-static.jsonl")).read()
    files = {"local, continuous": "local-continuous.jsonl", "local, static": "local-static.jsonl",
             "ray, 1 actor": "ray1.jsonl", "ray, 2 actors": "ray2.jsonl"}
    same = {name: open(os.path.join(work, f)).read() == ref for name, f in files.items()}
    print(f"\nSmolLM2-135M-Instruct fp32, {os.cpu_count()} cores, {args.threads} thread(s) per engine/actor, "
          f"torch {torch.__version__}, ray {ray.__version__}; {args.rows} rows, {args.new} new tokens each, greedy, "
          f"batch {args.batch_size}; model load alone {load:.1f} s (included below)")
    base = results["local, continuous"]
    print("| engine | seconds | rows/s | tokens/s | vs local continuous | same rows as local static |")
    print("|---|---|---|---|---|---|")
    for name, secs in results.items():
        print(f"| {name} | {secs:.1f} | {args.rows / secs:.2f} | {args.rows * args.new / secs:.1f} | "
              f"{base / secs:.2f}x | {same[name]} |")


if __name__ == "__main__":
    main()
