"""What ``generate(..., return_dict_in_generate=True)`` returns, and transition scores.

When transformers is loaded, ``generate`` returns these outputs as transformers' classes of the
same names (:func:`as_transformers_output`): an instance of transformers'
``GenerateDecoderOnlyOutput`` (a ``ModelOutput``) that is also an instance of genkit's, with
genkit's extra fields (``finish_reasons``, ``cross_attentions``) kept.
"""

from __future__ import annotations

import functools
import sys
from abc import ABCMeta
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import torch

from ..errors import ConfigError


class _Output(metaclass=ABCMeta):
    """Attribute access plus transformers-style ``out["sequences"]`` and iteration over set fields.
    (An ABC only so that :func:`as_transformers_output`'s classes register as its subclasses.)"""

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return self.to_tuple()[key]
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]  # type: ignore[arg-type]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in self.keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


@dataclass
class GenerateDecoderOnlyOutput(_Output):
    sequences: torch.LongTensor
    scores: tuple[torch.FloatTensor, ...] | None = None
    logits: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[Any, ...] | None = None
    hidden_states: tuple[tuple[torch.FloatTensor, ...], ...] | None = None
    past_key_values: Any = None
    #: an encoder-decoder model's decoder attention over the encoder output, per step (``generate``
    #: returns :class:`GenerateEncoderDecoderOutput` for those models)
    cross_attentions: tuple[Any, ...] | None = None
    #: why each row finished (``genkit.strategy.FINISH_REASONS``; ``None``: not recorded), for
    #: strategies written with ``FinishTracker``
    finish_reasons: list[str | None] | None = None


@dataclass
class GenerateBeamDecoderOnlyOutput(_Output):
    sequences: torch.LongTensor
    sequences_scores: torch.FloatTensor | None = None
    scores: tuple[torch.FloatTensor, ...] | None = None
    logits: tuple[torch.FloatTensor, ...] | None = None
    beam_indices: torch.LongTensor | None = None
    attentions: tuple[Any, ...] | None = None
    hidden_states: tuple[tuple[torch.FloatTensor, ...], ...] | None = None
    past_key_values: Any = None
    #: see :attr:`GenerateDecoderOnlyOutput.cross_attentions`
    cross_attentions: tuple[Any, ...] | None = None


@dataclass
class GenerateEncoderDecoderOutput(_Output):
    """An encoder-decoder model's output (greedy, sampling, contrastive, assisted): the encoder's
    ``encoder_attentions`` / ``encoder_hidden_states`` (one row per returned sequence), per step the
    decoder's ``decoder_attentions``, ``cross_attentions`` and ``decoder_hidden_states``."""

    sequences: torch.LongTensor
    scores: tuple[torch.FloatTensor, ...] | None = None
    logits: tuple[torch.FloatTensor, ...] | None = None
    encoder_attentions: tuple[torch.FloatTensor, ...] | None = None
    encoder_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    decoder_attentions: tuple[Any, ...] | None = None
    cross_attentions: tuple[Any, ...] | None = None
    decoder_hidden_states: tuple[Any, ...] | None = None
    past_key_values: Any = None
    finish_reasons: list[str | None] | None = None


@dataclass
class GenerateBeamEncoderDecoderOutput(_Output):
    """An encoder-decoder model's beam-search output (see :class:`GenerateEncoderDecoderOutput`)."""

    sequences: torch.LongTensor
    sequences_scores: torch.FloatTensor | None = None
    scores: tuple[torch.FloatTensor, ...] | None = None
    logits: tuple[torch.FloatTensor, ...] | None = None
    beam_indices: torch.LongTensor | None = None
    encoder_attentions: tuple[torch.FloatTensor, ...] | None = None
    encoder_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    decoder_attentions: tuple[Any, ...] | None = None
    cross_attentions: tuple[Any, ...] | None = None
    decoder_hidden_states: tuple[Any, ...] | None = None
    past_key_values: Any = None


def as_encoder_decoder_output(result: Any, encoder_hidden_states: tuple[Any, ...] | None,
                              encoder_attentions: tuple[Any, ...] | None) -> Any:
    """A strategy's decoder-only output class as the encoder-decoder one: the decoder's
    ``attentions`` / ``hidden_states`` renamed, the encoder's added (one row per encoder input, not
    per beam or returned sequence, as transformers reports them). Other objects pass through."""
    if isinstance(result, GenerateBeamDecoderOnlyOutput):
        target: type[GenerateBeamEncoderDecoderOutput | GenerateEncoderDecoderOutput] = GenerateBeamEncoderDecoderOutput
    elif isinstance(result, GenerateDecoderOnlyOutput):
        target = GenerateEncoderDecoderOutput
    else:
        return result
    values = {f.name: getattr(result, f.name) for f in fields(result)
              if f.name not in ("attentions", "hidden_states")}
    if target is GenerateBeamEncoderDecoderOutput:
        values.pop("finish_reasons", None)
    return target(**values, decoder_attentions=result.attentions, decoder_hidden_states=result.hidden_states,
                  encoder_attentions=encoder_attentions, encoder_hidden_states=encoder_hidden_states)


