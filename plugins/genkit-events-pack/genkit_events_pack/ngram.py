"""N-gram drafting from a user-given corpus, for genkit's assisted strategy.

The corpus is indexed once: every n-gram (``min_ngram_size`` to ``max_ngram_size`` tokens) maps to
the first place it occurs that has a continuation. To draft, the longest n-gram at the end of the
sequence that the index knows proposes the up to ``num_tokens`` tokens that followed it in the
corpus. The target model verifies them, so a wrong draft costs speed, never correctness.

Use it with ``candidate_generator="ngram_corpus"`` and ``candidate_generator_kwargs``:

- ``corpus``: a list of token-id lists, a list of texts, or one text;
- ``corpus_file``: a path instead — ``.jsonl`` lines are token-id lists or ``{"text": ...}``;
  other files are read as one text per line;
- ``tokenizer``: needed for texts — an object with ``encode`` or a name/path for
  ``genkit.load_tokenizer``; defaults to the ``tokenizer=`` passed to ``generate()``;
- ``num_tokens`` (default ``prompt_lookup_num_tokens`` or 10), ``max_ngram_size`` (default
  ``max_matching_ngram_size`` or 3), ``min_ngram_size`` (default 1).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["NgramCorpusCandidateGenerator", "NgramIndex", "ngram_corpus"]


class NgramIndex:
    """n-gram -> (document, position right after the n-gram)."""

    def __init__(self, docs: Sequence[Sequence[int]], max_ngram_size: int, min_ngram_size: int = 1) -> None:
        self.docs = [list(map(int, d)) for d in docs]
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.table: dict[tuple[int, ...], tuple[int, int]] = {}
        for d, doc in enumerate(self.docs):
            for end in range(1, len(doc)):  # an n-gram ending before `end` has a continuation
                for n in range(min_ngram_size, max_ngram_size + 1):
                    if end - n < 0:
                        break
                    self.table.setdefault(tuple(doc[end - n:end]), (d, end))

    def lookup(self, tail: Sequence[int], num_tokens: int) -> list[int]:
        """The continuation of the longest indexed n-gram that ``tail`` ends with."""
        for n in range(min(self.max_ngram_size, len(tail)), self.min_ngram_size - 1, -1):
            hit = self.table.get(tuple(tail[len(tail) - n:]))
            if hit is not None:
                d, pos = hit
                return self.docs[d][pos:pos + num_tokens]
        return []


class NgramCorpusCandidateGenerator:
    """Candidate generator over an :class:`NgramIndex`."""

    def __init__(self, index: NgramIndex, num_tokens: int = 10) -> None:
        self.index = index
        self.num_tokens = num_tokens

    def get_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        if input_ids.shape[0] != 1:
            raise ValueError("ngram_corpus drafting supports batch size 1")
        tail = input_ids[0, -self.index.max_ngram_size:].tolist()
        proposal = self.index.lookup(tail, self.num_tokens)
        if not proposal:
            return input_ids, None
        extra = torch.tensor([proposal], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, extra], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
        return None


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        enc = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        enc = tokenizer.encode(text)
    if hasattr(enc, "ids"):
        return list(enc.ids)
    if isinstance(enc, dict):
        return list(enc["input_ids"])
    return list(enc)


def _read_corpus_file(path: str) -> list[Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`corpus_file` {path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh]
    if not path.endswith(".jsonl"):
        return [line for line in lines if line]
    docs: list[Any] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, dict):
            if "text" not in item:
                raise ValueError(f"{path}:{i}: a JSON object line needs a \"text\" key")
            item = item["text"]
        docs.append(item)
    return docs


def _as_token_docs(corpus: Any, tokenizer: Any) -> list[list[int]]:
    if isinstance(corpus, str):
        corpus = [corpus]
    if not isinstance(corpus, (list, tuple)) or not corpus:
        raise ValueError("`corpus` must be a non-empty list of token-id lists or texts, or one text")
    docs: list[list[int]] = []
    for i, doc in enumerate(corpus):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError("a text `corpus` needs `tokenizer` (an object with encode(), or a name/path)")
            if isinstance(tokenizer, (str, os.PathLike)):
                import genkit

                tokenizer = genkit.load_tokenizer(os.fspath(tokenizer))
            docs.append(_encode(tokenizer, doc))
        elif isinstance(doc, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in doc):
            docs.append(list(doc))
        else:
            raise ValueError(f"`corpus`[{i}] must be a list of token ids >= 0 or a text; got {type(doc).__name__}")
    return docs


_INDEX_CACHE: OrderedDict[tuple[str, int, int], NgramIndex] = OrderedDict()
_INDEX_CACHE_SIZE = 4


def _index_for(docs: list[list[int]], max_n: int, min_n: int) -> NgramIndex:
    digest = hashlib.sha1(json.dumps(docs, separators=(",", ":")).encode()).hexdigest()
    key = (digest, max_n, min_n)
    index = _INDEX_CACHE.get(key)
    if index is None:
        index = NgramIndex(docs, max_n, min_n)
        _INDEX_CACHE[key] = index
        while len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
            _INDEX_CACHE.popitem(last=False)
    else:
        _INDEX_CACHE.move_to_end(key)
    return index


_ACCEPTED = ("corpus", "corpus_file", "tokenizer", "num_tokens", "max_ngram_size", "min_ngram_size")


def ngram_corpus(model: Any, config: Any, *, corpus: Any = None, corpus_file: str | None = None,
                 tokenizer: Any = None, num_tokens: int | None = None, max_ngram_size: int | None = None,
                 min_ngram_size: int = 1, assistant_model: Any = None, logits_processor: Any = None,
                 **unknown: Any) -> NgramCorpusCandidateGenerator:
    """Factory of the ``"ngram_corpus"`` candidate generator (see the module docstring)."""
    if unknown:
        raise ValueError(f"unknown `candidate_generator_kwargs` for ngram_corpus: {sorted(unknown)}; "
                         f"accepted: {', '.join(_ACCEPTED)}")
    if (corpus is None) == (corpus_file is None):
        raise ValueError("ngram_corpus needs exactly one of `corpus` or `corpus_file` in candidate_generator_kwargs")
    num_tokens = num_tokens if num_tokens is not None else (config.prompt_lookup_num_tokens or 10)
    max_n = max_ngram_size if max_ngram_size is not None else (config.max_matching_ngram_size or 3)
    for name, value in (("num_tokens", num_tokens), ("max_ngram_size", max_n), ("min_ngram_size", min_ngram_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ngram_corpus `{name}` must be an int >= 1; got {value!r}")
    if min_ngram_size > max_n:
        raise ValueError(f"ngram_corpus `min_ngram_size` ({min_ngram_size}) must be <= `max_ngram_size` ({max_n})")
    raw = _read_corpus_file(os.fspath(corpus_file)) if corpus_file is not None else corpus
    docs = _as_token_docs(raw, tokenizer)
    return NgramCorpusCandidateGenerator(_index_for(docs, max_n, min_ngram_size), num_tokens)
