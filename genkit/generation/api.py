"""``genkit.generate``: prepare inputs, merge the config, build processors and stop conditions
through the registry, pick a strategy (or a recipe), run it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import (
    GenerationConfig,
    ResolvedConfig,
    check_supported,
    merge_for_generate,
    resolve_lengths,
    unknown_key_error,
)
from ..config.checks import check_vocabulary, model_vocab_size
from ..errors import ConfigError
from ..plugins import get_registry
from ..strategy import StopConditions, StreamerOnce
from ..strategy.finish import special_tokens
from ..strategy.processing import LogitsProcessorList, ProcessorContext, merge_lists
from .encoder_decoder import Seq2SeqInputs, is_encoder_decoder, take_seq2seq_inputs
from .engines import engine_for
from .model_inputs import ForwardingView, ModelInputs, placeholder_prompt, take_model_inputs
from .padding import inferred_mask
from .recipe_call import TransformersMethod, run_transformers_method

logger = logging.getLogger("genkit.generation")

# registry order from which logits processors count as sampling warpers (temperature is 200)
WARPER_ORDER = 200

# keyword arguments that go to the model / loop rather than into the GenerationConfig
MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "tokenizer", "assistant_tokenizer"}


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
    ``trust_remote_code=True``), a local recipe folder, a registered strategy name, a callable
    with the strategy signature, or a transformers decoding loop marked with
    :func:`~genkit.generation.recipe_call.transformers_method`.
    """
    from ..recipes.reference import classify

    named = classify(custom_generate)
    arguments = dict(
        logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, assistant_model=assistant_model, streamer=streamer,
        negative_prompt_ids=negative_prompt_ids, negative_prompt_attention_mask=negative_prompt_attention_mask,
    )
    if isinstance(custom_generate, TransformersMethod):  # transformers' generate runs it (docs/recipes.md)
        return run_transformers_method(model, custom_generate, dict(inputs=inputs, generation_config=generation_config,
                                                                    **arguments), kwargs)
    if named is not None and named.is_recipe:  # every argument except the two that chose the recipe
        return _run_recipe(model, named.ref, trust_remote_code,
                           dict(inputs=inputs, generation_config=generation_config, **arguments), kwargs)
    model, generation_config = _from_transformers_objects(model, generation_config)
    engine = engine_for(generation_config, kwargs)  # cache_implementation="paged": continuous batching
    if engine is not None:
        return engine(model, inputs, generation_config, dict(arguments, custom_generate=custom_generate), kwargs)
    model = as_protocol_model(model)
    return _run_decoding(model, inputs, generation_config, custom_generate, arguments, kwargs)


def _run_recipe(model: Any, ref: str, trust_remote_code: bool | None, forwarded: dict[str, Any],
                kwargs: dict[str, Any]) -> Any:
    """``generate`` through the ``custom_generate`` recipe at ``ref``, given every argument that is set."""
    from ..recipes import load_recipe
    from .recipe_call import recipe_model, resolved_generation_config

    recipe = load_recipe(ref, trust_remote_code=trust_remote_code)
    given = recipe_model(model)
    if forwarded["generation_config"] is None:
        length = _recipe_prompt_length(given, forwarded.get("inputs"), kwargs)
        lengths = {k: kwargs[k] for k in ("max_new_tokens", "max_length") if kwargs.get(k) is not None}
        forwarded["generation_config"] = resolved_generation_config(given, length, lengths)
    with torch.no_grad():
        return recipe.generate(given, **{k: v for k, v in forwarded.items() if v is not None}, **kwargs)


def _recipe_prompt_length(model: Any, inputs: Any, kwargs: dict[str, Any]) -> int:
    """The length a recipe's ``max_length`` counts from: the prompt's, or for an encoder-decoder
    model the decoder's first tokens (the encoder's input is no part of the output)."""
    from .encoder_decoder import decoder_prompt_width

    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return decoder_prompt_width(model, kwargs.get("decoder_input_ids"))
    prompt = kwargs.get("input_ids") if inputs is None else inputs
    return int(prompt.shape[-1]) if isinstance(prompt, torch.Tensor) else 0


