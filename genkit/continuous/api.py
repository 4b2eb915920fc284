"""``generate_batch`` and ``init_continuous_batching`` (also methods of native models)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ArgumentTypeError, GenerationError, NotSupportedError
from .config import ContinuousBatchingConfig
from .gate import check_model
from .manager import ContinuousBatchingManager
from .requests import GenerationOutput
from .transformers_models import hf_generate_batch, hf_init_continuous_batching, transformers_model

logger = logging.getLogger("genkit.continuous")

__all__ = ["generate_batch", "init_continuous_batching"]


def init_continuous_batching(model: Any, generation_config: Any = None, manual_eviction: bool = False,
                             max_queue_size: int = 0,
                             continuous_batching_config: ContinuousBatchingConfig | None = None) -> ContinuousBatchingManager:
    """A :class:`ContinuousBatchingManager` for ``model`` (not started: call ``start()`` or use it
    as a context manager). A transformers model gets its own manager (transformers 5's), with the
    settings translated."""
    check_model(model)
    hf = transformers_model(model)
    if hf is not None:
        if manual_eviction:
            raise NotSupportedError("`manual_eviction` is not supported on a transformers model's manager")
        return hf_init_continuous_batching(hf, generation_config, continuous_batching_config, max_queue_size)
    return ContinuousBatchingManager(model, generation_config, manual_eviction=manual_eviction,
                                     max_queue_size=max_queue_size,
                                     continuous_batching_config=continuous_batching_config)


def generate_batch(model: Any, inputs: list[list[int]], generation_config: Any = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None, record_timestamps: bool = False,
                   progress_bar: bool = False, **kwargs: Any) -> dict[str, GenerationOutput]:
    """Generate for every prompt in ``inputs`` with continuous batching; returns
    ``{request_id: GenerationOutput}`` (ids ``req_0``, ``req_1``… in input order). ``kwargs`` are
    generation fields for every request (``max_new_tokens``, ``do_sample``, …). A request that
    fails has ``status`` FAILED and an ``error``; the others are unaffected. A transformers model
    runs its own ``generate_batch`` (transformers 5's), with the settings translated."""
    if not isinstance(inputs, (list, tuple)):
        raise ArgumentTypeError(f"`inputs` must be a list of token id lists; got {type(inputs).__name__}")
    if not inputs:
        return {}
    check_model(model)
    hf = transformers_model(model)
    if hf is not None:  # transformers' own engine, same result structure
        return hf_generate_batch(hf, [list(x) for x in inputs], generation_config, continuous_batching_config,
                                 record_timestamps, progress_bar, kwargs)
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(inputs), desc=f"Solving {len(inputs)} requests", unit="request")
    results: dict[str, GenerationOutput] = {}
    manager = init_continuous_batching(model, generation_config, continuous_batching_config=continuous_batching_config)
    with manager:
        ids = manager.add_requests([list(x) for x in inputs], record_timestamps=record_timestamps, **kwargs)
        pending = set(ids)
        while pending:
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise GenerationError(f"continuous batching stopped: {manager.error}")
                continue
            if out.is_finished() and out.request_id in pending:
                pending.discard(out.request_id)
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return {rid: results[rid] for rid in ids}
