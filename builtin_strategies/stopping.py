"""Stopping criteria built from the config: max length, max time, EOS, stop strings."""

from __future__ import annotations

import time
from typing import Any

import torch

from genkit.generation.processing import StoppingCriteria


class MaxLengthCriteria(StoppingCriteria):
    """Done once the sequence holds ``max_length`` tokens (prompt included)."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        done = input_ids.shape[-1] >= self.max_length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class MaxTimeCriteria(StoppingCriteria):
    """Done once ``max_time`` seconds have passed since ``initial_timestamp`` (default: creation)."""

    def __init__(self, max_time: float, initial_timestamp: float | None = None) -> None:
        self.max_time = max_time
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        done = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class EosTokenCriteria(StoppingCriteria):
    """Done where the last token is one of the EOS ids."""

    def __init__(self, eos_token_id: int | list[int] | torch.Tensor) -> None:
        if not isinstance(eos_token_id, torch.Tensor):
            eos_token_id = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        eos = self.eos_token_id.to(input_ids.device)
        return torch.isin(input_ids[:, -1], eos)


def build_stopping_criteria(config: Any, eos_ids: list[int], tokenizer: Any = None) -> list[StoppingCriteria]:
    criteria: list[StoppingCriteria] = [MaxLengthCriteria(config.max_length)]
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate()")
        from .stop_strings import StopStringCriteria

        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    if eos_ids:
        criteria.append(EosTokenCriteria(eos_ids))
    return criteria
