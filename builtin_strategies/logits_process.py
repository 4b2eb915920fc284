"""Built-in logits processors and warpers, with transformers-compatible names, constructor
signatures and semantics.

Every processor is ``__call__(input_ids, scores) -> scores`` over a batch: ``input_ids`` is
``(batch, cur_len)``, ``scores`` is ``(batch, vocab)``. They are vectorised over the batch (no
per-row Python loops except where a user callback must be called per row) and avoid host syncs:
decisions that depend on the step use the tensor *shape* (``cur_len``), never a tensor's value.

The warpers are built from small composable helpers (``_keep_top_k``, ``_softmax_entropy``, ...)
so a pack can reuse them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral, Real
from typing import Any

import torch

from genkit.config.checks import outside_vocabulary
from genkit.errors import ConfigError
from genkit.strategy.processing import LogitsProcessor

__all__ = [
    "EncoderNoRepeatNGramLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "ExponentialDecayLengthPenalty",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "MinPLogitsWarper",
    "NoBadWordsLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "PrefixConstrainedLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "TemperatureLogitsWarper",
    "TopHLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TypicalLogitsWarper",
]

NEG_INF = -float("inf")


# -- argument checks -------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _bad(name: str, accepted: str, value: Any) -> ValueError:
    return ValueError(f"`{name}` must be {accepted}; got {value!r}.")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise _bad(name, f"an int >= {minimum}", value)
    return int(value)


def _check_min_tokens(value: Any) -> int:
    return _check_int("min_tokens_to_keep", value, 1)


def _check_filter_value(value: Any) -> float:
    if not _is_num(value):
        raise _bad("filter_value", "a number (usually -inf)", value)
    return float(value)


def _token_id_tensor(name: str, ids: Any, device: Any = "cpu") -> torch.Tensor:
    """One id, a list of ids, or a 1-D integer tensor -> 1-D LongTensor of ids >= 0."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() > 1:
            raise _bad(name, "a token id >= 0, a list of ids, or a 1-D integer tensor", ids)
        t = ids.reshape(-1).to(dtype=torch.long)
        if bool((t < 0).any()):
            raise _bad(name, "token ids >= 0", ids)
        return t
    if _is_int(ids):
        ids = [ids]
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise _bad(name, "a token id >= 0, a list of ids >= 0, or a 1-D integer tensor", ids)
    return torch.tensor([int(i) for i in ids], dtype=torch.long, device=device)


class _VocabMask:
    """A cached boolean mask over the vocabulary marking a fixed set of token ids.

    Ids at or above the vocabulary size are ignored (a tokenizer may know more ids than the LM
    head has rows)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.device)
        mask = self._cache.get(key)
        if mask is None:
            vocab = scores.shape[-1]
            mask = torch.zeros(vocab + 1, dtype=torch.bool, device=scores.device)
            mask[self.ids.to(scores.device).clamp(max=vocab)] = True
            mask = mask[:vocab]
            self._cache[key] = mask
        return mask


# -- composable helpers (mlx-lm sample_utils style) -----------------------------------------------

def _kth_largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value per row, shape ``(batch, 1)``."""
    k = max(1, min(k, scores.shape[-1]))
    return torch.topk(scores, k, dim=-1).values[..., -1:]


def _keep_top_k(remove: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Never remove the ``k`` best-scoring tokens (ties with the k-th included)."""
    return remove & (scores < _kth_largest(scores, k))


def _softmax_entropy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, probs, entropy per row ``(batch,)``); tokens at -inf contribute nothing."""
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    entropy = -(logp.clamp(min=torch.finfo(logp.dtype).min) * p).sum(-1)
    return logp, p, entropy


def _mask_sorted(scores: torch.Tensor, order: torch.Tensor, remove_sorted: torch.Tensor,
                 filter_value: float) -> torch.Tensor:
    """Scatter a removal mask given in ``order`` back to vocabulary order and apply it."""
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, filter_value)


