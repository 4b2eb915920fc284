"""Continuous batching on transformers models: genkit's ``generate_batch`` /
``init_continuous_batching`` hand over to the model's own (transformers 5's ``ContinuousMixin``),
with the settings translated; genkit's engine runs genkit's native models only."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, NotSupportedError
from .config import ContinuousBatchingConfig


def transformers_model(model: Any) -> Any:
    """The transformers model behind ``model`` (itself, or the one genkit's adapter wraps), or None."""
    from ..models.adapter import is_transformers_object
    from ..models.hf_view import is_view

    inner = getattr(model, "hf_model", None) if getattr(model, "_genkit_protocol", False) else model
    if inner is not None and is_transformers_object(inner) and not is_view(inner) and hasattr(inner, "generate_batch"):
        return inner
    return None


def hf_generation_config(model: Any, generation_config: Any, kwargs: dict[str, Any]) -> Any:
    """A transformers ``GenerationConfig``: the given one (a genkit config translated field by
    field) or the model's, with ``kwargs`` applied; a setting transformers does not know is an error."""
    from ..models.hf_view import transformers_generation_config

    config = transformers_generation_config(model.generation_config if generation_config is None else generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise ConfigError("unknown generation setting(s) for a transformers model's continuous batching: "
                          + ", ".join(sorted(unused)))
    return config


# the generation fields transformers' continuous batching (5.24) runs as genkit.generate runs them:
# greedy search and sampling with temperature, top-k and top-p (the processors it marks as supported),
# suppress_tokens, the length in new tokens (``max_length`` is turned into them first: _new_tokens), the
# special tokens, several sequences per prompt; and
# fields that do not change the tokens. It drops others (repetition_penalty, min_new_tokens: a log
# line), fails on others (no_repeat_ngram_size, bad_words_ids) and never reads the rest (stop_strings,
# max_time, num_beams...): those are refused here, naming them.
HF_CB_FIELDS = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "suppress_tokens", "max_new_tokens", "num_return_sequences",
    "max_length", "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
    "continuous_batching_config", "compile_config", "disable_compile", "transformers_version",
})


def hf_refusal(config: Any) -> str | None:
    """Why transformers' continuous batching would not run the transformers ``GenerationConfig``
    ``config`` as ``genkit.generate`` runs it (a field set, and not to its "off" value, that it
    drops, fails on or never reads), naming the field; ``None`` when it runs it."""
    from genkit.config import default_values

    defaults = default_values()
    for name, value in config.to_dict().items():
        if name in HF_CB_FIELDS or name.startswith("_") or value is None or value is False:
            continue
        if value == defaults.get(name) or (name == "guidance_scale" and value == 1):
            continue
        off = f"set it to {defaults[name]!r} to run without it, or " if name in defaults else ""
        return (f"`{name}`={value!r}: a transformers model runs transformers' own continuous batching, which does "
                f"not run it as genkit.generate does; {off}use genkit.generate (or the model loaded with "
                "genkit.load_model, on genkit's engine)")
    return None


def check_hf(config: Any) -> None:
    """Refuse, naming the field, what :func:`hf_refusal` says transformers' continuous batching cannot run."""
    why = hf_refusal(config)
    if why is not None:
        raise NotSupportedError(f"continuous batching cannot run this request: {why}")


def hf_cb_config(continuous_batching_config: Any, positions: int) -> Any:
    """The transformers ``ContinuousBatchingConfig`` to use: the caller's, or one sized like genkit's
    own (``positions`` cache positions in genkit's block size, genkit's step budget): left to itself,
    transformers sizes its cache from the free memory, which on a CPU takes tens of seconds."""
    import transformers

    if isinstance(continuous_batching_config, ContinuousBatchingConfig):
        raise NotSupportedError("a transformers model runs its own continuous batching: pass a "
                                "transformers.ContinuousBatchingConfig (or none), not genkit's")
    if continuous_batching_config is not None:
        return continuous_batching_config
    ours = ContinuousBatchingConfig()
    return transformers.ContinuousBatchingConfig(page_size=ours.block_size,
                                                 num_blocks=-(-positions // ours.block_size),
                                                 max_batch_tokens=ours.max_batch_tokens)


def workload_positions(inputs: list[list[int]], config: Any) -> int:
    """Cache positions for a whole job: every prompt plus its new tokens, at most 8192 (but at least
    the longest request)."""
    new = int(getattr(config, "max_new_tokens", None) or getattr(config, "max_length", None) or 20)
    lengths = [len(p) for p in inputs]
    return max(max(lengths) + new, min(sum(lengths) + len(lengths) * new, 8192))


def hf_generate_batch(model: Any, inputs: list[list[int]], generation_config: Any, continuous_batching_config: Any,
                      record_timestamps: bool, progress_bar: bool, kwargs: dict[str, Any], *,
                      allow_block_sharing: bool | None = None, **options: Any) -> dict[str, Any]:
    """transformers' ``generate_batch``; ``options`` (``persistent_manager``, ``warmup``) go to it as is."""
    kwargs = dict(kwargs)
    max_new = kwargs.pop("max_new_tokens", None)
    config = hf_generation_config(model, generation_config, kwargs)
    if max_new is not None:
        config.max_new_tokens = max_new
    _new_tokens(config, inputs)
    check_hf(config)
    cb = hf_cb_config(continuous_batching_config, workload_positions(inputs, config))
    if allow_block_sharing is not None:
        cb.allow_block_sharing = allow_block_sharing
    return dict(model.generate_batch(inputs, generation_config=config, continuous_batching_config=cb,
                                     record_timestamps=record_timestamps, progress_bar=progress_bar, **options))


def _new_tokens(config: Any, inputs: list[list[int]]) -> None:
    """Set ``config.max_new_tokens`` when unset, as ``generate`` reads the length: transformers'
    continuous batching counts new tokens only. Without a ``max_length`` (transformers 5 leaves it
    unset), the default length counts new tokens (20); a ``max_length`` that was set counts the prompt
    too, which gives each prompt its own number of new tokens: the same for every prompt, or an
    error naming it."""
    if config.max_new_tokens is not None:
        return
    from genkit.config import default_values

    max_length = config.max_length
    if max_length is None:
        config.max_new_tokens = default_values()["max_length"]
        return
    lengths = sorted({len(p) for p in inputs})
    if len(lengths) != 1 or max_length <= lengths[0]:
        prompts = f"these prompts have {lengths[0]} to {lengths[-1]} tokens" if lengths else "the prompts are not known yet"
        raise NotSupportedError(f"`max_length`={max_length} counts the prompt, and {prompts}: transformers' continuous "
                                "batching (a transformers model's) takes one number of new tokens for every prompt; set "
                                "`max_new_tokens`")
    config.max_new_tokens = max_length - lengths[0]


def hf_init_continuous_batching(model: Any, generation_config: Any, continuous_batching_config: Any,
                                max_queue_size: int, allow_block_sharing: bool | None = None) -> Any:
    cb = hf_cb_config(continuous_batching_config, 8192)
    if max_queue_size:
        cb.max_queue_size = max_queue_size
    if allow_block_sharing is not None:
        cb.allow_block_sharing = allow_block_sharing
    config = hf_generation_config(model, generation_config, {})
    if config.max_length is None:  # a max_length counts each prompt: its requests give max_new_tokens
        _new_tokens(config, [])
    check_hf(config)
    return model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
