"""The sampler: the next token of each row and its log-probability, chosen in one place.

Every engine picks tokens with :func:`choose`: the decoding strategies (through
:func:`choose_tokens`), the continuous-batching manager and ``genkit serve``. So a request gets
the same tokens whichever engine runs it: greedy is the argmax of the processed scores; sampling
is one ``torch.multinomial`` draw per row from their softmax, from ``generator`` (``None``: torch's
global generator, which ``genkit.set_seed`` / ``torch.manual_seed`` seed). A
``torch.Generator`` seeded with ``s`` draws the same tokens as the global generator after
``torch.manual_seed(s)``.

Log-probabilities are those of the distribution the token was chosen from: ``log_softmax`` of the
processed scores (after every logits processor and sampling warper), in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Choice", "argmax_rows", "check_choosable", "choose", "choose_tokens", "log_probs"]


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked for ``rows`` rows.

    ``tokens`` ``(rows,)``; ``logprobs`` ``(rows,)`` the chosen tokens' log-probabilities (when
    asked for); ``top_ids`` / ``top_logprobs`` ``(rows, k)`` the ``k`` most likely tokens, best first
    (when ``top`` > 0 was asked for); ``ranks`` ``(rows,)`` each chosen token's rank, 1 + the number
    of tokens strictly more likely (when asked for)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    def row(self, i: int) -> tuple[int, float | None, list[tuple[int, float]]]:
        """Row ``i`` as plain values: (token, its log-probability or None, [(id, log-probability), ...])."""
        lp = None if self.logprobs is None else float(self.logprobs[i])
        top: list[tuple[int, float]] = []
        if self.top_ids is not None and self.top_logprobs is not None:
            top = list(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist()))
        return int(self.tokens[i]), lp, top


def choose_tokens(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None, *,
                  live: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from processed ``scores`` ``(rows, vocab)``: the argmax, or a draw from
    their softmax with ``do_sample`` (see the module docstring). A row every score of which is
    ``-inf`` (the processors allowed no token) raises (:func:`check_choosable`), and so does a draw
    from NaN scores, unless ``live`` ``(rows,)`` says the row is finished already (its token is
    replaced by padding). Greedy search takes a NaN score's token, as torch's and numpy's argmax do."""
    if not do_sample:
        tokens = argmax_rows(scores)
        check_choosable(scores, tokens, live)
        return tokens
    probs = torch.softmax(scores, dim=-1)
    try:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    except RuntimeError:  # a row of NaN probabilities: which, and why
        best = scores.amax(dim=-1)
        dead = _dead_rows(best)
        overflowed = best == float("inf")
        if not bool(dead.any()) and not bool(overflowed.any()):
            raise
        _refuse(scores, dead, live)
        _refuse_overflow(overflowed, live)
        dead = dead | overflowed
        probs = torch.where(dead[:, None], 1.0, probs)  # finished rows only: any token, padded over
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def check_choosable(scores: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor | None = None) -> None:
    """Raise where the token chosen for a row of ``scores`` is not a choice: its score is ``-inf``, so
    the processors ruled out every token (:class:`~genkit.errors.NoTokenAllowedError`; a token chosen
    as the maximum, or the best candidate). A NaN score is a choice, as argmax makes it (the greedy
    fast paths pick it too). Rows that ``live`` marks finished are not checked. One gather of the
    chosen scores."""
    dead = scores.gather(-1, tokens.reshape(-1, 1).to(scores.device)).squeeze(-1) == float("-inf")
    if bool(dead.any()):
        _refuse(scores, dead, live)


def _dead_rows(best: torch.Tensor) -> torch.Tensor:
    """Which rows' best score ``best`` ``(rows,)`` is ``-inf`` or NaN (no distribution to draw from)."""
    return ~(best > float("-inf"))


