"""The settings that a left-padded batch changes: the one list, for every path that pads rows or
takes the padding off.

``generate()`` on a caller's left-padded batch runs as transformers' does: the lengths it counts
are the batch's padded width (``max_length`` and ``min_length`` count it, ``forced_bos_token_id``
acts where it is one token) and the processors that read earlier tokens read the padding as tokens
(``no_repeat_ngram_size`` bans n-grams of pad ids, ``encoder_repetition_penalty`` favours the pad
id...). A row of such a batch can then get other tokens than the same row alone. Two paths
depend on it:

- ``genkit batch``'s static engine pads rows itself, and each row must get what ``generate`` gives
  it alone: rows with these settings share a batch only with prompts that the padding cannot
  reach (:func:`padding_group`);
- ``generate(cache_implementation="paged")`` takes each row's padding off, and must give what
  ``generate`` gives the padded batch: the lengths counted from the padded width become lengths of
  each row's own (:func:`unpadded_lengths`). The token readers cannot be given the padding back:
  each request reads its own tokens, as ``generate`` on the row alone does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# ``prefix_allowed_tokens_fn`` gets each row as it is, padding included
READS_ROW_ARGUMENTS = ("prefix_allowed_tokens_fn",)


def counts_max_length(config: Any) -> bool:
    """A ``max_length`` that counts the prompt (set by the call or the model, no ``max_new_tokens``)."""
    return config.max_new_tokens is None and "max_length" not in config.defaulted


def counts_min_length(config: Any) -> bool:
    """A ``min_length`` that counts the prompt (``min_new_tokens``, when set, replaces it)."""
    return config.min_new_tokens is None and bool(config.min_length)


def padding_readers(config: Any, *, seq2seq: bool = False,
                    arguments: Mapping[str, Any] | None = None) -> dict[str, int | None]:
    """The settings of a resolved ``config`` (and of the ``generate`` ``arguments``) that a row's
    padding changes, each with the prompt length from which the row is out of their reach: a row
    with at least that many prompt tokens gets the same tokens padded or not (a longer look back
    reads padding); None: any padding changes the row (the setting counts the row's whole length
    or reads all of its tokens). Empty: padding changes nothing.

    ``seq2seq``: the rows are an encoder-decoder model's encoder inputs (padded on the right); the
    decoder's lengths and tokens start at its start token, out of the padding's reach."""
    found: dict[str, int | None] = {}
    if config.encoder_repetition_penalty not in (None, 1.0):
        found["encoder_repetition_penalty"] = None
    if config.encoder_no_repeat_ngram_size:
        found["encoder_no_repeat_ngram_size"] = None
    if seq2seq:
        return found
    if counts_max_length(config):
        found["max_length"] = None
    if counts_min_length(config):
        found["min_length"] = None
    if config.no_repeat_ngram_size:
        found["no_repeat_ngram_size"] = None
    if config.forced_bos_token_id is not None:
        found["forced_bos_token_id"] = 2  # forced where the whole sequence is one token
    for name in ("sequence_bias", "bad_words_ids"):
        before = _tokens_before(getattr(config, name))
        if before:
            found[name] = before
    watermark = config.watermarking_config
    if watermark is not None:  # no watermark until the sequence holds its context
        width = getattr(watermark, "context_width", None)
        found["watermarking_config"] = width if isinstance(width, int) else None
    for name in READS_ROW_ARGUMENTS:
        if arguments and arguments.get(name) is not None:
            found[name] = None
    return found


def _tokens_before(value: Any) -> int:
    """The most tokens a ``sequence_bias`` or ``bad_words_ids`` sequence matches before its last."""
    if not value:
        return 0
    if isinstance(value, dict):
        from genkit.builtin_strategies.fields import parse_bias_key

        sequences = [parse_bias_key(key) for key in value]
    elif isinstance(value[0], (list, tuple)) and value[0] and isinstance(value[0][0], (list, tuple)):
        sequences = [pair[0] for pair in value]  # sequence_bias as [[ids, bias], ...]
    else:
        sequences = list(value)
    return max((len(s) - 1 for s in sequences if isinstance(s, (list, tuple))), default=0)


def padding_group(readers: Mapping[str, int | None], length: int) -> int | None:
    """Which rows a row of ``length`` prompt tokens may share a padded batch with: those of the
    same group. None: any row (no setting is in the padding's reach); else the row's own length,
    or the reach of the settings for every row out of it."""
    if not readers:
        return None
    reaches = list(readers.values())
    if any(r is None for r in reaches):
        return length
    farthest = max(r for r in reaches if r is not None)
    return min(length, farthest)


def inferred_mask(input_ids: Any, pad: int | None, eos_ids: list[int]) -> Any:
    """The attention mask of a prompt given without one (transformers' rule, which ``generate`` and
    ``generate(cache_implementation="paged")`` both follow): 0 where it holds the call's resolved
    ``pad_token_id``, when that id is no EOS id; None when every token counts."""
    if pad is None or pad in eos_ids or not bool((input_ids == pad).any()):
        return None
    return (input_ids != pad).long()


def unpadded_lengths(config: Any, width: int) -> dict[str, Any]:
    """The settings that give each row of a batch ``width`` tokens wide, computed without its
    padding, the lengths ``generate`` counts from the padded width: a ``max_length`` becomes the
    new tokens it leaves, a ``min_length`` the new tokens it asks for beyond the width (a minimum,
    ``min_new_tokens`` too, at most the new tokens the length leaves: generate stops there), and a
    ``forced_bos_token_id`` is off on a batch wider than one token (``generate`` forces it only where
    the whole sequence is one token). Only the settings to change (on ``config`` resolved); with
    ``max_new_tokens`` among them, a ``max_length`` of the call is to be dropped (it would only warn
    that ``max_new_tokens`` wins over it)."""
    from genkit.config import resolve_lengths

    changes: dict[str, Any] = {}
    room = int(resolve_lengths(config, width).max_length) - width  # the new tokens generate runs at most
    if counts_max_length(config):
        changes["max_new_tokens"] = room
    # a minimum past the room is the room (generate's length stops first: the same tokens), never
    # a `min_new_tokens` > `max_new_tokens`, which the config refuses and generate did not ask for
    if counts_min_length(config):
        changes["min_length"] = 0
        if config.min_length > width:
            changes["min_new_tokens"] = min(config.min_length - width, room)
    elif config.min_new_tokens is not None and config.min_new_tokens > room:
        changes["min_new_tokens"] = room
    if config.forced_bos_token_id is not None and width > 1:
        changes["forced_bos_token_id"] = None
    return changes
