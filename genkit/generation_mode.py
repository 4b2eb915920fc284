"""``GenerationMode``: transformers' names for the decoding modes, and which registered strategy
each built-in mode is.

genkit picks the strategy that runs through its plugin registry (``Registry.select_strategy``);
:meth:`genkit.GenerationConfig.get_generation_mode` reports that choice under transformers' name
through :data:`STRATEGY_MODES`. A strategy with no transformers counterpart (a pack's, e.g.
``"mirostat"``) is reported by its registry name, a plain ``str``. This module does not import torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from .errors import ConfigError


class GenerationMode(str, Enum):
    """The decoding modes of transformers' ``generate``, with transformers' values.

    A ``str`` enum: ``GenerationMode.SAMPLE == "sample"``, and it compares equal to transformers'
    own ``GenerationMode`` member of the same name.
    """

    # non-beam methods
    CONTRASTIVE_SEARCH = "contrastive_search"
    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    ASSISTED_GENERATION = "assisted_generation"
    DOLA_GENERATION = "dola_generation"
    # beam methods
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def _missing_(cls, value: Any) -> GenerationMode:
        raise ConfigError(f"{value!r} is not a valid GenerationMode; choose one of "
                          f"{', '.join(repr(m.value) for m in cls)}")


#: registry strategy name -> the transformers mode it implements. A strategy that lands for a mode
#: (contrastive search, DoLa) adds its registry name here if it differs from the ones listed.
STRATEGY_MODES: dict[str, GenerationMode] = {
    "greedy": GenerationMode.GREEDY_SEARCH,
    "sample": GenerationMode.SAMPLE,
    "assisted": GenerationMode.ASSISTED_GENERATION,
    "beam_search": GenerationMode.BEAM_SEARCH,
    "beam_sample": GenerationMode.BEAM_SAMPLE,
    "group_beam_search": GenerationMode.GROUP_BEAM_SEARCH,
    "constrained_beam_search": GenerationMode.CONSTRAINED_BEAM_SEARCH,
    "contrastive_search": GenerationMode.CONTRASTIVE_SEARCH,
    "contrastive": GenerationMode.CONTRASTIVE_SEARCH,
    "dola": GenerationMode.DOLA_GENERATION,
    "dola_generation": GenerationMode.DOLA_GENERATION,
    "assisted_early_exit": GenerationMode.ASSISTED_GENERATION,  # transformers' mode for assistant_early_exit
}


def mode_of_strategy(name: str) -> GenerationMode | str:
    """The ``GenerationMode`` of registry strategy ``name``, or ``name`` itself when transformers
    has no such mode."""
    return STRATEGY_MODES.get(name, name)
