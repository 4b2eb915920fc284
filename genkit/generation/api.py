"""``genkit.generate``: prepare inputs, merge the config, build processors and stopping criteria
through the registry, pick a strategy (or a recipe), run it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ..config import GenerationConfig, unknown_key_error
from ..plugins import get_registry
from .processing import LogitsProcessorList, ProcessorContext, StoppingCriteriaList, merge_lists

logger = logging.getLogger("genkit.generation")

# keyword arguments that go to the model / loop rather than into the GenerationConfig
# registry order from which logits processors count as sampling warpers (temperature is 200)
WARPER_ORDER = 200

MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "tokenizer"}


def _looks_like_hub_id(ref: str) -> bool:
    base = ref.split("@", 1)[0]
    parts = base.split("/")
    return len(parts) == 2 and all(parts) and not base.startswith((".", "/", "~"))


def generate(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: list[Any] | None = None,
    stopping_criteria: list[Any] | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    assistant_model: Any = None,
    streamer: Any = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    custom_generate: str | Callable[..., Any] | None = None,
    trust_remote_code: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Generate from ``model``. See ``docs/api.md`` for every argument.

    ``custom_generate`` may be a Hub recipe (``"org/repo"`` or ``"org/repo@rev"``, needs
    ``trust_remote_code=True``), a local recipe folder, a registered strategy name, or a callable
    with the strategy signature.
    """
    model = _as_protocol_model(model)

    # 1. recipes (Hub or local folder): forward every argument except the two that chose it
    if isinstance(custom_generate, (str, os.PathLike)):
        ref = os.fspath(custom_generate)
        registry = get_registry()
        if ref not in registry.items["strategy"]:
            if os.path.isdir(ref) or _looks_like_hub_id(ref):
                from ..recipes import load_recipe

                recipe = load_recipe(ref, trust_remote_code=trust_remote_code)
                forwarded = dict(
                    inputs=inputs, generation_config=generation_config, logits_processor=logits_processor,
                    stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                    assistant_model=assistant_model, streamer=streamer, negative_prompt_ids=negative_prompt_ids,
                    negative_prompt_attention_mask=negative_prompt_attention_mask,
                )
                forwarded = {k: v for k, v in forwarded.items() if v is not None}
                forwarded.update(kwargs)
                with torch.no_grad():
                    return recipe.generate(model, **forwarded)
            known = ", ".join(sorted(registry.items["strategy"]))
            raise ValueError(
                f"`custom_generate`={ref!r} is not a registered strategy ({known}), an existing local "
                "folder, or a Hub id of the form 'org/repo[@revision]'"
            )
    elif custom_generate is not None and not callable(custom_generate):
        raise ValueError(
            "`custom_generate` must be a strategy name, a local folder, a Hub id 'org/repo[@revision]', "
            f"or a callable; got {type(custom_generate).__name__}"
        )

    prepared = prepare(model, inputs, generation_config, logits_processor, stopping_criteria,
                       prefix_allowed_tokens_fn, streamer, kwargs)
    config = prepared.config

    if callable(custom_generate):
        decode = custom_generate
        strategy_name = getattr(custom_generate, "__name__", "callable")
    else:
        registry = get_registry()
        item = (registry.get("strategy", custom_generate) if isinstance(custom_generate, str)
                else registry.select_strategy(_with_assistant(config, assistant_model)))
        decode = item.load()
        strategy_name = item.name
    logger.debug("generating with strategy %s", strategy_name)

    extra: dict[str, Any] = {}
    if assistant_model is not None:
        extra["assistant_model"] = _as_protocol_model(assistant_model)
    if negative_prompt_ids is not None:
        extra["negative_prompt_ids"] = negative_prompt_ids
        extra["negative_prompt_attention_mask"] = negative_prompt_attention_mask
    try:
        # inference mode: no autograd bookkeeping on any of the loop's many small ops
        with torch.inference_mode():
            result = decode(
                model, prepared.input_ids, logits_processor=prepared.logits_processor,
                stopping_criteria=prepared.stopping_criteria, generation_config=config,
                streamer=prepared.streamer, **prepared.model_kwargs, **extra,
            )
    finally:
        if prepared.streamer is not None:
            prepared.streamer.end()
    if callable(custom_generate):
        return result
    if hasattr(result, "sequences"):
        # a normal tensor, so callers may edit it in place outside inference mode
        result.sequences = result.sequences.clone()
        if not config.return_dict_in_generate:
            return result.sequences
    return result


