"""Set-up shared by the decoding loops: the strategy call read once, and the buffers a loop fills.

A strategy is called as ``strategy(model, input_ids, logits_processor=..., stopping_criteria=...,
generation_config=..., streamer=..., <model inputs>)``. :func:`read_inputs` takes that call apart
once (refusing model inputs it does not know) and works out what every loop needs first: the
batch and prompt sizes, ``max_length``, whether the cache is used, and the stopping criteria split
into the EOS ids handled inline and the others. The helpers below size the buffers once for
``max_length``: the output sequences, the attention mask of a left-padded batch (with the position
of each row's next token) and the cache. :class:`StepOutputs` keeps the per-step tensors that
``output_scores`` / ``output_logits`` / ``output_hidden_states`` ask for.

Used by greedy search and sampling, assisted decoding, the beam strategies and by packs (Mirostat
in ``genkit-sampling-pack``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from genkit.strategy import StrategyCall


@dataclass
class LoopInputs:
    """One strategy call, read once (``use_cache`` already combined with the config's)."""

    model: Any
    input_ids: torch.Tensor
    logits_processor: Any
    stopping_criteria: Any
    config: Any
    streamer: Any
    attention_mask: torch.Tensor | None
    past_key_values: Any
    use_cache: bool
    position_ids: torch.Tensor | None
    batch: int
    prompt_len: int
    device: torch.device
    max_length: int
    others: list[Any]  # stopping criteria other than max length and EOS
    eos: torch.Tensor | None  # EOS ids of the EOS criteria, on ``device``


def read_inputs(name: str, model: Any, input_ids: torch.Tensor, **kwargs: Any) -> LoopInputs:
    """Read a strategy call; ``name`` names the strategy in the error for unknown model inputs."""
    call = StrategyCall.from_kwargs(name, model, input_ids, **kwargs)
    return LoopInputs(
        model=model, input_ids=input_ids, logits_processor=call.logits_processor, stopping_criteria=call.stop,
        config=call.config, streamer=call.streamer, attention_mask=call.attention_mask,
        past_key_values=call.past_key_values, use_cache=call.use_cache, position_ids=call.position_ids,
        batch=call.batch, prompt_len=call.prompt_len, device=call.device, max_length=call.max_length,
        others=list(call.stop.criteria), eos=call.stop.eos,
    )


def sequence_buffer(prompt: torch.Tensor, max_length: int, fill_value: int, beams: int | None = None) -> torch.Tensor:
    """Output buffer for ``max_length`` tokens that starts with ``prompt`` ``(batch, prompt_len)``:
    ``(batch, max_length)``, or ``(batch, beams, max_length)`` with the prompt in every beam."""
    batch, prompt_len = prompt.shape
    shape = (batch, max_length) if beams is None else (batch, beams, max_length)
    seqs = torch.full(shape, fill_value, dtype=torch.long, device=prompt.device)
    seqs[..., :prompt_len] = prompt if beams is None else prompt[:, None, :]
    return seqs


def mask_buffer(attention_mask: torch.Tensor | None, max_length: int,
                repeats: int = 1) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For a left-padded batch: the attention mask for ``max_length`` tokens (ones after the prompt)
    and the position of each row's next token ``(rows, 1)``, every row repeated ``repeats`` times.
    ``(None, None)`` when nothing is padded (the model then needs no mask)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None, None
    rows, prompt_len = attention_mask.shape
    buf = torch.ones((rows * repeats, max_length), dtype=attention_mask.dtype, device=attention_mask.device)
    buf[:, :prompt_len] = attention_mask.repeat_interleave(repeats, dim=0)
    return buf, attention_mask.sum(-1, keepdim=True).repeat_interleave(repeats, dim=0)


def open_cache(model: Any, past_key_values: Any, use_cache: bool, max_length: int) -> Any:
    """The cache a loop runs with: ``None`` with ``use_cache=False`` (a passed cache is left
    untouched: the loop re-runs the whole sequence each step), else the one passed in, else a new
    one sized for ``max_length`` when the model makes its own (``model.new_cache``), else ``None``."""
    if not use_cache:
        return None
    if past_key_values is None and hasattr(model, "new_cache"):
        return model.new_cache(max_length)
    return past_key_values


def uncached_prompt(input_ids: torch.Tensor, cache: Any,
                    position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt tokens (and their position ids) that a passed-in cache does not hold yet: with a
    cached prefix (``past_key_values=copy.deepcopy(prompt_cache)``) only the rest is fed."""
    held = cache.get_seq_length() if cache is not None else 0
    if not held:
        return input_ids, position_ids
    if held >= input_ids.shape[1]:
        raise ValueError(f"`past_key_values` already holds {held} positions but `input_ids` has {input_ids.shape[1]} "
                         "tokens: pass the whole prompt, cached prefix included, with at least one token more")
    return input_ids[:, held:], (position_ids[:, held:] if position_ids is not None else None)


class StepOutputs:
    """Per-step tensors kept for the output when the config asks for them."""

    def __init__(self, config: Any) -> None:
        self.want_scores = bool(config.output_scores)
        self.want_logits = bool(config.output_logits)
        self.want_hidden = bool(config.output_hidden_states)
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.hidden: list[Any] = []

    def model_step(self, logits: torch.Tensor, hidden: Any) -> None:
        """The raw last-position logits (copied) and the hidden states of one forward."""
        if self.want_logits:
            self.logits.append(logits.clone())
        if self.want_hidden:
            self.hidden.append(hidden)

    def processed(self, scores: torch.Tensor, copy: bool = False) -> None:
        """The processed scores of one step (``copy`` when the loop writes to ``scores`` later)."""
        if self.want_scores:
            self.scores.append(scores.clone() if copy else scores)

    def as_tuples(self) -> dict[str, tuple[Any, ...] | None]:
        """``scores``, ``logits`` and ``hidden_states`` for the output class (``None`` where not asked for)."""
        return {
            "scores": tuple(self.scores) if self.want_scores else None,
            "logits": tuple(self.logits) if self.want_logits else None,
            "hidden_states": tuple(self.hidden) if self.want_hidden else None,
        }
