"""Selectors of the beam strategies (imported at strategy selection: no torch here)."""

from __future__ import annotations

from typing import Any


def _beams(config: Any) -> bool:
    return int(config.num_beams) > 1


def _constrained(config: Any) -> bool:
    return config.force_words_ids is not None or bool(getattr(config, "constraints", None))


def is_beam_search(config: Any) -> bool:
    """num_beams > 1, no sampling, one group, no forced words or constraints."""
    return _beams(config) and not config.do_sample and int(config.num_beam_groups) == 1 and not _constrained(config)


def is_beam_sample(config: Any) -> bool:
    """num_beams > 1 with do_sample=True."""
    return _beams(config) and bool(config.do_sample)


def is_group_beam_search(config: Any) -> bool:
    """num_beam_groups > 1 (diverse beam search)."""
    return int(config.num_beam_groups) > 1


def is_constrained_beam_search(config: Any) -> bool:
    """force_words_ids or constraints set (constrained beam search)."""
    return _constrained(config) and _beams(config)
