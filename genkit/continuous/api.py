"""``generate_batch``, ``init_continuous_batching``, ``continuous_batching_context_manager`` and
``destroy_cached_continuous_batching_manager``: the methods of :class:`genkit.ContinuousMixin`
(transformers 5's), as functions of the model."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ArgumentTypeError, ConfigError, GenerationError, NotSupportedError, QueueFullError
from .config import ContinuousBatchingConfig
from .gate import UNSUPPORTED_ARGUMENTS, check_inputs, check_model
from .manager import ContinuousBatchingManager
from .requests import GenerationOutput, own_objects
from .transformers_models import hf_generate_batch, hf_init_continuous_batching, transformers_model

logger = logging.getLogger("genkit.continuous")

__all__ = ["continuous_batching_context_manager", "destroy_cached_continuous_batching_manager", "generate_batch",
           "init_continuous_batching"]


def init_continuous_batching(model: Any, generation_config: Any = None, manual_eviction: bool = False,
                             max_queue_size: int = 0, num_q_padding_intervals: int = 0,
                             num_kv_padding_intervals: int = 0, allow_block_sharing: bool | None = None, *,
                             continuous_batching_config: Any = None, workload_hints: Any = None,
                             **unknown: Any) -> ContinuousBatchingManager:
    """A :class:`ContinuousBatchingManager` for ``model`` (not started: call ``start()`` or use it
    as a context manager); the one its model keeps (``stop(keep_for_next_session=True)``) when there
    is one. The keywords are those of transformers 5.2 (``manual_eviction``, ``max_queue_size``,
    ``num_q_padding_intervals``, ``num_kv_padding_intervals``, ``allow_block_sharing``) and 5.24
    (``continuous_batching_config``: genkit's, transformers' or a dict; ``workload_hints``). The
    padding intervals (CUDA graphs) and ``workload_hints`` (GPU memory sizing) have no effect (a
    warning names them). A transformers model gets its own manager (transformers 5's), with the settings translated."""
    _refuse_unknown("init_continuous_batching", unknown)
    _check_no_effect(num_q_padding_intervals=num_q_padding_intervals,
                     num_kv_padding_intervals=num_kv_padding_intervals)
    if workload_hints is not None:
        from genkit.config.warn import warn_once

        warn_once("`workload_hints` has no effect in genkit (transformers sizes GPU memory from them; genkit sizes the "
                  "cache from continuous_batching_config's num_blocks)")
    check_model(model)
    hf = transformers_model(model)
    if hf is not None:
        if manual_eviction:
            raise NotSupportedError("`manual_eviction` is not supported on a transformers model's manager")
        return hf_init_continuous_batching(hf, generation_config, continuous_batching_config, max_queue_size,
                                           allow_block_sharing)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        _check_kept(cached, model, generation_config, continuous_batching_config, allow_block_sharing)
        logger.info("reusing the continuous batching manager the model kept (destroy_cached_continuous_batching_manager "
                    "drops it)")
        return cached
    cb = _cb_config(model, generation_config, continuous_batching_config, allow_block_sharing)
    return ContinuousBatchingManager(model, generation_config, manual_eviction=manual_eviction,
                                     max_queue_size=max_queue_size, continuous_batching_config=cb)


@contextmanager
def continuous_batching_context_manager(model: Any, generation_config: Any = None, block: bool = True,
                                        timeout: float | None = None, continuous_batching_config: Any = None,
                                        persistent_manager: bool = False, warmup: bool = True,
                                        workload_hints: Any = None, **kwargs: Any) -> Iterator[ContinuousBatchingManager]:
    """A started manager (transformers 5's context manager): stopped on exit (``block``,
    ``timeout``), and kept by the model for its next use with ``persistent_manager=True``.
    ``kwargs``: the other keywords of :func:`init_continuous_batching`."""
    manager = init_continuous_batching(model, generation_config, continuous_batching_config=continuous_batching_config,
                                       workload_hints=workload_hints, **kwargs)
    if warmup and not getattr(manager, "warmed_up", True):
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager and hasattr(manager, "destroy"):
            manager.destroy()


def destroy_cached_continuous_batching_manager(model: Any) -> None:
    """Stop and drop the manager the model kept (``persistent_manager=True``), if any."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        cached.destroy()
        if hasattr(model, "_cached_continuous_batching_manager"):
            del model._cached_continuous_batching_manager


def generate_batch(model: Any, inputs: list[list[int]], generation_config: Any = None,
                   continuous_batching_config: Any = None, record_timestamps: bool = False,
                   progress_bar: bool = False, persistent_manager: bool = False, warmup: bool = True,
                   num_q_padding_intervals: int = 0, num_kv_padding_intervals: int = 0,
                   allow_block_sharing: bool | None = None, **kwargs: Any) -> dict[str, GenerationOutput]:
    """Generate for every prompt in ``inputs`` with continuous batching; returns
    ``{request_id: GenerationOutput}`` (ids ``req_0``, ``req_1``… in input order). ``kwargs`` are
    generation fields for every request (``max_new_tokens``, ``do_sample``, …): an unknown one is a
    ``ConfigError`` naming it, before anything runs; ``logits_processor`` and ``stopping_criteria``
    lists are copied for each request (:func:`~genkit.continuous.requests.own_objects`: each runs its
    own, as ``generate`` does for one prompt). A request that fails has ``status`` FAILED and
    an ``error``; the others are unaffected. The other keywords are transformers' (5.2 and 5.24; see
    :func:`init_continuous_batching` and :func:`continuous_batching_context_manager`). A transformers
    model runs its own ``generate_batch`` (transformers 5's), with the settings translated."""
    if not isinstance(inputs, (list, tuple)):
        raise ArgumentTypeError(f"`inputs` must be a list of token id lists; got {type(inputs).__name__}")
    _check_no_effect(num_q_padding_intervals=num_q_padding_intervals,
                     num_kv_padding_intervals=num_kv_padding_intervals)
    if not inputs:
        return {}
    check_model(model)
    check_inputs(model, kwargs)
    hf = transformers_model(model)
    if hf is not None:  # transformers' own engine, same result structure
        return hf_generate_batch(hf, [list(x) for x in inputs], generation_config, continuous_batching_config,
                                 record_timestamps, progress_bar, kwargs, allow_block_sharing=allow_block_sharing,
                                 persistent_manager=persistent_manager, warmup=warmup)
    _check_request_kwargs(model, generation_config, kwargs)
    prompts = [list(x) for x in inputs]
    # each request its own processors and criteria (copied before anything is made: one may not copy)
    settings = [own_objects(kwargs) for _ in prompts] if len(prompts) > 1 else [kwargs]
    cb = _cb_config(model, generation_config, continuous_batching_config, allow_block_sharing)
    manager = init_continuous_batching(model, generation_config, continuous_batching_config=cb)
    if warmup and not manager.warmed_up:
        manager.warmup()
    # without a queue bound, every request is queued before the loop starts: its first step sees them all
    ids = [] if manager.max_queue_size else [manager.add_request(prompt, record_timestamps=record_timestamps, **kw)
                                             for prompt, kw in zip(prompts, settings)]
    manager.start()
    try:
        ids = ids or [_add_when_room(manager, prompt, record_timestamps, kw) for prompt, kw in zip(prompts, settings)]
        results = _collect(manager, ids, progress_bar)
    finally:
        manager.stop(block=True, timeout=30, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()
    return {rid: results[rid] for rid in ids}


def _add_when_room(manager: ContinuousBatchingManager, prompt: list[int], record_timestamps: bool,
                   kwargs: dict[str, Any]) -> str:
    """Queue ``prompt`` once the manager's ``max_queue_size`` lets it in (transformers' ``add_request``
    waits for room the same way): the requests ahead of it start or end meanwhile."""
    while True:
        try:
            return manager.add_request(prompt, record_timestamps=record_timestamps, **kwargs)
        except QueueFullError:
            if not manager.is_running():
                raise GenerationError(f"continuous batching stopped: {manager.error}") from None
            time.sleep(0.002)


def _collect(manager: ContinuousBatchingManager, ids: list[str], progress_bar: bool) -> dict[str, GenerationOutput]:
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc=f"Solving {len(ids)} requests", unit="request")
    results: dict[str, GenerationOutput] = {}
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
    return results


def _cb_config(model: Any, generation_config: Any, given: Any, allow_block_sharing: bool | None) -> Any:
    """The continuous batching config: the one given (any form), or the generation config's; with
    ``allow_block_sharing`` applied when it is given."""
    cb = ContinuousBatchingConfig.coerce(given)
    if allow_block_sharing is None:
        return cb
    if cb is None:
        from genkit.generation.api import merge_config

        cb = ContinuousBatchingConfig.from_generation_config(merge_config(model, generation_config, {})[0])
    return dataclasses.replace(cb, allow_block_sharing=allow_block_sharing)


# what add_request takes besides generation fields
_REQUEST_ARGUMENTS = frozenset({"seed", "tokenizer", "logits_processor", "stopping_criteria", "top_logprobs",
                                "max_new_tokens", "streaming", "eos_token_id"})


def _check_request_kwargs(model: Any, generation_config: Any, kwargs: dict[str, Any]) -> None:
    """An unknown generation keyword, or a bad value (an ``eos_token_id`` outside the vocabulary
    included), is an error before any request runs (each request would fail)."""
    from genkit.generation.api import merge_config

    fields = {k: v for k, v in kwargs.items() if k not in _REQUEST_ARGUMENTS and k not in UNSUPPORTED_ARGUMENTS}
    for name in ("eos_token_id", "max_new_tokens"):  # fields too, checked with the others (None: not given)
        if kwargs.get(name) is not None:
            fields[name] = kwargs[name]
    merge_config(model, generation_config, fields)


def _check_kept(kept: ContinuousBatchingManager, model: Any, generation_config: Any, continuous_batching_config: Any,
                allow_block_sharing: bool | None) -> None:
    """The manager the model kept runs with the configs it was made with: a ``generation_config`` or
    a continuous batching config given now that differs from those is refused (naming it), not
    dropped."""
    differs = []
    if generation_config is not None and generation_config != kept._given_config:
        differs.append("generation_config")
    cb = _cb_config(model, generation_config, continuous_batching_config, allow_block_sharing)
    if cb is not None and cb.resolved(model) != kept.cb_config:
        differs.append("continuous_batching_config" if allow_block_sharing is None else
                       "continuous_batching_config / allow_block_sharing")
    if differs:
        raise ConfigError(f"the model keeps a continuous batching manager (persistent_manager=True) made with another "
                          f"{' and '.join(f'`{d}`' for d in differs)}, which it would run with instead of this one; "
                          "call model.destroy_cached_continuous_batching_manager() first, or give the settings "
                          "per request (generation keyword arguments)")


def _refuse_unknown(function: str, unknown: dict[str, Any]) -> None:
    if unknown:
        raise ConfigError(f"{function}() got unknown keyword argument(s): {', '.join(sorted(unknown))}")


def _check_no_effect(**values: Any) -> None:
    """Keywords that only size CUDA graphs: ints >= 0, no effect in genkit (a warning says so)."""
    from genkit.config.warn import warn_once

    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"`{name}` must be an int >= 0 (CUDA graph padding; no effect in genkit); got {value!r}")
        if value:
            warn_once(f"`{name}` has no effect in genkit (it pads steps for CUDA graphs, which genkit does not use)")
