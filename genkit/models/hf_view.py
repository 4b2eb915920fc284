"""A native model seen as a transformers model, for code written for transformers (recipes).

:func:`transformers_view` returns a transformers ``PreTrainedModel`` (with transformers'
``GenerationMixin``) that holds the native model as its one submodule: the weights are the
native model's own (nothing is copied), and its ``forward`` is the native forward, writing into
transformers' ``DynamicCache``. transformers' ``generate`` and every helper a recipe calls on
the model (``_extract_generation_mode_kwargs``, ``_prepare_special_tokens``,
``prepare_inputs_for_generation``, ``_get_logits_processor``, ``_get_stopping_criteria``,
``_prepare_cache_for_generation``, ``_update_model_kwargs_for_generation``, ...) therefore run as
they do on a transformers model, over genkit's forward. Its ``config`` is the transformers config
class of the model type (``LlamaConfig``, ``GPT2Config``, ...) built from the native config, and
its ``generation_config`` a transformers ``GenerationConfig`` built from the native one.

Needs transformers (the ``transformers`` extra). See docs/recipes.md, "Recipes written for
transformers".
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("genkit.models")

_CACHE_FIELD = "cache"
# genkit attributes a recipe may still use on the view (read from the native model)
NATIVE_ATTRIBUTES = frozenset({"new_cache", "lm_head_logits", "supports_partial_depth", "cpu_weight_packing",
                               "self_speculation", "speculation_stats"})


def transformers_view(model: Any) -> Any:
    """``model`` (a native genkit model) as a transformers ``PreTrainedModel`` sharing its weights."""
    return _view_class()(model)


def model_for_recipe(model: Any) -> Any:
    """The model a ``custom_generate`` recipe is given for ``model``: a native genkit model as its
    transformers view when transformers is installed (recipes written for transformers call its
    ``GenerationMixin`` on the model they get), a transformers model wrapped in genkit's adapter (what
    ``genkit.load_model`` returns for an encoder-decoder checkpoint) unwrapped, since the adapter's
    forward speaks genkit's protocol, not transformers'; anything else as it is."""
    import importlib.util

    from .adapter import TransformersModelAdapter
    from .base import GenkitModel

    if isinstance(model, TransformersModelAdapter):
        return model.hf_model
    if isinstance(model, GenkitModel) and importlib.util.find_spec("transformers") is not None:
        return transformers_view(model)
    return model


def native_model(model: Any) -> Any:
    """The native model behind a view (``model`` itself when it is no view)."""
    return model._modules["genkit_model"] if is_view(model) else model


def is_view(model: Any) -> bool:
    """Whether ``model`` is a view made by :func:`transformers_view` (False without transformers)."""
    return type(model).__name__ == "GenkitTransformersView" and type(model).__module__ == __name__


def hf_config(model: Any) -> Any:
    """The transformers config of the native model's type, from its config's fields."""
    from transformers import AutoConfig

    data = {k: v for k, v in model.config.to_dict().items() if k not in ("name_or_path", "_name_or_path")}
    model_type = data.pop("model_type", None) or "llama"
    data.pop("transformers_version", None)
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = "sdpa"
    return config


def hf_generation_config(model: Any) -> Any:
    """A transformers ``GenerationConfig`` with the native model's generation settings."""
    from transformers import GenerationConfig

    data = {k: v for k, v in model.generation_config.to_diff_dict().items()
            if not k.startswith("_") and k != "transformers_version"}
    return GenerationConfig(**data)


def transformers_generation_config(config: Any) -> Any:
    """A transformers ``GenerationConfig`` with the fields a genkit ``config`` sets (field by field;
    a transformers one is copied)."""
    import transformers

    if isinstance(config, transformers.GenerationConfig):
        return transformers.GenerationConfig(**config.to_diff_dict())
    return transformers.GenerationConfig(**{k: v for k, v in config.to_dict().items() if v is not None})


