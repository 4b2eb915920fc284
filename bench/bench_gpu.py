"""Benchmark: genkit vs transformers on a GPU, same random weights, same process, interleaved rounds.

Models (random weights, saved once by transformers and loaded by both, so the weights are the same):
  smollm2-135m -- SmolLM2-135M's shape (30 layers, hidden 576, GQA 9/3, vocab 49152)
  llama-1b     -- Llama 3.2 1B's shape (16 layers, hidden 2048, GQA 32/8, vocab 128256)
Workloads (EOS off, so every run makes the requested tokens):
  batch1_greedy_128  -- batch 1, greedy, 128 new tokens (tokens compared between the engines)
  batch8_sample_64   -- batch 8, top-k 50 sampling, 64 new tokens
  cb32_greedy_64     -- continuous batching: ``generate_batch`` of 32 prompts of 8-96 tokens, greedy,
                        64 new tokens each (transformers 5's own ``generate_batch``; tokens compared)
The time of each run ends with torch.cuda.synchronize(); the median of the rounds is reported.

    python bench/bench_gpu.py --rounds 3 [--models smollm2-135m:float32,llama-1b:bfloat16] [--no-cb]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import first_difference  # noqa: E402  (the same comparison as bench_models.py)

SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
                     "rope_theta": 100000.0},
    "llama-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                 "rope_theta": 500000.0},
}
WORKLOADS = {"batch1_greedy_128": (1, 128, False), "batch8_sample_64": (8, 64, True)}


def save_random(shape: str, dtype: torch.dtype, folder: str, device: str) -> None:
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)


def load_both(folder: str, dtype: torch.dtype, device: str) -> dict:
    import transformers

    import genkit

    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval().to(device)
    ours = genkit.load_model(folder, dtype=dtype, device=device)
    for m in (hf, ours):
        m.generation_config.eos_token_id = None
    return {"genkit": ours, "transformers": hf}


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run(model, ids: torch.Tensor, new: int, sample: bool) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    sync(str(ids.device))
    t = time.perf_counter()
    with torch.inference_mode():
        kw = {"do_sample": True, "top_k": 50} if sample else {"do_sample": False}
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             pad_token_id=0, **kw)
    sync(str(ids.device))
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return time.perf_counter() - t, out


def run_batch(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """``generate_batch`` (continuous batching) of ``prompts``, greedy: (seconds, tokens per prompt)."""
    import transformers

    device = str(next(model.parameters()).device)
    sync(device)
    t = time.perf_counter()
    if not isinstance(model, transformers.PreTrainedModel):  # genkit's
        out = model.generate_batch(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
    else:
        config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate_batch(prompts, generation_config=config)
    sync(device)
    seconds = time.perf_counter() - t
    return seconds, [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[1]))]


def bench_batch(models: dict, vocab: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(8, 97, (32,), generator=g)]
    for m in models.values():  # warm-up
        run_batch(m, prompts[:2], 4)
    times: dict[str, list[float]] = {e: [] for e in models}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for e, m in models.items():
            seconds, outs[e] = run_batch(m, prompts, 64)
            times[e].append(seconds)
    row = {f"{e}_tok_s": 32 * 64 / statistics.median(t) for e, t in times.items()}
    row["genkit/transformers"] = row["genkit_tok_s"] / row["transformers_tok_s"]
    row["same_tokens"] = sum(a == b for a, b in zip(outs["genkit"], outs["transformers"]))
    return row


def bench_model(shape: str, dtype: torch.dtype, device: str, rounds: int, cb: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        save_random(shape, dtype, folder, device)
        models = load_both(folder, dtype, device)
    g = torch.Generator().manual_seed(1)
    result: dict = {}
    for wname, (batch, new, sample) in WORKLOADS.items():
        ids = torch.randint(3, SHAPES[shape]["vocab_size"], (batch, 24), generator=g).to(device)
        times: dict[str, list[float]] = {e: [] for e in models}
        outs = {}
        for e, m in models.items():  # warm-up
            run(m, ids, 8, sample)
        for _ in range(rounds):
            for e, m in models.items():
                seconds, outs[e] = run(m, ids, new, sample)
                times[e].append(seconds)
        tokens = batch * new
        row = {f"{e}_tok_s": tokens / statistics.median(t) for e, t in times.items()}
        row["genkit/transformers"] = row["genkit_tok_s"] / row["transformers_tok_s"]
        if not sample:
            row["first_difference"] = first_difference(outs["genkit"][:, 24:], outs["transformers"][:, 24:])
        result[wname] = row
    if cb:
        result["cb32_greedy_64"] = bench_batch(models, SHAPES[shape]["vocab_size"], rounds)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per workload (after one warm-up)")
    ap.add_argument("--models", default="smollm2-135m:float32,smollm2-135m:bfloat16,llama-1b:bfloat16",
                    help=f"comma-separated shape:dtype pairs (shapes: {', '.join(SHAPES)})")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-cb", action="store_true", help="leave out the continuous batching workload")
    args = ap.parse_args()
    from genkit.models.cpu import describe

    print(describe(), flush=True)  # the CPU kind these figures belong to
    import transformers

    name = torch.cuda.get_device_name(args.device) if "cuda" in args.device else "CPU"
    print(f"{name}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, rounds={args.rounds} (median)")
    print(f"{'model':<24} {'workload':<18} {'genkit tok/s':>13} {'HF tok/s':>9} {'genkit/HF':>10}  greedy tokens")
    results = {}
    for item in args.models.split(","):
        shape, dtype_name = item.split(":")
        r = bench_model(shape, getattr(torch, dtype_name), args.device, args.rounds, cb=not args.no_cb)
        results[item] = r
        for wname, row in r.items():
            same = "" if "first_difference" not in row else (
                "identical" if row["first_difference"] is None else f"differ from new token {row['first_difference']}")
            if "same_tokens" in row:
                same = f"{row['same_tokens']} of 32 prompts identical"
            print(f"{item:<24} {wname:<18} {row['genkit_tok_s']:>13.1f} {row['transformers_tok_s']:>9.1f} "
                  f"{row['genkit/transformers']:>9.2f}x  {same}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
