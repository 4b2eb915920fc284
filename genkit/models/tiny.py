"""Tiny randomly initialised models: for smoke runs (``genkit check``) and fast tests."""

from __future__ import annotations

from typing import Any

import torch

from .base import ModelConfig
from .llama import LlamaForCausalLM

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A 2-layer, 64-hidden Llama with random weights (deterministic for a seed), in eval mode."""
    config = ModelConfig(**{**TINY_LLAMA, **overrides})
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 if p.dim() > 1 else 1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()
