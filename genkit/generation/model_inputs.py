"""Model inputs besides the prompt for a decoder-only transformers model (``inputs_embeds``,
``token_type_ids``, ``pixel_values``...), forwarded as transformers' ``generate`` does.

A name is a model input when it is no generation parameter and the model's ``forward`` names it
(a catch-all ``**kwargs`` does not count, so a misspelt setting is still an error). The strategy
runs a :class:`ForwardingView` of the model, which adds them to the model's calls:

* ``inputs_embeds`` replaces the prompt's ids in the prompt's forward (without ``input_ids`` the
  prompt is a placeholder of pad ids that the output leaves out: ``sequences`` hold the new tokens
  only, as in transformers);
* ``token_type_ids``, ``mm_token_type_ids`` and Mllama's ``cross_attention_mask`` follow the tokens:
  each new token takes the type of its row's last prompt token (``token_type_ids``, the mask) or 0,
  text (``mm_token_type_ids``), as in transformers;
* the multimodal inputs transformers drops after the prefill (``pixel_values``, ``image_sizes``...)
  go to the prompt's forward only, on one row per prompt (with ``num_return_sequences`` the prompt
  runs once and its cache is repeated: their rows are images or patches, not sequences); any other
  goes to every forward;
* a model with its own generation positions (transformers' ``_prepare_position_ids_for_generation``
  overridden: Qwen2-VL's multimodal RoPE) gets them for the prompt, each new token the row's last
  prompt position + 1 per token, as transformers' generate builds them;
* ``logits_to_keep``: each forward computes the logits of at least that many last positions (0:
  all), as the caller asked; the strategy reads the positions it needs from them.

genkit's native models take ``inputs_embeds`` and ``logits_to_keep`` this way (:data:`NATIVE_INPUTS`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import field_table
from ..errors import ConfigError, NotSupportedError

__all__ = ["ForwardingView", "ModelInputs", "model_input_names", "take_model_inputs"]

# transformers' MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL (5.x), the ones genkit knows
PREFILL_ONLY = frozenset({
    "mm_encoder_outputs", "pixel_values", "pixel_mask", "input_features", "input_features_mask", "input_values",
    "padding_mask", "input_values_mask", "pixel_values_videos", "num_local_patches", "high_res_pixel_values",
    "image_patches_indices", "image_patches", "image_sizes", "image_sizes_videos", "pixel_attention_mask",
    "pixel_values_images", "pixel_values_local", "patches_grid", "image_token_pooling", "image_grids",
    "video_token_pooling", "video_grids",
    # Mllama drops these with its pixel_values after the prefill (its own prepare_inputs_for_generation)
    "aspect_ratio_ids", "aspect_ratio_mask",
})
# inputs that follow the tokens: name -> the type of a new token (None: its row's last prompt token's),
# transformers' `_update_model_kwargs_for_generation` (Mllama's for its `cross_attention_mask`, of
# shape (batch, sequence, images, tiles): a new token attends to the tiles its row's last token did)
TOKEN_TYPES: dict[str, int | None] = {"token_type_ids": None, "mm_token_type_ids": 0, "cross_attention_mask": None}
_LOOP = {"attention_mask", "position_ids", "past_key_values", "use_cache", "tokenizer", "assistant_tokenizer",
         "input_ids"}
# the inputs a native model's forward takes from generate (its other forward arguments are the loop's,
# or change what the forward returns: `labels`, `return_dict`, `num_layers`)
NATIVE_INPUTS = frozenset({"inputs_embeds", "logits_to_keep"})


@dataclass
class ModelInputs:
    """The extra inputs of one ``generate`` call: ``prefill`` (prompt forward only, one row per
    prompt), ``every`` (each forward), ``types`` (:data:`TOKEN_TYPES`: prompt columns),
    ``inputs_embeds``; ``placeholder``: the prompt's ids are stand-ins (only embeddings were given);
    ``repeats``: rows per prompt that the prompt's forward makes (``num_return_sequences``)."""

    prefill: dict[str, Any] = field(default_factory=dict)
    every: dict[str, Any] = field(default_factory=dict)
    types: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs_embeds: torch.Tensor | None = None
    placeholder: bool = False
    #: the caller's ``logits_to_keep`` (None: the strategy's own)
    logits_to_keep: int | None = None
    repeats: int = 1

    def __bool__(self) -> bool:
        return self.per_position or self.logits_to_keep is not None

    @property
    def per_position(self) -> bool:
        """Whether there are inputs that follow the tokens (anything but ``logits_to_keep``)."""
        return bool(self.prefill or self.every or self.types) or self.inputs_embeds is not None

    def repeat_interleave(self, n: int) -> None:
        """Each prompt's inputs ``n`` times (``num_return_sequences`` without beams). The
        ``prefill`` inputs stay one row per prompt: the prompt's forward runs once per prompt."""
        for store in (self.every, self.types):
            for k, v in store.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    store[k] = v.repeat_interleave(n, dim=0)
        if self.inputs_embeds is not None:
            self.inputs_embeds = self.inputs_embeds.repeat_interleave(n, dim=0)
        self.repeats *= n


