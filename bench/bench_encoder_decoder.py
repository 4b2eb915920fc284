"""Encoder-decoder per-token time: genkit vs transformers ``generate`` on the same T5 model, same run.

A randomly initialised T5 of t5-small's size (``T5Config()`` defaults: 6+6 layers, d_model 512,
d_ff 2048, 8 heads, vocabulary 32,128; ~60M parameters), batch 1, a 64-token source, ``--new-tokens``
new tokens with no EOS (both run every step); greedy search and 4-beam search. genkit drives the
same transformers model through its seq2seq adapter, so the forwards are the same work: what
differs is the loop (genkit runs the encoder once and its kit's loop; transformers its own).

Runs alternate between the two frameworks; reports the median of ``--repeats`` runs per framework
as milliseconds per generated token (one beam step for beam search), whether the sequences are
identical, and the ratio. Run: ``python bench/bench_encoder_decoder.py [--threads N] [--repeats R]
[--new-tokens T]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    fn_a()  # warm-up
    fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        fn_a()
        times_a.append(time.perf_counter() - t)
        t = time.perf_counter()
        fn_b()
        times_b.append(time.perf_counter() - t)
    return statistics.median(times_a), statistics.median(times_b)


def t5_small_random(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()


def compare(model, ids: torch.Tensor, new_tokens: int, beams: int, repeats: int) -> dict:
    import genkit

    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "num_beams": beams}
    with torch.no_grad():
        ref = model.generate(input_ids=ids, do_sample=False, **kw)
        got = genkit.generate(model, input_ids=ids, **kw)
        t_hf, t_gk = _median_pair(lambda: model.generate(input_ids=ids, do_sample=False, **kw),
                                  lambda: genkit.generate(model, input_ids=ids, **kw), repeats)
    steps = got.shape[1] - 1
    return {"search": "greedy" if beams == 1 else f"{beams}-beam", "steps": steps, "same": torch.equal(ref, got),
            "hf_ms": t_hf / steps * 1000, "gk_ms": t_gk / steps * 1000, "speedup": t_hf / t_gk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--source-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = t5_small_random()
    ids = torch.randint(3, 32000, (1, args.source_tokens), generator=torch.Generator().manual_seed(1))
    print(f"T5 (t5-small size, random), source {args.source_tokens} tokens, {torch.get_num_threads()} threads")
    print("| search | steps | sequences identical | transformers ms/token | genkit ms/token | speed-up |")
    print("|---|---|---|---|---|---|")
    for beams in (1, 4):
        r = compare(model, ids, args.new_tokens, beams, args.repeats)
        print(f"| {r['search']} | {r['steps']} | {r['same']} | {r['hf_ms']:.2f} | {r['gk_ms']:.2f} | "
              f"{r['speedup']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
