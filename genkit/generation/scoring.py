"""The log-probabilities of a prompt's own tokens: what evaluation harnesses call a
loglikelihood, and what ``genkit serve`` answers as OpenAI's ``echo`` + ``logprobs`` and vLLM's
``prompt_logprobs``.

:func:`score_prompt` runs the causal LM over the prompt and reports, for each token after the
first, its log-probability given the tokens before it (``log_softmax`` of the model's logits, in
float32, as the sampler's log-probabilities: :mod:`genkit.strategy.sampling`), its rank among the
vocabulary, and the ``top_n`` most likely tokens at that position. The forward runs in chunks of
positions through the model's key/value cache, so memory is bounded by ``logits_budget`` bytes of
logits whatever the prompt's length; the cache it leaves (the prompt but its last token) can be
handed to ``generate`` as ``past_key_values``, which then computes only the last prompt token
before the new ones::

    import torch
    import genkit
    from genkit.generation.scoring import score_prompt
    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=0)
    prompt = [1, 5, 9, 13, 17]
    scored = score_prompt(model, prompt, top_n=2, keep_cache=True)
    assert [s.token for s in scored.tokens] == prompt[1:]
    print(sum(s.logprob for s in scored.tokens))  # log P(prompt[1:] | prompt[0])
    out = genkit.generate(model, torch.tensor([prompt]), past_key_values=scored.cache,
                          max_new_tokens=4, do_sample=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, NotSupportedError
from ..strategy.sampling import choose

__all__ = ["LOGITS_BUDGET", "PromptScores", "TokenScore", "check_top_n", "chunk_positions", "score_prompt",
           "score_rows"]

# bytes of float32 logits (and their log-probabilities) one chunk of positions may take
LOGITS_BUDGET = 128 * 2**20


@dataclass(frozen=True)
class TokenScore:
    """One prompt token scored: its id, log-probability given the tokens before it, rank (1 + the
    number of tokens the model found strictly more likely there) and the ``top_n`` most likely
    tokens at its position, best first, as ``(id, log-probability)``."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class PromptScores:
    """:func:`score_prompt`'s answer: ``tokens[i]`` scores prompt token ``i + 1`` (the first token
    has nothing before it); ``cache``: the model's key/value cache holding every prompt position
    but the last (``keep_cache=True``), else ``None``."""

    tokens: list[TokenScore] = field(default_factory=list)
    cache: Any = None

    @property
    def total(self) -> float:
        """The sum of the tokens' log-probabilities: log P(prompt[1:] | prompt[0])."""
        return sum(s.logprob for s in self.tokens)


def score_prompt(model: Any, input_ids: Sequence[int] | torch.Tensor, *, top_n: int = 0, keep_cache: bool = False,
                 cache_length: int = 0, logits_budget: int = LOGITS_BUDGET) -> PromptScores:
    """Score ``input_ids`` (one prompt: a list of ids, or a ``(1, length)`` / ``(length,)``
    tensor) under the causal LM ``model`` (a genkit model or a transformers one); see the module
    docstring. ``top_n``: alternatives per position (0: none). ``keep_cache``: keep the cache
    (sized for ``cache_length`` positions when the model can use the hint, e.g. the prompt and the
    tokens ``generate`` will add)."""
    from .api import as_protocol_model
    from .encoder_decoder import is_encoder_decoder

    model = as_protocol_model(model)
    if is_encoder_decoder(model):
        raise NotSupportedError("scoring a prompt needs a causal LM: an encoder-decoder model's prompt is its "
                                "encoder's input, which it gives no probabilities to")
    ids = _prompt_ids(input_ids)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    _check(ids, top_n, vocab, logits_budget)
    length = int(ids.shape[1])
    scored = PromptScores()
    if length < 2 and not keep_cache:
        return scored
    new_cache = getattr(model, "new_cache", None)
    cache = new_cache(max(cache_length, length)) if new_cache is not None else None
    chunk = chunk_positions(vocab, logits_budget) if vocab else 256
    with torch.no_grad():
        for start in range(0, length - 1, chunk):
            end = min(start + chunk, length - 1)
            out = model(ids[:, start:end].to(model.device), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            scored.tokens += score_rows(out.logits[0], ids[0, start + 1:end + 1], top_n)
    scored.cache = cache if keep_cache else None
    return scored


def _prompt_ids(input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """One prompt as a ``(1, length)`` int64 tensor on the CPU."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.dtype.is_floating_point:
            raise ConfigError(f"`input_ids` must hold one prompt of token ids, (1, length) or (length,); got a "
                              f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}")
        return input_ids.long().cpu()
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ConfigError("`input_ids` must be a list of token ids (ints)")
    return torch.tensor([list(input_ids)], dtype=torch.long)


def chunk_positions(vocab: int, logits_budget: int = LOGITS_BUDGET) -> int:
    """How many positions' logits (and their float32 log-probabilities: 8 bytes per vocabulary entry)
    fit ``logits_budget``: the chunk a prompt is scored in (here and by continuous batching)."""
    return max(1, logits_budget // (8 * vocab))


def check_top_n(value: Any, name: str, high: int | None = None, high_text: str | None = None) -> int:
    """``value`` (alternatives per scored token, named ``name`` to the caller) an int from 0 to
    ``high`` (``high_text`` says what it is; None: no upper bound), else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (high is not None and value > high):
        bound = ">= 0" if high is None else f"from 0 to {high_text or high}"
        raise ConfigError(f"`{name}` must be an int {bound}; got {value!r}")
    return value


def _check(ids: torch.Tensor, top_n: int, vocab: int | None, logits_budget: int) -> None:
    if ids.shape[1] == 0:
        raise ConfigError("`input_ids` is empty: there is no prompt to score")
    check_top_n(top_n, "top_n", vocab or None, f"the vocabulary's size ({vocab})")
    if not isinstance(logits_budget, int) or logits_budget < 1:
        raise ConfigError(f"`logits_budget` must be a positive number of bytes; got {logits_budget!r}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab and high >= vocab):
        raise ConfigError(f"`input_ids` must be token ids from 0 to {vocab - 1 if vocab else 'the vocabulary'}; "
                          f"got {low if low < 0 else high}")


def score_rows(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> list[TokenScore]:
    """``tokens[i]``, the token that follows position ``i`` of ``logits`` ``(positions, vocab)``,
    scored (continuous batching scores a prompt's chunks with it as they are computed)."""
    picked = choose(logits, False, logprobs=True, top=top_n, tokens=tokens.to(logits.device), ranks=True)
    out = []
    for i in range(len(tokens)):
        token, lp, top = picked.row(i)
        assert lp is not None and picked.ranks is not None
        out.append(TokenScore(token, lp, int(picked.ranks[i]), tuple(top)))
    return out
