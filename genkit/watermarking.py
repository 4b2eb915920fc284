"""Watermarking: :class:`WatermarkingConfig` (the ``watermarking_config`` field of a generation) and
:class:`WatermarkDetector`, with transformers' names, arguments and results.

The watermark is the "green list" scheme of Kirchenbauer et al. (2023): before each token, a
pseudo-random fraction ``greenlist_ratio`` of the vocabulary, seeded from the preceding token(s)
(``"lefthash"``) or from the candidate token itself (``"selfhash"``), gets ``bias`` added to its
logits. The detector recomputes the green lists and tests whether a text holds more green tokens
than chance (a one-sided z-test). Generation and detection must use the same config, vocabulary
size and device type (the green lists come from ``torch.randperm`` on that device).

The processor itself is :class:`genkit.builtin_strategies.watermark.WatermarkLogitsProcessor`.
A watermark config is any object with ``construct_processor(vocab_size, device)``, ``to_dict()``
and ``validate()`` (:class:`BaseWatermarkingConfig` is the base class, as in transformers), so a
pack can ship another scheme (see ``plugins/genkit-synthid-pack``). Packs register their config
classes with the ``register_watermarks`` hook, so a ``watermarking_config`` dict read from
``generation_config.json`` becomes the config class whose keys it holds.

This module does not import torch at import time (``GenerationConfig`` uses it).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from .config.watermark_field import (
    as_watermarking_config,
    is_watermarking_config,
    registered_watermark_configs,
    watermark_config_keys,
)
from .errors import ConfigError

logger = logging.getLogger("genkit.watermarking")

__all__ = ["BaseWatermarkingConfig", "WatermarkDetector", "WatermarkDetectorOutput", "WatermarkingConfig",
           "as_watermarking_config", "is_watermarking_config", "registered_watermark_configs", "watermark_config_keys"]

SEEDING_SCHEMES = ("lefthash", "selfhash")


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v))


@dataclass
class BaseWatermarkingConfig(ABC):
    """Base class of watermark configs (transformers' ``BaseWatermarkingConfig``).

    A subclass is a dataclass whose fields are the keys written to ``generation_config.json``; it
    implements :meth:`validate` (raise :class:`~genkit.errors.ConfigError` naming the key) and
    :meth:`construct_processor`. The dict/JSON methods below come for free; :meth:`from_dict`
    refuses unknown keys with the closest name.
    """

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """Build from a dict (``generation_config.json``'s ``watermarking_config``); ``kwargs`` override."""
        data = {**config_dict, **kwargs}
        known = watermark_config_keys(cls)
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                hint = f" Did you mean `{close[0]}`?" if close else ""
                raise ConfigError(f"`watermarking_config` has an unknown key `{key}`; the keys of "
                                  f"{cls.__name__} are {', '.join(sorted(known))}.{hint}")
        try:
            return cls(**data)
        except TypeError as exc:  # a required key is missing
            raise ConfigError(f"`watermarking_config` ({cls.__name__}): {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The keys and values, as transformers writes them."""
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if not k.startswith("_")}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike[str]) -> None:
        with open(json_file_path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def update(self, **kwargs: Any) -> None:
        """Set the given keys (unknown keys are an error naming them), then validate."""
        for key, value in kwargs.items():
            if key not in watermark_config_keys(type(self)):
                raise ConfigError(f"`watermarking_config` has no key `{key}`")
            setattr(self, key, value)
        self.validate()

    def __iter__(self) -> Any:
        yield from self.to_dict().items()

    @abstractmethod
    def validate(self) -> None:
        """Raise :class:`~genkit.errors.ConfigError` naming the first bad key."""

    @abstractmethod
    def construct_processor(self, vocab_size: int, device: Any) -> Any:
        """The logits processor that applies this watermark."""


@dataclass
class WatermarkingConfig(BaseWatermarkingConfig):
    """Settings of the green-list watermark (transformers' ``WatermarkingConfig``).

    Args:
        greenlist_ratio: fraction of the vocabulary that is green at each step, in (0, 1).
        bias: added to the logits of the green tokens (a finite number; 0.5 to 2.5 is usual).
        hashing_key: the secret key the green lists are derived from (an int).
        seeding_scheme: ``"lefthash"`` (the green list depends on the previous ``context_width``
            tokens) or ``"selfhash"`` (it depends on the candidate token too; slower, more robust).
        context_width: how many previous tokens seed the green list (an int >= 1).

    >>> WatermarkingConfig(bias=2.5, seeding_scheme="selfhash").to_dict()["bias"]
    2.5
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~genkit.errors.ConfigError` naming the first bad key."""
        checks = (
            ("greenlist_ratio", _is_num(self.greenlist_ratio) and 0.0 < self.greenlist_ratio < 1.0,
             "a number in (0, 1)"),
            ("bias", _is_num(self.bias), "a finite number"),
            ("hashing_key", _is_int(self.hashing_key), "an int"),
            ("seeding_scheme", self.seeding_scheme in SEEDING_SCHEMES, '"lefthash" or "selfhash"'),
            ("context_width", _is_int(self.context_width) and self.context_width >= 1, "an int >= 1"),
        )
        for key, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"`watermarking_config.{key}` must be {accepted}; got {getattr(self, key)!r}")

    def construct_processor(self, vocab_size: int, device: Any) -> Any:
        """The logits processor that applies this watermark."""
        from .builtin_strategies.watermark import WatermarkLogitsProcessor

        return WatermarkLogitsProcessor(vocab_size=vocab_size, device=device, **self.to_dict())


@dataclass
class WatermarkDetectorOutput:
    """What :class:`WatermarkDetector` returns with ``return_dict=True``; one entry per row, as
    ``torch`` tensors (transformers returns numpy arrays; ``.numpy()`` converts)."""

    num_tokens_scored: Any = None
    num_green_tokens: Any = None
    green_fraction: Any = None
    z_score: Any = None
    p_value: Any = None
    prediction: Any = None
    confidence: Any = None


class WatermarkDetector:
    """Detects the green-list watermark (transformers' ``WatermarkDetector``).

    Args:
        model_config: the generating model's config (``vocab_size``, ``bos_token_id``).
        device: the device the text was generated on (the green lists depend on its type).
        watermarking_config: the exact :class:`WatermarkingConfig` (or dict) used to generate.
        ignore_repeated_ngrams: count every distinct n-gram once.
        max_cache_size: green-list lookups kept in memory.

    ``detector(sequences)`` returns one boolean prediction per row (``z_score > z_threshold``);
    ``return_dict=True`` returns a :class:`WatermarkDetectorOutput` with the counts, z-scores and
    p-values. Pass only the generated tokens where you can: the prompt is not watermarked.
    """

    def __init__(self, model_config: Any, device: Any, watermarking_config: Any,
                 ignore_repeated_ngrams: bool = False, max_cache_size: int = 128) -> None:
        from .builtin_strategies.watermark import GreenLists

        config = as_watermarking_config(watermarking_config)
        if not isinstance(config, WatermarkingConfig):
            raise ConfigError("`watermarking_config` must be a genkit.WatermarkingConfig or a dict of its keys; got "
                              f"{type(watermarking_config).__name__}")
        vocab_size = getattr(model_config, "vocab_size", None)
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ConfigError(f"`model_config.vocab_size` must be an int >= 1; got {vocab_size!r}")
        if not isinstance(ignore_repeated_ngrams, bool):
            raise ConfigError(f"`ignore_repeated_ngrams` must be True or False; got {ignore_repeated_ngrams!r}")
        if not _is_int(max_cache_size) or max_cache_size < 1:
            raise ConfigError(f"`max_cache_size` must be an int >= 1; got {max_cache_size!r}")
        self.config = config
        self.bos_token_id = getattr(model_config, "bos_token_id", None)
        self.greenlist_ratio = config.greenlist_ratio
        self.ignore_repeated_ngrams = ignore_repeated_ngrams
        self.green = GreenLists(vocab_size, device, config.greenlist_ratio, config.hashing_key,
                                config.seeding_scheme, config.context_width, cache_size=max_cache_size)

    def _score(self, input_ids: Any) -> tuple[list[float], list[float]]:
        """(tokens scored, green tokens) per row."""
        selfhash = self.config.seeding_scheme == "selfhash"
        n = self.config.context_width + (0 if selfhash else 1)
        scored, green = [], []
        for row in input_ids.tolist():
            counts = Counter(tuple(row[i:i + n]) for i in range(len(row) - n + 1))
            hits = {g: self.green.is_green(g if selfhash else g[:-1], g[-1]) for g in counts}
            if self.ignore_repeated_ngrams:
                scored.append(float(len(counts)))
                green.append(float(sum(hits.values())))
            else:
                scored.append(float(sum(counts.values())))
                green.append(float(sum(c for g, c in counts.items() if hits[g])))
        return scored, green

    def __call__(self, input_ids: Any, z_threshold: float = 3.0, return_dict: bool = False) -> Any:
        """Predictions (``z_score > z_threshold``) per row, or a :class:`WatermarkDetectorOutput`."""
        import torch

        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ConfigError("`input_ids` must be a 2-D tensor of token ids (batch, length)")
        if not _is_num(z_threshold):
            raise ConfigError(f"`z_threshold` must be a finite number; got {z_threshold!r}")
        if self.bos_token_id is not None:
            has_bos = input_ids[:, 0] == self.bos_token_id
            if bool(has_bos.any()) != bool(has_bos.all()):
                raise ConfigError("some rows start with the BOS token and some do not; tokenize every row the same "
                                  "way")
            if bool(has_bos.all()):
                input_ids = input_ids[:, 1:]
        if input_ids.shape[-1] - self.config.context_width < 1:
            raise ConfigError(f"`input_ids` needs at least one token to score after the first "
                              f"{self.config.context_width} (context_width) tokens")
        scored_l, green_l = self._score(input_ids)
        scored = torch.tensor(scored_l, dtype=torch.float64)
        green = torch.tensor(green_l, dtype=torch.float64)
        gamma = self.greenlist_ratio
        z = (green - gamma * scored) / torch.sqrt(scored * gamma * (1 - gamma))
        prediction = z > z_threshold
        if not return_dict:
            return prediction
        p_value = 0.5 * torch.special.erfc(z / math.sqrt(2))
        return WatermarkDetectorOutput(num_tokens_scored=scored, num_green_tokens=green,
                                       green_fraction=green / scored, z_score=z, p_value=p_value,
                                       prediction=prediction, confidence=1 - p_value)
