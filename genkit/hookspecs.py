"""Hook specifications: the six ways a plugin adds to genkit.

Each hook receives a ``register`` callable; a plugin calls it once per item it contributes. Each
hook is called once through the plugin manager (so ``tryfirst``, hook wrappers and call monitoring
work); every ``register`` also takes ``fields=`` (``GenerationConfig`` fields the item owns). A new
hook is one hookspec here plus one entry in ``genkit.plugins.KIND_TABLE``. See ``docs/hooks.md``
for every signature with a runnable example.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("genkit")
hookimpl = pluggy.HookimplMarker("genkit")


@hookspec
def register_strategies(register: Callable[..., None]) -> None:
    """Register decoding strategies.

    ``register(name, decode, *, applies=None, priority=0, fields=(), description="")`` where ``decode`` is
    ``decode(model, input_ids, *, logits_processor, stopping_criteria, generation_config, streamer,
    **model_kwargs)`` (or a ``"module:attr"`` string imported on first use) and ``applies(config)``
    tells whether the strategy handles a configuration; the highest priority that applies wins (two
    that apply with the same priority are an error). Write the loop with ``genkit.strategy``.
    """


@hookspec
def register_logits_processors(register: Callable[..., None]) -> None:
    """Register logits processors and warpers.

    ``register(name, factory, *, fields=(), order=0, description="")`` where
    ``factory(config, context)`` returns a processor instance or ``None`` when the config leaves it
    off, and ``fields`` is a sequence of :class:`genkit.plugins.FieldSpec` that become legal
    ``GenerationConfig`` keys.
    """


@hookspec
def register_candidate_generators(register: Callable[..., None]) -> None:
    """Register draft sources for assisted decoding.

    ``register(name, factory, *, fields=(), description="")`` where ``factory(model, config, **kwargs)``
    returns an object with ``get_candidates(input_ids)`` and
    ``update_candidate_strategy(input_ids, scores, num_matches)``.
    """


@hookspec
def register_streamers(register: Callable[..., None]) -> None:
    """Register named streamers.

    ``register(name, factory, *, fields=(), description="")`` where ``factory(tokenizer=None, **kwargs)``
    returns an object with ``put(token_ids)`` and ``end()``.
    """


@hookspec
def register_watermarks(register: Callable[..., None]) -> None:
    """Register watermark schemes.

    ``register(name, config_class, *, description="")`` where ``config_class`` (or a ``"module:attr"``
    string) is a :class:`genkit.BaseWatermarkingConfig` subclass: an instance passed as
    ``watermarking_config=`` builds the scheme's logits processor, and a ``watermarking_config`` dict
    (e.g. read from ``generation_config.json``) becomes the registered class that has its keys.
    """


@hookspec
def register_schedulers(register: Callable[..., None]) -> None:
    """Register continuous-batching schedulers.

    ``register(name, scheduler_class, *, fields=(), description="")`` where ``scheduler_class`` (or a
    ``"module:attr"`` string) is a :class:`genkit.Scheduler` subclass: it decides which requests
    run in each step. ``ContinuousBatchingConfig(scheduler_type=name)`` (or ``scheduler=name``)
    picks it.
    """