def _seen_mask(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(batch, vocab)`` bool: which tokens appear in each row of ``token_ids``.

    Ids >= ``vocab`` (used as "ignore" markers) are dropped."""
    seen = torch.zeros((token_ids.shape[0], vocab + 1), dtype=torch.bool, device=token_ids.device)
    seen.scatter_(1, token_ids.clamp(min=0, max=vocab), True)
    return seen[:, :vocab]


def _penalise(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """Push scores towards "less likely": divide positive ones, multiply negative ones."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def _penalise_tokens(scores: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise, once each, the tokens listed per row in ``token_ids`` (ids >= vocab are ignored).

    Works on the listed positions only (gather / scatter into a spare last column for the
    ignored ids) rather than on the whole vocabulary."""
    vocab = scores.shape[-1]
    ids = token_ids.clamp(min=0, max=vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))
    return padded.scatter(1, ids, _penalise(padded.gather(1, ids), penalty))[:, :vocab]


def _ngram_bans(history: torch.Tensor, context: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """``(batch, vocab)`` bool: tokens that would complete an n-gram of ``history`` whose first
    ``n - 1`` tokens equal the last ``n - 1`` tokens of ``context`` (row-aligned)."""
    batch = context.shape[0]
    if history.shape[-1] < n:
        return torch.zeros((batch, vocab), dtype=torch.bool, device=context.device)
    windows = history.unfold(1, n, 1)  # (batch, num_windows, n)
    if n > 1:
        prefix = context[:, context.shape[-1] - (n - 1):]
        hits = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
    else:
        hits = torch.ones(windows.shape[:2], dtype=torch.bool, device=context.device)
    nxt = torch.where(hits, windows[..., -1], vocab)
    return _seen_mask(nxt, vocab)


# -- warpers ---------------------------------------------------------------------------------------

class TemperatureLogitsWarper(LogitsProcessor):
    """Divide the scores by ``temperature`` (> 0): below 1 sharpens, above 1 flattens."""

    def __init__(self, temperature: float) -> None:
        if not _is_num(temperature) or not temperature > 0 or math.isinf(temperature):
            hint = " For greedy decoding set do_sample=False." if _is_num(temperature) and temperature == 0 else ""
            raise ConfigError(f"`temperature` must be a finite number > 0; got {temperature!r}.{hint}")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores / self.temperature


class TopKLogitsWarper(LogitsProcessor):
    """Keep the ``top_k`` highest-scoring tokens (ties with the k-th kept), filter the rest."""

    def __init__(self, top_k: int, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1) -> None:
        top_k = _check_int("top_k", top_k, 1)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)
        self.top_k = max(top_k, self.min_tokens_to_keep)
        self.filter_value = _check_filter_value(filter_value)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.masked_fill(scores < _kth_largest(scores, self.top_k), self.filter_value)


def top_k_first(processors: Any) -> int | None:
    """The ``k`` of a :class:`TopKLogitsWarper` first in ``processors``, or second after one
    :class:`TemperatureLogitsWarper` of 1e-3 to 1e3 (genkit's own classes; the order ``generate``
    builds): every score below the k-th largest is then filtered before anything else reads it, so
    a step may give only the logits that can be among the ``k`` largest
    (:meth:`genkit.strategy.Stepper.forward_top`; the temperature's range keeps the quotients
    normal floats, see ``proxy_blocks`` in genkit/models/block_kernel.c). None otherwise."""
    lead = list(processors[:2]) if isinstance(processors, list) else []
    if lead and type(lead[0]) is TemperatureLogitsWarper and 1e-3 <= lead[0].temperature <= 1e3:
        lead = lead[1:]
    return lead[0].top_k if lead and type(lead[0]) is TopKLogitsWarper else None


class TopPLogitsWarper(LogitsProcessor):
    """Nucleus sampling: keep the smallest set of best tokens whose probability reaches ``top_p``."""

    def __init__(self, top_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1) -> None:
        if not _is_num(top_p) or not 0 <= top_p <= 1:
            raise _bad("top_p", "a number in [0, 1]", top_p)
        self.top_p = float(top_p)
        self.filter_value = _check_filter_value(filter_value)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ascending, order = torch.sort(scores, dim=-1)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = mass_up_to <= 1 - self.top_p
        remove[..., -self.min_tokens_to_keep:] = False
        return _mask_sorted(scores, order, remove, self.filter_value)


class MinPLogitsWarper(LogitsProcessor):
    """Keep tokens whose probability is at least ``min_p`` times the top token's probability."""

    def __init__(self, min_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1) -> None:
        if not _is_num(min_p) or not 0 <= min_p <= 1:
            raise _bad("min_p", "a number in [0, 1]", min_p)
        self.min_p = float(min_p)
        self.filter_value = _check_filter_value(filter_value)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = scores.softmax(dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        k = min(self.min_tokens_to_keep, scores.shape[-1])
        best = torch.topk(probs, k, dim=-1).indices
        remove = remove.scatter(-1, best, False)
        return scores.masked_fill(remove, self.filter_value)


class TypicalLogitsWarper(LogitsProcessor):
    """Locally typical sampling: keep the tokens whose surprisal is closest to the entropy, up
    to a total probability of ``mass``."""

    def __init__(self, mass: float = 0.9, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1) -> None:
        if not _is_num(mass) or not 0 < mass < 1:
            raise _bad("typical_p", "a number in (0, 1) (1.0 disables it)", mass)
        self.mass = float(mass)
        self.filter_value = _check_filter_value(filter_value)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores, dim=-1)
        entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
        distance = (-logp - entropy).abs()
        by_distance, order = torch.sort(distance, dim=-1)
        mass = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        cut = (mass < self.mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
        remove = by_distance > by_distance.gather(-1, cut)
        remove[..., :self.min_tokens_to_keep] = False
        return _mask_sorted(scores, order, remove, self.filter_value)


class EpsilonLogitsWarper(LogitsProcessor):
    """Epsilon sampling: filter tokens whose probability is below ``epsilon``."""

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1) -> None:
        if not _is_num(epsilon) or not 0 < epsilon < 1:
            raise _bad("epsilon_cutoff", "a number in (0, 1) (0 disables it)", epsilon)
        self.epsilon = float(epsilon)
        self.filter_value = _check_filter_value(filter_value)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        remove = scores.softmax(dim=-1) < self.epsilon
        return scores.masked_fill(_keep_top_k(remove, scores, self.min_tokens_to_keep), self.filter_value)


class EtaLogitsWarper(LogitsProcessor):
    """Eta sampling: an entropy-dependent cutoff ``min(eta, sqrt(eta) * exp(-entropy))``."""

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1,
                 device: str | torch.device = "cpu") -> None:
        if not _is_num(epsilon) or not 0 < epsilon < 1:
            raise _bad("eta_cutoff", "a number in (0, 1) (0 disables it)", epsilon)
        self.epsilon = float(epsilon)
        self.filter_value = _check_filter_value(filter_value)
        self.min_tokens_to_keep = _check_min_tokens(min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        _, probs, entropy = _softmax_entropy(scores)
        eta = torch.clamp(math.sqrt(self.epsilon) * torch.exp(-entropy), max=self.epsilon)[:, None]
        remove = probs < eta
        return scores.masked_fill(_keep_top_k(remove, scores, self.min_tokens_to_keep), self.filter_value)


class TopHLogitsWarper(LogitsProcessor):
    """Top-H: among the ``top_n`` (100) best tokens, keep the best ones whose cumulative entropy
    contribution stays within ``top_h`` times the entropy of that truncated distribution."""

    def __init__(self, top_h: float, filter_value: float = NEG_INF) -> None:
        if not _is_num(top_h) or not 0 < top_h <= 1:
            raise _bad("top_h", "a number in (0, 1]", top_h)
        self.top_h = float(top_h)
        self.top_n = 100
        self.filter_value = _check_filter_value(filter_value)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        n = min(self.top_n, scores.shape[-1])
        best, idx = torch.topk(scores, n, dim=-1)
        p = best.softmax(dim=-1)
        lognorm = (best - best.logsumexp(dim=-1, keepdim=True)).clamp(min=torch.finfo(best.dtype).min)
        entropy = -(lognorm * p).sum(-1)
        # per-token terms from log(p) (not the log-softmax) so that, at top_h=1, the last
        # cumulative term lands on the same side of the threshold as transformers'
        terms = torch.where(p > 0, -p * torch.log(p), torch.zeros_like(p))
        keep_best = terms.cumsum(dim=-1) <= (self.top_h * entropy)[:, None]
        keep_best[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, keep_best)
        return scores.masked_fill(~keep, self.filter_value)


# -- penalties -------------------------------------------------------------------------------------

class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Penalise every token that already appears in the sequence (CTRL-style).

    ``prompt_ignore_length``: an int (skip that many leading tokens in every row) or a 1-D tensor
    with one count per row -- genkit passes each row's left-padding length so pad tokens are not
    penalised.
    """

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None) -> None:
        if not _is_num(penalty) or not penalty > 0:
            raise _bad("penalty", "a number > 0 (1.0 means no penalty)", penalty)
        if prompt_ignore_length is not None:
            if isinstance(prompt_ignore_length, torch.Tensor):
                if prompt_ignore_length.dim() != 1:
                    raise _bad("prompt_ignore_length", "an int >= 0 or a 1-D tensor with one count per row",
                               tuple(prompt_ignore_length.shape))
            else:
                _check_int("prompt_ignore_length", prompt_ignore_length, 0)
        self.penalty = float(penalty)
        self.prompt_ignore_length = prompt_ignore_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        ignore = self.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):
            rows = input_ids.shape[0]
            if rows % ignore.shape[0]:
                raise ConfigError(f"`prompt_ignore_length` has {ignore.shape[0]} rows but the batch has {rows}")
            ignore = ignore.to(input_ids.device)
            self.prompt_ignore_length = ignore
            if rows != ignore.shape[0]:  # beams: each prompt's rows follow one another
                ignore = ignore.repeat_interleave(rows // ignore.shape[0])
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            input_ids = input_ids.masked_fill(positions[None, :] < ignore[:, None], vocab)
        elif ignore:
            input_ids = input_ids[:, ignore:]
        return _penalise_tokens(scores, input_ids, self.penalty)


class EncoderRepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Hallucination penalty: *favour* tokens of the encoder input (the prompt for decoder-only
    models) by the inverse of ``penalty``."""

    def __init__(self, penalty: float, encoder_input_ids: torch.LongTensor) -> None:
        if not _is_num(penalty) or not penalty > 0:
            raise _bad("penalty", "a number > 0 (1.0 means no penalty)", penalty)
        if not isinstance(encoder_input_ids, torch.Tensor) or encoder_input_ids.dim() != 2:
            raise _bad("encoder_input_ids", "a 2-D LongTensor (batch, length)", type(encoder_input_ids).__name__)
        self.penalty = 1.0 / float(penalty)
        self.encoder_input_ids = encoder_input_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        enc = self.encoder_input_ids.to(scores.device)
        if scores.shape[0] > enc.shape[0]:
            enc = enc.repeat_interleave(scores.shape[0] // enc.shape[0], dim=0)
        return _penalise_tokens(scores, enc, self.penalty)


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Forbid any n-gram of size ``ngram_size`` from occurring twice in a row's sequence."""

    def __init__(self, ngram_size: int) -> None:
        self.ngram_size = _check_int("ngram_size", ngram_size, 1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] < self.ngram_size:
            return scores
        banned = _ngram_bans(input_ids, input_ids, self.ngram_size, scores.shape[-1])
        return scores.masked_fill(banned, NEG_INF)


class EncoderNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Forbid n-grams of size ``encoder_ngram_size`` that occur in the encoder input (the prompt)."""

    def __init__(self, encoder_ngram_size: int, encoder_input_ids: torch.LongTensor) -> None:
        self.ngram_size = _check_int("encoder_ngram_size", encoder_ngram_size, 1)
        if not isinstance(encoder_input_ids, torch.Tensor) or encoder_input_ids.dim() not in (1, 2):
            raise _bad("encoder_input_ids", "a 1-D or 2-D LongTensor", type(encoder_input_ids).__name__)
        if encoder_input_ids.dim() == 1:
            encoder_input_ids = encoder_input_ids[None, :]
        self.encoder_input_ids = encoder_input_ids
        self.batch_size = encoder_input_ids.shape[0]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        n = self.ngram_size
        if input_ids.shape[-1] < n - 1:
            return scores
        enc = self.encoder_input_ids.to(scores.device)
        hypos = scores.shape[0]
        if hypos != enc.shape[0]:
            enc = enc.repeat_interleave(hypos // enc.shape[0], dim=0)
        banned = _ngram_bans(enc, input_ids, n, scores.shape[-1])
        return scores.masked_fill(banned, NEG_INF)


class PresenceFrequencyPenaltyLogitsProcessor(LogitsProcessor):
    """OpenAI's presence and frequency penalties (as vLLM applies them): every token already
    generated loses ``presence_penalty`` once and ``frequency_penalty`` per occurrence from its
    logit. The prompt (the first ``prompt_length`` tokens of each row) is not counted; negative
    penalties favour repetition."""

    def __init__(self, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, prompt_length: int = 0) -> None:
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, "a number between -2.0 and 2.0", value)
        _check_int("prompt_length", prompt_length, 0)
        self.presence_penalty, self.frequency_penalty = float(presence_penalty), float(frequency_penalty)
        self.prompt_length = int(prompt_length)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length:]
        if generated.shape[1] == 0:
            return scores
        vocab = scores.shape[-1]
        ids = generated.clamp(min=0, max=vocab)
        counts = torch.zeros((scores.shape[0], vocab + 1), dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=scores.dtype))
        counts = counts[:, :vocab]
        return scores - counts * self.frequency_penalty - (counts > 0).to(scores.dtype) * self.presence_penalty


class SequenceBiasLogitsProcessor(LogitsProcessor):
    """Add a bias to a token when the tokens before it complete a given sequence.

    ``sequence_bias``: ``{(id, ...): bias}`` or ``[[[id, ...], bias], ...]``. A one-token sequence
    biases that token at every step.
    """

    def __init__(self, sequence_bias: dict[tuple[int, ...], float] | list[Any]) -> None:
        self.sequence_bias = self._normalise(sequence_bias)
        self._prepared: tuple[int, torch.device] | None = None
        self._single: torch.Tensor | None = None
        self._groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def _normalise(sequence_bias: Any, name: str = "sequence_bias") -> dict[tuple[int, ...], float]:
        accepted = ("a non-empty dict {tuple of token ids >= 0: bias} or a non-empty list of "
                    "[list of token ids >= 0, bias] pairs")
        if isinstance(sequence_bias, dict):
            from .fields import parse_bias_key

            items = [(parse_bias_key(k), b) for k, b in sequence_bias.items()]
            if not all(isinstance(k, tuple) for k, _ in items):
                raise _bad(name, accepted, sequence_bias)
        elif isinstance(sequence_bias, list):
            items = []
            for pair in sequence_bias:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], (list, tuple)):
                    raise _bad(name, accepted, sequence_bias)
                items.append((tuple(pair[0]), pair[1]))
        else:
            raise _bad(name, accepted, sequence_bias)
        if not items:
            raise _bad(name, accepted, sequence_bias)
        out: dict[tuple[int, ...], float] = {}
        for ids, bias in items:
            if len(ids) == 0 or not all(_is_int(i) and i >= 0 for i in ids) or not _is_num(bias):
                raise _bad(name, accepted, sequence_bias)
            out[tuple(int(i) for i in ids)] = float(bias)
        return out

    def _prepare(self, scores: torch.Tensor) -> None:
        vocab, device = scores.shape[-1], scores.device
        too_big = sorted({i for ids in self.sequence_bias for i in ids if i >= vocab})
        if too_big:
            raise ConfigError(f"`{self._arg_name}` holds token ids {too_big} outside the model's vocabulary "
                              f"(size {vocab}); accepted ids are 0..{vocab - 1}")
        single = torch.zeros(vocab, dtype=torch.float32, device=device)
        by_len: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, bias in self.sequence_bias.items():
            if len(ids) == 1:
                single[ids[0]] = bias
            else:
                by_len.setdefault(len(ids) - 1, []).append((ids, bias))
        self._single = single
        self._groups = [
            (torch.tensor([ids[:-1] for ids, _ in group], device=device),
             torch.tensor([ids[-1] for ids, _ in group], device=device),
             torch.tensor([bias for _, bias in group], dtype=torch.float32, device=device))
            for _, group in sorted(by_len.items())
        ]
        self._prepared = (vocab, device)

    _arg_name = "sequence_bias"

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prepared != (scores.shape[-1], scores.device):
            self._prepare(scores)
        assert self._single is not None
        out = scores + self._single.to(scores.dtype)
        for prefixes, last, values in self._groups:
            plen = prefixes.shape[1]
            if plen > input_ids.shape[1]:
                continue
            hit = (input_ids[:, None, input_ids.shape[1] - plen:] == prefixes[None]).all(dim=-1)  # (batch, n)
            out.index_add_(1, last, torch.where(hit, values, 0.0).to(out.dtype))
        return out


class NoBadWordsLogitsProcessor(SequenceBiasLogitsProcessor):
    """Forbid token sequences: the last token of each ``bad_words_ids`` entry gets -inf when the
    tokens before it are already there. A one-token entry equal to an EOS id is ignored."""

    _arg_name = "bad_words_ids"

    def __init__(self, bad_words_ids: list[list[int]], eos_token_id: int | list[int] | torch.Tensor | None = None
                 ) -> None:
        accepted = "a non-empty list of non-empty lists of token ids >= 0"
        if not isinstance(bad_words_ids, (list, tuple)) or len(bad_words_ids) == 0:
            raise _bad("bad_words_ids", accepted, bad_words_ids)
        for seq in bad_words_ids:
            if not isinstance(seq, (list, tuple)) or len(seq) == 0 or not all(_is_int(i) and i >= 0 for i in seq):
                raise _bad("bad_words_ids", accepted, bad_words_ids)
        self.bad_word_ids = [list(s) for s in bad_words_ids]
        eos = set() if eos_token_id is None else set(_token_id_tensor("eos_token_id", eos_token_id).tolist())
        kept = [s for s in self.bad_word_ids if not (len(s) == 1 and s[0] in eos)]
        self.sequence_bias = {tuple(int(i) for i in s): NEG_INF for s in kept}
        self._prepared = None
        self._single = None
        self._groups = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.sequence_bias:
            return scores
        return super().__call__(input_ids, scores)


# -- length and forcing ----------------------------------------------------------------------------

class MinLengthLogitsProcessor(LogitsProcessor):
    """Forbid EOS while the sequence (prompt included) is shorter than ``min_length``."""

    def __init__(self, min_length: int, eos_token_id: int | list[int] | torch.Tensor,
                 device: str | torch.device = "cpu") -> None:
        self.min_length = _check_int("min_length", min_length, 0)
        self.eos_token_id = _token_id_tensor("eos_token_id", eos_token_id, device)
        self._eos = _VocabMask(self.eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] >= self.min_length:
            return scores
        return scores.masked_fill(self._eos(scores), NEG_INF)


class MinNewTokensLengthLogitsProcessor(LogitsProcessor):
    """Forbid EOS until ``min_new_tokens`` tokens follow the first ``prompt_length_to_skip``."""

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int,
                 eos_token_id: int | list[int] | torch.Tensor, device: str | torch.device = "cpu") -> None:
        self.prompt_length_to_skip = _check_int("prompt_length_to_skip", prompt_length_to_skip, 0)
        self.min_new_tokens = _check_int("min_new_tokens", min_new_tokens, 0)
        self.eos_token_id = _token_id_tensor("eos_token_id", eos_token_id, device)
        self._eos = _VocabMask(self.eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip >= self.min_new_tokens:
            return scores
        return scores.masked_fill(self._eos(scores), NEG_INF)


class PrefixConstrainedLogitsProcessor(LogitsProcessor):
    """Allow only the tokens ``prefix_allowed_tokens_fn(batch_id, row_ids)`` returns.

    The callback runs once per row per step (it is user Python); the mask is applied in one op.
    Each call's rows are prompt-major, ``num_beams`` rows per prompt, and row ``r`` belongs to
    prompt ``r // num_beams``; diverse beam search calls the processors on one group of beams at
    a time, so for it ``num_beams`` is the beams of one group (``num_beams // num_beam_groups``).
    If every beam of a prompt in the call has only -inf among its allowed tokens, the allowed
    tokens get 0 so that generation can go on.
    """

    def __init__(self, prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]], num_beams: int) -> None:
        if not callable(prefix_allowed_tokens_fn):
            raise _bad("prefix_allowed_tokens_fn", "a callable (batch_id, input_ids) -> list of token ids",
                       prefix_allowed_tokens_fn)
        self._prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
        self._num_beams = _check_int("num_beams", num_beams, 1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        beams = self._num_beams
        if input_ids.shape[0] % beams:
            raise ConfigError(
                 f"PrefixConstrainedLogitsProcessor was built for {beams} beams per prompt but called on "
                 f"{input_ids.shape[0]} rows, not a multiple of {beams}: build it with the beams of one call "
                 "(num_beams, or num_beams // num_beam_groups for diverse beam search)"
             )
        rows: list[int] = []
        cols: list[int] = []
        for row in range(input_ids.shape[0]):
            allowed = self._prefix_allowed_tokens_fn(row // beams, input_ids[row])
            allowed = allowed.tolist() if isinstance(allowed, torch.Tensor) else list(allowed)
            if len(allowed) == 0:
                raise ConfigError(
                     f"`prefix_allowed_tokens_fn` returned no allowed tokens for batch id {row // beams}: the "
                     "constraint cannot be satisfied; it must return a non-empty list of token ids"
                 )
            rows.extend([row] * len(allowed))
            cols.extend(int(c) for c in allowed)
        mask = torch.full_like(scores, NEG_INF)
        mask[torch.tensor(rows, device=scores.device), torch.tensor(cols, device=scores.device)] = 0
        out = scores + mask
        stuck = out.amax(dim=-1).isneginf().view(-1, beams).all(dim=-1, keepdim=True)
        return torch.where(stuck.repeat_interleave(beams, dim=0), mask, out)


class ForcedBOSTokenLogitsProcessor(LogitsProcessor):
    """Force ``bos_token_id`` as the first generated token (when the sequence has length 1)."""

    def __init__(self, bos_token_id: int) -> None:
        self.bos_token_id = _check_int("bos_token_id", bos_token_id, 0)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] != 1:
            return scores
        check_forced_ids("forced_bos_token_id", [self.bos_token_id], scores.shape[-1])
        out = torch.full_like(scores, NEG_INF)
        out[:, self.bos_token_id] = 0
        return out


def check_forced_ids(name: str, ids: list[int], vocab: int) -> None:
    """A forced token must be one the model can score (transformers fails with an IndexError); generate
    checks its settings before the first step (genkit.config.checks.check_vocabulary), this a processor
    made by hand."""
    outside = [i for i in ids if i >= vocab]
    if outside:
        raise ConfigError(outside_vocabulary(name, outside, vocab))


class ForcedEOSTokenLogitsProcessor(LogitsProcessor):
    """Force an EOS token when the next token is the last one ``max_length`` allows."""

    def __init__(self, max_length: int, eos_token_id: int | list[int] | torch.Tensor,
                 device: str | torch.device = "cpu") -> None:
        self.max_length = _check_int("max_length", max_length, 1)
        self.eos_token_id = _token_id_tensor("eos_token_id", eos_token_id, device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] != self.max_length - 1:
            return scores
        check_forced_ids("forced_eos_token_id", self.eos_token_id.tolist(), scores.shape[-1])
        out = torch.full_like(scores, NEG_INF)
        out[:, self.eos_token_id.to(scores.device)] = 0
        return out


class InfNanRemoveLogitsProcessor(LogitsProcessor):
    """Replace NaN by 0 and +-inf by the dtype's largest/smallest finite value."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        info = torch.finfo(scores.dtype)
        return torch.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)


class ExponentialDecayLengthPenalty(LogitsProcessor):
    """After ``start_index`` new tokens, raise the EOS score by ``|score| * (factor**steps - 1)``."""

    def __init__(self, exponential_decay_length_penalty: tuple[int, float],
                 eos_token_id: int | list[int] | torch.Tensor, input_ids_seq_length: int) -> None:
        pair = exponential_decay_length_penalty
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0
                or not _is_num(pair[1]) or pair[1] <= 0):
            raise _bad("exponential_decay_length_penalty", "a pair (start_index: int >= 0, decay_factor: number > 0)",
                       pair)
        _check_int("input_ids_seq_length", input_ids_seq_length, 0)
        self.regulation_start = int(pair[0]) + input_ids_seq_length
        self.regulation_factor = float(pair[1])
        self.eos_token_id = _token_id_tensor("eos_token_id", eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        steps = input_ids.shape[-1] - self.regulation_start
        if steps <= 0:
            return scores
        eos = self.eos_token_id.to(scores.device)
        eos_scores = scores[:, eos]
        boost = eos_scores.abs() * (self.regulation_factor ** steps - 1)
        boost = boost.masked_fill(~torch.isfinite(eos_scores), 0.0)
        out = scores.clone()
        out[:, eos] = eos_scores + boost
        return out


class LogitNormalization(LogitsProcessor):
    """Log-softmax the scores (use last, after the warpers)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.log_softmax(dim=-1)


class SuppressTokensLogitsProcessor(LogitsProcessor):
    """Give ``suppress_tokens`` a score of -inf at every step."""

    def __init__(self, suppress_tokens: Iterable[int] | torch.Tensor, device: str | torch.device = "cpu") -> None:
        ids = suppress_tokens if isinstance(suppress_tokens, torch.Tensor) else list(suppress_tokens)
        self.suppress_tokens = _token_id_tensor("suppress_tokens", ids, device)
        self._mask = _VocabMask(self.suppress_tokens)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.masked_fill(self._mask(scores), NEG_INF)


class SuppressTokensAtBeginLogitsProcessor(LogitsProcessor):
    """Give ``begin_suppress_tokens`` -inf at the step where the sequence length is ``begin_index``."""

    def __init__(self, begin_suppress_tokens: Sequence[int] | torch.Tensor, begin_index: int,
                 device: str | torch.device = "cpu") -> None:
        ids = begin_suppress_tokens if isinstance(begin_suppress_tokens, torch.Tensor) else list(begin_suppress_tokens)
        self.begin_suppress_tokens = _token_id_tensor("begin_suppress_tokens", ids, device)
        self.begin_index = _check_int("begin_index", begin_index, 0)
        self._mask = _VocabMask(self.begin_suppress_tokens)

    def set_begin_index(self, begin_index: int) -> None:
        self.begin_index = _check_int("begin_index", begin_index, 0)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] != self.begin_index:
            return scores
        return scores.masked_fill(self._mask(scores), NEG_INF)
