"""Benchmark: native GPT-2 vs transformers' GPT2LMHeadModel, float32, CPU, batch-1 greedy decode.

GPT-2 small's shapes (124M: 12 layers, hidden 768, 12 heads, vocabulary 50257, 1024 positions),
random weights made by transformers, saved and loaded by genkit (``genkit.load_model``): the same
weights in both engines. For each thread count (``--threads 1,2``): one warm-up, then ``--rounds``
interleaved rounds (genkit, transformers; the order alternates each round) of a greedy decode of
``--new`` tokens after a 16-token prompt, EOS disabled so every run makes every token; median
tokens/s per engine, the ratio of the medians, the median of the per-round ratios, and whether
the greedy tokens are identical (the first difference otherwise). genkit's model is loaded afresh
for each thread count (its per-CPU kernel choice is made at that count) and the product route it
ran on is printed with the choice's reason (``GENKIT_KERNEL=gemv`` etc. forces one).

    OMP_NUM_THREADS=2 python bench/bench_gpt2.py --threads 1,2 --rounds 5 [--new 128]

``--batch N`` measures instead N requests of 16-64 prompt tokens, ``--new`` new tokens each, greedy, as
``genkit serve`` and ``genkit batch`` run them: genkit's continuous batching (``generate_batch``, what
both now run GPT-2 on), the engines they ran it on before (``genkit batch``: one left-padded
``generate`` of all; ``genkit serve``: ``generate`` one request at a time) and transformers'
continuous batching (``generate_batch``) on the same weights; best of ``--rounds``, every engine's
tokens checked against genkit's sequential ``generate``.

    python bench/bench_gpt2.py --threads 2 --batch 16 --new 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
PROMPT_LEN = 16


def build(folder: str):
    """transformers' GPT-2 with random weights, saved to ``folder`` for genkit to load."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**GPT2_SMALL, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def load_genkit(folder: str):
    import genkit

    model = genkit.load_model(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def decode(model, ids: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return elapsed, out


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).any(dim=0).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def measure(engines: dict, ids: torch.Tensor, new: int, rounds: int) -> dict[str, float]:
    """Interleaved rounds of both engines at the current thread count."""
    names = list(engines)
    for name in names:  # warm-up (first calls lay weights out, probe kernels, fault pages in)
        decode(engines[name], ids, min(new, 8))
    times: dict[str, list[float]] = {name: [] for name in names}
    outs: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            elapsed, outs[name] = decode(engines[name], ids, new)
            times[name].append(elapsed)
    result = {f"{name}_tok_s": new / statistics.median(t) for name, t in times.items()}
    result["ratio_of_medians"] = result["genkit_tok_s"] / result["transformers_tok_s"]
    result["median_round_ratio"] = statistics.median(h / g for g, h in zip(times["genkit"], times["transformers"]))
    at = first_difference(outs["genkit"][:, ids.shape[1]:], outs["transformers"][:, ids.shape[1]:])
    result["first_difference"] = -1 if at is None else at
    return result


def routes(model) -> str:
    """The product route per shape class the genkit model ran on, and why (the kernel choice)."""
    prepared = getattr(model, "_prepared", None)
    prepared = prepared[1] if prepared else None
    if prepared is None:
        return "the modules (no inference path)"
    choice = prepared.choice
    if choice is None:
        return "fixed: " + ("packed" if model.weights_packed else "plain")
    return "; ".join(f"{cls} {path} ({choice.reasons[cls][:60]})" for cls, path in choice.paths.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default: 1,2)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per thread count (after one warm-up)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per decode (default: 128)")
    ap.add_argument("--batch", type=int, default=0, help="N requests batched (see the docstring); 0: batch-1 decode")
    args = ap.parse_args()
    import transformers

    from genkit.models.cpu import describe

    print(describe(), flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}, load average {os.getloadavg()[0]:.2f}", flush=True)
    ids = torch.randint(3, GPT2_SMALL["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as folder:
        hf = build(folder)
        print(f"{'threads':>7} {'genkit tok/s':>13} {'HF tok/s':>9} {'genkit/HF':>10} {'per-round':>10}  tokens")
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            ours = load_genkit(folder)  # a fresh model: its kernel choice is made at this thread count
            if args.batch:
                batched(ours, hf, args.batch, args.new, args.rounds)
                continue
            report(threads, measure({"genkit": ours, "transformers": hf}, ids, args.new, args.rounds), ours)


def batched(ours, hf, n: int, new: int, rounds: int) -> None:
    """``n`` requests through each batching engine (see the module docstring), best of ``rounds``."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, GPT2_SMALL["vocab_size"], (int(k),), generator=g).tolist()
               for k in torch.randint(16, 65, (n,), generator=g)]
    greedy = {"max_new_tokens": new, "do_sample": False, "eos_token_id": None}

    def sequential():
        return [ours.generate(torch.tensor([p]), **greedy)[0, len(p):].tolist() for p in prompts]

    def static():
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return [row[width:].tolist() for row in ours.generate(ids, attention_mask=mask, pad_token_id=0, **greedy)]

    def continuous(model):
        return lambda: [o.generated_tokens for o in model.generate_batch(prompts, **greedy).values()]

    engines = {"genkit generate_batch (continuous)": continuous(ours), "genkit static batch (genkit batch before)":
               static, "genkit sequential generate (genkit serve before)": sequential,
               "transformers generate_batch": continuous(hf)}
    ours.generate_batch(prompts[:2], max_new_tokens=2)  # warm-up
    times, tokens = {}, {}
    with torch.inference_mode():
        for name, run in engines.items():
            times[name] = float("inf")
            for _ in range(rounds):
                t = time.perf_counter()
                tokens[name] = run()
                times[name] = min(times[name], time.perf_counter() - t)
    ref, first = tokens["genkit sequential generate (genkit serve before)"], next(iter(times))
    print(f"| engine ({n} requests, {new} new tokens each, {torch.get_num_threads()} threads) | s | tokens/s | "
          f"genkit continuous vs it | same tokens |\n|---|---|---|---|---|")
    for name, t in times.items():
        same = sum(a == b for a, b in zip(tokens[name], ref))
        print(f"| {name} | {t:.2f} | {n * new / t:.1f} | {t / times[first]:.2f}x | {same}/{n} |", flush=True)


def report(threads: int, r: dict[str, float], ours) -> None:
    same = "identical" if r["first_difference"] < 0 else f"differ from new token {r['first_difference']}"
    print(f"{threads:>7} {r['genkit_tok_s']:>13.1f} {r['transformers_tok_s']:>9.1f} {r['ratio_of_medians']:>9.2f}x "
          f"{r['median_round_ratio']:>9.2f}x  {same}  (load average {os.getloadavg()[0]:.2f})", flush=True)
    print(json.dumps({"threads": threads, **r}))
    print(f"        genkit's routes: {routes(ours)}", flush=True)


if __name__ == "__main__":
    main()
