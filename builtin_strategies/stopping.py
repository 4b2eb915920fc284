"""Stopping criteria built from the config: max length, max time, EOS, stop strings.

``generate`` keeps max length and the EOS ids as data (``genkit.strategy.StopConditions``), which
the loops check as tensor ops; :func:`config_criteria` builds the others (time, stop strings), which
are called once per step with the sequences so far. ``MaxLengthCriteria`` and ``EosTokenCriteria``
are the same conditions as objects, for callers that want a ``StoppingCriteriaList``; they live in
the kit (``genkit.strategy.processing``, which ``StopConditions.as_list`` uses) and are re-exported here.
"""

from __future__ import annotations

import logging
import math
import time
from numbers import Real
from typing import Any

import torch

from genkit.errors import ConfigError
from genkit.strategy.processing import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria

logger = logging.getLogger("genkit.stopping")

__all__ = ["EosTokenCriteria", "MaxLengthCriteria", "MaxTimeCriteria", "build_stopping_criteria", "config_criteria"]


class MaxTimeCriteria(StoppingCriteria):
    """Done once ``max_time`` seconds have passed since ``initial_timestamp`` (default: creation)."""

    finish_reason = "max_time"  # genkit.strategy.FINISH_REASONS

    def __init__(self, max_time: float, initial_timestamp: float | None = None) -> None:
        if not isinstance(max_time, Real) or isinstance(max_time, bool) or not max_time > 0 or math.isnan(max_time):
            raise ConfigError(f"`max_time` must be a number of seconds > 0; got {max_time!r}.")
        self.max_time = float(max_time)
        self.initial_timestamp = time.time() if initial_timestamp is None else float(initial_timestamp)

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        done = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class ConfidenceCriteria(StoppingCriteria):
    """Stop when the model gave the last token of row 0 a probability below
    ``assistant_confidence_threshold`` (a draft model's confidence; ``scores`` is the tuple of
    per-step scores and its last entry is used). Returns a plain ``bool``, as transformers' does."""

    def __init__(self, assistant_confidence_threshold: float) -> None:
        value = assistant_confidence_threshold
        if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 1:
            raise ConfigError(f"`assistant_confidence_threshold` must be a number in [0, 1]; got {value!r}")
        self.assistant_confidence_threshold = value

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> bool:  # type: ignore[override]
        probs = scores[-1].softmax(-1)
        return bool(probs[0, input_ids[0, -1]].item() < self.assistant_confidence_threshold)


def validate_stopping_criteria(stopping_criteria: Any, max_length: int) -> Any:
    """A copy of ``stopping_criteria`` that stops at ``max_length``: a ``MaxLengthCriteria`` is
    added when there is none, and a ``UserWarning`` says so when one with another length is there
    (it is kept), as in transformers."""
    import copy
    import warnings

    from genkit.strategy.processing import StoppingCriteriaList

    criteria = StoppingCriteriaList(copy.deepcopy(list(stopping_criteria)))
    current = criteria.max_length
    if current is not None and current != max_length:
        warnings.warn("You set different `max_length` for stopping criteria and `max_length` parameter", UserWarning,
                      stacklevel=2)
    elif current is None:
        criteria.append(MaxLengthCriteria(max_length=max_length))
    return criteria


def build_stopping_criteria(config: Any, eos_ids: list[int], tokenizer: Any = None,
                            max_position_embeddings: int | None = None) -> list[StoppingCriteria]:
    """The criteria a config asks for, in transformers' order: length, time, stop strings, EOS."""
    criteria: list[StoppingCriteria] = [MaxLengthCriteria(config.max_length, max_position_embeddings)]
    criteria.extend(config_criteria(config, tokenizer))
    if eos_ids:
        criteria.append(EosTokenCriteria(eos_ids))
    return criteria


def config_criteria(config: Any, tokenizer: Any = None) -> list[StoppingCriteria]:
    """The criteria a config asks for besides max length and EOS: time, then stop strings."""
    criteria: list[StoppingCriteria] = []
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ConfigError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate()")
        from .stop_strings import StopStringCriteria

        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    return criteria
