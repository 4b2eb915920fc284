"""What a ``custom_generate`` recipe is given: the model and, when the caller set none, the
generation config (see docs/recipes.md, "Recipes written for transformers").

- A transformers model is given as it is (the caller's object).
- A native genkit model is given as a transformers view sharing its weights
  (:func:`genkit.models.hf_view.transformers_view`) when transformers is installed, so recipes
  written against transformers' ``GenerationMixin`` run on it unchanged; without transformers, as
  it is.
- With no ``generation_config`` from the caller, the recipe gets the model's generation config
  with transformers' global defaults filled in (``max_length`` 20 when no length is set), as
  transformers' own ``generate`` resolves it.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any


def recipe_model(model: Any) -> Any:
    """The model a recipe is given for ``model`` (the caller's)."""
    from ..models.base import GenkitModel

    if isinstance(model, GenkitModel) and importlib.util.find_spec("transformers") is not None:
        from ..models.hf_view import transformers_view

        return transformers_view(model)
    return model


def resolved_generation_config(model: Any) -> Any:
    """``model``'s generation config (genkit's or transformers') with every unset field at its
    global default; a copy, the model's own is untouched."""
    config = getattr(model, "generation_config", None)
    if config is None:
        from ..config import GenerationConfig

        return GenerationConfig().with_defaults()
    if hasattr(config, "with_defaults"):  # genkit's GenerationConfig
        return config.with_defaults()
    config = copy.deepcopy(config)  # transformers' GenerationConfig
    config.update(**config._get_default_generation_params(), defaults_only=True)
    return config
