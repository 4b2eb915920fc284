"""Base types for logits processors and stopping criteria, and the context their factories get."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


class LogitsProcessor:
    """``__call__(input_ids, scores) -> scores`` over a batch: ``input_ids`` is
    ``(batch, cur_len)``, ``scores`` is ``(batch, vocab)`` float logits for the next token."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(input_ids, scores)")


class LogitsProcessorList(list[Any]):
    """Applies each processor in order."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.FloatTensor:
        for processor in self:
            scores = processor(input_ids, scores, **kwargs) if kwargs else processor(input_ids, scores)
        return scores


class StoppingCriteria:
    """``__call__(input_ids, scores) -> BoolTensor (batch,)``: True where that row is done."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs: Any) -> torch.BoolTensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(input_ids, scores)")


class StoppingCriteriaList(list[Any]):
    """A row is done when any criterion says so."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            done = done | criterion(input_ids, scores, **kwargs)
        return done  # type: ignore[return-value]  # torch types a bool tensor as Tensor

    @property
    def max_length(self) -> int | None:
        for criterion in self:
            value = getattr(criterion, "max_length", None)
            if value is not None:
                return int(value)
        return None


@dataclass
class ProcessorContext:
    """What a processor factory may need besides the config."""

    input_ids_seq_length: int
    eos_token_ids: list[int]
    device: torch.device
    attention_mask: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None
    tokenizer: Any = None
    model: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


def merge_lists(default: Iterable[Any], custom: Iterable[Any] | None, kind: str, logger: Any) -> list[Any]:
    """Merge the user's processors or criteria into the ones built from the config: a user
    instance of a type the config also builds replaces it (with a warning); others go last."""
    custom = list(custom or [])
    out: list[Any] = []
    used: set[int] = set()
    for item in default:
        replacement = next((c for c in custom if type(c) is type(item)), None)
        if replacement is not None:
            logger.warning(
                "a %s of type %s was passed to generate() and is also built from the generation config; "
                "the one passed in takes precedence", kind, type(item).__name__,
            )
            out.append(replacement)
            used.add(id(replacement))
        else:
            out.append(item)
    out.extend(c for c in custom if id(c) not in used)
    return out
