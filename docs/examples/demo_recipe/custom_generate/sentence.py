"""The stopping criterion and the tokenizer scan behind sentence-end sampling."""

from __future__ import annotations

from typing import Any

import torch

ENDINGS = (".", "!", "?", "。", "!", "?")


_CACHE: dict[int, tuple[Any, list[int]]] = {}


def sentence_end_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's tokens whose text ends a sentence (empty without a tokenizer);
    computed once per tokenizer object."""
    if tokenizer is None:
        return []
    hit = _CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    size = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    ids = [[token_id] for token_id in range(size)]
    if hasattr(tokenizer, "batch_decode"):
        texts = tokenizer.batch_decode(ids)
    else:
        texts = [tokenizer.decode(one) for one in ids]
    out = [token_id for token_id, text in enumerate(texts)
           if text.strip().endswith(ENDINGS) and not text.strip().endswith("...")]
    _CACHE[id(tokenizer)] = (tokenizer, out)
    return out


class SentenceEndCriteria:
    """True for a row once its continuation holds ``max_sentences`` sentence-end tokens."""

    def __init__(self, end_ids: list[int], max_sentences: int, prompt_length: int) -> None:
        self.end_ids = torch.tensor(sorted(set(end_ids)), dtype=torch.long)
        self.max_sentences = max_sentences
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_length:]
        hits = torch.isin(new, self.end_ids.to(new.device)).sum(dim=-1)
        return hits >= self.max_sentences