def _with_assistant(config: GenerationConfig, assistant_model: Any) -> GenerationConfig:
    if assistant_model is None:
        return config
    c = config.copy()
    object.__setattr__(c, "_assistant_model", assistant_model)
    return c


def _as_protocol_model(model: Any) -> Any:
    """Native models pass through; a transformers model is wrapped by the adapter."""
    from ..models.base import GenkitModel

    if isinstance(model, GenkitModel) or getattr(model, "_genkit_protocol", False):
        return model
    if type(model).__module__.startswith("transformers."):
        from ..models.adapter import wrap_transformers_model

        return wrap_transformers_model(model)
    return model


class Prepared:
    """Everything a strategy receives."""

    def __init__(self, input_ids: torch.Tensor, config: GenerationConfig, logits_processor: LogitsProcessorList,
                 stopping_criteria: StoppingCriteriaList, streamer: Any, model_kwargs: dict[str, Any]) -> None:
        self.input_ids = input_ids
        self.config = config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.model_kwargs = model_kwargs


def merge_config(model: Any, generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> tuple[
        GenerationConfig, dict[str, Any]]:
    """model's generation_config < ``generation_config`` < kwargs. Returns (config, model kwargs)."""
    base = getattr(model, "generation_config", None)
    config = base.copy() if isinstance(base, GenerationConfig) else GenerationConfig()
    if generation_config is not None:
        if not isinstance(generation_config, GenerationConfig):
            raise ValueError(
                f"`generation_config` must be a genkit.GenerationConfig; got {type(generation_config).__name__}"
            )
        config.update(**generation_config.to_diff_dict())
    cfg_kwargs = {k: v for k, v in kwargs.items() if k not in MODEL_KWARGS}
    model_kwargs = {k: v for k, v in kwargs.items() if k in MODEL_KWARGS}
    unused = config.update(**cfg_kwargs)
    if unused:
        key = next(iter(unused))
        from ..config import _field_table

        raise unknown_key_error(key, list(_field_table()) + sorted(MODEL_KWARGS),
                                what="generation parameter (GenerationConfig field or model input)")
    return config, model_kwargs


def _special_tokens(model: Any, config: GenerationConfig) -> list[int]:
    mc = getattr(model, "config", None)
    if not isinstance(getattr(model, "generation_config", None), GenerationConfig) and mc is not None:
        # no generation config of its own: the special tokens come from the model config
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if getattr(config, name) is None and getattr(mc, name, None) is not None:
                object.__setattr__(config, name, getattr(mc, name))
    eos = config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if config.pad_token_id is None and eos_ids:
        object.__setattr__(config, "pad_token_id", eos_ids[0])
    return eos_ids


def prepare(model: Any, inputs: torch.Tensor | None, generation_config: GenerationConfig | None,
            logits_processor: list[Any] | None, stopping_criteria: list[Any] | None,
            prefix_allowed_tokens_fn: Any, streamer: Any, kwargs: dict[str, Any]) -> Prepared:
    """Inputs, config, processors and stopping criteria for a strategy."""
    kwargs = dict(kwargs)
    if "input_ids" in kwargs:
        if inputs is not None:
            raise ValueError("pass the prompt once: either `inputs` or `input_ids`, not both")
        inputs = kwargs.pop("input_ids")
    config, model_kwargs = merge_config(model, generation_config, kwargs)
    eos_ids = _special_tokens(model, config)
    device = getattr(model, "device", torch.device("cpu"))

    # inputs
    if inputs is None:
        if config.bos_token_id is None:
            raise ValueError("no `input_ids` given and no `bos_token_id` to start from; pass a prompt")
        inputs = torch.full((1, 1), config.bos_token_id, dtype=torch.long, device=device)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        raise ValueError("`input_ids` must be a 2-D LongTensor (batch, sequence_length)")
    if inputs.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
        raise ValueError(f"`input_ids` must hold integer token ids; got dtype {inputs.dtype}")
    input_ids = inputs.to(device=device, dtype=torch.long)
    batch, input_len = input_ids.shape
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None and config.pad_token_id is not None and config.pad_token_id not in eos_ids \
            and bool((input_ids == config.pad_token_id).any()):
        attention_mask = (input_ids != config.pad_token_id).long()
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} must match `input_ids` {tuple(input_ids.shape)}"
            )
        attention_mask = attention_mask.to(device=device, dtype=torch.long)
        if batch > 1 and bool((attention_mask[:, -1] == 0).any()):
            logger.warning("a row of the batch is right-padded; decoder-only models need left padding "
                           "(tokenizer padding_side='left') for correct results")
        model_kwargs["attention_mask"] = attention_mask

    # lengths
    if config.max_new_tokens is not None:
        object.__setattr__(config, "max_length", input_len + config.max_new_tokens)
    elif config.max_length <= input_len:
        raise ValueError(
            f"`max_length` ({config.max_length}) must be larger than the input length ({input_len}); "
            "set `max_new_tokens` to the number of tokens to generate"
        )
    if config.min_new_tokens is not None:
        object.__setattr__(config, "min_length", max(config.min_length, input_len + config.min_new_tokens))

    # more sequences per prompt
    n = config.num_return_sequences
    if n > 1 and config.num_beams == 1:
        input_ids = input_ids.repeat_interleave(n, dim=0)
        for key in ("attention_mask", "position_ids"):
            if model_kwargs.get(key) is not None:
                model_kwargs[key] = model_kwargs[key].repeat_interleave(n, dim=0)
        cache = model_kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:  # a prompt cache: one row per sequence too
            cache.batch_repeat_interleave(n)  # the name genkit's KVCache and transformers' caches share

    # streamer
    if isinstance(streamer, str):
        streamer = get_registry().get("streamer", streamer).load()(tokenizer=model_kwargs.get("tokenizer"))

    # processors through the registry, then the user's
    ctx = ProcessorContext(
        input_ids_seq_length=input_len, eos_token_ids=eos_ids, device=input_ids.device,
        attention_mask=model_kwargs.get("attention_mask"), input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=model_kwargs.get("tokenizer"), model=model,
    )
    built = []
    first_warper = None
    for item in get_registry().processors():
        proc = item.load()(config, ctx)
        if proc is not None:
            if first_warper is None and item.order >= WARPER_ORDER:
                first_warper = len(built)
            built.append(proc)
    merged = merge_lists(built, logits_processor, "logits processor", logger)
    if first_warper is not None and len(merged) > len(built):
        # as in transformers, the user's extra processors run before the sampling warpers
        # (registry order >= WARPER_ORDER) and the final renormalisation
        merged = merged[:first_warper] + merged[len(built):] + merged[first_warper:len(built)]
    processors = LogitsProcessorList(merged)

    from genkit.builtin_strategies.stopping import build_stopping_criteria

    criteria = StoppingCriteriaList(
        merge_lists(build_stopping_criteria(config, eos_ids, model_kwargs.get("tokenizer")), stopping_criteria,
                    "stopping criterion", logger)
    )
    model_kwargs.pop("tokenizer", None)
    return Prepared(input_ids, config, processors, criteria, streamer, model_kwargs)
