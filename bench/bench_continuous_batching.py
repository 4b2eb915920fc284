"""Continuous batching on SmolLM2-135M: genkit vs transformers 5's ``generate_batch``, same run.

Work: 32 prompts of 20-200 tokens (random words, seeded), 64 new tokens each, greedy, no EOS (every
request makes all 64). Measured in one run, each the best of ``--repeats``:

- transformers 5 ``model.generate_batch`` on the same float32 weights (the demo folder);
- genkit ``model.generate_batch``;
- genkit static batch: one left-padded ``generate`` over the 32 prompts;
- genkit sequential ``generate``, one prompt at a time.

Tokens/s = generated tokens / wall time; every engine's tokens are checked against sequential
``generate``. Then time to first token and throughput with 1, 8 and 32 concurrent requests through
the manager (streaming requests added at once).

``--long-prompts 1500-3000`` measures instead what long prompts cost the decode steps: a few requests
(``--requests``, default 4) of that many prompt tokens added at once to ``generate_batch`` on the
float32 model and the Q4_1 GGUF, the decoding rate counted after the last request's first token
(every request decoding; the prefills' time left out).

Run: ``python bench/bench_continuous_batching.py [--threads 2] [--repeats 2] [--skip-transformers]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

import genkit
from genkit.models.cpu import describe

WORDS = ("the of and to in is that for it as with was on be by this are or his from at which but have an not they "
         "you were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way").split()
NEW = 64


def prompts_for(tok: Any, n: int = 32, seed: int = 0, lengths: tuple[int, int] = (20, 200)) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(*lengths)
        ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(target)))[:target]
        out.append(ids)
    return out


def best(fn: Any, repeats: int) -> tuple[float, Any]:
    t_best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best, result


def static_batch(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != -1).long()
    for i, p in enumerate(prompts):
        mask[i, :width - len(p)] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return [row[width:].tolist() for row in out]


def concurrency(model: Any, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(median time to first token in s, generated tokens/s) for ``n`` requests added at once."""
    with model.init_continuous_batching() as manager:
        start = time.perf_counter()
        ids = [manager.add_request(prompts[i % len(prompts)], max_new_tokens=NEW, streaming=True, do_sample=False,
                                   eos_token_id=None) for i in range(n)]
        first: dict[str, float] = {}
        done = 0
        while done < n:
            out = manager.get_result(timeout=60)
            if out is None:
                raise RuntimeError("no output for 60 s")
            first.setdefault(out.request_id, time.perf_counter() - start)
            done += out.is_finished()
        wall = time.perf_counter() - start
    assert set(first) == set(ids)
    return statistics.median(first.values()), n * NEW / wall


def quantized_vs_float(dense: Any, prompts: list[list[int]], seq: list[list[int]], repeats: int) -> None:
    """generate_batch on the demo GGUF kept quantized (Q4_1 on the block kernel: a step of decoding
    requests is one C call) against the float32 model, alternating, ``repeats`` rounds: the median
    of each, and the median of the rounds' paired ratios (a load that changes between rounds cancels)."""
    from genkit.models.demo import demo_gguf_path, genkit_home

    quantized = genkit.load_model(demo_gguf_path(f"{genkit_home()}/bench-gguf"))
    quantized.generate_batch(prompts[:2], max_new_tokens=4)  # warm-up
    times: dict[str, list[float]] = {"float32": [], "Q4_1": []}
    outs: dict[str, Any] = {}
    for _ in range(repeats):
        for name, m in (("float32", dense), ("Q4_1", quantized)):
            t = time.perf_counter()
            res = m.generate_batch(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
            times[name].append(time.perf_counter() - t)
            outs[name] = [o.generated_tokens for o in res.values()]
    q_ref = [quantized.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                eos_token_id=None)[0, len(p):].tolist() for p in prompts[:4]]
    total = len(prompts) * NEW
    print("\n| continuous batching (generate_batch) | wall s, median (all) | tokens/s | vs float32 | same tokens |\n"
          "|---|---|---|---|---|")
    t_f = statistics.median(times["float32"])
    for name in times:
        t = statistics.median(times[name])
        same = (outs[name] == seq) if name == "float32" else (outs[name][:4] == q_ref)
        what = "as sequential generate" if name == "float32" else "as its own sequential generate (first 4 prompts)"
        print(f"| {name} | {t:.2f} ({', '.join(f'{x:.2f}' for x in times[name])}) | {total / t:.1f} | "
              f"{t_f / t:.2f}x | {same} {what} |", flush=True)
    paired = [f / q for f, q in zip(times["float32"], times["Q4_1"])]  # a round's pair ran back to back
    print(f"\nQ4_1 vs float32 per interleaved round: {', '.join(f'{r:.2f}x' for r in paired)}; "
          f"median {statistics.median(paired):.2f}x", flush=True)


