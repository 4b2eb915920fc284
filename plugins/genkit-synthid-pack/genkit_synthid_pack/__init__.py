"""genkit-synthid-pack: the SynthID text watermark (Dathathri et al., Nature 2024) as a genkit pack.

- :class:`SynthIDTextWatermarkingConfig` — pass it as ``watermarking_config=`` to ``generate``
  (transformers' class of the same name: same fields, defaults and JSON form);
- :class:`~genkit_synthid_pack.processor.SynthIDTextWatermarkLogitsProcessor` — tournament
  sampling with g-values, the same scores as transformers' processor;
- :mod:`~genkit_synthid_pack.detector` — the paper's mean and weighted-mean g-value scores
  (no training needed) and the Bayesian detector (transformers' ``BayesianDetectorModel`` and
  ``SynthIDTextWatermarkDetector``).

This module is what the ``genkit`` entry point names, so it is imported at discovery time: it
imports no torch. The hook registers the config class, so a ``watermarking_config`` dict with
SynthID's keys (e.g. in ``generation_config.json``) becomes a :class:`SynthIDTextWatermarkingConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from genkit import hookimpl

from .config import SynthIDTextWatermarkingConfig

__version__ = "0.1.0"

__all__ = ["SynthIDTextWatermarkDetector", "SynthIDTextWatermarkLogitsProcessor", "SynthIDTextWatermarkingConfig",
           "mean_score", "weighted_mean_score"]

_LAZY = {
    "SynthIDTextWatermarkLogitsProcessor": "processor",
    "SynthIDTextWatermarkState": "processor",
    "SynthIDTextWatermarkDetector": "detector",
    "BayesianDetectorConfig": "detector",
    "BayesianDetectorModel": "detector",
    "mean_score": "detector",
    "weighted_mean_score": "detector",
}


def __getattr__(name: str) -> Any:  # the torch-using names are imported on first use
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'genkit_synthid_pack' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


@hookimpl
def register_watermarks(register: Callable[..., None]) -> None:
    register("synthid_text", "genkit_synthid_pack.config:SynthIDTextWatermarkingConfig",
             description="SynthID text: tournament sampling with g-values (Dathathri et al., Nature 2024).")
