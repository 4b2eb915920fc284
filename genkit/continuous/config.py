"""``ContinuousBatchingConfig``: the engine's sizes and policies, under transformers 5's names.

Fields that only concern GPUs in transformers (CUDA graphs, compile configs, memory fractions,
offloading, tensor parallelism) are accepted and have no effect (listed in ``NO_EFFECT``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from genkit.errors import ConfigError

__all__ = ["NO_EFFECT", "ContinuousBatchingConfig"]

NO_EFFECT = ("max_memory_percent", "max_blocks_per_request", "use_async_batching", "use_cuda_graph",
             "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config", "decode_compile_config",
             "default_compile_level", "auto_switch_to_flash", "cpu_offload_space", "cpu_offload_space_safety_threshold",
             "per_request_processors", "drop_unsupported_processors", "disable_nccl_graph_mixing", "cpu_group_timeout",
             "use_default_compile_configs", "max_cached_graphs", "page_size")


@dataclass
class ContinuousBatchingConfig:
    """Sizes and policies of continuous batching.

    - ``block_size``: tokens per cache block (32);
    - ``num_blocks``: blocks in the cache (None: enough for ``max_requests_per_batch`` requests of
      the model's whole context, capped at 1 GiB of cache);
    - ``max_batch_tokens``: tokens in one step (512): a step's prompt tokens plus one per decoding request;
    - ``max_requests_per_batch``: requests in one step (64);
    - ``scheduler_type``: ``"fifo"`` or ``"prefill_first"`` (see genkit.continuous.scheduler);
    - ``safety_margin``: fraction of the cache the fifo scheduler keeps free for running requests
      before it admits new ones (0.2);
    - ``allow_block_sharing``: share the cache blocks of common prompt prefixes (True);
    - ``return_logprobs``: record each generated token's log-probability (False);
    - ``max_queue_size``: requests waiting at most (0: unbounded);
    - ``seed``: accepted for transformers' sake; seed requests with ``seed=`` per request.
    """

    block_size: int = 32
    num_blocks: int | None = None
    max_batch_tokens: int = 512
    max_requests_per_batch: int = 64
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    return_logprobs: bool = False
    max_queue_size: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        from .scheduler import SCHEDULERS

        checks = [("block_size", _pos_int(self.block_size), "an int >= 1"),
                  ("num_blocks", self.num_blocks is None or _pos_int(self.num_blocks), "an int >= 1 or None"),
                  ("max_batch_tokens", _pos_int(self.max_batch_tokens), "an int >= 1"),
                  ("max_requests_per_batch", _pos_int(self.max_requests_per_batch), "an int >= 1"),
                  ("scheduler_type", self.scheduler_type in SCHEDULERS, " or ".join(repr(s) for s in SCHEDULERS)),
                  ("safety_margin", self.safety_margin is None or (isinstance(self.safety_margin, (int, float))
                                                                   and 0 <= self.safety_margin < 1),
                   "a number in [0, 1) or None"),
                  ("allow_block_sharing", isinstance(self.allow_block_sharing, bool), "True or False"),
                  ("return_logprobs", isinstance(self.return_logprobs, bool), "True or False"),
                  ("max_queue_size", isinstance(self.max_queue_size, int) and self.max_queue_size >= 0,
                   "an int >= 0")]
        for name, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"`continuous_batching_config.{name}` must be {accepted}; got "
                                  f"{getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContinuousBatchingConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in names and k not in NO_EFFECT]
        if unknown:
            raise ConfigError(f"`continuous_batching_config` has an unknown key `{unknown[0]}`; accepted: "
                              f"{', '.join(sorted(names))}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_generation_config(cls, config: Any) -> ContinuousBatchingConfig:
        value = getattr(config, "continuous_batching_config", None)
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if callable(getattr(value, "to_dict", None)):  # transformers' own config object
            return cls.from_dict(value.to_dict())
        raise ConfigError(f"`continuous_batching_config` must be a genkit.ContinuousBatchingConfig or a dict; got "
                          f"{type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self, model: Any) -> ContinuousBatchingConfig:
        """A copy with ``num_blocks`` chosen for ``model`` when unset."""
        if self.num_blocks is not None:
            return self
        cfg = model.config
        context = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        blocks = self.max_requests_per_batch * -(-min(context, 4096) // self.block_size)
        head_dim = cfg.get("head_dim", cfg.hidden_size // cfg.num_attention_heads)
        per_block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.block_size * 4
        blocks = max(1, min(blocks, (1 << 30) // per_block))
        return dataclasses.replace(self, num_blocks=blocks)


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
