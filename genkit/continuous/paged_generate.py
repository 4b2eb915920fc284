"""``generate(..., cache_implementation="paged")``: a batch through continuous batching, as
transformers 5 switches it (each row without its left padding is one request). Registered with
``genkit.generation.engines`` by the ``genkit`` package (generation does not import this package)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError, GenkitError, NotSupportedError
from ..generation.padding import inferred_mask, unpadded_lengths
from ..strategy.finish import special_tokens


def paged_generate(model: Any, inputs: torch.Tensor | None, generation_config: Any, refused: dict[str, Any],
                   kwargs: dict[str, Any]) -> torch.Tensor:
    """The sequences ``(batch, longest)``: each prompt row as given, then its tokens, right-padded
    with ``pad_token_id`` (as ``generate`` pads rows that finished early)."""
    from .api import generate_batch

    kwargs = dict(kwargs)
    refused = dict(refused)
    for name in ("stopping_criteria", "logits_processor"):  # each request runs them, as generate does
        if refused.get(name) is not None:
            kwargs[name] = refused[name]
        refused.pop(name, None)
    kwargs.pop("cache_implementation", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    merged = _check_gate(model, generation_config, refused, kwargs)
    _check_transformers_model(model, merged)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() not in (1, 2):
        raise ConfigError("cache_implementation=\"paged\" needs `input_ids` as a 1-D or 2-D LongTensor")
    ids = inputs[None] if inputs.dim() == 1 else inputs
    # the special tokens generate resolves: its pad id fills finished rows and, in a prompt given
    # without a mask, marks the padding generate infers
    resolved, eos_ids = special_tokens(model, merged)
    # the lengths generate counts from the batch's width (its padding too), as each row's own
    changes = unpadded_lengths(merged, ids.shape[1])
    if "max_new_tokens" in changes:
        kwargs.pop("max_length", None)
    kwargs.update(changes)
    mask = kwargs.pop("attention_mask", None)
    if mask is None:
        mask = inferred_mask(ids, resolved.pad_token_id, eos_ids)
    rows = [row[m.bool()].tolist() if mask is not None else row.tolist() for row, m in
            zip(ids, mask if mask is not None else ids)]
    config = generation_config
    if config is not None and getattr(config, "cache_implementation", None) == "paged":
        config = config.copy() if hasattr(config, "copy") else config
        config.cache_implementation = None
    out = generate_batch(model, rows, config, **kwargs)
    failed = [r for r in out.values() if r.error is not None]
    if failed:
        raise GenkitError(f"request {failed[0].request_id} failed: {failed[0].error}")
    pad = resolved.pad_token_id if resolved.pad_token_id is not None else 0  # as generate pads them
    seqs = [row.tolist() + r.generated_tokens for row, r in zip(ids, out.values())]
    width = max(map(len, seqs))
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long, device=ids.device)


def _check_gate(model: Any, generation_config: Any, arguments: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Refuse what continuous batching cannot run (the gate, :mod:`genkit.continuous.gate`), naming the
    field; the merged config when it can run."""
    from ..generation.api import merge_config
    from .gate import check_model, input_refusal, refusal

    check_model(model)
    why = input_refusal(model, kwargs)
    if why is not None:
        raise NotSupportedError(f"cache_implementation=\"paged\" (continuous batching) cannot run this request: {why}")
    request_objects = ("input_ids", "stopping_criteria", "logits_processor")  # not settings: the requests take them
    config, _ = merge_config(model, generation_config, {k: v for k, v in kwargs.items() if k not in request_objects})
    why = refusal(config, **arguments)
    if why is not None:
        raise NotSupportedError(f"cache_implementation=\"paged\" (continuous batching) cannot run this request: {why}; "
                                "drop the setting or use another cache_implementation")
    return config


def _check_transformers_model(model: Any, merged: Any) -> None:
    """A transformers model runs transformers' continuous batching: what it cannot run is refused
    here, naming the setting as the caller gave it (a ``min_length`` is turned into the new tokens it
    asks for below, and would be named ``min_new_tokens`` there)."""
    from ..models.hf_view import transformers_generation_config
    from .transformers_models import check_hf, transformers_model

    if transformers_model(model) is not None:
        check_hf(transformers_generation_config(merged))
