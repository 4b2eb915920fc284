"""What a ``custom_generate`` recipe is given: the model and, when the caller set none, the
generation config (see docs/recipes.md, "Recipes written for transformers").

- A transformers model is given as it is (the caller's object); one wrapped in genkit's adapter
  (what ``genkit.load_model`` returns for an encoder-decoder checkpoint) is given unwrapped.
- A native genkit model is given as a transformers view sharing its weights
  (:func:`genkit.models.hf_view.transformers_view`) when transformers is installed, so recipes
  written against transformers' ``GenerationMixin`` run on it unchanged; without transformers, as
  it is.
- With no ``generation_config`` from the caller, the recipe gets the model's generation config
  with transformers' global defaults filled in and the length: the caller's ``max_new_tokens`` /
  ``max_length`` arguments when given (also left in the arguments; ``max_new_tokens`` with the
  ``max_length`` it makes for this prompt, as a recipe reading either expects), else the model's, else
  ``max_length`` at the prompt's length (an encoder-decoder model's: the decoder's) + 20 (capped by
  the model's context): transformers' own
  ``generate`` resolves an unset length the same way ("by default let's always generate 20 new
  tokens"). A recipe that passes both on to ``generate`` so gives one length, not two that conflict.

A decoding loop written for transformers' ``custom_generate=<callable>`` (it calls
``model.prepare_inputs_for_generation``, ``model._update_model_kwargs_for_generation``, reads
``generation_config._pad_token_tensor``, ``model_kwargs["cache"]``...) is marked with
:func:`transformers_method` and then run by transformers' own ``generate`` on the model a recipe is
given (:func:`run_transformers_method`): a callable's signature cannot tell the two contracts apart.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, NotSupportedError


def recipe_model(model: Any) -> Any:
    """The model a recipe is given for ``model`` (the caller's):
    :func:`genkit.models.hf_view.model_for_recipe`."""
    from ..models.hf_view import model_for_recipe

    return model_for_recipe(model)


DEFAULT_NEW_TOKENS = 20  # transformers' default length, counted from the end of the prompt


def resolved_generation_config(model: Any, prompt_length: int = 0, lengths: dict[str, int] | None = None) -> Any:
    """``model``'s generation config (genkit's or transformers') with every unset field at its
    global default and the length: ``lengths`` (the caller's ``max_new_tokens`` / ``max_length``
    arguments) when given, else the model's, else ``prompt_length`` + 20 new tokens (capped by the
    model's context); a copy, the model's own is untouched."""
    config = getattr(model, "generation_config", None)
    length_set = config is not None and (
        getattr(config, "max_length", None) is not None or getattr(config, "max_new_tokens", None) is not None)
    if config is None:
        from ..config import GenerationConfig

        resolved = GenerationConfig().with_defaults()
    elif hasattr(config, "with_defaults"):  # genkit's GenerationConfig
        resolved = config.with_defaults()
    else:  # transformers' GenerationConfig
        resolved = copy.deepcopy(config)
        resolved.update(**resolved._get_default_generation_params(), defaults_only=True)
    if lengths:  # where the recipe reads them, in agreement (a length of its own would conflict)
        for name, value in lengths.items():
            setattr(resolved, name, value)
        if lengths.get("max_new_tokens") is not None:
            resolved.max_length = prompt_length + lengths["max_new_tokens"]
    elif not length_set:
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        max_length = prompt_length + DEFAULT_NEW_TOKENS
        resolved.max_length = max_length if limit is None else min(max_length, limit)
    return resolved


class TransformersMethod:
    """A decoding loop written against transformers' ``custom_generate=<callable>`` contract
    (:func:`transformers_method`); calling it calls the loop."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn) or isinstance(fn, TransformersMethod):
            raise ConfigError("`transformers_method` takes a decoding function (model, input_ids, logits_processor, "
                              f"stopping_criteria, generation_config, ...); got {type(fn).__name__}")
        self.fn = fn
        functools.update_wrapper(self, fn)  # transformers reads the loop's own parameters (inspect.signature)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def transformers_method(fn: Callable[..., Any]) -> TransformersMethod:
    """``fn`` marked as a transformers decoding method: ``genkit.generate(model, ...,
    custom_generate=transformers_method(fn))`` runs it as ``model.generate(..., custom_generate=fn)``
    runs it in transformers (on a native model's transformers view, see :func:`recipe_model`),
    whereas a bare callable gets genkit's strategy contract (``docs/hooks.md``)."""
    return TransformersMethod(fn)


def run_transformers_method(model: Any, method: TransformersMethod, forwarded: dict[str, Any],
                            kwargs: dict[str, Any]) -> Any:
    """transformers' ``generate`` on the model a recipe is given for ``model``, handing the loop over
    to ``method``; ``forwarded``: ``generate``'s other arguments (``inputs``, ``generation_config``...)."""
    from ..models.adapter import is_transformers_object
    from ..models.hf_view import transformers_generation_config

    given = recipe_model(model)
    if not is_transformers_object(given):
        raise NotSupportedError("`custom_generate`: a transformers decoding method runs on transformers' "
                                "GenerationMixin; install transformers (pip install 'genkit[transformers]')")
    config = forwarded.get("generation_config")
    if config is not None:
        forwarded = dict(forwarded, generation_config=transformers_generation_config(config))
    # the class's generate: an instance may have a model repo's recipe bound to `generate`
    return type(given).generate(given, **{k: v for k, v in forwarded.items() if v is not None},
                                custom_generate=method.fn, **kwargs)
