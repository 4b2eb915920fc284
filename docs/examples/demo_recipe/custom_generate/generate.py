"""Sentence-end sampling: min-p sampling that stops once the continuation has finished
``max_sentences`` sentences (a token ending in '.', '!' or '?'), instead of running on to
``max_new_tokens`` mid-sentence. Works with any streamer (it only adds a stopping criterion)."""

from __future__ import annotations

from typing import Any

import genkit

from .sentence import SentenceEndCriteria, sentence_end_token_ids


def generate(model: Any, inputs: Any = None, *, max_sentences: int = 1, sentence_end_ids: list[int] | None = None,
             min_p: float = 0.05, temperature: float = 0.8, **kwargs: Any) -> Any:
    """Sample with min-p and stop every row after ``max_sentences`` sentence ends.

    ``sentence_end_ids`` defaults to the tokenizer's tokens that end with '.', '!' or '?' (the
    ``tokenizer=`` argument, or the tokenizer of a text streamer); without either, it runs as plain
    min-p sampling.
    """
    if not isinstance(max_sentences, int) or max_sentences < 1:
        raise ValueError(f"`max_sentences` must be a positive integer; got {max_sentences!r}")
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    # the tokenizer: passed as tokenizer=..., or the one a text streamer already holds
    tokenizer = kwargs.get("tokenizer") or getattr(kwargs.get("streamer"), "tokenizer", None)
    ids = list(sentence_end_ids) if sentence_end_ids is not None else sentence_end_token_ids(tokenizer)
    criteria = list(kwargs.pop("stopping_criteria", None) or [])
    if ids and inputs is not None:
        criteria.append(SentenceEndCriteria(ids, max_sentences, prompt_length=inputs.shape[-1]))
    kwargs.setdefault("do_sample", True)
    return genkit.generate(model, inputs, min_p=min_p, temperature=temperature, stopping_criteria=criteria,
                           **kwargs)
