"""Per-token greedy time: genkit vs transformers ``generate`` on the same weights, same run.

Models: a tiny Llama (2 layers, hidden 64; 256 new tokens) and a 12-layer, 768-hidden Llama
(~124M parameters; 64 new tokens), both randomly initialised, saved by transformers and loaded
by genkit. Also a bare cached forward loop (model call + argmax, nothing else) per framework, so
the loop overhead shows. Run: ``python bench/bench_core.py [--threads N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bare_loop(model, ids: torch.Tensor, steps: int, cache_factory) -> None:
    cache = cache_factory()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps - 1):
        out = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)


def run(name: str, cfg_kwargs: dict, new_tokens: int, repeats: int) -> dict:
    import transformers

    import genkit

    torch.manual_seed(0)
    # no EOS id: both run the full length, so the per-token figures compare like with like
    cfg = transformers.LlamaConfig(**cfg_kwargs, eos_token_id=None, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = genkit.load_model(d)
    ids = torch.randint(3, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        ref = hf.generate(ids, do_sample=False, max_new_tokens=new_tokens)
        got = ours.generate(ids, max_new_tokens=new_tokens)
        same = torch.equal(ref, got)
        t_hf = _time(lambda: hf.generate(ids, do_sample=False, max_new_tokens=new_tokens), repeats)
        t_gk = _time(lambda: ours.generate(ids, max_new_tokens=new_tokens), repeats)
        t_bare_gk = _time(lambda: bare_loop(ours, ids, new_tokens, lambda: ours.new_cache(16 + new_tokens)), repeats)
        t_bare_hf = _time(lambda: bare_loop(hf, ids, new_tokens, lambda: transformers.DynamicCache(config=hf.config)),
                          repeats)
    per = lambda t: t / new_tokens * 1000  # noqa: E731
    row = dict(model=name, tokens=new_tokens, same_tokens=same, hf_ms=per(t_hf), genkit_ms=per(t_gk),
               speedup=t_hf / t_gk, genkit_bare_ms=per(t_bare_gk), genkit_vs_bare=t_gk / t_bare_gk,
               hf_bare_ms=per(t_bare_hf), hf_vs_bare=t_hf / t_bare_hf)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    base = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                tie_word_embeddings=False)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| model | new tokens | tokens identical | transformers ms/token | genkit ms/token | speed-up | "
          "genkit / its bare loop | transformers / its bare loop |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg, n in (("tiny Llama (2L, 64h)", tiny, 256), ("Llama 12L 768h (~124M)", base, 64)):
        r = run(name, cfg, n, args.repeats)
        print(f"| {r['model']} | {r['tokens']} | {r['same_tokens']} | {r['hf_ms']:.3f} | {r['genkit_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['genkit_vs_bare']:.3f}x | {r['hf_vs_bare']:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
