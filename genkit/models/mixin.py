"""``model.generate(...)`` on native models (and on anything that mixes this in)."""

from __future__ import annotations

from typing import Any

import torch

from .continuous_mixin import ContinuousMixin


class GenerationMixin(ContinuousMixin):
    """Adds ``generate``, ``generate_batch``, ``init_continuous_batching`` and
    ``compute_transition_scores`` to a model.

    Each is the public function of the same name applied to the model. The generation and
    continuous-batching packages sit above the models (docs/architecture.md), so these methods
    reach them through the public ``genkit`` namespace, resolved on first use, as a user's code
    would; nothing in ``genkit.models`` imports them. The continuous-batching methods come from
    :class:`~genkit.models.continuous_mixin.ContinuousMixin` (registered by ``genkit/__init__.py``).
    """

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """:func:`genkit.generate` on this model."""
        import genkit

        return genkit.generate(self, inputs, **kwargs)

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        from ..strategy.outputs import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
