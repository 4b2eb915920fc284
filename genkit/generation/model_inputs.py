"""Model inputs besides the prompt for a decoder-only transformers model (``inputs_embeds``,
``token_type_ids``, ``pixel_values``...), forwarded as transformers' ``generate`` does.

A name is a model input when it is no generation parameter and the model's ``forward`` names it
(a catch-all ``**kwargs`` does not count, so a misspelt setting is still an error). The strategy
runs a :class:`ForwardingView` of the model, which adds them to the model's calls:

* ``inputs_embeds`` replaces the prompt's ids in the prompt's forward (without ``input_ids`` the
  prompt is a placeholder of pad ids that the output leaves out: ``sequences`` hold the new tokens
  only, as in transformers);
* ``token_type_ids`` follow the tokens: each new token takes the type of its row's last prompt token;
* the multimodal inputs transformers drops after the prefill (``pixel_values``, ``image_sizes``...)
  go to the prompt's forward only; any other goes to every forward;
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

__all__ = ["ForwardingView", "ModelInputs", "take_model_inputs"]

# transformers' MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL (5.x), the ones genkit knows
PREFILL_ONLY = frozenset({
    "pixel_values", "pixel_mask", "input_features", "input_features_mask", "input_values", "padding_mask",
    "pixel_values_videos", "image_sizes", "pixel_attention_mask", "pixel_values_images", "image_patches",
})
_LOOP = {"attention_mask", "position_ids", "past_key_values", "use_cache", "tokenizer", "assistant_tokenizer",
         "input_ids"}
# the inputs a native model's forward takes from generate (its other forward arguments are the loop's,
# or change what the forward returns: `labels`, `return_dict`, `num_layers`)
NATIVE_INPUTS = frozenset({"inputs_embeds", "logits_to_keep"})


@dataclass
class ModelInputs:
    """The extra inputs of one ``generate`` call: ``prefill`` (prompt forward only), ``every``
    (each forward), ``token_type_ids`` (prompt columns), ``inputs_embeds``; ``placeholder``: the
    prompt's ids are stand-ins (only embeddings were given)."""

    prefill: dict[str, Any] = field(default_factory=dict)
    every: dict[str, Any] = field(default_factory=dict)
    token_type_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None
    placeholder: bool = False
    #: the caller's ``logits_to_keep`` (None: the strategy's own)
    logits_to_keep: int | None = None

    def __bool__(self) -> bool:
        return self.per_position or self.logits_to_keep is not None

    @property
    def per_position(self) -> bool:
        """Whether there are inputs that follow the tokens (anything but ``logits_to_keep``)."""
        return bool(self.prefill or self.every) or self.token_type_ids is not None or self.inputs_embeds is not None

    def repeat_interleave(self, n: int) -> None:
        """Each prompt's inputs ``n`` times (``num_return_sequences`` without beams)."""
        for store in (self.prefill, self.every):
            for k, v in store.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    store[k] = v.repeat_interleave(n, dim=0)
        if self.token_type_ids is not None:
            self.token_type_ids = self.token_type_ids.repeat_interleave(n, dim=0)
        if self.inputs_embeds is not None:
            self.inputs_embeds = self.inputs_embeds.repeat_interleave(n, dim=0)


def _forward_names(model: Any) -> set[str]:
    hf = getattr(model, "hf_model", None)
    forward = getattr(hf if hf is not None else model, "forward", None)
    if forward is None:
        return set()
    params = inspect.signature(forward).parameters
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def take_model_inputs(model: Any, kwargs: dict[str, Any]) -> ModelInputs:
    """Take the model inputs out of ``kwargs`` (names that are no generation parameter and that the
    model's forward names); what is left is refused or used as generation parameters."""
    table = field_table()
    others = [k for k in kwargs if k not in table and k not in _LOOP]
    names = _forward_names(model) if others else set()  # (inspecting the forward costs ~0.1 ms)
    taken = ModelInputs()
    for key in [k for k in others if k in names]:
        value = kwargs.pop(key)
        if value is None:
            continue
        if key == "inputs_embeds":
            taken.inputs_embeds = value
        elif key == "logits_to_keep":
            taken.logits_to_keep = _checked_logits_to_keep(value)
        elif key == "token_type_ids":
            taken.token_type_ids = value
        elif key in PREFILL_ONLY:
            taken.prefill[key] = value
        else:
            taken.every[key] = value
    refused = [] if getattr(model, "_genkit_protocol", False) else sorted(set(_given(taken)) - NATIVE_INPUTS)
    if refused:
        raise NotSupportedError(f"model inputs {refused} are forwarded to transformers models only; "
                                f"{type(model).__name__}'s forward is genkit's own (it takes "
                                f"{', '.join(sorted(NATIVE_INPUTS))} from generate)")
    return taken


def _checked_logits_to_keep(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"`logits_to_keep` must be an int >= 0 (0 keeps every position's logits); got {value!r}")
    return value


def _given(taken: ModelInputs) -> list[str]:
    names = [*taken.prefill, *taken.every]
    names += ["token_type_ids"] if taken.token_type_ids is not None else []
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

    def __call__(self, input_ids: torch.Tensor, *, past_key_values: Any = None, use_cache: bool = True,
                 position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        cached = past_key_values.get_seq_length() if (past_key_values is not None and use_cache) else 0
        held = cached - self.offset if cached else 0
        new = int(input_ids.shape[1])
        if not use_cache and self.inputs.per_position:
            raise NotSupportedError("model inputs (`inputs_embeds`, `token_type_ids`, `pixel_values`...) need "
                                    "use_cache=True: each forward after the prompt's runs the new tokens only")
        extra = dict(self.inputs.every)
        if held < self.prompt_len:  # the prompt's forward
            extra.update(self.inputs.prefill)
            if self.inputs.inputs_embeds is not None:
                extra["inputs_embeds"] = self.inputs.inputs_embeds[:, held:held + new]
                input_ids = None  # type: ignore[assignment]
        types = self.inputs.token_type_ids
        if types is not None:
            rows = input_ids.shape[0] if input_ids is not None else extra["inputs_embeds"].shape[0]
            extra["token_type_ids"] = self._types(types, held, new, int(rows))
        if position_ids is None and self.offset:  # the tokens' own positions, not the cache's
            position_ids = torch.arange(held, held + new, device=self.model.device)[None, :]
        caller_keep = self.inputs.logits_to_keep
        if caller_keep is not None:
            kwargs["logits_to_keep"] = _widest(kwargs.get("logits_to_keep", caller_keep), caller_keep)
        out = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache,
                         position_ids=position_ids, **kwargs, **extra)
        if held == 0 and use_cache and out.past_key_values is not None:
            self.offset = out.past_key_values.get_seq_length() - new
        return out

    def _types(self, types: torch.Tensor, held: int, new: int, rows: int) -> torch.Tensor:
        """The token types of positions ``held .. held + new`` for ``rows`` rows."""
        full = torch.cat([types, types[:, -1:].expand(-1, max(0, held + new - types.shape[1]))], dim=1)
        part = full[:, held:held + new]
        return part.repeat_interleave(rows // part.shape[0], dim=0) if rows > part.shape[0] else part

    forward = __call__

    def __getattr__(self, name: str) -> Any:
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


def _widest(strategy: Any, caller: int) -> Any:
    """The ``logits_to_keep`` a forward runs with: the strategy's, widened to the caller's (0 keeps
    every position). A tensor from the strategy (positions it picks, or none) is kept as it is."""
    if isinstance(strategy, torch.Tensor):
        return strategy
    return 0 if caller == 0 or strategy == 0 else max(int(strategy), caller)