def _view_forward(self: Any, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                  cache: Any = None, inputs_embeds: Any = None, labels: Any = None, use_cache: bool | None = None,
                  logits_to_keep: Any = 0, output_attentions: bool | None = None,
                  output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs: Any) -> Any:
    """The view's forward: the native forward, with transformers' arguments, positions
    (:func:`_transformers_positions`) and output class (``past_key_values`` is read as ``cache``,
    its name before transformers 5.24)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("cache_position", None)  # positions come from the cache's length
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if cache is None and use_cache is not False:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
    if position_ids is None:
        position_ids = _transformers_positions(attention_mask, cache, input_ids if inputs_embeds is None else inputs_embeds)
    out = self.genkit_model(
        input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
        inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache is not False,
        logits_to_keep=logits_to_keep, output_attentions=bool(output_attentions),
        output_hidden_states=bool(output_hidden_states), **kwargs)
    result = CausalLMOutputWithPast(loss=out.loss, logits=out.logits, hidden_states=out.hidden_states,
                                    attentions=out.attentions, **{_CACHE_FIELD: out.past_key_values})
    return result.to_tuple() if return_dict is False else result


def _transformers_positions(attention_mask: Any, cache: Any, inputs: Any) -> Any:
    """The positions transformers' forward gives where genkit's would differ: with a padded 2-D
    ``attention_mask`` and no ``position_ids``, transformers counts from the cache's length, pads
    included (its ``generate`` passes positions of its own), genkit the real tokens only. Elsewhere
    None (the native forward's positions are the same)."""
    if inputs is None or attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
        return None
    import torch

    past = int(cache.get_seq_length()) if cache is not None else 0
    return torch.arange(past, past + int(inputs.shape[1]), device=inputs.device).unsqueeze(0)


@functools.cache
def _view_class() -> type:
    """The view class, made on first use (transformers is imported here, not with genkit)."""
    from transformers import GenerationMixin, PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    class GenkitTransformersView(PreTrainedModel, GenerationMixin):  # type: ignore[misc]
        """A native genkit model as a transformers causal LM (see the module docstring)."""

        base_model_prefix = "genkit_model"
        main_input_name = "input_ids"
        _is_stateful = False
        _supports_sdpa = True
        _supports_flash_attn = False
        _supports_flex_attn = False
        _supports_attention_backend = False
        _can_compile_fullgraph = False

        def __init__(self, model: Any) -> None:
            super().__init__(hf_config(model))
            self.genkit_model = model
            self.generation_config = hf_generation_config(model)
            self.name_or_path = getattr(model.config, "name_or_path", None) or ""
            self.train(model.training)

        forward = _view_forward

        def get_input_embeddings(self) -> Any:
            return self.genkit_model.get_input_embeddings()

        def get_output_embeddings(self) -> Any:
            return self.genkit_model.get_output_embeddings()

        def get_decoder(self) -> Any:
            """The decoder without the LM head, as transformers' ``get_decoder()`` gives it (its output class)."""
            from .base import DecoderStack

            return DecoderStack(self, BaseModelOutputWithPast, _CACHE_FIELD)

        def create_masks_for_generate(self, attention_mask: Any = None, **kwargs: Any) -> Any:
            """The mask as given: transformers' ``prepare_inputs_for_generation`` asks for 4-D masks
            laid out on a static cache's buffer; the native forward builds its own from the 2-D mask
            (its cache gives it one key per position, :class:`~genkit.models.cache.TransformersCacheLayers`)."""
            return attention_mask

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name in NATIVE_ATTRIBUTES:
                    return getattr(self._modules["genkit_model"], name)
                raise

        def __repr__(self) -> str:
            return f"GenkitTransformersView({type(self._modules['genkit_model']).__name__})"

    global _CACHE_FIELD
    # transformers 5.24 names the output's cache `cache` (`past_key_values` before)
    _CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    GenkitTransformersView.__module__ = __name__
    return GenkitTransformersView
