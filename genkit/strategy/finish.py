"""The stopping side of a decoding loop: EOS, lengths, stopping criteria and the streamer."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from .call import StrategyCall

__all__ = ["FinishTracker", "StreamerOnce"]


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

    # -- per step ------------------------------------------------------------------------------
    def pad(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``(rows,)`` with the pad token in rows that are already finished."""
        if not self.pads_finished:
            return tokens
        return torch.where(self.unfinished, tokens, self.pad_token_id)

    def update(self, sequences: torch.Tensor, scores: torch.Tensor | None, tokens: torch.Tensor) -> bool:
        """After ``tokens`` ``(rows,)`` were appended to ``sequences``: stream them, mark the rows
        they finish, and return ``True`` when the loop should stop (``max_length`` reached, or
        every row finished)."""
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        if self.eos is not None:
            self.unfinished = self.unfinished & ~torch.isin(tokens, self.eos)
        for criterion in self.criteria:
            self.unfinished = self.unfinished & ~criterion(sequences, scores)
        if sequences.shape[-1] >= self.max_length:
            return True
        return self.may_finish_early and not bool(self.unfinished.any())

    def hits(self, tokens: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """Which candidates end with their last token (no state change; for beam search):
        ``tokens`` ``(...)`` are the last tokens of ``sequences`` ``(..., length)``."""
        length = sequences.shape[-1]
        hits = torch.full_like(tokens, length >= self.max_length, dtype=torch.bool)
        if self.eos is not None:
            hits = hits | torch.isin(tokens, self.eos)
        if self.criteria:
            flat = sequences.reshape(-1, length)
            for criterion in self.criteria:
                hits = hits | criterion(flat, None).view(tokens.shape)
        return hits
