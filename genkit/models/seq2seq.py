"""Encoder-decoder (seq2seq) transformers models through genkit's model protocol.

``generate`` runs the encoder once (:meth:`TransformersSeq2SeqAdapter.encode`), then hands the
strategy :meth:`TransformersSeq2SeqAdapter.decoder` — a :class:`DecoderView`, which is a causal LM
in genkit's protocol whose "prompt" is the decoder's input (``decoder_start_token_id`` or the
caller's ``decoder_input_ids``). The encoder's output travels with the view and with its cache
(:class:`Seq2SeqCache`): whatever a strategy does to the rows of the cache (``reorder`` for beam
search, ``repeat_interleave`` after a prefill, ``select``) happens to the encoder's hidden states
and mask too, so strategies written on the kit work unchanged on both kinds of model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, NotSupportedError
from .adapter import TransformersCache, TransformersModelAdapter

__all__ = ["DecoderView", "EncoderState", "Seq2SeqCache", "TransformersSeq2SeqAdapter", "load_seq2seq"]


@dataclass
class EncoderState:
    """The encoder's output for the rows being decoded: ``hidden`` ``(rows, source_len, d)``, the
    encoder ``attention_mask`` ``(rows, source_len)`` (``None``: every position attends), and what
    the output reports (``hidden_states``, ``attentions`` of the encoder, one row per prompt)."""

    hidden: torch.Tensor
    attention_mask: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    #: the encoder's token ids when the encoder read text (encoder-specific processors use them)
    input_ids: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: the encoder's output class and its other fields (Moonshine's downsampled ``attention_mask``,
    #: SwitchTransformers' ``router_logits``), which the model's forward reads from ``encoder_outputs``;
    #: a tensor field with one row per encoder row follows the rows as ``hidden`` does
    output_type: Any = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])

    def index_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (reorder, select)."""
        index = index.to(self.hidden.device)
        self.hidden = self.hidden.index_select(0, index)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, index.to(self.attention_mask.device))
        for key in self._row_fields():
            self.fields[key] = self.fields[key].index_select(0, index.to(self.fields[key].device))

    def repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times (beams, ``num_return_sequences``)."""
        if repeats == 1:
            return
        rows = self.rows
        self.hidden = self.hidden.repeat_interleave(repeats, dim=0)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.repeat_interleave(repeats, dim=0)
        for key in self._row_fields(rows):
            self.fields[key] = self.fields[key].repeat_interleave(repeats, dim=0)

    def _row_fields(self, rows: int | None = None) -> list[str]:
        """The tensor fields with one row per encoder row (``rows``: the count before a change)."""
        rows = self.rows if rows is None else rows
        return [k for k, v in self.fields.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows]

    def encoder_outputs(self) -> Any:
        """The running hidden states as the ``encoder_outputs`` a transformers model takes: the
        encoder's own output class with its other fields (``BaseModelOutput`` when unknown)."""
        from transformers.modeling_outputs import BaseModelOutput

        cls = self.output_type if self.output_type is not None else BaseModelOutput
        return cls(last_hidden_state=self.hidden, **self.fields)


class Seq2SeqCache(TransformersCache):
    """The decoder's ``EncoderDecoderCache`` (self- and cross-attention) bound to the
    :class:`EncoderState`: row operations apply to both, so they stay aligned."""

    def __init__(self, cache: Any, state: EncoderState) -> None:
        super().__init__(cache)
        self.state = state

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self.state.index_rows(index)

    def select(self, index: torch.Tensor) -> None:
        super().select(index)
        self.state.index_rows(index)

    def repeat_interleave(self, repeats: int) -> None:
        super().repeat_interleave(repeats)
        self.state.repeat_interleave(repeats)

    def __getattr__(self, name: str) -> Any:
        if name in ("cache", "state"):
            raise AttributeError(name)
        return getattr(self.cache, name)


@dataclass
class DecoderStepOutput:
    """One decoder forward as a causal LM's output (``hidden_states`` and ``attentions`` are the
    decoder's; ``cross_attentions`` the decoder's attention over the encoder output)."""

    logits: torch.Tensor
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None


