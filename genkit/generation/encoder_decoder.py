"""``generate`` on an encoder-decoder model: which inputs go to the encoder and which to the
decoder, running the encoder once, and the decoder's first tokens.

The rules are transformers': the encoder's main input (``input_ids``, ``input_features``,
``pixel_values``...) or ``inputs_embeds``, the encoder's ``attention_mask`` and every other name the
encoder's forward takes go to the encoder; ``decoder_``-prefixed names go to the decoder (at
every step); ``encoder_outputs`` replaces the encoder run; the decoder starts from
``decoder_input_ids`` (``decoder_start_token_id`` prepended when the first column lacks it) or
from ``decoder_start_token_id`` (else ``bos_token_id``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import field_table
from ..config.checks import model_vocab_size, outside_vocabulary
from ..errors import ConfigError, NotSupportedError

logger = logging.getLogger("genkit.generation")

__all__ = ["Seq2SeqInputs", "decoder_prompt_width", "is_encoder_decoder", "new_tokens_start", "take_seq2seq_inputs",
           "text_prompt_refusal"]

# names that never reach the encoder (transformers' `irrelevant_prefix`)
_NOT_FOR_ENCODER = ("decoder_", "cross_attn", "use_cache", "cache", "past_key_values")
# decoder inputs the loop itself makes: name -> why they cannot be given
_DECODER_REFUSED = {
    "decoder_inputs_embeds": "the decoder's input is token ids (pass `decoder_input_ids`)",
    "decoder_position_ids": "the decoder's positions follow its cache",
}
# model kwargs of the loop that stay with generate
_LOOP_KWARGS = {"use_cache", "tokenizer", "assistant_tokenizer"}


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(model, "is_encoder_decoder", False))


def new_tokens_start(model: Any, prompt_width: int) -> int:
    """Where the new tokens begin in the sequences ``generate`` returns for a prompt ``prompt_width``
    tokens wide and no decoder prompt: after an encoder-decoder model's decoder start token (its
    sequences are the decoder's), else after the prompt."""
    return 1 if is_encoder_decoder(model) else prompt_width


def decoder_prompt_width(model: Any, decoder_input_ids: Any) -> int:
    """How many tokens a transformers encoder-decoder ``model``'s decoder starts with (what its
    ``max_length`` counts from): the start token, else the caller's ``decoder_input_ids`` with the
    start token prepended when their first column lacks it (never for Whisper and Donut)."""
    if decoder_input_ids is None:
        return 1
    ids = torch.as_tensor(decoder_input_ids)
    width = int(ids.shape[-1]) if ids.dim() else 0
    config = getattr(model, "generation_config", None)
    start = getattr(config, "decoder_start_token_id", None)
    start = getattr(config, "bos_token_id", None) if start is None else start
    if width == 0 or _keeps_decoder_ids(model) or not isinstance(start, int):
        return max(width, 1)
    return width + int(bool((ids.reshape(-1, width)[:, 0] != start).all()))


def text_prompt_refusal(model: Any, what: str) -> str | None:
    """Why ``what`` (``"genkit serve"``, ``"genkit batch"``, ``"genkit generate"``), which reads text
    prompts, cannot run ``model``: an encoder-decoder model whose encoder reads audio or images
    (``input_features``, ``pixel_values``), naming the input; ``None`` for any other model."""
    name = getattr(model, "encoder_input_name", "input_ids") if is_encoder_decoder(model) else "input_ids"
    if name == "input_ids":
        return None
    return (f"{what} reads text prompts, but {type(getattr(model, 'hf_model', model)).__name__}'s encoder reads "
            f"`{name}` (audio or images): run it from Python with genkit.generate(model, {name}=...) "
            "(docs/encoder_decoder.md)")


