"""The SynthID text watermark's logits processor (transformers' ``SynthIDTextWatermarkLogitsProcessor``).

Tournament sampling, as transformers implements it: for every candidate token ``x`` a hash of the
``ngram_len - 1`` previous tokens, ``x`` and each key gives one pseudo-random bit per layer (the
*g-values*, read from a table of random bits). Layer by layer the distribution is reweighted::

    p <- p * (1 + g_l - E_p[g_l])

which is what a tournament between samples of ``p`` decided by ``g_l`` leaves on average. Tokens
with g-value 1 gain mass, so watermarked text has more g-values of 1 than chance (0.5), and that
is what the detectors measure. A context (the previous ``ngram_len - 1`` tokens) already seen in
this generation is not watermarked again (the last ``context_history_size`` contexts are kept).

The processor is stateful, like transformers': it is built anew for each ``generate`` call (by
``SynthIDTextWatermarkingConfig.construct_processor``); its first call starts the context at
zeros, and each later call shifts in the token appended since. The hashes are 64-bit integer
arithmetic that wraps around, computed with the same torch operations as transformers, so
g-values and scores are identical.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from genkit import LogitsProcessor
from genkit.errors import ConfigError

logger = logging.getLogger("genkit_synthid_pack")

__all__ = ["SynthIDTextWatermarkLogitsProcessor", "SynthIDTextWatermarkState", "accumulate_hash"]

# the linear congruential generator of newlib/musl
LCG_MULTIPLIER = 6364136223846793005
LCG_INCREMENT = 1


def accumulate_hash(current_hash: torch.Tensor, data: torch.Tensor, multiplier: int = LCG_MULTIPLIER,
                    increment: int = LCG_INCREMENT) -> torch.Tensor:
    """Fold the last dimension of ``data`` into ``current_hash`` (int64, wrapping):
    ``h <- (h + data[..., i]) * multiplier + increment`` for each ``i``; shapes broadcast."""
    for i in range(data.shape[-1]):
        current_hash = torch.add(current_hash, data[..., i])
        current_hash = torch.mul(current_hash, multiplier)
        current_hash = torch.add(current_hash, increment)
    return current_hash


class SynthIDTextWatermarkState:
    """Per-generation state: each row's current context and its recently seen context hashes."""

    def __init__(self, batch_size: int, ngram_len: int, context_history_size: int, device: Any) -> None:
        self.context = torch.zeros((batch_size, ngram_len - 1), dtype=torch.int64, device=device)
        self.context_history = torch.zeros((batch_size, context_history_size), dtype=torch.int64, device=device)
        self.num_calls = 0


