"""``SynthIDTextWatermarkingConfig``: the settings of the SynthID text watermark.

Same fields, defaults and dict/JSON form as transformers 5's ``SynthIDTextWatermarkingConfig``,
so a ``generation_config.json`` written by either reads in the other. transformers checks only
``sampling_table_size <= 2**24`` (in ``validate()``); this class also checks every field's type and
range, when it is built and when it is updated, with an error that names the field.

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any

from genkit import BaseWatermarkingConfig
from genkit.errors import ConfigError

__all__ = ["MAX_SAMPLING_TABLE_SIZE", "SynthIDTextWatermarkingConfig"]

MAX_SAMPLING_TABLE_SIZE = 2**24
_INT64 = (-(2**63), 2**63 - 1)


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_int64(v: Any) -> bool:
    return _is_int(v) and _INT64[0] <= v <= _INT64[1]


@dataclass
class SynthIDTextWatermarkingConfig(BaseWatermarkingConfig):
    """Settings of the SynthID text watermark (transformers' ``SynthIDTextWatermarkingConfig``).

    Args:
        ngram_len: length of the n-grams whose hash seeds the g-values: each token is scored in
            the context of the ``ngram_len - 1`` tokens before it (an int >= 1; 5 is usual).
        keys: the secret watermarking keys, one per tournament layer (a non-empty list of
            64-bit ints; their number is the watermark's depth).
        context_history_size: how many recent contexts each row remembers; a context seen
            again is not watermarked (an int >= 1).
        sampling_table_seed: seed of the table that maps hashes to g-values (an int).
        sampling_table_size: size of that table (an int in [1, 2**24]).
        skip_first_ngram_calls: leave the first ``ngram_len - 1`` generated tokens unwatermarked.
        debug_mode: replace the model's scores by uniform ones before watermarking (tests only).

    >>> SynthIDTextWatermarkingConfig(ngram_len=5, keys=[654, 400, 836]).to_dict()["sampling_table_size"]
    65536
    """

    ngram_len: int
    keys: list[int]
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~genkit.errors.ConfigError` naming the first bad field."""
        checks = (
            ("ngram_len", _is_int(self.ngram_len) and self.ngram_len >= 1, "an int >= 1"),
            ("keys", isinstance(self.keys, (list, tuple)) and len(self.keys) > 0
             and all(_is_int64(k) for k in self.keys), "a non-empty list of 64-bit ints"),
            ("context_history_size", _is_int(self.context_history_size) and self.context_history_size >= 1,
             "an int >= 1"),
            ("sampling_table_seed", _is_int(self.sampling_table_seed) and -(2**63) <= self.sampling_table_seed < 2**64,
             "an int in [-2**63, 2**64)"),
            ("sampling_table_size", _is_int(self.sampling_table_size)
             and 1 <= self.sampling_table_size <= MAX_SAMPLING_TABLE_SIZE, "an int in [1, 2**24]"),
            ("skip_first_ngram_calls", isinstance(self.skip_first_ngram_calls, bool), "True or False"),
            ("debug_mode", isinstance(self.debug_mode, bool), "True or False"),
        )
        for key, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"`watermarking_config.{key}` must be {accepted}; got {getattr(self, key)!r}")

    @property
    def depth(self) -> int:
        """The number of tournament layers (``len(keys)``)."""
        return len(self.keys)

    def construct_processor(self, vocab_size: int, device: Any) -> Any:
        """The :class:`~genkit_synthid_pack.processor.SynthIDTextWatermarkLogitsProcessor` of this config
        (``vocab_size`` is not needed: the g-values are computed for every token of the scores)."""
        from .processor import SynthIDTextWatermarkLogitsProcessor

        return SynthIDTextWatermarkLogitsProcessor(
            ngram_len=self.ngram_len, keys=list(self.keys), sampling_table_size=self.sampling_table_size,
            sampling_table_seed=self.sampling_table_seed, context_history_size=self.context_history_size,
            device=device, skip_first_ngram_calls=self.skip_first_ngram_calls, debug_mode=self.debug_mode)