def _from_transformers_objects(model: Any, generation_config: Any) -> tuple[Any, Any]:
    """A transformers view of a native model (what a recipe was given) is that native model; a
    transformers ``GenerationConfig`` (what a recipe may pass on) is read as genkit's."""
    from ..models.adapter import is_transformers_object
    from ..models.hf_view import is_view, native_model

    if is_view(model):
        model = native_model(model)
    if generation_config is not None and is_transformers_object(generation_config):
        from ..models.adapter import genkit_generation_config

        generation_config = genkit_generation_config(generation_config, getattr(model, "generation_config", None))
    return model, generation_config


def _run_decoding(model: Any, inputs: torch.Tensor | None, generation_config: GenerationConfig | None,
                  custom_generate: str | Callable[..., Any] | None, arguments: dict[str, Any],
                  kwargs: dict[str, Any]) -> Any:
    """``generate`` on the generate engine: prepare the call, pick the strategy, run it, shape the output."""
    # the negative prompt is the classifier-free guidance processor's input (ProcessorContext.extras)
    negative = {k: arguments[k] for k in ("negative_prompt_ids", "negative_prompt_attention_mask")}
    prepared = prepare(model, inputs, generation_config, arguments["logits_processor"],
                       arguments["stopping_criteria"], arguments["prefix_allowed_tokens_fn"], arguments["streamer"],
                       kwargs, processor_inputs={k: v for k, v in negative.items() if v is not None},
                       assistant_model=arguments["assistant_model"])
    assistant_model = arguments["assistant_model"]
    decode = _pick_strategy(custom_generate, prepared.config, assistant_model)
    extra: dict[str, Any] = {}
    if assistant_model is not None:
        extra["assistant_model"] = as_protocol_model(assistant_model)
        if prepared.seq2seq is not None:  # the assistant's own encoder reads the same input
            extra["assistant_model"] = prepared.seq2seq.bind_assistant(extra["assistant_model"], prepared.config)
    _check_assistant_tokenizer(prepared, assistant_model)
    if prepared.tokenizer is not None:
        extra["tokenizer"] = prepared.tokenizer
    try:
        result = _run_strategy(decode, prepared.model if prepared.model is not None else model, prepared, extra)
    except (AttributeError, KeyError) as error:  # (transformers' helpers, model_kwargs["cache"]...)
        if callable(custom_generate) and hasattr(error, "add_note"):  # (Python 3.11+)
            error.add_note("genkit.generate gives a bare `custom_generate` callable genkit's strategy contract (the "
                           "native model, genkit's GenerationConfig: docs/hooks.md); a loop written for transformers' "
                           "GenerationMixin runs with custom_generate=genkit.transformers_method(fn)")
        raise
    if callable(custom_generate):
        return result
    if prepared.hidden_prompt and hasattr(result, "sequences"):  # transformers returns the new tokens only
        result.sequences = result.sequences[:, prepared.hidden_prompt:]
    return _finish_output(result, prepared.config, prepared.seq2seq)


def _check_assistant_tokenizer(prepared: Prepared, assistant_model: Any) -> None:
    """``assistant_tokenizer=`` (universal assisted decoding) needs an assistant and the target's tokenizer."""
    if prepared.model_kwargs.get("assistant_tokenizer") is None:
        prepared.model_kwargs.pop("assistant_tokenizer", None)
        return
    if assistant_model is None:
        raise ConfigError("`assistant_tokenizer` is the tokenizer of `assistant_model`: pass `assistant_model=` too")
    if prepared.tokenizer is None:
        raise ConfigError("`assistant_tokenizer` needs `tokenizer=` (the target model's tokenizer) too: drafts are "
                          "re-encoded from text")


