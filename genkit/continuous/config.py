"""``ContinuousBatchingConfig``: the engine's sizes and policies, under transformers 5's names.

Every field of transformers' ``ContinuousBatchingConfig`` (5.24, the installed reference) is a
field here. Those that only concern transformers' GPU engine (CUDA graphs, compile configs, memory
fractions, offloading, tensor parallelism) are accepted and have no effect, on a CPU or a GPU: they
are listed, with why, in ``NO_EFFECT`` (and in docs/continuous_batching.md); one given another value
than its default is named in a warning (:func:`warn_no_effect`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from genkit.errors import ConfigError

__all__ = ["NO_EFFECT", "ContinuousBatchingConfig", "warn_no_effect"]

NO_EFFECT = {
    "max_memory_percent": "sizes the cache from free GPU memory; genkit sizes it from num_blocks (see there)",
    "max_blocks_per_request": "the block table of the flash-attention decode fast path (GPU)",
    "use_async_batching": "double-buffers GPU steps",
    "use_cuda_graph": "CUDA graphs",
    "q_padding_interval_size": "query padding for CUDA graphs",
    "kv_padding_interval_size": "key/value padding for CUDA graphs",
    "varlen_compile_config": "torch.compile of the GPU prefill path",
    "decode_compile_config": "torch.compile of the GPU decode path",
    "default_compile_level": "default compile configs of the GPU paths",
    "auto_switch_to_flash": "switches the attention to flash-attention kernels (GPU)",
    "cpu_offload_space": "offloads a preempted request's GPU cache to CPU memory; genkit's preempted requests recompute",
    "cpu_offload_space_safety_threshold": "caps cpu_offload_space",
    "per_request_processors": "genkit always applies each request's own processors and settings",
    "drop_unsupported_processors": "genkit runs every logits processor; none is unsupported",
    "disable_nccl_graph_mixing": "NCCL with tensor parallelism (GPU)",
    "cpu_group_timeout": "tensor-parallel communication",
    "use_default_compile_configs": "deprecated in transformers 5.11 (default_compile_level)",
    "max_cached_graphs": "deprecated in transformers 5.13 (CUDA graphs)",
}


@dataclass
class ContinuousBatchingConfig:
    """Sizes and policies of continuous batching (docs/continuous_batching.md has the full table).

    - ``block_size``: tokens per cache block (None: ``page_size`` when given, else 32);
      ``page_size`` is transformers' name for it since 5.17 (``block_size`` wins when both are set);
    - ``num_blocks``: blocks in the cache (None: enough for ``max_requests_per_batch`` requests of
      the model's whole context, capped at 1 GiB of cache);
    - ``max_batch_tokens``: tokens in one step (None: 512): a step's prompt tokens plus one per
      decoding request;
    - ``max_requests_per_batch``: requests in one step (None: 64);
    - ``scheduler_type``: a registered scheduler (``"fifo"``, ``"prefill_first"`` or a pack's, see
      ``register_schedulers``); ``scheduler``: the same, or a ``genkit.Scheduler`` subclass, and it
      wins over ``scheduler_type``;
    - ``safety_margin``: fraction of the cache a scheduler keeps free for running requests before
      it admits new ones (None: the scheduler's default, 0.2 for fifo, 0 for prefill_first);
    - ``allow_block_sharing``: share the cache blocks of common prompt prefixes (True);
    - ``return_logprobs``: record each generated token's log-probability (False);
    - ``max_queue_size``: requests waiting at most (0: unbounded); one more is refused;
    - ``seed``: the seed of the random generator that seeds each request without a ``seed=`` of
      its own (None: torch's global generator);
    - the fields of ``NO_EFFECT``: accepted, no effect on a CPU.
    """

    block_size: int | None = None
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    return_logprobs: bool = False
    max_queue_size: int = 0
    seed: int | None = None
    scheduler: Any = None
    page_size: int | None = None
    max_memory_percent: float | None = None
    max_blocks_per_request: int | None = None
    use_async_batching: bool | None = None
    use_cuda_graph: Any = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    default_compile_level: int = 0
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None

    def __post_init__(self) -> None:
        if self.block_size is None:
            self.block_size = 32 if self.page_size is None else self.page_size
        if self.max_batch_tokens is None:
            self.max_batch_tokens = 512
        if self.max_requests_per_batch is None:
            self.max_requests_per_batch = 64
        if isinstance(self.scheduler, str):  # a name: the same as scheduler_type
            if self.scheduler not in _scheduler_names():  # named as given, not as the scheduler_type it becomes
                raise ConfigError(f"`continuous_batching_config.scheduler` must be {_accepted_schedulers()}, a "
                                  f"genkit.Scheduler subclass or None; got {self.scheduler!r}")
            self.scheduler_type, self.scheduler = self.scheduler, None
        checks = [("block_size", _pos_int(self.block_size), "an int >= 1"),
                  ("page_size", self.page_size is None or _pos_int(self.page_size), "an int >= 1 or None"),
                  ("num_blocks", self.num_blocks is None or _pos_int(self.num_blocks), "an int >= 1 or None"),
                  ("max_batch_tokens", _pos_int(self.max_batch_tokens), "an int >= 1 or None"),
                  ("max_requests_per_batch", _pos_int(self.max_requests_per_batch), "an int >= 1 or None"),
                  ("scheduler_type", self.scheduler_type in _scheduler_names(), _accepted_schedulers()),
                  ("scheduler", self.scheduler is None or _is_scheduler_class(self.scheduler),
                   "a registered scheduler name, a genkit.Scheduler subclass or None"),
                  ("safety_margin", self.safety_margin is None or (isinstance(self.safety_margin, (int, float))
                                                                   and not isinstance(self.safety_margin, bool)
                                                                   and 0 <= self.safety_margin < 1),
                   "a number in [0, 1) or None"),
                  ("allow_block_sharing", isinstance(self.allow_block_sharing, bool), "True or False"),
                  ("return_logprobs", isinstance(self.return_logprobs, bool), "True or False"),
                  ("max_queue_size", isinstance(self.max_queue_size, int) and self.max_queue_size >= 0,
                   "an int >= 0"),
                  ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                   "an int or None")]
        for name, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"`continuous_batching_config.{name}` must be {accepted}; got "
                                  f"{getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContinuousBatchingConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ConfigError(f"`continuous_batching_config` has an unknown key `{unknown[0]}`; accepted: "
                              f"{', '.join(sorted(names))}")
        return cls(**data)

    @classmethod
    def coerce(cls, value: Any) -> ContinuousBatchingConfig | None:
        """``value`` as a genkit config: itself, a dict of fields, or transformers' own
        ``ContinuousBatchingConfig`` (every field read); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return cls.from_dict({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        if callable(getattr(value, "to_dict", None)):
            return cls.from_dict(value.to_dict())
        raise ConfigError(f"`continuous_batching_config` must be a genkit.ContinuousBatchingConfig, a "
                          f"transformers.ContinuousBatchingConfig or a dict; got {type(value).__name__}")

    @classmethod
    def from_generation_config(cls, config: Any) -> ContinuousBatchingConfig:
        return cls.coerce(getattr(config, "continuous_batching_config", None)) or cls()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self, model: Any) -> ContinuousBatchingConfig:
        """A copy with ``num_blocks`` chosen for ``model`` when unset."""
        if self.num_blocks is not None:
            return self
        cfg = model.config
        context = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        blocks = self.max_requests_per_batch * -(-min(context, 4096) // self.block_size)
        from ..models.memory import kv_bytes_per_position

        per_block = max(kv_bytes_per_position(cfg, 4) * self.block_size, 1)
        blocks = max(1, min(blocks, (1 << 30) // per_block))
        return dataclasses.replace(self, num_blocks=blocks)


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _scheduler_names() -> list[str]:
    from genkit.plugins import get_registry

    return list(get_registry().items["scheduler"])


def _accepted_schedulers() -> str:
    names = [repr(n) for n in _scheduler_names()]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def _is_scheduler_class(value: Any) -> bool:
    from .scheduler import Scheduler

    return isinstance(value, type) and issubclass(value, Scheduler)


def warn_no_effect(cb: ContinuousBatchingConfig) -> None:
    """Warn (once per setting) about the :data:`NO_EFFECT` fields ``cb`` gives another value than
    their default: accepted for transformers' sake, but nothing in genkit acts on them."""
    from genkit.config.warn import warn_once

    defaults = {f.name: f.default for f in dataclasses.fields(ContinuousBatchingConfig)}
    given = [name for name in NO_EFFECT if getattr(cb, name) != defaults.get(name)]
    if given:
        verb = "has" if len(given) == 1 else "have"
        warn_once(f"continuous_batching_config: {', '.join(f'`{n}`' for n in given)} {verb} no effect in genkit "
                  f"({'; '.join(f'{n}: {NO_EFFECT[n]}' for n in given)}); docs/continuous_batching.md")
