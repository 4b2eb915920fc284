"""genkit-sampling-pack: DRY and XTC logits processors and the Mirostat v2 strategy.

This module is what the ``genkit`` entry point names, so it is imported at discovery time: it
imports no torch. The processors and the strategy are registered as ``"module:attr"`` strings and
imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral, Real
from typing import Any

from genkit import FieldSpec, hookimpl

__version__ = "0.1.0"

_M = "genkit_sampling_pack"


def _num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _token_ids(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) and x >= 0 for x in v)


# -- the GenerationConfig fields this pack owns ------------------------------------------------
DRY_FIELDS = (
    FieldSpec("dry_multiplier", 0.0, lambda v: _num(v) and v >= 0, "a number >= 0 (0 disables DRY)",
              "Strength of the DRY penalty."),
    FieldSpec("dry_base", 1.75, lambda v: _num(v) and v > 1, "a number > 1",
              "Growth of the penalty per token of repeated sequence beyond the allowed length."),
    FieldSpec("dry_allowed_length", 2, lambda v: _int(v) and v >= 1, "an int >= 1",
              "Longest repeated sequence that is not penalised."),
    FieldSpec("dry_sequence_breakers", None, _token_ids, "a list of token ids >= 0, or None",
              "Token ids that end a repeated sequence (e.g. the ids of newline or ':')."),
    FieldSpec("dry_penalty_last_n", -1, lambda v: _int(v) and v >= -1,
              "an int >= -1 (-1: the whole sequence, 0: DRY off, n: the last n tokens)",
              "How many of the most recent tokens DRY looks at."),
)
XTC_FIELDS = (
    FieldSpec("xtc_probability", 0.0, lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1] (0 disables XTC)",
              "Chance that XTC acts at a step."),
    FieldSpec("xtc_threshold", 0.1, lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1]",
              "Tokens at least this probable are 'top choices'; all but the least probable are removed."),
)
MIROSTAT_FIELDS = (
    FieldSpec("mirostat_tau", None, lambda v: _num(v) and v > 0, "a number > 0 (target surprise, bits) or None",
              "Target surprise of Mirostat v2; setting it selects the `mirostat` strategy."),
    FieldSpec("mirostat_eta", 0.1, lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]",
              "Learning rate of Mirostat v2's surprise controller."),
)


def uses_mirostat(config: Any) -> bool:
    """Selector of the ``mirostat`` strategy: ``mirostat_tau`` is set and a single beam is asked for."""
    return config.mirostat_tau is not None and config.num_beams == 1


@hookimpl
def register_logits_processors(register: Callable[..., None]) -> None:
    # order: DRY runs with the penalties (after repetition_penalty, 40); XTC after the truncation
    # warpers (top_k 210 ... eta_cutoff 260), as in llama.cpp's default sampler chain.
    register("dry", f"{_M}.processors:make_dry", fields=DRY_FIELDS, order=45,
             description="DRY ('don't repeat yourself') penalty on tokens that would extend a repeated sequence.")
    register("xtc", f"{_M}.processors:make_xtc", fields=XTC_FIELDS, order=270,
             description="XTC ('exclude top choices'): sometimes drop all but the least likely of the top tokens.")


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    # Mirostat's knobs belong to the strategy that reads them: any registered item may own fields
    register("mirostat", f"{_M}.mirostat:mirostat_decode", applies=f"{_M}:uses_mirostat", priority=5,
             fields=MIROSTAT_FIELDS,
             description="Mirostat v2: sampling that steers the surprise of each token towards mirostat_tau.")
