"""Structured outputs: the per-token cost of constrained decoding against unconstrained, same run.

On SmolLM2-135M-Instruct (the demo model, ``genkit.load_model("smollm2")``), batch 1, greedy, up
to ``--new-tokens`` tokens. For each prompt, three runs alternate ``--repeats`` times:
unconstrained, ``response_format`` with a JSON schema, and ``guided_regex``. A run's time per
token is (time of the run - time of the prompt's prefill) / (tokens generated - 1): the prefill
(``max_new_tokens=1``) is measured in the same round and subtracted, so runs that stop at
different lengths compare. Reported: the median ms per token of each, and constrained /
unconstrained as a ratio.

Then the grammar engines alone, on the tokens the JSON run produced: the time to compute the
next-token mask and accept the token, per token, for llguidance (what genkit uses) and, when it is
installed, xgrammar (``TokenizerInfo`` built from the same vocabulary), best of ``--repeats``.

Run: ``python bench/bench_structured.py [--threads N] [--repeats R] [--new-tokens T] [--engines-only]``
(``--engines-only``: the engines alone, on the tokens of a fixed JSON answer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import genkit

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string"}},
            "required": ["kind", "name"]}},
    "required": ["name", "age", "city", "hobbies", "pet"], "additionalProperties": False}
EXAMPLE = {"name": "Alice Martin", "age": 34, "city": "Paris", "hobbies": ["reading", "chess", "running"],
           "pet": {"kind": "cat", "name": "Milo"}}
REGEX = r"([A-Z][a-z]+ ){2,12}[A-Z][a-z]+\."
PROMPTS = ["Describe a person who lives in Paris, as JSON.", "Invent a character for a story; answer in JSON.",
           "Tell me about your best friend."]


def _timed(model: Any, ids: torch.Tensor, **kw: Any) -> tuple[float, int, torch.Tensor]:
    start = time.perf_counter()
    out = genkit.generate(model, ids, **kw)
    return time.perf_counter() - start, out.shape[1] - ids.shape[1], out


def decoding(model: Any, tok: Any, repeats: int, new_tokens: int) -> list[int]:
    """Per-token time of each mode; returns the JSON run's tokens for the engine comparison."""
    modes = {"unconstrained": {}, "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}}, "regex": {"guided_regex": REGEX}}
    per_token: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    trace: list[int] = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")["input_ids"]
        for mode, kw in modes.items():  # warm-up (and the grammar's first compile)
            genkit.generate(model, ids, max_new_tokens=4, tokenizer=tok, **kw)
        for _ in range(repeats):
            prefill = _timed(model, ids, max_new_tokens=1, tokenizer=tok)[0]
            for mode, kw in modes.items():
                seconds, n, out = _timed(model, ids, max_new_tokens=new_tokens, tokenizer=tok, **kw)
                if n > 1:
                    per_token[mode].append((seconds - prefill) / (n - 1))
                    counts[mode].append(n)
                if mode == "json_schema" and not trace:
                    trace = out[0, ids.shape[1]:].tolist()
    base = statistics.median(per_token["unconstrained"])
    for mode in modes:
        ms = statistics.median(per_token[mode])
        print(f"{mode:14s} {ms * 1e3:7.2f} ms/token  ({statistics.median(counts[mode]):.0f} tokens)  "
              f"ratio {ms / base:.3f}")
    return trace


def engines(tok: Any, trace: list[int], repeats: int) -> None:
    """Mask + accept per token for each grammar engine, on the same tokens."""
    from genkit.builtin_strategies.structured import GrammarLogitsProcessor

    proc = GrammarLogitsProcessor(tok, json_schema=SCHEMA)
    words = (len(tok) + 31) // 32

    def llguidance_run() -> float:
        matcher, mask = proc._root.deep_copy(), torch.zeros(words, dtype=torch.int32)
        start = time.perf_counter()
        for t in trace:
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
            matcher.consume_token(t)
        return (time.perf_counter() - start) / len(trace)

    print(f"llguidance     {min(llguidance_run() for _ in range(repeats)) * 1e6:7.1f} us/token (mask + accept)")
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar       not installed")
        return
    vocab = [""] * len(tok)
    for piece, i in tok.get_vocab().items():
        vocab[i] = piece
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=len(tok),
                             stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)

    def xgrammar_run() -> float:
        matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, len(tok))
        start = time.perf_counter()
        for t in trace:
            matcher.fill_next_token_bitmask(mask, 0)
            matcher.accept_token(t)
        return (time.perf_counter() - start) / len(trace)

    print(f"xgrammar       {min(xgrammar_run() for _ in range(repeats)) * 1e6:7.1f} us/token (mask + accept)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--engines-only", action="store_true",
                        help="only the grammar engines, on the tokens of a fixed JSON answer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = genkit.load_model("smollm2"), genkit.load_tokenizer("smollm2")
    print(f"SmolLM2-135M-Instruct, {args.threads} thread(s), greedy, up to {args.new_tokens} new tokens, "
          f"median of {args.repeats} x {len(PROMPTS)} prompts")
    if args.engines_only:
        trace = tok.encode(json.dumps(EXAMPLE), add_special_tokens=False) + [tok.eos_token_id]
    else:
        with torch.no_grad():
            trace = decoding(model, tok, args.repeats, args.new_tokens)
    print(f"grammar engines on the JSON run's {len(trace)} tokens:")
    engines(tok, trace, args.repeats)


if __name__ == "__main__":
    main()