class SynthIDTextWatermarkLogitsProcessor(LogitsProcessor):
    """Applies the SynthID text watermark (see the module docstring); the arguments are those of
    :class:`~genkit_synthid_pack.SynthIDTextWatermarkingConfig`, plus the ``device`` the tables live on.

    Scores come back as log-probabilities (tokens whose probability became 0 get the dtype's
    lowest finite value), as in transformers.
    """

    def __init__(self, ngram_len: int, keys: Sequence[int], sampling_table_size: int, sampling_table_seed: int,
                 context_history_size: int, device: Any, skip_first_ngram_calls: bool = False,
                 debug_mode: bool = False) -> None:
        self.ngram_len = int(ngram_len)
        self.keys = torch.tensor(list(keys), device=device)
        generator = torch.Generator(device=device).manual_seed(sampling_table_seed)
        # random bits indexed by hash modulo the table size (the three_bricks hashing, as in transformers)
        self.sampling_table = torch.randint(low=0, high=2, size=(sampling_table_size,), generator=generator,
                                            device=device)
        self.context_history_size = int(context_history_size)
        self.device = device
        self.state: SynthIDTextWatermarkState | None = None
        self.skip_first_ngram_calls = bool(skip_first_ngram_calls)
        self.debug_mode = bool(debug_mode)

    @property
    def depth(self) -> int:
        return int(self.keys.shape[0])

    # -- hashing and g-values --------------------------------------------------------------------
    def _with_keys(self, hash_result: torch.Tensor) -> torch.Tensor:
        """``(...)`` hashes -> ``(..., depth)``: each hash continued with each key."""
        return accumulate_hash(hash_result[..., None], self.keys[:, None])

    def compute_ngram_keys(self, ngrams: torch.Tensor) -> torch.Tensor:
        """Keys ``(batch, num_ngrams, depth)`` of n-grams ``(batch, num_ngrams, ngram_len)``."""
        if ngrams.dim() != 3 or ngrams.shape[2] != self.ngram_len:
            raise ConfigError(f"`ngrams` must have the shape (batch_size, num_ngrams, ngram_len={self.ngram_len}); "
                              f"got {tuple(ngrams.shape)}")
        start = torch.ones(ngrams.shape[0], 1, device=self.device, dtype=torch.long)
        return self._with_keys(accumulate_hash(start, ngrams))

    def _compute_keys(self, n_minus_1_grams: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``(batch, num_indices, depth)`` of each context ``(batch, ngram_len - 1)`` followed by
        each candidate of ``indices`` ``(batch, num_indices)``, and the hash of the context alone."""
        start = torch.ones(n_minus_1_grams.shape[0], device=self.device, dtype=torch.long)
        context_hash = accumulate_hash(start, n_minus_1_grams)
        with_candidate = accumulate_hash(context_hash[:, None], indices[:, :, None])
        return self._with_keys(with_candidate), context_hash

    def sample_g_values(self, ngram_keys: torch.Tensor) -> torch.Tensor:
        """g-values (0 or 1, same shape) of hash keys: the sampling table at ``key % table size``."""
        return self.sampling_table[ngram_keys % self.sampling_table.shape[0]]

    def compute_g_values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """g-values ``(batch, length - (ngram_len - 1), depth)`` of every n-gram of ``input_ids``."""
        self._check_input_ids_shape(input_ids)
        return self.sample_g_values(self.compute_ngram_keys(input_ids.unfold(1, self.ngram_len, 1)))

    # -- the watermark -------------------------------------------------------------------------
    def update_scores(self, scores: torch.Tensor, g_values: torch.Tensor) -> torch.Tensor:
        """Reweight ``softmax(scores)`` by the g-values ``(batch, vocab, depth)``, one layer after the
        other; log-probabilities out."""
        probs = torch.softmax(scores, dim=1)
        for i in range(g_values.shape[2]):
            g = g_values[:, :, i]
            g_mass = (g * probs).sum(dim=1, keepdim=True)
            probs = probs * (1 + g - g_mass)
        log_probs = torch.log(probs)
        return torch.where(torch.isfinite(log_probs), log_probs, torch.finfo(log_probs.dtype).min)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self._check_input_ids_shape(input_ids)
        batch_size, vocab_size = scores.shape
        if self.debug_mode:
            scores = torch.ones_like(scores)
        if self.state is None:
            self.state = SynthIDTextWatermarkState(batch_size, self.ngram_len, self.context_history_size, self.device)
        else:
            if self.state.context.shape[0] != batch_size:
                raise ConfigError(f"the SynthID watermark started with {self.state.context.shape[0]} rows and is now "
                                  f"called with {batch_size}; build a new processor for each generation")
            self.state.context = torch.cat((self.state.context, input_ids[:, -1:]), dim=1)[:, 1:]
        state = self.state
        state.num_calls += 1
        if self.skip_first_ngram_calls and state.num_calls < self.ngram_len:
            return scores
        candidates = torch.arange(vocab_size, device=self.device).unsqueeze(0).expand(batch_size, -1)
        ngram_keys, context_hash = self._compute_keys(state.context, candidates)
        updated = self.update_scores(scores, self.sample_g_values(ngram_keys))
        context_hash = context_hash[:, None]
        repeated = (state.context_history == context_hash).any(dim=1, keepdim=True)
        state.context_history = torch.cat((context_hash, state.context_history), dim=1)[:, :-1]
        return torch.where(repeated, scores, updated)

    # -- what the detectors need -----------------------------------------------------------------
    def compute_context_repetition_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(batch, length - (ngram_len - 1))``: True where the n-gram's context was not among the
        last ``context_history_size`` contexts before it (the positions the watermark acted on)."""
        self._check_input_ids_shape(input_ids)
        batch_size = input_ids.shape[0]
        history = torch.zeros((batch_size, self.context_history_size), dtype=torch.int64, device=self.device)
        contexts = input_ids[:, :-1].unfold(1, self.ngram_len - 1, 1)
        start = torch.ones(batch_size, device=self.device, dtype=torch.long)
        repeated = []
        for i in range(contexts.shape[1]):
            context_hash = accumulate_hash(start, contexts[:, i, :])[:, None]
            repeated.append((history == context_hash).any(dim=1, keepdim=True))
            history = torch.cat((context_hash, history), dim=1)[:, :-1]
        return torch.logical_not(torch.cat(repeated, dim=1))

    def compute_eos_token_mask(self, input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
        """``(batch, length)``: True before each row's first ``eos_token_id``, False from it on."""
        self._check_input_ids_shape(input_ids)
        return (input_ids == eos_token_id).cumsum(dim=1) == 0

    def expected_mean_g_value(self, vocab_size: int, coinflip_prob: float = 0.5) -> float:
        """The mean g-value of watermarked text for a uniform model and one layer (the paper's bound)."""
        return coinflip_prob + coinflip_prob * (1 - coinflip_prob) * (1 - (1 / vocab_size))

    @staticmethod
    def _check_input_ids_shape(input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ConfigError(f"`input_ids` must have the shape (batch_size, length); got {tuple(input_ids.shape)}")
