"""``model.generate(...)`` on native models (and on anything that mixes this in)."""

from __future__ import annotations

from typing import Any

import torch


class GenerationMixin:
    """Adds ``generate`` and ``compute_transition_scores`` to a model."""

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        from .api import generate

        return generate(self, inputs, **kwargs)

    def generate_batch(self, inputs: list[list[int]], generation_config: Any = None, **kwargs: Any) -> Any:
        """Continuous batching over ``inputs`` (see :func:`genkit.continuous.generate_batch`)."""
        from ..continuous import generate_batch

        return generate_batch(self, inputs, generation_config, **kwargs)

    def init_continuous_batching(self, generation_config: Any = None, **kwargs: Any) -> Any:
        """A continuous batching manager (see :func:`genkit.continuous.init_continuous_batching`)."""
        from ..continuous import init_continuous_batching

        return init_continuous_batching(self, generation_config, **kwargs)

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        from ..strategy.outputs import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