def _pick_strategy(custom_generate: Any, config: GenerationConfig, assistant_model: Any) -> Callable[..., Any]:
    """The decode function: the callable given, the strategy named, or the registry's choice."""
    if callable(custom_generate):
        logger.debug("generating with callable %s", getattr(custom_generate, "__name__", custom_generate))
        return custom_generate  # type: ignore[no-any-return]
    if assistant_model is not None and custom_generate is None and config.num_beams != 1:
        # (transformers warns and generates without the assistant)
        raise ConfigError(f"`assistant_model` (assisted decoding) works with num_beams=1; got num_beams={config.num_beams}")
    registry = get_registry()
    item = (registry.get("strategy", os.fspath(custom_generate)) if custom_generate is not None
            else registry.select_strategy(_with_assistant(config, assistant_model)))
    if custom_generate is not None:
        check_named_strategy(item, config)
    logger.debug("generating with strategy %s", item.name)
    return item.load()  # type: ignore[no-any-return]


class _Flipped:
    """``config`` read with ``do_sample`` the other way."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._config, name)
        return (not value) if name == "do_sample" else value


def check_named_strategy(item: Any, config: Any) -> None:
    """A strategy named by ``custom_generate`` runs whatever the settings select, so a ``do_sample``
    the caller set (``config.user_set``) against it is a ConfigError rather than ignored: greedy
    search with ``do_sample=True``, sampling with ``do_sample=False``. (A strategy without an
    ``applies`` predicate, or a ``do_sample`` from the model's generation config, is not checked.)"""
    if item.applies is None or "do_sample" not in getattr(config, "user_set", ()):
        return
    if not item.matches(config) and item.matches(_Flipped(config)):
        raise ConfigError(f"`custom_generate`={item.name!r} does not run with `do_sample`={bool(config.do_sample)!r}: "
                          f"it {'samples' if not config.do_sample else 'does not sample'}; drop `do_sample` or name "
                          "another strategy")


def _run_strategy(decode: Callable[..., Any], model: Any, prepared: Prepared, extra: dict[str, Any]) -> Any:
    """Call the strategy in inference mode; the streamer is ended on every exit path."""
    try:
        # inference mode: no autograd bookkeeping on any of the loop's many small ops
        with torch.inference_mode():
            return decode(
                model, prepared.input_ids, logits_processor=prepared.logits_processor,
                stopping_criteria=prepared.stopping_criteria, generation_config=prepared.config,
                streamer=prepared.streamer, **prepared.model_kwargs, **extra,
            )
    finally:
        if prepared.streamer is not None:
            prepared.streamer.end()


def _finish_output(result: Any, config: GenerationConfig, seq2seq: Seq2SeqInputs | None = None) -> Any:
    """Sequences as a normal tensor (editable outside inference mode), the caller's own cache type
    back, the encoder-decoder output classes for an encoder-decoder model, transformers' output
    classes when transformers is loaded (``as_transformers_output``), and the bare tensor unless
    ``return_dict_in_generate``."""
    if not hasattr(result, "sequences"):
        return result
    result.sequences = result.sequences.clone()
    cache = getattr(result, "past_key_values", None)
    if cache is not None:
        from ..models.adapter import TransformersCache

        if isinstance(cache, TransformersCache):
            result.past_key_values = cache.cache
    if not config.return_dict_in_generate:
        return result.sequences
    if seq2seq is not None:
        from ..strategy.outputs import as_encoder_decoder_output

        # transformers: the encoder's (a precomputed `encoder_outputs`' too) when asked for, one row per input
        result = as_encoder_decoder_output(
            result, seq2seq.state.hidden_states if config.output_hidden_states else None,
            seq2seq.state.attentions if config.output_attentions else None)
    from ..strategy.outputs import as_transformers_output

    return as_transformers_output(result)


def _with_assistant(config: ResolvedConfig, assistant_model: Any) -> ResolvedConfig:
    return config if assistant_model is None else config.replace(assistant_model=assistant_model)


def as_protocol_model(model: Any) -> Any:
    """Native models pass through; a transformers model is wrapped by the adapter."""
    from ..models.adapter import is_transformers_object, wrap_transformers_model
    from ..models.base import GenkitModel
    from ..models.hf_view import is_view, native_model

    if isinstance(model, GenkitModel) or getattr(model, "_genkit_protocol", False):
        return model
    if is_view(model):  # (the view of a native model derives from transformers' PreTrainedModel)
        return native_model(model)
    if is_transformers_object(model):  # transformers' model classes and users' subclasses of them
        return wrap_transformers_model(model)
    return model


@dataclass
class Prepared:
    """Everything a strategy receives."""

    input_ids: torch.Tensor
    config: GenerationConfig
    logits_processor: LogitsProcessorList
    stopping_criteria: StopConditions
    streamer: Any
    model_kwargs: dict[str, Any]
    tokenizer: Any = None
    #: what the strategy runs when it is not the model given (an encoder-decoder model's decoder)
    model: Any = None
    #: an encoder-decoder model's inputs and encoder output
    seq2seq: Seq2SeqInputs | None = None
    #: leading columns of the sequences that stand in for a prompt given as embeddings only
    hidden_prompt: int = 0


def merge_config(model: Any, generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> tuple[
        ResolvedConfig, dict[str, Any]]:
    """generation_config < model's generation_config (what it leaves unset; a transformers
    ``GenerationConfig`` set on the model is read as genkit's) < defaults < kwargs
    (``genkit.config.merge_for_generate``). Returns (config, model kwargs)."""
    base = getattr(model, "generation_config", None)
    from ..models.adapter import is_transformers_object

    if base is not None and is_transformers_object(base):
        from ..models.adapter import genkit_generation_config

        base = genkit_generation_config(base)  # a transformers GenerationConfig set on a native model
    config, rest = merge_for_generate(base if isinstance(base, GenerationConfig) else None, generation_config, kwargs)
    model_kwargs = {k: v for k, v in rest.items() if k in MODEL_KWARGS}
    unknown = [k for k in rest if k not in MODEL_KWARGS]
    if unknown:
        from ..config import field_table

        raise unknown_key_error(unknown[0], list(field_table()) + sorted(MODEL_KWARGS),
                                what="generation parameter (GenerationConfig field or model input)")
    check_supported(config)
    check_token_ids(model, config)
    return config, model_kwargs


def check_token_ids(model: Any, config: GenerationConfig) -> None:
    """The config's token ids (``eos_token_id``, ``suppress_tokens``, ``sequence_bias``, ...) are
    int64s and lie in the model's vocabulary, the width of its logits
    (:func:`genkit.config.checks.check_vocabulary`). Without a model (a batch row's check), or for a
    model without a ``vocab_size``, only the first."""
    check_vocabulary(config, model_vocab_size(model))


def prepare(model: Any, inputs: torch.Tensor | None, generation_config: GenerationConfig | None,
            logits_processor: list[Any] | None, stopping_criteria: list[Any] | None,
            prefix_allowed_tokens_fn: Any, streamer: Any, kwargs: dict[str, Any], *,
            processor_inputs: dict[str, Any] | None = None, assistant_model: Any = None) -> Prepared:
    """Inputs, config, processors and stop conditions for a strategy, in named steps.
    ``processor_inputs`` (e.g. ``negative_prompt_ids``) reach the processor factories as
    ``ProcessorContext.extras``; ``assistant_model`` counts in the memory check."""
    kwargs = dict(kwargs)
    seq2seq = take_seq2seq_inputs(model, inputs, kwargs) if is_encoder_decoder(model) else None
    forwarded = ModelInputs() if seq2seq is not None else take_model_inputs(model, kwargs)
    if seq2seq is not None:
        inputs = None
    elif "input_ids" in kwargs:
        if inputs is not None:
            raise ConfigError("pass the prompt once: either `inputs` or `input_ids`, not both")
        inputs = kwargs.pop("input_ids")
    config, model_kwargs = merge_config(model, generation_config, kwargs)
    _check_attentions(model, config)
    config, eos_ids = special_tokens(model, config)
    check_token_ids(model, config)  # the special tokens it took from the model's config
    device = getattr(model, "device", torch.device("cpu"))
    if seq2seq is None:
        inputs = _embeddings_prompt(inputs, forwarded, config, model_kwargs)
        input_ids = _prompt_ids(inputs, config, device)
        _attention_mask(input_ids, config, eos_ids, model_kwargs)
    else:
        input_ids = _start_seq2seq(model, seq2seq, config, model_kwargs, device)
    _adapt_cache(model_kwargs)
    extras = dict(processor_inputs or {})
    config = _set_lengths(model, config, input_ids, seq2seq, extras, assistant_model)
    input_ids = _expand_to_sequences(input_ids, config, model_kwargs, seq2seq, forwarded)
    tokenizer = model_kwargs.pop("tokenizer", None)
    if seq2seq is not None:  # the encoder's token ids (None when it read audio, pixels or embeddings)
        extras["encoder_input_ids"] = seq2seq.state.input_ids
    processors = _build_processors(model, config, input_ids, eos_ids, model_kwargs, logits_processor,
                                   prefix_allowed_tokens_fn, tokenizer, extras)
    stop = _build_stop_conditions(config, eos_ids, tokenizer, stopping_criteria, input_ids.device)
    runs = model.decoder(seq2seq.state) if seq2seq is not None else (
        ForwardingView(model, forwarded, input_ids.shape[1]) if forwarded else None)
    return Prepared(input_ids, config, processors, stop, _open_streamer(streamer, tokenizer), model_kwargs, tokenizer,
                    model=runs, seq2seq=seq2seq, hidden_prompt=input_ids.shape[1] if forwarded.placeholder else 0)


def _embeddings_prompt(inputs: torch.Tensor | None, forwarded: ModelInputs, config: ResolvedConfig,
                       model_kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A prompt given as ``inputs_embeds``: its ids (the caller's, of the same length) or stand-ins;
    no prompt beside other model inputs (``pixel_values``): BOS, one row per input (as in transformers)."""
    embeds = forwarded.inputs_embeds
    if embeds is None:
        tensors = [v for v in (*forwarded.prefill.values(), *forwarded.every.values()) if isinstance(v, torch.Tensor)]
        if inputs is None and tensors and config.bos_token_id is not None:  # e.g. pixel_values only: start from BOS
            return torch.full((tensors[0].shape[0], 1), int(config.bos_token_id), dtype=torch.long)
        return inputs
    if inputs is None:
        forwarded.placeholder = True
        inputs = placeholder_prompt(embeds, config.pad_token_id if config.pad_token_id is not None else 0)
        if model_kwargs.get("attention_mask") is None:
            model_kwargs["attention_mask"] = torch.ones_like(inputs)
    elif tuple(inputs.shape) != tuple(embeds.shape[:2]):
        raise ConfigError(f"`inputs_embeds` {tuple(embeds.shape)} and `input_ids` {tuple(inputs.shape)} must "
                          "cover the same tokens (batch, sequence_length)")
    return inputs


def _check_attentions(model: Any, config: ResolvedConfig) -> None:
    """``output_attentions=True`` needs a model whose forward returns attention weights."""
    if not config.output_attentions or getattr(model, "_genkit_protocol", False):
        return  # the transformers adapters forward it to the model
    import inspect

    forward = getattr(model, "forward", model)
    params = inspect.signature(forward).parameters
    if "output_attentions" not in params:
        from ..errors import NotSupportedError

        raise NotSupportedError(f"`output_attentions=True` is not supported by {type(model).__name__}: its forward "
                                "does not return attention weights (output_hidden_states=True works)")


def check_encoder_decoder_settings(config: Any) -> None:
    """The settings an encoder-decoder model cannot run, refused by name (a NotSupportedError):
    DoLa and classifier-free guidance (``genkit serve`` asks before it queues a request)."""
    from ..errors import NotSupportedError

    if config.dola_layers is not None:
        raise NotSupportedError("`dola_layers` (DoLa) is supported for decoder-only models only: it projects the "
                                "decoder's intermediate layers through the LM head, which an encoder-decoder model's "
                                "adapter does not expose")
    if config.guidance_scale not in (None, 1, 1.0):
        raise NotSupportedError("`guidance_scale` (classifier-free guidance) is supported for decoder-only models "
                                "only: its unconditional pass runs the prompt through a decoder-only model")


def _start_seq2seq(model: Any, seq2seq: Seq2SeqInputs, config: ResolvedConfig, model_kwargs: dict[str, Any],
                   device: torch.device) -> torch.Tensor:
    """An encoder-decoder model: run the encoder once, return the decoder's first tokens (its prompt)."""
    from ..errors import NotSupportedError

    if model_kwargs.get("past_key_values") is not None:
        raise NotSupportedError("`past_key_values` for an encoder-decoder model is not supported: genkit runs the "
                                "encoder and starts the decoder's cache itself (pass `encoder_outputs` to reuse the "
                                "encoder's work)")
    check_encoder_decoder_settings(config)
    if seq2seq.inputs is not None and seq2seq.input_name == "input_ids":  # checked as a decoder-only prompt is
        seq2seq.inputs = _prompt_ids(seq2seq.inputs, config, device)
    return seq2seq.start(model, config, device)


def _prompt_ids(inputs: torch.Tensor | None, config: GenerationConfig, device: torch.device) -> torch.Tensor:
    """The prompt as a ``(batch, length)`` long tensor on the model's device; no prompt starts from
    ``bos_token_id`` (as in transformers); an empty one is an error (transformers fails obscurely)."""
    if inputs is None:
        if config.bos_token_id is None:
            raise ConfigError("no `input_ids` given and no `bos_token_id` to start from; pass a prompt")
        return torch.full((1, 1), config.bos_token_id, dtype=torch.long, device=device)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        raise ConfigError("`input_ids` must be a 2-D LongTensor (batch, sequence_length)")
    if inputs.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
        raise ConfigError(f"`input_ids` must hold integer token ids; got dtype {inputs.dtype}")
    if inputs.shape[1] == 0:
        raise ConfigError(
            f"the prompt is empty: `input_ids` has shape {tuple(inputs.shape)} (no tokens). Pass at least one "
            "token, or pass no prompt (inputs=None) to start from `bos_token_id`"
        )
    return inputs.to(device=device, dtype=torch.long)


def _attention_mask(input_ids: torch.Tensor, config: GenerationConfig, eos_ids: list[int],
                    model_kwargs: dict[str, Any]) -> None:
    """Check the caller's mask, or infer one from pad tokens in the prompt (left padding)."""
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = inferred_mask(input_ids, config.pad_token_id, eos_ids)
    if attention_mask is None:
        return
    if attention_mask.shape != input_ids.shape:
        raise ConfigError(
            f"`attention_mask` shape {tuple(attention_mask.shape)} must match `input_ids` {tuple(input_ids.shape)}"
        )
    attention_mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if input_ids.shape[0] > 1 and bool((attention_mask[:, -1] == 0).any()):
        logger.warning("a row of the batch is right-padded; decoder-only models need left padding "
                       "(tokenizer padding_side='left') for correct results")
    model_kwargs["attention_mask"] = attention_mask


def _adapt_cache(model_kwargs: dict[str, Any]) -> None:
    """A transformers cache passed as ``past_key_values`` is adapted to genkit's cache protocol here,
    once (``genkit.models.adapter.as_genkit_cache``)."""
    cache = model_kwargs.get("past_key_values")
    if cache is not None:
        from ..models.adapter import as_genkit_cache

        model_kwargs["past_key_values"] = as_genkit_cache(cache)


def _set_lengths(model: Any, config: ResolvedConfig, input_ids: torch.Tensor, seq2seq: Seq2SeqInputs | None,
                 extras: dict[str, Any], assistant_model: Any) -> ResolvedConfig:
    """``max_length`` and ``min_length`` from the ``*_new_tokens`` settings and the prompt length
    (``genkit.config.resolve_lengths``, transformers 5's rules), checked against the model's context
    and the memory the sequences would hold (``genkit.models.memory.generation_memory``: with the
    encoder's cross-attention, classifier-free guidance's branch, the assistant model, the outputs
    recorded) before any buffer or cache is sized."""
    from ..models.memory import generation_memory

    negative = extras.get("negative_prompt_ids")
    guidance = config.guidance_scale is not None and config.guidance_scale != 1
    memory = generation_memory(
        model, assistant=assistant_model, guidance=guidance,
        encoder_positions=int(seq2seq.state.hidden.shape[1]) if seq2seq is not None else 0,
        negative_positions=int(negative.shape[-1]) - int(input_ids.shape[1]) if isinstance(negative, torch.Tensor) else 0,
        config=config)
    return resolve_lengths(config, int(input_ids.shape[1]),
                           getattr(getattr(model, "config", None), "max_position_embeddings", None),
                           prompts=int(input_ids.shape[0]), memory=memory)


def _expand_to_sequences(input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any],
                         seq2seq: Seq2SeqInputs | None = None, forwarded: ModelInputs | None = None) -> torch.Tensor:
    """``num_return_sequences`` > 1 without beams: one row per sequence (a prompt cache, an
    encoder output and the model inputs too)."""
    n = config.num_return_sequences
    if n <= 1 or config.num_beams != 1:
        return input_ids
    if seq2seq is not None:
        seq2seq.state.repeat_interleave(n)
    if forwarded:
        forwarded.repeat_interleave(n)
    for key in ("attention_mask", "position_ids"):
        if model_kwargs.get(key) is not None:
            model_kwargs[key] = model_kwargs[key].repeat_interleave(n, dim=0)
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        cache.repeat_interleave(n)
    return input_ids.repeat_interleave(n, dim=0)


def _open_streamer(streamer: Any, tokenizer: Any) -> Any:
    """A registered streamer name becomes an instance; ``end()`` reaches the streamer once."""
    if isinstance(streamer, str):
        streamer = get_registry().get("streamer", streamer).load()(tokenizer=tokenizer)
    return StreamerOnce.wrap(streamer)


def _build_processors(model: Any, config: GenerationConfig, input_ids: torch.Tensor, eos_ids: list[int],
                      model_kwargs: dict[str, Any], user: list[Any] | None, prefix_allowed_tokens_fn: Any,
                      tokenizer: Any, extras: dict[str, Any] | None = None) -> LogitsProcessorList:
    """The registry's processors for this config, then the user's (before the sampling warpers)."""
    extras = dict(extras or {})
    # the encoder's input: the prompt of a decoder-only model (as in transformers)
    encoder_input_ids = extras.pop("encoder_input_ids") if "encoder_input_ids" in extras else input_ids
    ctx = ProcessorContext(
        input_ids_seq_length=input_ids.shape[1], eos_token_ids=eos_ids, device=input_ids.device,
        attention_mask=model_kwargs.get("attention_mask"), input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=tokenizer, model=model,
        extras=extras, encoder_input_ids=encoder_input_ids,
    )
    _adapt_guidance(user)
    built = []
    first_warper = None
    for item in get_registry().processors():
        proc = item.load()(config, ctx)
        if proc is not None:
            if first_warper is None and item.order >= WARPER_ORDER:
                first_warper = len(built)
            built.append(proc)
    merged = merge_lists(built, user, "logits processor", logger)
    if first_warper is not None and len(merged) > len(built):
        # as in transformers, the user's extra processors run before the sampling warpers
        # (registry order >= WARPER_ORDER) and the final renormalisation
        merged = merged[:first_warper] + merged[len(built):] + merged[first_warper:len(built)]
    return LogitsProcessorList(merged)


def _adapt_guidance(user: list[Any] | None) -> None:
    """genkit's classifier-free guidance processor given by the caller on a transformers model (its
    transformers signature) runs that model through the adapter from its first call on, as a passed
    transformers cache is adapted (:func:`_adapt_cache`): its unconditional branch then keeps a
    cache in genkit's protocol, which rolls back with assisted decoding's drafts (past a sliding
    window too)."""
    from genkit.builtin_strategies.guidance import UnbatchedClassifierFreeGuidanceLogitsProcessor

    for processor in user or ():
        if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor) and processor.cache is None:
            processor.model = as_protocol_model(processor.model)


def _build_stop_conditions(config: GenerationConfig, eos_ids: list[int], tokenizer: Any, user: list[Any] | None,
                           device: torch.device) -> StopConditions:
    """Max length and EOS ids as data; the config's other criteria (time, stop strings) and the
    user's are called at every step."""
    from genkit.builtin_strategies.stopping import config_criteria

    criteria = merge_lists(config_criteria(config, tokenizer), user, "stopping criterion", logger)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device) if eos_ids else None
    return StopConditions(max_length=int(config.max_length), eos=eos, criteria=tuple(criteria))
