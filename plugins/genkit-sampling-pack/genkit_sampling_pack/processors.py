"""The DRY and XTC logits processors and their factories.

DRY ("don't repeat yourself"): if the text ends with a sequence that already occurred earlier,
the token that followed the earlier occurrence is penalised, the more the longer the repeat:
``penalty = dry_multiplier * dry_base ** (match_length - dry_allowed_length)`` for
``match_length >= dry_allowed_length``, subtracted from that token's logit. A match never extends
across a sequence-breaker token, and a breaker token is never penalised.

XTC ("exclude top choices"): with probability ``xtc_probability`` per step and row, every token
whose probability is at least ``xtc_threshold`` is removed except the least probable of them, so
the most predictable continuations give way to other plausible ones. It acts only when at least
two tokens clear the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from genkit import LogitsProcessor, ProcessorContext

__all__ = ["DRYLogitsProcessor", "XTCLogitsWarper", "make_dry", "make_xtc"]

# match lengths are capped so the exponent stays finite and the scan stays linear in practice
MAX_MATCH_LENGTH = 64


class DRYLogitsProcessor(LogitsProcessor):
    """The DRY repetition penalty (see the module docstring)."""

    def __init__(self, multiplier: float, base: float = 1.75, allowed_length: int = 2,
                 sequence_breakers: Sequence[int] | None = None, penalty_last_n: int = -1) -> None:
        if multiplier < 0:
            raise ValueError(f"`dry_multiplier` must be >= 0; got {multiplier!r}")
        if base <= 1:
            raise ValueError(f"`dry_base` must be > 1; got {base!r}")
        if allowed_length < 1:
            raise ValueError(f"`dry_allowed_length` must be >= 1; got {allowed_length!r}")
        if penalty_last_n < -1:
            raise ValueError(f"`dry_penalty_last_n` must be >= -1; got {penalty_last_n!r}")
        self.multiplier = float(multiplier)
        self.base = float(base)
        self.allowed_length = int(allowed_length)
        self.breakers = frozenset(int(t) for t in (sequence_breakers or ()))
        self.penalty_last_n = int(penalty_last_n)

    def penalties(self, ids: list[int]) -> dict[int, float]:
        """Token id -> penalty for one row of token ids."""
        if self.penalty_last_n == 0 or self.multiplier == 0 or len(ids) < 2:
            return {}
        if self.penalty_last_n > 0:
            ids = ids[-self.penalty_last_n:]
        n = len(ids)
        last = ids[-1]
        if last in self.breakers:
            return {}
        longest: dict[int, int] = {}
        for end in range(n - 2, -1, -1):  # `end` is the last position of an earlier occurrence
            if ids[end] != last:
                continue
            follower = ids[end + 1]
            if follower in self.breakers:
                continue
            length = 1
            while length < MAX_MATCH_LENGTH and end - length >= 0:
                earlier, recent = ids[end - length], ids[n - 1 - length]
                if earlier != recent or earlier in self.breakers:
                    break
                length += 1
            if length > longest.get(follower, 0):
                longest[follower] = length
        out = {}
        for token, length in longest.items():
            if length >= self.allowed_length:
                out[token] = self.multiplier * math.pow(self.base, length - self.allowed_length)
        return out

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = input_ids.tolist()
        out = scores
        for b, ids in enumerate(rows):
            pen = self.penalties(ids)
            if not pen:
                continue
            if out is scores:
                out = scores.clone()
            tokens = torch.tensor(list(pen), dtype=torch.long, device=scores.device)
            values = torch.tensor(list(pen.values()), dtype=scores.dtype, device=scores.device)
            out[b].index_add_(0, tokens, -values)
        return out


class XTCLogitsWarper(LogitsProcessor):
    """XTC sampling (see the module docstring). Randomness comes from torch's global generator
    (or ``generator``), so ``torch.manual_seed`` makes it reproducible."""

    def __init__(self, probability: float, threshold: float = 0.1, generator: torch.Generator | None = None) -> None:
        if not 0 <= probability <= 1:
            raise ValueError(f"`xtc_probability` must be in [0, 1]; got {probability!r}")
        if not 0 <= threshold <= 1:
            raise ValueError(f"`xtc_threshold` must be in [0, 1]; got {threshold!r}")
        self.probability = float(probability)
        self.threshold = float(threshold)
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = scores.shape[0]
        roll = torch.rand(batch, generator=self.generator, device="cpu").to(scores.device)
        act = roll < self.probability
        probs = torch.softmax(scores.float(), dim=-1)
        top = (probs >= self.threshold) & (probs > 0)  # tokens already removed are never "top"
        act = act & (top.sum(dim=-1) >= 2)
        if not bool(act.any()):
            return scores
        # the least probable of the top choices survives
        survivor = torch.where(top, probs, torch.full_like(probs, float("inf"))).argmin(dim=-1)
        remove = top.clone()
        remove[torch.arange(batch, device=scores.device), survivor] = False
        remove &= act[:, None]
        return scores.masked_fill(remove, float("-inf"))


def make_dry(config: Any, ctx: ProcessorContext) -> DRYLogitsProcessor | None:
    """DRY when ``dry_multiplier > 0`` and ``dry_penalty_last_n != 0``."""
    if not config.dry_multiplier or config.dry_penalty_last_n == 0:
        return None
    return DRYLogitsProcessor(config.dry_multiplier, config.dry_base, config.dry_allowed_length,
                              config.dry_sequence_breakers, config.dry_penalty_last_n)


def make_xtc(config: Any, ctx: ProcessorContext) -> XTCLogitsWarper | None:
    """XTC when sampling and ``xtc_probability > 0``."""
    if not config.do_sample or not config.xtc_probability:
        return None
    return XTCLogitsWarper(config.xtc_probability, config.xtc_threshold)