def decode_rate(model: Any, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    """(s until every request had its first token, tokens/s counted after that, the tokens) for one
    ``generate_batch`` of ``prompts``: the rate of steps in which every request decodes."""
    res = model.generate_batch(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               record_timestamps=True)
    outs = list(res.values())
    start = min(o.lifespan[0] for o in outs)
    t1 = max(o.timestamps[0] for o in outs)
    t2 = max(o.timestamps[-1] for o in outs)
    after = sum(t > t1 for o in outs for t in o.timestamps)
    return t1 - start, after / (t2 - t1), [o.generated_tokens for o in outs]


def long_prompts(dense: Any, tok: Any, lengths: tuple[int, int], n: int, repeats: int) -> None:
    """Decode rate with ``n`` long prompts in the paged cache, float32 and Q4_1 alternating."""
    from genkit.models.demo import demo_gguf_path, genkit_home

    quantized = genkit.load_model(demo_gguf_path(f"{genkit_home()}/bench-gguf"))
    prompts = prompts_for(tok, n, lengths=lengths)
    print(f"{n} requests of {min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens added at once, "
          f"{NEW} new tokens each, greedy; median of {repeats}\n", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {"float32": [], "Q4_1": []}
    tokens: dict[str, list[list[int]]] = {}
    for m in (dense, quantized):
        m.generate_batch(prompts[:1], max_new_tokens=2)  # warm-up
    for _ in range(repeats):
        for name, m in (("float32", dense), ("Q4_1", quantized)):
            prefill, rate, tokens[name] = decode_rate(m, prompts)
            runs[name].append((prefill, rate))
    print("| model | prefills s | decode tokens/s, every request decoding (all runs) | same tokens as generate "
          "(first request) |\n|---|---|---|---|")
    for name, m in (("float32", dense), ("Q4_1", quantized)):
        ref = m.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None)[0, len(prompts[0]):].tolist()
        rates = [r for _, r in runs[name]]
        print(f"| {name} | {statistics.median(p for p, _ in runs[name]):.2f} | {statistics.median(rates):.1f} "
              f"({', '.join(f'{r:.1f}' for r in rates)}) | {tokens[name][0] == ref} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-sequential", action="store_true", help="skip timing sequential generate (slow)")
    parser.add_argument("--no-concurrency", action="store_true", help="skip the concurrency table")
    parser.add_argument("--quantized", action="store_true",
                        help="also: generate_batch on the Q4_1 GGUF (block kernel) against float32, interleaved")
    parser.add_argument("--long-prompts", metavar="LO-HI",
                        help="only: the decode rate of --requests requests with LO-HI prompt tokens each")
    parser.add_argument("--requests", type=int, default=4, help="requests for --long-prompts (default 4)")
    args = parser.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    torch.set_num_threads(args.threads)
    from genkit.models.demo import ensure_demo_model

    folder = ensure_demo_model()
    model, tok = genkit.load_model(folder), genkit.load_tokenizer(folder)
    if args.long_prompts:
        lo, _, hi = args.long_prompts.partition("-")
        long_prompts(model, tok, (int(lo), int(hi or lo)), args.requests, max(args.repeats, 3))
        return
    prompts = prompts_for(tok)
    total = len(prompts) * NEW
    print(f"SmolLM2-135M-Instruct float32, {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens ({sum(map(len, prompts))} in all), {NEW} new tokens each, greedy; "
          f"{args.threads} threads, best of {args.repeats}; torch {torch.__version__}\n")
    if args.no_sequential:  # the static batch's tokens (equal to sequential generate's) are the reference
        t_seq, seq = float("nan"), static_batch(model, prompts)
    else:
        t_seq, seq = best(lambda: [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                                  eos_token_id=None)[0, len(p):].tolist() for p in prompts], 1)
    print("| engine | wall s | tokens/s | genkit generate_batch vs it | same tokens as sequential |\n"
          "|---|---|---|---|---|", flush=True)
    rows = [("genkit sequential generate", t_seq, True)]
    model.generate_batch(prompts[:2], max_new_tokens=4)  # warm-up
    t_cb, res = best(lambda: model.generate_batch(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=None),
                     args.repeats)
    rows.append(("genkit generate_batch", t_cb, [o.generated_tokens for o in res.values()] == seq))
    t_static, out = best(lambda: static_batch(model, prompts), args.repeats)
    rows.append(("genkit static left-padded batch", t_static, out == seq))
    for name, t, same in rows:
        print(f"| {name} | {t:.2f} | {total / t:.1f} | {t / t_cb:.2f}x | {same} |", flush=True)
    if args.quantized:
        quantized_vs_float(model, prompts, seq, args.repeats)
    rows = []
    print("\n| concurrent requests | median time to first token s | tokens/s |\n|---|---|---|")
    for n in () if args.no_concurrency else (1, 8, 32):
        ttft, tps = concurrency(model, prompts, n)
        print(f"| {n} | {ttft:.3f} | {tps:.1f} |", flush=True)

    if not args.skip_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        hf.generate_batch(prompts[:2], generation_config=config)  # warm-up
        t_hf, res_hf = best(lambda: hf.generate_batch(prompts, generation_config=config), args.repeats)
        got = [res_hf[k].generated_tokens for k in sorted(res_hf, key=lambda k: int(k.split("_")[1]))]
        rows.append(("transformers 5 generate_batch", t_hf, got == seq))
        print("\n| engine | wall s | tokens/s | genkit generate_batch vs it | same tokens as sequential |\n"
              "|---|---|---|---|---|", flush=True)
    for name, t, same in rows:
        print(f"| {name} | {t:.2f} | {total / t:.1f} | {t / t_cb:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
