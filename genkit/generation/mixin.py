"""``model.generate(...)`` on native models (and on anything that mixes this in)."""

from __future__ import annotations

from typing import Any

import torch


class GenerationMixin:
    """Adds ``generate`` and ``compute_transition_scores`` to a model."""

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        from .api import generate

        return generate(self, inputs, **kwargs)

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        from .outputs import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
