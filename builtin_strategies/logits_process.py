"""Built-in logits processors and warpers (transformers-compatible semantics)."""

from __future__ import annotations

import torch

from genkit.generation.processing import LogitsProcessor


class TemperatureLogitsWarper(LogitsProcessor):
    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores / self.temperature


class TopKLogitsWarper(LogitsProcessor):
    def __init__(self, top_k: int, filter_value: float = -float("inf"), min_tokens_to_keep: int = 1) -> None:
        self.top_k = max(top_k, min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        return scores.masked_fill(scores < kth, self.filter_value)
