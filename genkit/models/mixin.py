"""``model.generate(...)`` on native models (and on anything that mixes this in)."""

from __future__ import annotations

from typing import Any

import torch


class GenerationMixin:
    """Adds ``generate``, ``generate_batch``, ``init_continuous_batching`` and
    ``compute_transition_scores`` to a model.

    Each is the public function of the same name applied to the model. The generation and
    continuous-batching packages sit above the models (docs/architecture.md), so these methods
    reach them through the public ``genkit`` namespace, resolved on first use, as a user's code
    would; nothing in ``genkit.models`` imports them.
    """

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """:func:`genkit.generate` on this model."""
        import genkit

        return genkit.generate(self, inputs, **kwargs)

    def generate_batch(self, inputs: list[list[int]], generation_config: Any = None, **kwargs: Any) -> Any:
        """Continuous batching over ``inputs`` (see :func:`genkit.continuous.generate_batch`)."""
        import genkit

        return genkit.generate_batch(self, inputs, generation_config, **kwargs)

    def init_continuous_batching(self, generation_config: Any = None, **kwargs: Any) -> Any:
        """A continuous batching manager (see :func:`genkit.continuous.init_continuous_batching`)."""
        import genkit

        return genkit.init_continuous_batching(self, generation_config, **kwargs)

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        from ..strategy.outputs import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
