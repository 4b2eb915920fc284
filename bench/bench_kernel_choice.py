"""Float32 batch-1 greedy with each dense kernel path, against transformers, on this CPU.

For the random 12-layer, 768-hidden Llama (~124M) and SmolLM2-135M-Instruct (float32, from the demo
GGUF), at each thread count: genkit with the per-CPU kernel choice (``genkit.models.kernel_choice``:
what it picked and why is printed), genkit forced to oneDNN-packed weights, genkit forced to plain
weights, genkit forced to its own matrix-vector kernel (``GENKIT_KERNEL=gemv``), and transformers, in interleaved rounds (median ms per token of ``--rounds``), the tokens of
each compared with transformers'.

Run: ``python bench/bench_kernel_choice.py --threads 1,2 --rounds 5``

``--clock cpu`` (``--threads 1`` only) times each generation by the CPU time of the one thread that
runs it (``time.thread_time``) instead of the wall clock: on a machine other work shares, the time
this process waits for a core is left out (the memory bandwidth the others take is not).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import genkit
from genkit.models import kernel_choice
from genkit.models.cpu import describe

BASE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, max_position_embeddings=1024, tie_word_embeddings=False)


def _models(name: str) -> tuple[Any, str]:
    import transformers

    if name == "llama-124m":
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, eos_token_id=None, pad_token_id=0)).eval()
        folder = tempfile.mkdtemp(prefix="bench-kc-")
        atexit.register(shutil.rmtree, folder, True)  # 0.5 GB of weights: not left in /tmp
        hf.save_pretrained(folder)
        return hf, folder
    from genkit.models.demo import ensure_demo_model

    folder = ensure_demo_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf, folder


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = CLOCKS["wall"]
FORCED = {"genkit gemv": "gemv"}  # engines whose path GENKIT_KERNEL forces at their first generation


def _engines(hf: Any, folder: str) -> dict[str, Any]:
    engines: dict[str, Any] = {"transformers": hf}
    for label, packing in (("genkit (choice)", None), ("genkit packed", True), ("genkit plain", False),
                           ("genkit gemv", None)):
        model = genkit.load_model(folder)
        model.cpu_weight_packing = packing
        engines[label] = model
    return engines


def _warm_up(engines: dict[str, Any], ids: torch.Tensor) -> None:
    """One short generation per engine: the kernel choice's probe (or GENKIT_KERNEL's forced path)."""
    for e, m in engines.items():
        if e in FORCED:
            os.environ[kernel_choice.ENV] = FORCED[e]
        try:
            _decode(m, ids, 4)
        finally:
            os.environ.pop(kernel_choice.ENV, None)


def _decode(model: Any, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = CLOCK()
        out = model.generate(ids, max_new_tokens=new + 1, **kw)
        full = CLOCK() - t
        t = CLOCK()
        model.generate(ids, max_new_tokens=1, **kw)
        one = CLOCK() - t
    return (full - one) / new * 1e3, out[0, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--models", default="llama-124m,smollm2")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the generating thread's CPU time (--threads 1 only)")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    if args.clock == "cpu" and args.threads != "1":
        ap.error(f"--clock cpu times one thread: use it with --threads 1 (got --threads {args.threads})")
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); {args.clock} clock; median ms/token of "
          f"{args.rounds} interleaved rounds, batch 1, greedy, {args.new_tokens} new tokens\n")
    print("| model | threads | engine | ms/token | tok/s | vs transformers | tokens as transformers |\n"
          "|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        hf, folder = _models(name)
        ids = torch.randint(3, 30000, (1, 16), generator=torch.Generator().manual_seed(0))
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            engines = _engines(hf, folder)  # the choice is made at the first generation, for this thread count
            times: dict[str, list[float]] = {e: [] for e in engines}
            tokens: dict[str, list[int]] = {}
            _warm_up(engines, ids)  # the choice's probe, at this thread count
            for _ in range(args.rounds):
                for e, m in engines.items():
                    ms, tokens[e] = _decode(m, ids, args.new_tokens)
                    times[e].append(ms)
            ref = statistics.median(times["transformers"])
            for e in engines:
                ms = statistics.median(times[e])
                print(f"| {name} | {threads} | {e} | {ms:.2f} | {1e3 / ms:.1f} | {ref / ms:.2f}x | "
                      f"{tokens[e] == tokens['transformers']} |", flush=True)
            choice = engines["genkit (choice)"]._prepared[1].choice
            if choice is not None:
                print(f"|  |  | choice: {choice.paths} ({choice.reasons['decode']}) | | | | |")
            kernel_choice.CHOSEN.clear()


if __name__ == "__main__":
    main()