def _forward_names(model: Any) -> set[str]:
    hf = getattr(model, "hf_model", None)
    forward = getattr(hf if hf is not None else model, "forward", None)
    if forward is None:
        return set()
    params = inspect.signature(forward).parameters
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def model_input_names(model: Any, kwargs: dict[str, Any]) -> list[str]:
    """The names in ``kwargs`` that are ``model``'s inputs: no generation parameter, and named by
    its forward."""
    table = field_table()
    others = [k for k in kwargs if k not in table and k not in _LOOP]
    names = _forward_names(model) if others else set()  # (inspecting the forward costs ~0.1 ms)
    return [k for k in others if k in names]


def take_model_inputs(model: Any, kwargs: dict[str, Any]) -> ModelInputs:
    """Take the model inputs out of ``kwargs`` (names that are no generation parameter and that the
    model's forward names); what is left is refused or used as generation parameters."""
    taken = ModelInputs()
    for key in model_input_names(model, kwargs):
        value = kwargs.pop(key)
        if value is None:
            continue
        if key == "inputs_embeds":
            taken.inputs_embeds = value
        elif key == "logits_to_keep":
            taken.logits_to_keep = _checked_logits_to_keep(value)
        elif key in TOKEN_TYPES:
            taken.types[key] = value
        elif key in PREFILL_ONLY:
            taken.prefill[key] = value
        else:
            taken.every[key] = value
    _refuse_own_generate(model, taken)
    refused = [] if getattr(model, "_genkit_protocol", False) else sorted(set(_given(taken)) - NATIVE_INPUTS)
    if refused:
        raise NotSupportedError(f"model inputs {refused} are forwarded to transformers models only; "
                                f"{type(model).__name__}'s forward is genkit's own (it takes "
                                f"{', '.join(sorted(NATIVE_INPUTS))} from generate)")
    return taken


def _refuse_own_generate(model: Any, taken: ModelInputs) -> None:
    """A transformers model whose class has its own ``generate`` (BLIP-2, InstructBLIP, Kosmos-2...)
    turns its image inputs into its language model's input first; its forward wants them at every
    step, where genkit (as transformers' plain loop) gives them to the prompt's forward only."""
    hf = getattr(model, "hf_model", model)
    if not taken.prefill:
        return
    for klass in type(hf).__mro__:
        if klass.__name__ == "GenerationMixin":
            return
        if "generate" in vars(klass):
            names = ", ".join(f"`{k}`" for k in sorted(taken.prefill))
            raise NotSupportedError(
                f"{type(hf).__name__} has its own `generate`, which prepares {names} for its language model before "
                "decoding; genkit runs transformers' plain generation loop and cannot reproduce it: use the "
                "model's own `generate`, or pass its language model the embeddings it prepares")


