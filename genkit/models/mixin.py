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

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, next_sequence_length: int | None = None,
                                      cache: Any = None, attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, is_first_iteration: bool = False,
                                      **kwargs: Any) -> dict[str, Any]:
        """The keyword arguments of the next forward, as transformers 5's
        ``GenerationMixin.prepare_inputs_for_generation`` makes them for a decoder-only model (for
        code written against it): the last ``next_sequence_length`` ids (all without it), or
        ``inputs_embeds`` instead on the first iteration; the cache as ``past_key_values`` (also
        read from ``past_key_values=``); ``position_ids`` and ``token_type_ids`` cut to the ids'
        length; the attention mask; every other keyword (``use_cache``, ``logits_to_keep``...) as
        given, ``labels`` left out."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        inputs: dict[str, Any] = {}
        if inputs_embeds is not None and is_first_iteration:
            embeds = inputs_embeds if next_sequence_length is None else inputs_embeds[:, -next_sequence_length:, :]
            inputs["input_ids"], inputs["inputs_embeds"] = None, embeds.clone(memory_format=torch.contiguous_format)
        else:
            ids = input_ids if next_sequence_length is None else input_ids[:, -next_sequence_length:]
            inputs["input_ids"] = ids.clone(memory_format=torch.contiguous_format)
        length = (inputs["input_ids"] if inputs["input_ids"] is not None else inputs["inputs_embeds"]).shape[1]
        if cache is not None:
            inputs["past_key_values"] = cache
        for key in ("position_ids", "token_type_ids"):
            value = kwargs.pop(key, None)
            if value is not None:
                inputs[key] = value if value.shape[-1] == length else value[..., -length:].contiguous()
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        kwargs.pop("labels", None)
        return {**inputs, **kwargs}

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        from ..strategy.outputs import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
