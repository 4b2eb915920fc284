"""Base types for logits processors and stopping criteria, the two stop conditions every call has
(max length, EOS) as criterion objects, and the context processor factories get."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from genkit.config.fields import is_int
from genkit.errors import ConfigError

logger = logging.getLogger("genkit.stopping")


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


class MaxLengthCriteria(StoppingCriteria):
    """Done once the sequence holds ``max_length`` tokens (prompt included).

    ``max_position_embeddings``: when given, a warning is logged once the sequence grows past
    the model's trained context.
    """

    finish_reason = "length"  # genkit.strategy.FINISH_REASONS

    def __init__(self, max_length: int, max_position_embeddings: int | None = None) -> None:
        if not is_int(max_length) or max_length < 1:
            raise ConfigError(f"`max_length` must be an int >= 1; got {max_length!r}.")
        if max_position_embeddings is not None and (not is_int(max_position_embeddings)
                                                    or max_position_embeddings < 1):
            raise ConfigError(f"`max_position_embeddings` must be an int >= 1 or None; got {max_position_embeddings!r}.")
        self.max_length = int(max_length)
        self.max_position_embeddings = max_position_embeddings
        self._warned = False

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        cur = input_ids.shape[-1]
        done = cur >= self.max_length
        if (not done and not self._warned and self.max_position_embeddings is not None
                and cur > self.max_position_embeddings):
            self._warned = True
            logger.warning("the sequence (%d tokens) is longer than the model's max_position_embeddings (%d); "
                           "expect degraded output", cur, self.max_position_embeddings)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool,  # type: ignore[return-value]
                          device=input_ids.device)  # (torch types a bool tensor as Tensor)


class EosTokenCriteria(StoppingCriteria):
    """Done where the last token is one of the EOS ids (one id, a list, or a 1-D tensor)."""

    finish_reason = "eos"  # genkit.strategy.FINISH_REASONS

    def __init__(self, eos_token_id: int | list[int] | torch.Tensor) -> None:
        if not isinstance(eos_token_id, torch.Tensor):
            ids: Any = [eos_token_id] if is_int(eos_token_id) else eos_token_id
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(i) and i >= 0 for i in ids):
                raise ConfigError(
                    f"`eos_token_id` must be a token id >= 0, a non-empty list of ids or a 1-D tensor; got {eos_token_id!r}."
                )
            eos_token_id = torch.tensor([int(i) for i in ids], dtype=torch.long)
        elif eos_token_id.dtype.is_floating_point or eos_token_id.dtype == torch.bool:
            raise ConfigError(f"`eos_token_id` must hold integer token ids; got dtype {eos_token_id.dtype}.")
        self.eos_token_id = eos_token_id.reshape(-1).long()

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        eos = self.eos_token_id.to(input_ids.device)
        return torch.isin(input_ids[:, -1], eos)  # type: ignore[return-value]  # a bool tensor


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
    #: the encoder's input ids (encoder-specific processors): an encoder-decoder model's encoder
    #: input (``None`` when it read audio, pixels or embeddings), a decoder-only model's prompt
    encoder_input_ids: torch.Tensor | None = None


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
