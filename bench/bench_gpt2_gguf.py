"""GPT-2 GGUF files: genkit's decode against llama.cpp's on the same file, and against the tied head
genkit had before it ran on the embedding's codes.

A GPT-2 of GPT-2 small's shape (12 layers, hidden 768, 12 heads, vocabulary 50,257, 1,024 positions;
random weights made by transformers, seeded), written by the tests' helper
(tests/test_gguf_gpt2.py ``write_gpt2_gguf``, as llama.cpp's converter and llama-quantize lay it
out) with ``--qtype`` projections (Q8_0, Q4_0...) and a Q8_0 tied embedding. Per thread count, in
alternating rounds (medians):

- ``genkit``: ``genkit.load_model(file)``: the tied head on the Q8_0 table's codes (the last of its
  16-row panels padded with rows of zeros: 50,257 is not a multiple of 16), each decode step one
  block-kernel call from token id to logits;
- ``genkit, float32 head``: the same model with the table de-quantized and shared by a float32 head,
  what genkit loaded before (the head's 154 MB read at every step, the ends as modules);
- llama.cpp's ``llama-bench`` tg128 (``--llama-bench``; built as bench/bench_serve_vs_llamacpp.py
  says, never a genkit dependency).

genkit's rate is bench/bench_quantized.py's: 128 new tokens after a 12-token prompt, less a 1-token
generate. Both genkit variants' greedy tokens are checked equal.

``--batch N``: instead, continuous batching (``generate_batch``) of N requests of 16-64 prompt tokens,
32 new tokens each, greedy, on the GGUF file against the float32 model of the same weights (saved by
transformers), alternating rounds, medians; each checked against its own sequential ``generate``
(first 4 prompts).

Run: ``OMP_NUM_THREADS=2 PYTHONPATH=. python bench/bench_gpt2_gguf.py --llama-bench build/bin/llama-bench
[--qtype Q4_0] [--threads 1,2]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from bench_gpt2 import GPT2_SMALL  # noqa: E402
from bench_quantized import _genkit_decode, _llama_bench_rates  # noqa: E402
from test_gguf_gpt2 import write_gpt2_gguf  # noqa: E402

import genkit  # noqa: E402
from genkit.models.cpu import describe  # noqa: E402


def write(path: str, qtype: str) -> None:
    """The GGUF file, and the same weights as a float32 folder beside it (``path`` without ``.gguf``)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SMALL)).eval()
    write_gpt2_gguf(path, hf, qtype=qtype, embed_qtype="Q8_0")
    hf.save_pretrained(path[:-len(".gguf")])


def batched(path: str, n: int, rounds: int) -> None:
    """Continuous batching on the GGUF file against the float32 folder (see the module docstring)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, GPT2_SMALL["vocab_size"], (int(k),), generator=g).tolist()
               for k in torch.randint(16, 65, (n,), generator=g)]
    greedy = {"max_new_tokens": 32, "do_sample": False, "eos_token_id": None}
    models = {"float32": genkit.load_model(path[:-len(".gguf")]), "GGUF": genkit.load_model(path)}
    times: dict[str, list[float]] = {name: [] for name in models}
    outs: dict[str, list[list[int]]] = {}
    for model in models.values():
        model.generate_batch(prompts[:2], max_new_tokens=2)  # warm-up
    for _ in range(rounds):
        for name, model in models.items():
            t = time.perf_counter()
            outs[name] = [o.generated_tokens for o in model.generate_batch(prompts, **greedy).values()]
            times[name].append(time.perf_counter() - t)
    print(f"| generate_batch, {n} requests x 32 tokens, {torch.get_num_threads()} threads | s (all) | tokens/s | "
          "vs float32 | as its sequential generate |\n|---|---|---|---|---|")
    for name, model in models.items():
        seq = [model.generate(torch.tensor([p]), **greedy)[0, len(p):].tolist() for p in prompts[:4]]
        t = statistics.median(times[name])
        print(f"| {name} | {t:.2f} ({', '.join(f'{x:.2f}' for x in times[name])}) | {n * 32 / t:.1f} | "
              f"{statistics.median(times['float32']) / t:.2f}x | {outs[name][:4] == seq} |", flush=True)


def with_float_head(path: str) -> Any:
    """The file's model as genkit loaded it before: the Q8_0 table de-quantized, a float32 head sharing it."""
    model = genkit.load_model(path)
    table = model.transformer.wte
    weight = (table.codes.float().view(table.num_embeddings, -1, 32) * table.scales[..., None]).reshape(
        table.num_embeddings, -1)
    model.transformer.wte = nn.Embedding.from_pretrained(weight, freeze=True)
    model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.lm_head.weight = model.transformer.wte.weight
    model._prepared = None
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (tg128 on the same file)")
    ap.add_argument("--prompt-bench", help="a second llama-bench for its pp512 run, where the first one's prompt "
                    "path crashes (llama.cpp's AMX build on some Xeons; bench_quantized.py's option)")
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="N requests through continuous batching (docstring)")
    args = ap.parse_args()
    print(describe(), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"gpt2-small-{args.qtype}.gguf")
        t = time.perf_counter()
        write(path, args.qtype)
        print(f"GPT-2 small shape, {args.qtype} projections, Q8_0 tied embedding ({os.path.getsize(path) / 2**20:.0f} "
              f"MiB, written in {time.perf_counter() - t:.0f} s); {args.rounds} alternating rounds, medians\n")
        if args.batch:
            for threads in (int(n) for n in args.threads.split(",")):
                torch.set_num_threads(threads)
                batched(path, args.batch, args.rounds)
            return
        ids = torch.randint(3, GPT2_SMALL["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
        print("| threads | genkit tok/s | genkit, float32 head tok/s | llama.cpp tg128 tok/s | genkit / float32 head | "
              "genkit / llama.cpp | same tokens |\n|---|---|---|---|---|---|---|")
        for threads in (int(n) for n in args.threads.split(",")):
            torch.set_num_threads(threads)
            models = {"genkit": genkit.load_model(path), "float head": with_float_head(path)}
            rates: dict[str, list[float]] = {name: [] for name in [*models, "llama.cpp"]}
            tokens = {}
            for _ in range(args.rounds):
                for name, model in models.items():
                    seconds, tokens[name] = _genkit_decode(model, ids, 128, args.repeats)
                    rates[name].append(128 / seconds)
                if args.llama_bench:
                    rates["llama.cpp"].append(_llama_bench_rates(args.llama_bench, path, threads, args.repeats,
                                                                 False, args.prompt_bench)["tg128"])
            med = {name: statistics.median(r) if r else float("nan") for name, r in rates.items()}
            print(f"| {threads} | {med['genkit']:.1f} | {med['float head']:.1f} | {med['llama.cpp']:.1f} | "
                  f"{med['genkit'] / med['float head']:.2f}x | {med['genkit'] / med['llama.cpp']:.2f}x | "
                  f"{tokens['genkit'] == tokens['float head']} |", flush=True)


if __name__ == "__main__":
    main()