def _refuse(scores: torch.Tensor, dead: torch.Tensor, live: torch.Tensor | None) -> None:
    """Raise for the first row that ``dead`` marks and ``live`` (when given) does not mark finished."""
    if live is not None:
        dead = dead & live.to(dead.device)
    rows = dead.nonzero().flatten().tolist()
    if not rows:
        return
    from genkit.errors import GenerationError, NoTokenAllowedError

    row = rows[0]
    if bool(scores[row].isnan().any()):
        raise GenerationError(f"the scores of row {row} are NaN (the model's logits or a logits processor gave "
                              "NaN): no token can be chosen")
    raise NoTokenAllowedError(
        f"no token is allowed for row {row}: the logits processors set every token's score to -inf. The "
        "constraints contradict each other (e.g. suppress_tokens / bad_words_ids / allowed_token_ids / "
        "logit_bias against a guided_* grammar or prefix_allowed_tokens_fn); choosing anyway would emit a "
        "token they rule out")


def _refuse_overflow(overflowed: torch.Tensor, live: torch.Tensor | None) -> None:
    """Raise for the first row that ``overflowed`` marks (a score of +inf: its softmax is NaN) and
    ``live`` (when given) does not mark finished."""
    rows = (overflowed if live is None else overflowed & live.to(overflowed.device)).nonzero().flatten().tolist()
    if rows:
        from genkit.errors import GenerationError

        raise GenerationError(
            f"the scores of row {rows[0]} hold +inf, so sampling has no distribution to draw from: a logits "
            "processor's result overflowed (e.g. a repetition_penalty or encoder_repetition_penalty far from 1, an "
            "exponential_decay_length_penalty or guidance_scale too large)")


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` (the first maximum of each row; a NaN counts as the maximum), with
    numpy's vectorized argmax for a float32 / float64 tensor on the CPU: torch's reduction over a
    vocabulary-wide row is several times slower, and far slower where its threads share busy cores
    (a continuous-batching step chooses for every request at once). Without numpy: torch's."""
    array = _numpy(scores) if scores.dtype in (torch.float32, torch.float64) else None
    if array is not None:
        import numpy as np

        return torch.from_numpy(np.asarray(np.argmax(array, axis=-1))).long()
    return scores.argmax(dim=-1)


def _ranks(lp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1 + the number of tokens more likely than each row's chosen one, counted by numpy on the
    CPU where it can (5x torch's sum of a vocabulary-wide boolean row here), else by torch."""
    rows, own = _numpy(lp), _numpy(chosen[:, None])
    if rows is not None and own is not None:
        import numpy as np

        return torch.from_numpy(np.asarray(np.count_nonzero(rows > own, axis=1))).long() + 1
    return (lp > chosen[:, None]).sum(-1) + 1


def _numpy(t: torch.Tensor) -> Any:
    """``t`` as a numpy array sharing its memory, where numpy can read it (a CPU tensor without
    grad, outside ``torch.compile``); None otherwise, and without numpy (optional: the gguf extra
    brings it)."""
    if t.device.type != "cpu" or t.requires_grad or torch.compiler.is_compiling():
        return None
    try:
        return t.numpy()
    except (ImportError, RuntimeError):
        return None


def log_probs(scores: torch.Tensor) -> torch.Tensor:
    """The log-probabilities ``(rows, vocab)`` that processed ``scores`` stand for (float32)."""
    return torch.log_softmax(scores.float(), dim=-1)


def choose(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None, *,
           logprobs: bool = False, top: int = 0, tokens: torch.Tensor | None = None,
           ranks: bool = False) -> Choice:
    """:func:`choose_tokens`, with the chosen tokens' log-probabilities when ``logprobs`` (and their
    ``ranks``) and the ``top`` most likely alternatives when ``top`` > 0. ``tokens``: report on these
    tokens instead of choosing (a strategy that has chosen already, e.g. a finished row's pad token;
    a prompt's own next tokens, genkit.generation.scoring)."""
    if top < 0:
        from genkit.errors import ConfigError

        raise ConfigError(f"`top` (top log-probabilities) must be an int >= 0; got {top!r}")
    if tokens is None:
        tokens = choose_tokens(scores, do_sample, generator)
    if not logprobs and not top and not ranks:
        return Choice(tokens)
    lp = log_probs(scores)
    chosen = lp.gather(-1, tokens.reshape(-1, 1).to(lp.device)).squeeze(-1)
    rank = _ranks(lp, chosen) if ranks else None
    if not top:
        return Choice(tokens, chosen, ranks=rank)
    best = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return Choice(tokens, chosen, best.indices, best.values, rank)
