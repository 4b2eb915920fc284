"""Continuous batching: a paged KV cache, schedulers, a background manager, ``generate_batch``.
See docs/continuous_batching.md."""

from __future__ import annotations

from .api import (
    continuous_batching_context_manager,
    destroy_cached_continuous_batching_manager,
    generate_batch,
    init_continuous_batching,
)
from .config import ContinuousBatchingConfig
from .manager import ContinuousBatchingManager
from .requests import GenerationOutput, RequestState, RequestStatus
from .scheduler import FIFOScheduler, PrefillFirstScheduler, Scheduler

__all__ = ["ContinuousBatchingConfig", "ContinuousBatchingManager", "FIFOScheduler", "GenerationOutput",
           "PrefillFirstScheduler", "RequestState", "RequestStatus", "Scheduler",
           "continuous_batching_context_manager", "destroy_cached_continuous_batching_manager", "generate_batch",
           "init_continuous_batching"]
