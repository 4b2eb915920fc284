"""Per-step tensors that ``output_scores`` / ``output_logits`` / ``output_hidden_states`` /
``output_attentions`` ask for."""

from __future__ import annotations

from typing import Any

import torch

from genkit.errors import NotSupportedError

__all__ = ["StepOutputs"]


class StepOutputs:
    """Per-step tensors kept for the output when the config asks for them."""

    def __init__(self, config: Any) -> None:
        self.want_scores = bool(config.output_scores)
        self.want_logits = bool(config.output_logits)
        self.want_hidden = bool(config.output_hidden_states)
        self.want_attentions = bool(getattr(config, "output_attentions", False))
        self.attentions: list[Any] = []
        self.cross_attentions: list[Any] = []
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.hidden: list[Any] = []

    @property
    def recording(self) -> bool:
        """Whether anything is kept at all."""
        return self.want_scores or self.want_logits or self.want_hidden or self.want_attentions

    def model_step(self, logits: torch.Tensor, hidden: Any, attentions: tuple[Any, Any] | None = None) -> None:
        """The raw last-position logits (copied), the hidden states and the attentions
        (``Stepper.attentions``: the model's, and an encoder-decoder decoder's cross-attentions) of
        one forward."""
        if self.want_logits:
            self.logits.append(logits.clone())
        if self.want_hidden:
            self.hidden.append(hidden)
        if self.want_attentions:
            if attentions is None:
                raise NotSupportedError("`output_attentions=True` is not supported by this strategy (it does not "
                                        "record the model's attentions); greedy search, sampling, the beam "
                                        "searches, contrastive search, assisted decoding (prompt lookup too) "
                                        "and DoLa do")
            self.attentions.append(attentions[0])
            self.cross_attentions.append(attentions[1])

    def processed(self, scores: torch.Tensor, copy: bool = False) -> None:
        """The processed scores of one step (``copy`` when the loop writes to ``scores`` later)."""
        if self.want_scores:
            self.scores.append(scores.clone() if copy else scores)

    def as_tuples(self) -> dict[str, tuple[Any, ...] | None]:
        """``scores``, ``logits``, ``hidden_states``, ``attentions`` and ``cross_attentions`` for the output class (``None`` where not asked for)."""
        return {
            "scores": tuple(self.scores) if self.want_scores else None,
            "logits": tuple(self.logits) if self.want_logits else None,
            "hidden_states": tuple(self.hidden) if self.want_hidden else None,
            "attentions": tuple(self.attentions) if self.want_attentions else None,
            "cross_attentions": (tuple(self.cross_attentions) if self.want_attentions
                                 and any(c is not None for c in self.cross_attentions) else None),
        }
