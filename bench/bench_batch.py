"""``genkit batch`` rows/s on SmolLM2-135M-Instruct: the local engine (continuous batching and
static left-padded batches) vs Ray Data with 1 and 2 actors, same rows, same run (issue 17).

Rows: ``--rows`` prompts (the demo sentences, repeated), ``--new`` new tokens each, greedy, no EOS
(every row makes all its tokens); batch size 16 (rows per step or per ``generate`` call, and rows
per Ray ``map_batches`` call); one job each, committed in chunks of 64. Each engine loads the
model itself (included in its time, as in a real job; the load alone is printed). ``--threads``
torch threads per engine: the local engines set it, each Ray actor gets that many CPUs (Ray sets
its OMP threads to match), and the local Ray cluster has 2 x threads CPUs. Output rows are compared
with the local static engine's. ``--repeats N`` runs N rounds over the four engines (interleaved,
so a busy spell on a shared machine spreads over them) and counts each engine's best time.
Run: ``python bench/bench_batch.py [--rows 128] [--new 32] [--threads 1] [--repeats 1]``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import BATCH_PROMPTS, demo_paths  # noqa: E402

ENGINES = ("local, continuous", "local, static", "ray, 1 actor", "ray, 2 actors")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all engines; the best time counts")
    args = parser.parse_args()
    import ray
    import torch

    import genkit
    from genkit.batch import make_local_engine, run_batch
    from genkit.ray import RayEngine

    torch.set_num_threads(args.threads)
    _gguf, folder = demo_paths()
    work = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, work, True)
    src = os.path.join(work, "in.jsonl")
    with open(src, "w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": i, "prompt": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]}) + "\n")
    kwargs = {"max_new_tokens": args.new, "do_sample": False, "eos_token_id": None}
    times: dict[str, list[float]] = {}
    t = time.perf_counter()
    genkit.load_model(folder), genkit.load_tokenizer(folder)
    load = time.perf_counter() - t
    ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=False)
    outputs: dict[str, str] = {}
    for repeat in range(args.repeats):  # rounds interleave the engines, so a busy spell spreads over them
        for name in ENGINES:
            dst = os.path.join(work, f"{name.replace(', ', '-').replace(' ', '')}-{repeat}.jsonl")
            t = time.perf_counter()
            if name.startswith("local"):
                batching = name.split(", ")[1]
                engine = make_local_engine(genkit.load_model(folder), genkit.load_tokenizer(folder), kwargs,
                                           batch_size=args.batch_size, batching=batching)
                with torch.inference_mode():
                    run_batch(src, dst, engine, chunk_size=64)
            else:
                engine = RayEngine(folder, kwargs, batch_size=args.batch_size, workers=int(name.split(", ")[1][0]),
                                   num_cpus=args.threads)
                run_batch(src, dst, engine, chunk_size=64)
            times.setdefault(name, []).append(time.perf_counter() - t)
            outputs.setdefault(name, open(dst).read())
            print(f"round {repeat + 1}, {name}: {times[name][-1]:.1f} s", flush=True)
    ray.shutdown()
    print(f"\nSmolLM2-135M-Instruct fp32, {os.cpu_count()} cores, {args.threads} thread(s) per engine/actor, "
          f"torch {torch.__version__}, ray {ray.__version__}; {args.rows} rows, {args.new} new tokens each, greedy, "
          f"batch {args.batch_size}; model load alone {load:.1f} s (included below); best of {args.repeats}")
    base = min(times["local, continuous"])
    print("| engine | seconds, best (all) | rows/s | tokens/s | vs local continuous | same rows as local static |")
    print("|---|---|---|---|---|---|")
    for name, secs in times.items():
        best = min(secs)
        print(f"| {name} | {best:.1f} ({', '.join(f'{x:.1f}' for x in secs)}) | {args.rows / best:.2f} | "
              f"{args.rows * args.new / best:.1f} | {base / best:.2f}x | {outputs[name] == outputs['local, static']} |")


if __name__ == "__main__":
    main()
