"""The stopping side of a decoding loop: EOS, lengths, stopping criteria and the streamer.

This module holds the one finish decision of genkit: :func:`finish_codes` says which rows are
finished and why (one of :data:`FINISH_REASONS`), and :func:`eos_token_ids` /
:func:`special_tokens` are the one place the EOS ids are read. :class:`FinishTracker` (the
strategies), the continuous-batching manager, ``genkit serve`` and ``genkit batch`` all read them.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from genkit.config import GenerationConfig, ResolvedConfig, resolve_special_tokens
from genkit.config.checks import model_vocab_size
from genkit.config.resolve import (
    SPECIAL_TOKENS,
    eos_token_ids,  # the one reading of an eos_token_id setting
)
from genkit.errors import ConfigError

from .call import StopConditions, StrategyCall

__all__ = ["FINISH_REASONS", "FinishTracker", "StreamerOnce", "eos_or_length", "eos_token_ids", "finish_codes",
           "finish_reason",
           "openai_finish_reason", "reason_names", "special_tokens"]

#: Why a row finished, highest priority first: when several conditions end a row at the same step,
#: the first one here is its reason. ``eos``: an end-of-sequence token; ``stop_string``: a stop
#: string (``StopStringCriteria``); ``criteria``: another stopping criterion (the caller's own);
#: ``cancelled``: the request was cancelled; ``max_time``: ``max_time`` seconds passed;
#: ``length``: ``max_length`` / ``max_new_tokens`` reached.
FINISH_REASONS = ("eos", "stop_string", "criteria", "cancelled", "max_time", "length")
_CODE = {name: i + 1 for i, name in enumerate(FINISH_REASONS)}  # 0: not finished


def finish_reason(criterion: Any) -> str:
    """The reason a stopping criterion gives when it ends a row: its ``finish_reason`` attribute
    (one of :data:`FINISH_REASONS`), else ``"criteria"``."""
    reason = getattr(criterion, "finish_reason", None)
    return reason if reason in _CODE else "criteria"


def finish_codes(stop: StopConditions, sequences: torch.Tensor, scores: torch.Tensor | None,
                 tokens: torch.Tensor) -> torch.Tensor:
    """THE finish decision: ``(rows,)`` int8 codes for ``sequences`` ``(rows, length)`` whose last
    tokens are ``tokens`` ``(rows,)``: 0 where the row goes on, else ``1 +`` the index of its reason
    in :data:`FINISH_REASONS` (:func:`reason_names` turns them into names). Tensor ops only: no
    host sync unless a criterion makes one."""
    done = sequences.shape[-1] >= stop.max_length
    if not stop.criteria and stop.eos is not None and not done:  # the common step: EOS only (code 1)
        return torch.isin(tokens, stop.eos).to(torch.int8)
    codes = torch.full((sequences.shape[0],), _CODE["length"] if done else 0, dtype=torch.int8,
                       device=sequences.device)
    # lowest priority first, so that the highest-priority reason is written last
    for code, criterion in sorted(((_CODE[finish_reason(c)], c) for c in stop.criteria), key=lambda x: -x[0]):
        hit = torch.as_tensor(criterion(sequences, scores), device=codes.device)
        codes = torch.where(hit, code, codes)
    if stop.eos is not None:
        eos_hit = torch.isin(tokens.to(stop.eos.device), stop.eos).to(codes.device)
        codes = torch.where(eos_hit, _CODE["eos"], codes)
    return codes


def eos_or_length(stop: StopConditions, length: int, token: int) -> str | None:
    """:func:`finish_codes`' reason for one row whose ``stop`` has no criteria (EOS and
    ``max_length`` only), from plain values: ``length`` tokens (prompt included) after choosing
    ``token``. ``"eos"`` wins over ``"length"`` (:data:`FINISH_REASONS`' order)."""
    if stop.criteria:
        raise ConfigError("eos_or_length decides for stop conditions without criteria; use finish_codes")
    if stop.eos is not None and token in stop.eos.tolist():
        return "eos"
    return "length" if length >= stop.max_length else None


def reason_names(codes: torch.Tensor) -> list[str | None]:
    """Codes of :func:`finish_codes` as reason names (``None``: not finished)."""
    return [FINISH_REASONS[c - 1] if c else None for c in codes.tolist()]


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for a genkit reason: ``"length"`` where a limit cut the text
    (``length``, ``max_time``), ``"stop"`` otherwise; ``None`` stays ``None``."""
    if reason is None:
        return None
    return "length" if reason in ("length", "max_time") else "stop"


def special_tokens(model: Any, config: ResolvedConfig) -> tuple[ResolvedConfig, list[int]]:
    """The config of a generation with its special tokens resolved, and its EOS ids: a model
    without a generation config of its own gives its model config's EOS / BOS / pad ids to fields
    the config leaves unset, and the pad id defaults to the first EOS id the model's vocabulary holds
    (:func:`genkit.config.resolve_special_tokens`)."""
    mc = getattr(model, "config", None)
    own = isinstance(getattr(model, "generation_config", None), GenerationConfig)
    model_tokens = {} if own or mc is None else {name: getattr(mc, name, None) for name in SPECIAL_TOKENS}
    config = resolve_special_tokens(config, model_tokens, model_vocab_size(model))
    return config, eos_token_ids(config.eos_token_id)


class StreamerOnce:
    """A streamer whose ``end()`` reaches the wrapped streamer once, however often it is called
    (the finish tracker and ``generate`` both end it on every exit path). Other attributes are
    read from the wrapped streamer, available as :attr:`streamer`."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.ended = False

    @classmethod
    def wrap(cls, streamer: Any) -> Any:
        return streamer if streamer is None or isinstance(streamer, StreamerOnce) else cls(streamer)

    def put(self, value: torch.Tensor) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.streamer.end()

    def __getattr__(self, name: str) -> Any:
        if name == "streamer":
            raise AttributeError(name)
        return getattr(self.streamer, name)


class FinishTracker:
    """Which rows are still generating, and whether the loop is done.

    Use it as a context manager: entering streams the prompt, leaving ends the streamer on every
    exit path (errors included)::

        with FinishTracker(call) as finish:
            ...
            tokens = finish.pad(tokens)             # finished rows get the pad token
            stepper.push(tokens)
            if finish.update(stepper.sequences, scores, tokens):
                break

    ``rows`` defaults to the call's batch size.
    """

    def __init__(self, call: StrategyCall, rows: int | None = None) -> None:
        stop = call.stop
        self.stop = stop
        self.max_length = stop.max_length
        self.eos = stop.eos
        self.criteria = stop.criteria
        self.pad_token_id = call.pad_token_id
        self.pads_finished = stop.pads_finished
        self.may_finish_early = stop.may_finish_early
        self.streamer = call.streamer
        self.prompt = call.input_ids
        n = call.batch if rows is None else rows
        self.unfinished = torch.ones(n, dtype=torch.bool, device=call.device)
        #: per row, 0 while it goes on, else its reason's code (:func:`finish_codes`)
        self.codes = torch.zeros(n, dtype=torch.int8, device=call.device)

    @property
    def reasons(self) -> list[str | None]:
        """Why each row finished (a name of :data:`FINISH_REASONS`; ``None``: it has not)."""
        return reason_names(self.codes)

    # -- streamer ------------------------------------------------------------------------------
    def __enter__(self) -> FinishTracker:
        if self.streamer is not None:
            self.streamer.put(self.prompt.cpu())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End the streamer (once)."""
        if self.streamer is not None:
            streamer, self.streamer = self.streamer, None
            streamer.end()

    @property
    def reads_scores(self) -> bool:
        """Whether :meth:`update` hands the step's scores to anything: a stopping criterion, or a
        streamer's ``put_step`` (a greedy step without them may skip computing the logits)."""
        return bool(self.criteria) or getattr(self.streamer, "put_step", None) is not None

    # -- per step ------------------------------------------------------------------------------
    def pad(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``(rows,)`` with the pad token in rows that are already finished."""
        if not self.pads_finished:
            return tokens
        return torch.where(self.unfinished, tokens, self.pad_token_id)

    def update(self, sequences: torch.Tensor, scores: torch.Tensor | None, tokens: torch.Tensor) -> bool:
        """After ``tokens`` ``(rows,)`` were appended to ``sequences``: stream them, mark the rows
        they finish (and why, :func:`finish_codes`), and return ``True`` when the loop should stop
        (``max_length`` reached, or every row finished).

        A streamer that defines ``put_step(scores, finished)`` gets it after ``put(tokens)``: the
        processed ``scores`` the tokens were chosen from, and per row the reason it finished at
        this step (``None`` elsewhere)."""
        newly = finish_codes(self.stop, sequences, scores, tokens).mul_(self.unfinished)  # rows finished now
        self.codes.add_(newly)  # a finished row's code stays (it was 0 until now)
        self.unfinished = self.codes == 0
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
            put_step = getattr(self.streamer, "put_step", None)
            if put_step is not None:
                put_step(scores, reason_names(newly))
        if sequences.shape[-1] >= self.max_length:
            return True
        return self.may_finish_early and not bool(self.unfinished.any())

    def hits(self, tokens: torch.Tensor, sequences: torch.Tensor, count_length: bool = True) -> torch.Tensor:
        """Which candidates end with their last token (no state change; for beam search):
        ``tokens`` ``(...)`` are the last tokens of ``sequences`` ``(..., length)``. With
        ``count_length=False`` reaching ``max_length`` does not count (EOS and the criteria only)."""
        length = sequences.shape[-1]
        hits = torch.full_like(tokens, count_length and length >= self.max_length, dtype=torch.bool)
        if self.eos is not None:
            hits = hits | torch.isin(tokens, self.eos)
        if self.criteria:
            flat = sequences.reshape(-1, length)
            for criterion in self.criteria:
                hits = hits | criterion(flat, None).view(tokens.shape)
        return hits
