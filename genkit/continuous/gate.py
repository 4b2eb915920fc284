"""The one gate: can continuous batching run this request?

Continuous batching (the :class:`~genkit.continuous.ContinuousBatchingManager`, ``generate_batch``,
``generate(cache_implementation="paged")``, ``genkit serve`` and ``genkit batch``) runs the
registry's ``greedy`` and ``sample`` strategies, one sequence per request, with the logits
processors the request's config builds. Everything else — beam search (every kind, constraints
included), contrastive search, DoLa, assisted decoding, classifier-free guidance, watermarking,
recipes and strategies by name — runs its own loop or needs more than one forward pass per
token. Every engine asks :func:`refusal` (or :func:`refusal_for_kwargs`); what it refuses goes to
``generate`` (serve, batch) or is an error naming the field (the manager, the paged cache). No
setting is ever dropped on the way.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, NotSupportedError

__all__ = ["CB_STRATEGIES", "UNSUPPORTED_ARGUMENTS", "UNSUPPORTED_FIELDS", "argument_refusal", "check", "check_inputs",
           "check_model", "input_refusal", "model_refusal", "refusal", "refusal_for_kwargs", "take_arguments"]

# the registered strategies whose decode step the manager runs itself
CB_STRATEGIES = frozenset({"greedy", "sample"})

# config fields whose effect the manager cannot produce, set to anything but "off": field -> why
UNSUPPORTED_FIELDS: dict[str, str] = {
    "num_return_sequences": "continuous batching runs one sequence per request",
    "guidance_scale": "classifier-free guidance runs a second (unconditional) forward pass at every step",
    "watermarking_config": "watermarking runs on the generate engine only",
    "output_scores": "continuous batching returns tokens, not scores",
    "output_logits": "continuous batching returns tokens, not logits",
    "output_hidden_states": "continuous batching returns tokens, not hidden states",
    "return_dict_in_generate": "continuous batching returns tokens, not a generate output object",
}

# arguments of ``generate`` (not config fields) that continuous batching cannot take: name -> why
UNSUPPORTED_ARGUMENTS: dict[str, str] = {
    "custom_generate": "a custom generate (a recipe, a strategy by name or a callable) runs its own loop",
    "assistant_model": "assisted decoding runs its own loop",
    "prefix_allowed_tokens_fn": "each request's processors are built from its config",
    "streamer": "a streaming request (add_request(streaming=True)) streams instead",
    "negative_prompt_ids": "classifier-free guidance runs a second (unconditional) forward pass at every step",
    "negative_prompt_attention_mask": "classifier-free guidance runs a second (unconditional) forward pass at every "
                                      "step",
}

_RUNS = "continuous batching runs greedy search and sampling, one sequence per request"


def model_refusal(model: Any) -> str | None:
    """Why continuous batching cannot run ``model`` at all, or ``None``: encoder-decoder models
    (T5, BART, Whisper...) run on ``genkit.generate`` only (docs/encoder_decoder.md); ``genkit serve``
    and ``genkit batch`` run them on their generate engines for this reason."""
    config = getattr(model, "config", None)
    if getattr(model, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        name = type(getattr(model, "hf_model", model)).__name__
        return (f"{name} is an encoder-decoder model: continuous batching runs decoder-only models; use "
                "genkit.generate (model.generate) for it (genkit serve and genkit batch run it that way)")
    return None


def check_model(model: Any) -> None:
    """Raise :class:`~genkit.errors.NotSupportedError` with :func:`model_refusal`'s reason, if any."""
    why = model_refusal(model)
    if why is not None:
        raise NotSupportedError(f"continuous batching cannot run this model: {why}")


def input_refusal(model: Any, kwargs: dict[str, Any]) -> str | None:
    """Why continuous batching cannot take these ``generate`` keyword arguments: model inputs
    besides the prompt's token ids (``pixel_values``, ``image_grid_thw``, ``inputs_embeds``,
    ``token_type_ids``...: :mod:`genkit.generation.model_inputs`), naming them; ``None`` when
    there are none. A request runs its token ids only, so such an input is never dropped."""
    from genkit.generation.model_inputs import model_input_names

    if model is None:
        return None
    names = [k for k in model_input_names(model, kwargs) if kwargs[k] is not None]
    if not names:
        return None
    listed = ", ".join(f"`{k}`" for k in names)
    return (f"model inputs besides the prompt's token ids ({listed}) are not taken: continuous batching runs "
            "token prompts only; use genkit.generate (model.generate) for them")


def check_inputs(model: Any, kwargs: dict[str, Any]) -> None:
    """Raise :class:`~genkit.errors.NotSupportedError` with :func:`input_refusal`'s reason, if any."""
    why = input_refusal(model, kwargs)
    if why is not None:
        raise NotSupportedError(f"continuous batching cannot run this request: {why}")