@dataclass
class Seq2SeqInputs:
    """The encoder's and the decoder's share of a ``generate`` call on an encoder-decoder model."""

    inputs: torch.Tensor | None
    input_name: str
    attention_mask: torch.Tensor | None = None
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)
    decoder_kwargs: dict[str, Any] = field(default_factory=dict)
    encoder_outputs: Any = None
    decoder_input_ids: torch.Tensor | None = None
    #: set by :meth:`start`: the encoder's output (``genkit.models.seq2seq.EncoderState``)
    state: Any = None

    def start(self, model: Any, config: Any, device: torch.device) -> torch.Tensor:
        """Run the encoder (unless ``encoder_outputs`` was given) and return the decoder's first
        tokens ``(batch, n)``."""
        from ..models.seq2seq import encoder_state_from_outputs

        self._check_mask(self.attention_mask)
        mask = self.attention_mask.to(device) if self.attention_mask is not None else None
        if self.encoder_outputs is not None:
            self.state = encoder_state_from_outputs(self.encoder_outputs, mask)
            if self.inputs is not None and self.input_name == "input_ids":
                self.state.input_ids = self.inputs.to(device)
        else:
            inputs = self.inputs if self.inputs is not None else _bos_inputs(config, self.input_name, device)
            if self.input_name == "input_ids":
                _check_vocab("input_ids", torch.as_tensor(inputs), _encoder_vocab(model))
            self.state = model.encode(inputs.to(device), self.input_name, attention_mask=mask,
                                      output_attentions=bool(config.output_attentions),
                                      output_hidden_states=bool(config.output_hidden_states), **self.encoder_kwargs)
        self.state.extra.update(self.decoder_kwargs)
        if mask is not None and mask.shape[0] != self.state.rows:
            raise ConfigError(f"`attention_mask` has {mask.shape[0]} rows but the encoder output has {self.state.rows}")
        return self._decoder_ids(model, config, device)

    def _check_mask(self, mask: torch.Tensor | None) -> None:
        """A text encoder's mask covers its tokens: ``(batch, sequence_length)`` of the ids or embeddings."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ConfigError(f"`attention_mask` must be a tensor; got {type(mask).__name__}")
        if mask is None or self.inputs is None or self.input_name not in ("input_ids", "inputs_embeds"):
            return
        want = tuple(self.inputs.shape[:2])
        if tuple(mask.shape) != want:
            raise ConfigError(f"`attention_mask` shape {tuple(mask.shape)} must match the encoder's `{self.input_name}` "
                              f"{want} (batch, sequence_length)")

    def bind_assistant(self, assistant: Any, config: Any) -> Any:
        """The assistant model of assisted decoding as the strategy runs it: an encoder-decoder
        assistant's decoder bound to its own encoder's reading of the same input."""
        if not is_encoder_decoder(assistant):
            raise NotSupportedError("an encoder-decoder model's `assistant_model` must be an encoder-decoder model "
                                    f"too (it reads the same encoder input); got {type(assistant).__name__}")
        if self.inputs is None:
            raise NotSupportedError("assisted decoding with precomputed `encoder_outputs` is not supported: the "
                                    "assistant runs its own encoder on the input; pass the input instead")
        mask = self.state.attention_mask
        state = assistant.encode(self.inputs.to(assistant.device), self.input_name, attention_mask=mask,
                                 **self.encoder_kwargs)
        state.repeat_interleave(self.state.rows // state.rows)
        return assistant.decoder(state)

    def _decoder_ids(self, model: Any, config: Any, device: torch.device) -> torch.Tensor:
        batch = self.state.rows
        start = _start_tokens(config, batch, device)
        _check_vocab("decoder_start_token_id", start, model_vocab_size(model))
        ids = self.decoder_input_ids
        if ids is None:
            return start
        if isinstance(ids, (list, tuple)):
            ids = torch.as_tensor(ids)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != batch:
            raise ConfigError(f"`decoder_input_ids` must be a 2-D LongTensor with {batch} rows (one per encoder "
                              f"input); got {getattr(ids, 'shape', type(ids).__name__)}")
        ids = ids.to(device=device, dtype=torch.long)
        _check_vocab("decoder_input_ids", ids, model_vocab_size(model))
        if _keeps_decoder_ids(model) or ids.shape[1] == 0 or not bool((ids[:, 0] != start[:, 0]).all()):
            return ids if ids.shape[1] else start
        return torch.cat([start, ids], dim=-1)


def _check_vocab(name: str, ids: torch.Tensor, vocab: int | None) -> None:
    """Token ids must lie in ``[0, vocab)`` (the embedding lookup fails with an IndexError)."""
    if vocab is None or not ids.numel():
        return
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise ConfigError(outside_vocabulary(name, sorted({int(i) for i in bad.tolist()}), vocab))


def _encoder_vocab(model: Any) -> int | None:
    """The number of token ids the encoder's embedding has (``None`` when it does not say)."""
    try:
        return int(model.hf_model.get_encoder().get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _keeps_decoder_ids(model: Any) -> bool:
    """Whisper and Donut take caller-given decoder ids as they are (transformers' exceptions)."""
    cfg = model.config
    if cfg.model_type == "whisper" or "donut" in type(getattr(model, "hf_model", model)).__name__.lower():
        return True
    encoder = getattr(cfg, "encoder", None)
    return cfg.model_type == "vision-encoder-decoder" and "donut" in str(getattr(encoder, "model_type", "")).lower()


def _start_tokens(config: Any, batch: int, device: torch.device) -> torch.Tensor:
    start = config.decoder_start_token_id
    if start is None:
        start = config.bos_token_id
    if start is None:
        raise ConfigError("an encoder-decoder model needs `decoder_start_token_id` (or `bos_token_id`) to start the "
                          "decoder; pass it, or pass `decoder_input_ids`")
    if isinstance(start, (list, tuple)):
        if len(start) != batch:
            raise ConfigError(f"`decoder_start_token_id` has {len(start)} ids but the batch has {batch} rows: pass "
                              "one id, or one per row")
        return torch.tensor(list(start), dtype=torch.long, device=device).view(-1, 1)
    return torch.full((batch, 1), int(start), dtype=torch.long, device=device)


def _bos_inputs(config: Any, input_name: str, device: torch.device) -> torch.Tensor:
    """No encoder input: a text encoder reads ``bos_token_id`` (as in transformers)."""
    if input_name != "input_ids":  # audio, pixels: token ids are no stand-in (transformers fails deep inside)
        raise ConfigError(f"no encoder input given: this model's encoder reads `{input_name}` (its `input_ids` are "
                          f"the decoder's tokens); pass `{input_name}` or `encoder_outputs`")
    if config.bos_token_id is None:
        raise ConfigError("no encoder input given: pass `inputs` (or the model's input by name, e.g. `input_ids`, "
                          "`input_features`, `pixel_values`) or `encoder_outputs`")
    return torch.full((1, 1), int(config.bos_token_id), dtype=torch.long, device=device)


def take_seq2seq_inputs(model: Any, inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> Seq2SeqInputs:
    """Take the encoder's and the decoder's inputs out of ``kwargs`` (what is left are generation
    parameters; a name neither the config nor the model knows stays there and is refused)."""
    name = model.encoder_input_name
    given = kwargs.pop(name, None)
    if given is not None and inputs is not None:
        raise ConfigError(f"pass the encoder input once: either `inputs` or `{name}`, not both")
    inputs = given if given is not None else inputs
    embeds = kwargs.pop("inputs_embeds", None)
    if embeds is not None:
        if inputs is not None:
            raise ConfigError("pass `inputs_embeds` or the encoder's input ids, not both")
        inputs, name = embeds, "inputs_embeds"
    decoder_ids = kwargs.pop("decoder_input_ids", None)
    if name != "input_ids" and "input_ids" in kwargs:  # transformers: `input_ids` are then the decoder's
        if decoder_ids is not None:
            raise ConfigError("pass the decoder's ids once: either `decoder_input_ids` or `input_ids`")
        decoder_ids = kwargs.pop("input_ids")
    taken = Seq2SeqInputs(inputs=inputs, input_name=name, attention_mask=kwargs.pop("attention_mask", None),
                          encoder_outputs=kwargs.pop("encoder_outputs", None), decoder_input_ids=decoder_ids)
    _check_decoder_mask(kwargs.pop("decoder_attention_mask", None))
    _sort_model_kwargs(model, kwargs, taken)
    return taken


def _check_decoder_mask(mask: Any) -> None:
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise NotSupportedError("`decoder_attention_mask` with masked positions is not supported: the decoder's "
                                "input is not padded in genkit (pass `decoder_input_ids` of equal length per row)")


def _sort_model_kwargs(model: Any, kwargs: dict[str, Any], taken: Seq2SeqInputs) -> None:
    """Names that are not generation parameters: ``decoder_`` ones the model's forward takes go to
    the decoder, others the encoder takes go to the encoder."""
    table = field_table()
    for key in [k for k in kwargs if k not in table and k not in _LOOP_KWARGS]:
        if key in _DECODER_REFUSED and key in model.forward_parameters:
            raise NotSupportedError(f"`{key}` is not supported: {_DECODER_REFUSED[key]}")
        if key.startswith("decoder_") and key in model.forward_parameters:
            taken.decoder_kwargs[key] = kwargs.pop(key)
        elif not any(key.startswith(p) for p in _NOT_FOR_ENCODER) and model.encoder_accepts(key):
            taken.encoder_kwargs[key] = kwargs.pop(key)
