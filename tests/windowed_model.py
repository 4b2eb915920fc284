"""A tiny sliding-window Mistral (random weights, window 5) saved by transformers and loaded by genkit:
the model the tests of transformers' windowed and static caches share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def windowed_mistral(folder: Path) -> tuple[Any, Any, Any]:
    """``(config, transformers model, genkit model)`` on the same weights, saved under ``folder``."""
    import transformers

    import genkit

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = transformers.MistralForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return config, hf, genkit.load_model(folder)