_OUTPUT_CLASSES = (GenerateDecoderOnlyOutput, GenerateBeamDecoderOnlyOutput, GenerateEncoderDecoderOutput,
                   GenerateBeamEncoderDecoderOutput)


def as_transformers_output(result: Any) -> Any:
    """``result`` (one of this module's output classes) as transformers' class of the same name,
    when transformers is loaded: a subclass of transformers' class with genkit's extra fields,
    registered as a subclass of genkit's, so ``isinstance`` holds for both. The cache is
    transformers' ``cache`` field (``past_key_values`` before transformers 5.24; both names read
    it). Without transformers loaded, or for another object, ``result`` itself."""
    if "transformers" not in sys.modules or type(result) not in _OUTPUT_CLASSES:
        return result
    twin, cache_field = _transformers_twins()[type(result)]
    values = {f.name: getattr(result, f.name) for f in fields(result)}
    values[cache_field] = values.pop("past_key_values")
    return twin(**values)


def _cache_of(self: Any) -> Any:
    return getattr(self, "cache", None)


@functools.cache
def _transformers_twins() -> dict[type, tuple[type, str]]:
    """genkit's output class -> (its transformers twin, the twin's cache field), made on first use."""
    from transformers.generation import utils as hf_generation

    twins: dict[type, tuple[type, str]] = {}
    for ours in _OUTPUT_CLASSES:
        theirs = getattr(hf_generation, ours.__name__)
        cache_field = "cache" if "cache" in theirs.__dataclass_fields__ else "past_key_values"
        extra = [(f.name, f.type, field(default=None)) for f in fields(ours)
                 if f.name not in theirs.__dataclass_fields__ and f.name != "past_key_values"]
        namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"transformers' ``{ours.__name__}`` with "
                                     f"genkit's extra fields ({', '.join(n for n, _, _ in extra) or 'none'})."}
        if cache_field == "cache":  # read the cache under its old name without transformers' deprecation warning
            namespace["past_key_values"] = property(_cache_of)
        twin = make_dataclass(ours.__name__, extra, bases=(theirs,), namespace=namespace)
        ours.register(twin)
        twins[ours] = (twin, cache_field)
    return twins


def compute_transition_scores(
    sequences: torch.Tensor,
    scores: tuple[torch.Tensor, ...],
    beam_indices: torch.Tensor | None = None,
    normalize_logits: bool = False,
) -> torch.Tensor:
    """Score of each generated token: ``(batch, generated_length)``.

    ``scores`` are the per-step processed scores from ``output_scores=True``; with beam search
    pass ``beam_indices`` so each row follows its beam's history. ``normalize_logits`` applies a
    log-softmax first (for scores that are raw logits).
    """
    if not scores:
        raise ConfigError("`scores` is empty: generate with output_scores=True and return_dict_in_generate=True")
    steps = len(scores)
    stacked = torch.stack(scores, dim=0)  # (steps, batch*beams, vocab)
    if beam_indices is None:
        beam_indices = torch.arange(stacked.shape[1], device=sequences.device).view(-1, 1).expand(-1, steps)
    stacked = stacked.reshape(steps, -1, stacked.shape[-1])
    if normalize_logits:
        stacked = torch.log_softmax(stacked.float(), dim=-1)
    beam_indices = beam_indices[:, :steps]
    beam_indices_mask = beam_indices < 0
    max_beam_length = int((1 - beam_indices_mask.long()).sum(-1).max())
    beam_indices = beam_indices.clone()[:, :max_beam_length]
    beam_indices_mask = beam_indices_mask[:, :max_beam_length]
    beam_indices[beam_indices_mask] = 0
    tokens = sequences[:, sequences.shape[-1] - max_beam_length:]
    step_idx = torch.arange(max_beam_length, device=stacked.device)[None, :].expand_as(beam_indices)
    out = stacked[step_idx, beam_indices.to(stacked.device), tokens.to(stacked.device)]
    out = out.masked_fill(beam_indices_mask.to(out.device), 0.0)
    return out
