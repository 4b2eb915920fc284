"""Classifier-free guidance (CFG) for language models (Sanchez et al., 2023): transformers'
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` and its factory.

At each step the processor runs the model on an *unconditional* branch (the negative prompt, or
the prompt's last token when none is given, followed by the tokens generated so far) and mixes
the two next-token log-distributions::

    scores = guidance_scale * (log_softmax(cond) - log_softmax(uncond)) + log_softmax(uncond)

The unconditional branch keeps its own cache between steps, so each step runs one token. The
processor tracks which generated tokens its cache holds: when it is called on a history that
differs from the last one (assisted decoding verifies drafts, then rolls back), it crops its
cache to the common prefix and runs the rest, so it gives the same scores as plain decoding.

Positions in the unconditional branch follow its attention mask (left padding is skipped, as on
the conditional branch). transformers' processor numbers every position, pads included, so with a
left-padded batch of negative prompts the two can differ; without padding they agree.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.errors import ConfigError, NotSupportedError
from genkit.strategy.processing import LogitsProcessor, ProcessorContext

logger = logging.getLogger("genkit.guidance")

__all__ = ["ClassifierFreeGuidanceLogitsProcessor", "UnbatchedClassifierFreeGuidanceLogitsProcessor",
           "make_guidance"]


def _check_scale(guidance_scale: Any) -> float:
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not guidance_scale > 1:
        raise ConfigError(f"`guidance_scale` must be a number > 1 for ClassifierFreeGuidanceLogitsProcessor; got "
                          f"{guidance_scale!r}")
    return float(guidance_scale)


class ClassifierFreeGuidanceLogitsProcessor(LogitsProcessor):
    """Classifier-free guidance on a doubled batch (transformers' ``ClassifierFreeGuidanceLogitsProcessor``).

    The caller runs the conditional and the unconditional inputs as one batch: ``scores`` has
    ``2 * batch`` rows, the conditional ones first, and ``input_ids`` the ``batch`` conditional
    rows. The result has ``batch`` rows::

        uncond + (cond - uncond) * guidance_scale

    (raw logits, not log-probabilities, as in transformers). ``generate(guidance_scale=...)`` does not
    use this class: it uses :class:`UnbatchedClassifierFreeGuidanceLogitsProcessor`, which runs the
    unconditional branch itself; this one is for loops that batch both branches (as transformers'
    MusicGen does).

    Args:
        guidance_scale: a number > 1.
    """

    def __init__(self, guidance_scale: float) -> None:
        self.guidance_scale = _check_scale(guidance_scale)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 2 * input_ids.shape[0]:
            raise ConfigError(
                "`scores` must have twice the batch size of `input_ids` (the conditional rows first, then the "
                f"unconditional rows); got {scores.shape[0]} rows of scores for {input_ids.shape[0]} rows of input_ids")
        cond, uncond = scores.split(scores.shape[0] // 2, dim=0)
        return uncond + (cond - uncond) * self.guidance_scale


class UnbatchedClassifierFreeGuidanceLogitsProcessor(LogitsProcessor):
    """Classifier-free guidance with the unconditional branch computed by ``model`` itself.

    Args:
        guidance_scale: 1 leaves the scores as log-probabilities; above 1 follows the prompt more
            closely (and moves away from the negative prompt); below 1 the reverse.
        model: the model generating (called with transformers' convention).
        unconditional_ids: ``(batch, length)`` negative prompt; default: each row's last prompt token.
        unconditional_attention_mask: its mask (left padding), default all ones.
        use_cache: keep the unconditional branch's cache between steps (else re-run it each step).
        max_length: the longest generation expected (sizes a native model's cache); optional.

    The branch follows the history each call is given: a strategy that goes back (assisted decoding
    verifies drafts, early exit) gets the scores plain decoding would give, its cache cropped to the
    common prefix. Such a strategy turns :meth:`record_past` on (``Stepper.rollback``), so a cache
    whose sliding-window layers drop old positions can be cropped back past the window. A
    transformers ``model`` given here is run through genkit's adapter by ``generate``.
    """

    def __init__(self, guidance_scale: float, model: Any, unconditional_ids: torch.Tensor | None = None,
                 unconditional_attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                 max_length: int = 0) -> None:
        self.guidance_scale = float(guidance_scale)
        self.model = model
        self.uncond_ids = unconditional_ids
        self.uncond_mask = unconditional_attention_mask
        self.use_cache = bool(use_cache)
        self.max_length = int(max_length)
        self.cache: Any = None
        self._recording = False  # record_past(True) is in force
        self._prompt_len = -1  # length of the conditional prompt (the first call's input)
        self._fed = torch.empty(0)  # generated tokens (rows, m) the unconditional branch has run
        self._logits: torch.Tensor | None = None  # its next-token logits after them

    def _start(self, input_ids: torch.Tensor) -> None:
        self._prompt_len = input_ids.shape[1]
        if self.uncond_ids is None:
            self.uncond_ids = input_ids[:, -1:]
        self.uncond_ids = self.uncond_ids.to(input_ids.device)
        if self.uncond_mask is None:
            self.uncond_mask = torch.ones_like(self.uncond_ids)
        self.uncond_mask = self.uncond_mask.to(device=input_ids.device, dtype=torch.long)
        self._fed = input_ids[:, :0]
        if self.use_cache:
            new_cache = getattr(self.model, "new_cache", None)
            if callable(new_cache):
                room = self.uncond_ids.shape[1] + max(self.max_length - self._prompt_len, 0)
                self.cache = new_cache(room)
                if self._recording:
                    self.record_past(True)

    def record_past(self, on: bool) -> None:
        """``on``: the calls may go back (a strategy verifying drafts; ``Stepper.rollback`` turns it
        on and off). The branch's cache then keeps the positions its sliding-window layers drop
        (its optional ``record_past``, transformers' ``DynamicCache`` adapted) until a call goes
        back, whose crop cuts them back to the window. Off: cut back to the window, recording no
        more, as in plain decoding. A cache that keeps every position needs nothing."""
        self._recording = bool(on)
        record = getattr(self.cache, "record_past", None)
        if record is None:
            return
        if not on:  # (while recording, a crop that keeps every position cuts back to the window)
            self.cache.crop(self.cache.get_seq_length())
        record(self._recording)

    def unconditional_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(rows, vocab)`` of the unconditional branch after the tokens
        ``input_ids`` holds beyond the conditional prompt."""
        if self._prompt_len < 0:
            self._start(input_ids)
        assert self.uncond_ids is not None and self.uncond_mask is not None
        generated = input_ids[:, self._prompt_len:]
        m, n = self._fed.shape[1], generated.shape[1]
        common = min(m, n)
        if common:
            differ = (self._fed[:, :common] != generated[:, :common]).any(dim=0).nonzero()
            if differ.numel():
                common = int(differ[0, 0])
        if self._logits is not None and common == m == n:
            return self._logits
        prefix = self.uncond_ids.shape[1]
        seq = torch.cat([self.uncond_ids, generated], dim=1)
        mask = torch.cat([self.uncond_mask, torch.ones_like(generated)], dim=1)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        # the cache keeps what is still valid, and at least the last token is run again
        keep = min(prefix + common, seq.shape[1] - 1) if self.use_cache and self._logits is not None else 0
        if self.cache is not None and self.cache.get_seq_length() > keep:
            self.cache.crop(keep)
        out = self.model(seq[:, keep:], attention_mask=mask, position_ids=positions[:, keep:],
                         past_key_values=self.cache if self.use_cache else None, use_cache=self.use_cache,
                         logits_to_keep=1)
        if self.use_cache and out.past_key_values is not None:
            self.cache = out.past_key_values
        self._fed = generated
        self._logits = out.logits[:, -1, :].float()
        return self._logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = torch.log_softmax(scores, dim=-1)
        if self.guidance_scale == 1:
            return scores
        uncond = torch.log_softmax(self.unconditional_logits(input_ids), dim=-1).to(scores.dtype)
        return self.guidance_scale * (scores - uncond) + uncond


def _negative_prompt(ctx: ProcessorContext, rows: int, per_prompt: int) -> tuple[Any, Any]:
    """The negative prompt and its mask, checked and expanded to one row per generated sequence."""
    ids = ctx.extras.get("negative_prompt_ids")
    mask = ctx.extras.get("negative_prompt_attention_mask")
    if ids is None:
        if mask is not None:
            raise ConfigError("`negative_prompt_attention_mask` was given without `negative_prompt_ids`")
        return None, None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype.is_floating_point:
        raise ConfigError("`negative_prompt_ids` must be a 2-D tensor of token ids (batch, length), length >= 1; got "
                          f"{type(ids).__name__}{tuple(ids.shape) if isinstance(ids, torch.Tensor) else ''}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape)):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConfigError(f"`negative_prompt_attention_mask` must have the shape of `negative_prompt_ids` "
                          f"{tuple(ids.shape)}; got {shape}")
    batch = ids.shape[0]
    if batch == rows:
        repeat = 1
    elif batch * per_prompt == rows:
        repeat = per_prompt
    elif batch == 1:
        repeat = rows
    else:
        raise ConfigError(f"`negative_prompt_ids` has {batch} rows; give one per prompt ({rows // per_prompt}) or one "
                          "for all")
    ids = ids.to(device=ctx.device, dtype=torch.long).repeat_interleave(repeat, dim=0)
    if mask is not None:
        mask = mask.to(device=ctx.device, dtype=torch.long).repeat_interleave(repeat, dim=0)
    return ids, mask


def make_guidance(config: Any, ctx: ProcessorContext) -> Any:
    """Factory of the ``guidance`` processor: on when ``guidance_scale`` is set and not 1."""
    scale = config.guidance_scale
    given = [k for k in ("negative_prompt_ids", "negative_prompt_attention_mask") if ctx.extras.get(k) is not None]
    if scale is None or scale == 1:
        if given and scale is None:
            raise ConfigError(f"`{given[0]}` is the negative prompt of classifier-free guidance: set `guidance_scale` "
                              "(a number >= 0, not 1) to use it")
        if given:
            logger.warning("`guidance_scale`=1 turns classifier-free guidance off: `%s` has no effect", given[0])
        return None
    if config.num_beams > 1:
        raise NotSupportedError("`guidance_scale` (classifier-free guidance) works with greedy search, sampling and "
                                "assisted decoding; not with beam search (num_beams > 1)")
    if ctx.model is None:
        raise ConfigError("`guidance_scale` needs the model to run the unconditional branch")
    rows = ctx.input_ids.shape[0] if ctx.input_ids is not None else 1
    per_prompt = config.num_return_sequences if config.num_beams == 1 else 1
    ids, mask = _negative_prompt(ctx, rows, per_prompt)
    return UnbatchedClassifierFreeGuidanceLogitsProcessor(scale, ctx.model, unconditional_ids=ids,
                                                          unconditional_attention_mask=mask,
                                                          use_cache=bool(config.use_cache),
                                                          max_length=int(config.max_length))