def refusal(config: Any, **arguments: Any) -> str | None:
    """Why continuous batching cannot run a request with the resolved ``config`` (a
    :class:`~genkit.GenerationConfig`) and these ``generate`` ``arguments`` (``custom_generate``,
    ``assistant_model``, ...; ``None`` means not given), naming the field; ``None`` when it can."""
    why = argument_refusal(arguments)
    if why is not None:
        return why
    from genkit.config import default_values

    defaults = default_values()
    for name, reason in UNSUPPORTED_FIELDS.items():
        value = getattr(config, name, None)
        if not _off(name, value, defaults):
            return f"`{name}`={value!r}: {reason}"
    return _strategy_refusal(config)


def check(config: Any, **arguments: Any) -> None:
    """Raise :class:`~genkit.errors.NotSupportedError` with :func:`refusal`'s reason, if any."""
    why = refusal(config, **arguments)
    if why is not None:
        raise NotSupportedError(f"continuous batching cannot run this request: {why}")


def refusal_for_kwargs(model: Any, kwargs: dict[str, Any], **arguments: Any) -> str | None:
    """:func:`refusal` for ``generate``-style keyword arguments (``generate`` arguments such as
    ``custom_generate`` may be among them) over ``model``'s generation config (``model`` may be
    ``None``: the defaults). Settings ``generate`` itself refuses are a reason too (their error),
    so that the generate engine reports them."""
    from genkit.generation.api import merge_config

    why_model = model_refusal(model) or input_refusal(model, kwargs)
    if why_model is not None:
        return why_model
    settings = dict(kwargs)
    why = argument_refusal({**take_arguments(settings), **arguments})
    if why is not None:
        return why
    try:
        config, _ = merge_config(model, None, settings)
    except ValueError as exc:  # ConfigError, UnknownItemError, NotSupportedError: generate reports it
        return str(exc)
    return refusal(config)


def take_arguments(settings: dict[str, Any]) -> dict[str, Any]:
    """Pop the ``generate`` arguments the gate judges (:data:`UNSUPPORTED_ARGUMENTS`) out of
    ``settings`` and return them; ``trust_remote_code`` goes too (it matters with
    ``custom_generate`` only, which the gate refuses). What is left are generation settings."""
    arguments = {k: settings.pop(k) for k in list(settings) if k in UNSUPPORTED_ARGUMENTS}
    settings.pop("trust_remote_code", None)
    return arguments


def argument_refusal(arguments: dict[str, Any]) -> str | None:
    """Why continuous batching cannot run a request given these ``generate`` ``arguments``
    (``custom_generate``, ``assistant_model``, ...; ``None`` means not given), or ``None``."""
    for name, value in arguments.items():
        if name not in UNSUPPORTED_ARGUMENTS:
            raise ConfigError(f"the continuous batching gate knows no argument {name!r}; known: "
                              f"{', '.join(sorted(UNSUPPORTED_ARGUMENTS))}")
        if value is not None:
            return f"`{name}` is set: {UNSUPPORTED_ARGUMENTS[name]}"
    return None


def _off(name: str, value: Any, defaults: dict[str, Any]) -> bool:
    """Whether ``value`` of field ``name`` leaves its feature off: unset (every field of a config
    that sets nothing is ``None``), ``False``, or the global default."""
    if value is None or value is False or value == defaults.get(name):
        return True
    return name == "guidance_scale" and value == 1


def _strategy_refusal(config: Any) -> str | None:
    """The registry's strategy for ``config`` when it is not greedy or sampling, with the fields
    that select it."""
    from genkit.plugins import get_registry

    registry = get_registry()
    chosen = registry.select_strategy(config).name
    if chosen in CB_STRATEGIES:
        return None
    fields = [f"`{name}`={getattr(config, name)!r}" for name in _selecting_fields(registry, config, chosen)]
    what = " and ".join(fields) + (" selects" if len(fields) == 1 else " select") if fields else "these settings select"
    return f"{what} the strategy {chosen!r}; {_RUNS}"


def _selecting_fields(registry: Any, config: Any, chosen: str) -> list[str]:
    """The fields set in ``config`` whose default would select greedy or sampling; else those
    whose default would select another strategy than ``chosen``."""
    from genkit.config import default_values, field_table

    defaults = default_values()
    to_cb, to_other = [], []
    for name in field_table():
        default = defaults.get(name)
        if getattr(config, name, default) == default:
            continue
        try:
            picked = registry.select_strategy(_with(config, name, default)).name
        except (TypeError, ValueError):  # not valid, or no strategy applies, without it
            continue
        if picked in CB_STRATEGIES:
            to_cb.append(name)
        elif picked != chosen:
            to_other.append(name)
    return to_cb or to_other


def _with(config: Any, name: str, value: Any) -> Any:
    """``config`` with ``name`` set to ``value`` (a resolved config's :meth:`replace`, else a copy)."""
    if callable(getattr(config, "replace", None)):
        return config.replace(**{name: value})
    trial = config.copy()
    setattr(trial, name, value)
    return trial