def _checked_logits_to_keep(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"`logits_to_keep` must be an int >= 0 (0 keeps every position's logits); got {value!r}")
    return value


def _given(taken: ModelInputs) -> list[str]:
    names = [*taken.prefill, *taken.every, *taken.types]
    names += ["logits_to_keep"] if taken.logits_to_keep is not None else []
    return names + (["inputs_embeds"] if taken.inputs_embeds is not None else [])


def placeholder_prompt(embeds: torch.Tensor, pad: int) -> torch.Tensor:
    """Stand-in ids for a prompt given only as embeddings ``(batch, length, hidden)``."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        raise ConfigError("`inputs_embeds` must be a 3-D tensor (batch, sequence_length, hidden_size)")
    return torch.full(embeds.shape[:2], pad, dtype=torch.long, device=embeds.device)


class ForwardingView:
    """The model as the strategy runs it, adding the call's :class:`ModelInputs` to its forwards.
    Other attributes are the model's."""

    _genkit_protocol = True

    def __init__(self, model: Any, inputs: ModelInputs, prompt_len: int) -> None:
        self.model = model
        self.inputs = inputs
        self.prompt_len = prompt_len
        # positions the cache holds beyond the tokens (a model that puts image tokens before the
        # text, e.g. GIT): known after the prompt's forward
        self.offset = 0
        # the prompt's positions by the model's own rule (None: the strategy's), set by its forward
        self.own = _own_positions(model)
        self.positions: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, *, past_key_values: Any = None, use_cache: bool = True,
                 position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        cached = past_key_values.get_seq_length() if (past_key_values is not None and use_cache) else 0
        held = cached - self.offset if cached else 0
        new = int(input_ids.shape[1])
        if not use_cache and self.inputs.per_position:
            raise NotSupportedError("model inputs (`inputs_embeds`, `token_type_ids`, `pixel_values`...) need "
                                    "use_cache=True: each forward after the prompt's runs the new tokens only")
        prompt = held < self.prompt_len
        # the prompt's forward on one row per prompt when the prefill inputs' rows are not sequences
        n = self.inputs.repeats if prompt and self.inputs.prefill else 1
        input_ids, attention_mask, position_ids = (_nth(x, n) for x in (input_ids, attention_mask, position_ids))
        extra = self._extra(held, new, prompt, n)
        ids = None if self.inputs.placeholder else input_ids  # the prompt's ids, embeddings given or not
        if "inputs_embeds" in extra:
            input_ids = None  # type: ignore[assignment]
        rows = int(extra["inputs_embeds"].shape[0] if input_ids is None else input_ids.shape[0])
        for name, fill in TOKEN_TYPES.items():
            if name in self.inputs.types:
                extra[name] = _types(_nth(self.inputs.types[name], n), fill, held, new, rows)
        if self.own is not None:
            position_ids = self._own(held, new, rows, ids, attention_mask, extra)
        elif position_ids is None and self.offset:  # the tokens' own positions, not the cache's
            position_ids = torch.arange(held, held + new, device=self.model.device)[None, :]
        caller_keep = self.inputs.logits_to_keep
        if caller_keep is not None:
            kwargs["logits_to_keep"] = _widest(kwargs.get("logits_to_keep", caller_keep), caller_keep)
        out = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache, attention_mask=attention_mask,
                         position_ids=position_ids, **kwargs, **extra)
        if held == 0 and use_cache and out.past_key_values is not None:
            self.offset = out.past_key_values.get_seq_length() - new
        return _repeat_rows(out, n) if n > 1 else out

    def _extra(self, held: int, new: int, prompt: bool, n: int) -> dict[str, Any]:
        """The inputs of a forward of positions ``held .. held + new`` but the token types (the
        prompt's rows taken every ``n``-th)."""
        extra = {k: _nth(v, n) for k, v in self.inputs.every.items()}
        if prompt:
            extra.update(self.inputs.prefill)
            if self.inputs.inputs_embeds is not None:
                extra["inputs_embeds"] = _nth(self.inputs.inputs_embeds, n)[:, held:held + new]
        return extra

    def _own(self, held: int, new: int, rows: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
             extra: dict[str, Any]) -> torch.Tensor:
        """Positions ``held .. held + new`` by the model's own rule: the prompt's from the model
        (its first forward), then the row's last prompt position + 1 per token (transformers'
        ``_update_model_kwargs_for_generation``), ``rows`` rows."""
        if self.positions is None:
            if held or input_ids is None:
                raise NotSupportedError(
                    f"{type(self.own.__self__).__name__} computes the prompt's positions from its ids (multimodal "
                    "RoPE): pass the prompt's `input_ids` and no prompt cache (`past_key_values`)")
            self.positions = self.own(input_ids, {**extra, "attention_mask": attention_mask})
        pos = self.positions
        last = pos.shape[-1] - 1
        index = torch.arange(held, held + new, device=pos.device)
        part = pos[..., index.clamp(max=last)] + (index - last).clamp(min=0)
        batch_dim = part.dim() - 2
        prompts = int(part.shape[batch_dim])
        return part.repeat_interleave(rows // prompts, dim=batch_dim) if rows > prompts else part

    forward = __call__

    def __getattr__(self, name: str) -> Any:
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


def _types(types: torch.Tensor, fill: int | None, held: int, new: int, rows: int) -> torch.Tensor:
    """Token types of positions ``held .. held + new`` for ``rows`` rows: a new token's is ``fill``
    (None: its row's last prompt token's)."""
    more = max(0, held + new - types.shape[1])
    tail = types[:, -1:].expand(-1, more, *types.shape[2:]) if fill is None else \
        types.new_full((types.shape[0], more, *types.shape[2:]), fill)
    part = torch.cat([types, tail], dim=1)[:, held:held + new]
    return part.repeat_interleave(rows // part.shape[0], dim=0) if rows > part.shape[0] else part


def _nth(x: Any, n: int) -> Any:
    """Every ``n``-th row of a tensor (the prompts' rows of inputs repeated per sequence)."""
    return x[::n] if n > 1 and isinstance(x, torch.Tensor) and x.dim() > 0 else x


def _repeat_rows(out: Any, n: int) -> Any:
    """A prompt forward run on one row per prompt, as ``n`` rows per prompt: its cache, logits,
    hidden states and attentions."""
    if out.past_key_values is not None:
        out.past_key_values.repeat_interleave(n)
    out.logits = out.logits.repeat_interleave(n, dim=0)
    for name in ("hidden_states", "attentions"):
        if getattr(out, name, None) is not None:
            setattr(out, name, tuple(None if t is None else t.repeat_interleave(n, dim=0) for t in getattr(out, name)))
    return out


def _own_positions(model: Any) -> Any:
    """A transformers model's own ``_prepare_position_ids_for_generation`` when its class
    overrides transformers' (multimodal RoPE: Qwen2-VL, Qwen2.5-VL...), else None."""
    hf = getattr(model, "hf_model", None)
    for klass in type(hf).__mro__ if hf is not None else ():
        if "_prepare_position_ids_for_generation" in vars(klass):
            return None if klass.__name__ == "GenerationMixin" else hf._prepare_position_ids_for_generation
    return None


def _widest(strategy: Any, caller: int) -> Any:
    """The ``logits_to_keep`` a forward runs with: the strategy's, widened to the caller's (0 keeps
    every position). A tensor from the strategy (positions it picks, or none) is kept as it is."""
    if isinstance(strategy, torch.Tensor):
        return strategy
    return 0 if caller == 0 or strategy == 0 else max(int(strategy), caller)
