"""Continuous batching: a paged KV cache, schedulers, a background manager, ``generate_batch``.
See docs/continuous_batching.md."""

from __future__ import annotations

from .api import generate_batch, init_continuous_batching
from .config import ContinuousBatchingConfig
from .manager import ContinuousBatchingManager
from .requests import GenerationOutput, RequestStatus

__all__ = ["ContinuousBatchingConfig", "ContinuousBatchingManager", "GenerationOutput", "RequestStatus",
           "generate_batch", "init_continuous_batching"]