class DecoderView:
    """The decoder of a seq2seq model, bound to one encoder output, in genkit's causal-LM protocol.

    Strategies call it like a decoder-only model (``input_ids`` are decoder tokens). Its cache
    (:meth:`new_cache`) carries the :class:`EncoderState`; without a cache the rows of the state
    follow the rows of the input by whole-number expansion (beams after a prefill)."""

    _genkit_protocol = True
    is_encoder_decoder = True

    def __init__(self, adapter: TransformersSeq2SeqAdapter, state: EncoderState) -> None:
        self.adapter = adapter
        self.state = state
        self.config = adapter.config
        self.generation_config = adapter.generation_config

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    def new_cache(self, max_length: int = 0) -> Seq2SeqCache:
        """An empty ``EncoderDecoderCache`` bound to this view's encoder state."""
        from transformers import DynamicCache, EncoderDecoderCache

        return Seq2SeqCache(EncoderDecoderCache(DynamicCache(), DynamicCache()), self.state)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotSupportedError(f"{type(self.adapter.hf_model).__name__} is an encoder-decoder model: projecting an "
                                "intermediate decoder layer through the LM head (DoLa, early exit) is supported for "
                                "decoder-only models only")

    def _state_for(self, rows: int, cache: Any) -> EncoderState:
        state = cache.state if isinstance(cache, Seq2SeqCache) else self.state
        if state.rows != rows:
            if rows % state.rows:
                raise ConfigError(f"the decoder runs {rows} rows but the encoder output has {state.rows}")
            state.repeat_interleave(rows // state.rows)
        return state

    def __call__(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = True,
                 output_hidden_states: bool = False, output_attentions: bool = False,
                 logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> DecoderStepOutput:
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        state = self._state_for(int(input_ids.shape[0]), past_key_values)
        hf_cache = past_key_values.cache if isinstance(past_key_values, TransformersCache) else past_key_values
        inputs: dict[str, Any] = {self.adapter._cache_arg: hf_cache} if use_cache else {}
        if attention_mask is not None:
            inputs["decoder_attention_mask"] = attention_mask
        if position_ids is not None and "decoder_position_ids" in self.adapter._forward_params:
            inputs["decoder_position_ids"] = position_ids
        if output_attentions:
            inputs["output_attentions"] = True
        inputs.update(state.extra)  # the caller's `decoder_*` inputs, at every step
        out = self.adapter.hf_model(
            decoder_input_ids=input_ids, encoder_outputs=state.encoder_outputs(), attention_mask=state.attention_mask,
            use_cache=use_cache, output_hidden_states=output_hidden_states, return_dict=True, **inputs, **kwargs)
        return DecoderStepOutput(
            logits=out.logits, past_key_values=past_key_values if use_cache else None,
            hidden_states=getattr(out, "decoder_hidden_states", None) if output_hidden_states else None,
            attentions=getattr(out, "decoder_attentions", None) if output_attentions else None,
            cross_attentions=getattr(out, "cross_attentions", None) if output_attentions else None)

    forward = __call__

    def __repr__(self) -> str:
        return f"DecoderView({type(self.adapter.hf_model).__name__}, {self.state.rows} rows)"


class TransformersSeq2SeqAdapter(TransformersModelAdapter):
    """A transformers encoder-decoder model (T5, BART, Pegasus, Marian, Whisper,
    ``VisionEncoderDecoderModel``...): :meth:`encode` runs the encoder once, :meth:`decoder` gives
    the strategy the decoder bound to that output."""

    is_encoder_decoder = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._forward_params = set(inspect.signature(model.forward).parameters)
        encoder = model.get_encoder()
        self.encoder_input_name = getattr(encoder, "main_input_name", None) or model.main_input_name
        self._encoder_params = set(inspect.signature(encoder.forward).parameters)
        # a model that prepares its encoder's input itself (Florence-2 merges the image's features into
        # the text encoder's embeddings): transformers' generate runs its override, and so does `encode`
        self._model_encodes = _overrides_encoder_preparation(model)
        if self._model_encodes:
            self._encoder_params |= self._forward_params

    @property
    def forward_parameters(self) -> set[str]:
        """The names the wrapped model's ``forward`` takes."""
        return self._forward_params

    def encoder_accepts(self, name: str) -> bool:
        """Whether the encoder's forward names ``name`` (a catch-all ``**kwargs`` does not count)."""
        return name in self._encoder_params

    @torch.no_grad()
    def encode(self, inputs: torch.Tensor, input_name: str, *, attention_mask: torch.Tensor | None = None,
               output_attentions: bool = False, output_hidden_states: bool = False,
               **encoder_kwargs: Any) -> EncoderState:
        """Run the encoder once on ``inputs`` (passed as ``input_name``: ``input_ids``,
        ``inputs_embeds``, ``input_features``, ``pixel_values``...), without autograd (its graph
        would hold every encoder activation for as long as the decoding runs)."""
        encoder = self.hf_model.get_encoder()
        kwargs = dict(encoder_kwargs)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if output_attentions:
            kwargs["output_attentions"] = True
        if output_hidden_states:
            kwargs["output_hidden_states"] = True
        if self._model_encodes:
            out = self._model_encoder_outputs(inputs, input_name, kwargs)
        else:
            out = encoder(**{input_name: inputs}, return_dict=True, **kwargs)
        return EncoderState(
            hidden=out.last_hidden_state, attention_mask=attention_mask,
            hidden_states=getattr(out, "hidden_states", None) if output_hidden_states else None,
            attentions=getattr(out, "attentions", None) if output_attentions else None,
            input_ids=inputs if input_name == "input_ids" else None, **_output_fields(out))

    def _model_encoder_outputs(self, inputs: torch.Tensor, input_name: str, kwargs: dict[str, Any]) -> Any:
        """The encoder's output as the model's own ``_maybe_prepare_encoder_kwargs_for_generation``
        makes it (``kwargs``: the mask, the other model inputs and the ``output_*`` switches)."""
        from transformers import GenerationConfig

        config = GenerationConfig(output_attentions=bool(kwargs.pop("output_attentions", False)),
                                  output_hidden_states=bool(kwargs.pop("output_hidden_states", False)))
        if input_name == "inputs_embeds":
            kwargs["inputs_embeds"], tensor, input_name = inputs, None, "input_ids"
        else:
            tensor = inputs
        prepared = self.hf_model._maybe_prepare_encoder_kwargs_for_generation(tensor, kwargs, input_name, config)
        return prepared["encoder_outputs"]

    def decoder(self, state: EncoderState) -> DecoderView:
        """The decoder bound to ``state`` (a causal LM for the strategy)."""
        return DecoderView(self, state)

    def new_cache(self, max_length: int = 0) -> TransformersCache:
        raise NotSupportedError("an encoder-decoder model's cache belongs to its decoder: call "
                                "`model.decoder(model.encode(...)).new_cache()`")

    def __repr__(self) -> str:
        return f"TransformersSeq2SeqAdapter({type(self.hf_model).__name__})"


def _overrides_encoder_preparation(model: Any) -> bool:
    """Whether ``model``'s class overrides transformers' ``_maybe_prepare_encoder_kwargs_for_generation``."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return False
    base = getattr(GenerationMixin, "_maybe_prepare_encoder_kwargs_for_generation", None)
    own = getattr(type(model), "_maybe_prepare_encoder_kwargs_for_generation", None)
    return base is not None and own is not None and own is not base


def encoder_state_from_outputs(encoder_outputs: Any, attention_mask: torch.Tensor | None) -> EncoderState:
    """A precomputed ``encoder_outputs`` (a transformers ``BaseModelOutput``, a tuple whose first
    item is the last hidden state, or a tensor) as an :class:`EncoderState`."""
    hidden = getattr(encoder_outputs, "last_hidden_state", None)
    if hidden is None and isinstance(encoder_outputs, (tuple, list)) and encoder_outputs:
        hidden = encoder_outputs[0]
    if hidden is None and isinstance(encoder_outputs, torch.Tensor):
        hidden = encoder_outputs
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ConfigError("`encoder_outputs` must be the encoder's output (a BaseModelOutput or a tuple whose first "
                          "item is the last hidden state, shape (batch, source_length, hidden_size)); got "
                          f"{type(encoder_outputs).__name__}")
    return EncoderState(hidden=hidden, attention_mask=attention_mask,
                        hidden_states=getattr(encoder_outputs, "hidden_states", None),
                        attentions=getattr(encoder_outputs, "attentions", None), **_output_fields(encoder_outputs))


# the encoder output's fields the running state holds apart (reported once per input, not per row)
_OWN_FIELDS = ("last_hidden_state", "hidden_states", "attentions")


def _output_fields(out: Any) -> dict[str, Any]:
    """An encoder output's class and its fields but the hidden states and attentions, for
    :class:`EncoderState` (nothing for a tuple or a tensor: a plain ``BaseModelOutput`` then)."""
    from transformers.utils import ModelOutput

    if not isinstance(out, ModelOutput):
        return {}
    fields = {k: v for k, v in out.items() if k not in _OWN_FIELDS and v is not None}
    return {"output_type": type(out), "fields": fields}


def load_seq2seq(folder: str, dtype: torch.dtype | None = None, device: Any = None) -> TransformersSeq2SeqAdapter:
    """An encoder-decoder checkpoint folder loaded by transformers (``AutoModelForSeq2SeqLM``,
    ``AutoModelForSpeechSeq2Seq`` for Whisper-like models, ``AutoModelForImageTextToText`` /
    ``VisionEncoderDecoderModel`` for image-to-text), in genkit's adapter. Needs the
    ``transformers`` extra."""
    try:
        import transformers
    except ImportError:
        raise NotSupportedError(f"{folder} holds an encoder-decoder model (is_encoder_decoder in config.json): genkit "
                                "loads those through transformers; pip install 'genkit-lm[transformers]'") from None
    config = transformers.AutoConfig.from_pretrained(folder)
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    errors = []
    # (AutoModelForVision2Seq is transformers 4's name of AutoModelForImageTextToText: Pix2Struct, Florence-2)
    for auto in ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModelForImageTextToText",
                 "AutoModelForVision2Seq", "VisionEncoderDecoderModel"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            model = cls.from_pretrained(folder, config=config, **kwargs)
        except ValueError as exc:  # this auto class does not map the config's model type
            errors.append(f"{auto}: {exc}")
            continue
        if device is not None:
            model = model.to(device)
        return TransformersSeq2SeqAdapter(model.eval())
    raise NotSupportedError(f"{folder}: transformers has no encoder-decoder class for model_type "
                            f"{config.model_type!r} ({'; '.join(errors)[:300]})")
