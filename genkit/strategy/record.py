"""Per-step tensors that ``output_scores`` / ``output_logits`` / ``output_hidden_states`` ask for."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepOutputs"]


class StepOutputs:
    """Per-step tensors kept for the output when the config asks for them."""

    def __init__(self, config: Any) -> None:
        self.want_scores = bool(config.output_scores)
        self.want_logits = bool(config.output_logits)
        self.want_hidden = bool(config.output_hidden_states)
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.hidden: list[Any] = []

    def model_step(self, logits: torch.Tensor, hidden: Any) -> None:
        """The raw last-position logits (copied) and the hidden states of one forward."""
        if self.want_logits:
            self.logits.append(logits.clone())
        if self.want_hidden:
            self.hidden.append(hidden)

    def processed(self, scores: torch.Tensor, copy: bool = False) -> None:
        """The processed scores of one step (``copy`` when the loop writes to ``scores`` later)."""
        if self.want_scores:
            self.scores.append(scores.clone() if copy else scores)

    def as_tuples(self) -> dict[str, tuple[Any, ...] | None]:
        """``scores``, ``logits`` and ``hidden_states`` for the output class (``None`` where not asked for)."""
        return {
            "scores": tuple(self.scores) if self.want_scores else None,
            "logits": tuple(self.logits) if self.want_logits else None,
            "hidden_states": tuple(self.hidden) if self.want_hidden else None,
        }
