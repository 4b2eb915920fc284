"""Driving a transformers ``PreTrainedModel`` with genkit's strategies.

``wrap_transformers_model(model)`` returns an object with genkit's model protocol (see
``docs/models.md``): callable with transformers' keyword arguments, ``config``,
``generation_config`` (a genkit :class:`~genkit.GenerationConfig` built from the model's own),
``device``, ``dtype``, ``new_cache()`` and ``lm_head_logits()``. Its cache is a transformers
``DynamicCache`` adapted, once, to genkit's cache protocol by :class:`TransformersCache`
(``crop(n)`` keeps ``n`` positions, ``reorder``, ``select``, ``repeat_interleave``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from ..errors import ConfigError, NotSupportedError
from .base import positions_from_mask
from .outputs import CausalLMOutput

logger = logging.getLogger("genkit.models.adapter")


def is_transformers_object(obj: Any) -> bool:
    """Whether ``obj``'s class is transformers' or derives from one of transformers' classes (a
    user's ``class MyCache(DynamicCache)`` or ``class MyModel(LlamaForCausalLM)``, a recipe's own
    ``Cache`` subclass): read from the class's bases, so transformers is never imported here."""
    return any(c.__module__.startswith("transformers.") for c in type(obj).__mro__)


class TransformersCache:
    """A transformers cache (``DynamicCache`` and friends) seen through genkit's cache protocol
    (:class:`genkit.protocols.Cache`). It wraps the cache rather than subclassing it, so each name
    keeps one meaning: ``crop(n)`` here keeps ``n`` positions, as on genkit's own caches, while
    transformers' ``DynamicCache.crop(n)`` removes ``n``. The adapter hands the wrapped cache
    (:attr:`cache`) to the model; other attributes are read from it."""

    _recording = False  # record_past(True) is in force (a class default: unpickling sets no attributes)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def get_seq_length(self, layer: int = 0) -> int:
        return int(self.cache.get_seq_length(layer))

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end). While
        :meth:`record_past` is on, a crop that keeps every position still cuts the sliding-window
        layers back to their window (transformers' ``crop(0)``)."""
        length = self.get_seq_length()
        keep = max_length if max_length >= 0 else length + max_length
        if keep < 0:
            raise ConfigError(f"cannot crop the cache to {max_length}: it holds {length} positions")
        layers = self._held_by_layer()
        if len({held for _, held in layers}) > 1:  # a partial-depth forward left the first layers ahead
            for layer, held in layers:
                mine = max_length if max_length >= 0 else held + max_length
                if held and (mine < held or self._recording):
                    layer.crop(min(mine - held, 0))
        elif keep < length or (self._recording and length):  # (transformers' crop(0) fails on an empty layer)
            self.cache.crop(keep - length)  # transformers: a negative count removes that many

    def _held_by_layer(self) -> list[tuple[Any, int]]:
        """Each key/value layer of the (self-attention) cache with the positions it holds; empty for a
        cache without transformers 5's ``layers``."""
        layers = getattr(getattr(self.cache, "self_attention_cache", self.cache), "layers", None) or ()
        return [(layer, int(layer.get_seq_length())) for layer in layers if hasattr(layer, "keys")]

    def record_past(self, on: bool) -> None:
        """``on``: the sliding-window layers keep every position the forwards add until the next
        :meth:`crop` (transformers' ``activate_past_recording``), so a crop can roll back past their
        window; each crop then cuts them back to it. Off: they keep their window only, as plain
        decoding wants (recording would hold every past position). Strategies that roll the cache
        back turn it on through :meth:`genkit.strategy.Stepper.rollback`."""
        if on:
            self._recording = hasattr(self.cache, "activate_past_recording")
            if self._recording:
                self.cache.activate_past_recording()
            return
        layers = getattr(getattr(self.cache, "self_attention_cache", self.cache), "layers", ())
        for layer in layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
        self._recording = False

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (beam search)."""
        self.cache.reorder_cache(index)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index``."""
        self.cache.batch_select_indices(index)

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times."""
        self.cache.batch_repeat_interleave(repeats)

    def __getattr__(self, name: str) -> Any:
        if name == "cache":  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self.cache, name)

    def __repr__(self) -> str:
        return f"TransformersCache({type(self.cache).__name__}, {self.get_seq_length()} positions)"


def as_genkit_cache(cache: Any) -> Any:
    """The boundary: a transformers cache is wrapped in :class:`TransformersCache`; genkit's own
    caches (and wrapped ones) pass through."""
    if not isinstance(cache, TransformersCache) and is_transformers_object(cache):
        return TransformersCache(cache)
    return cache


def genkit_generation_config(hf_config: Any, base: Any = None) -> Any:
    """A transformers ``GenerationConfig`` as a genkit one: the fields it sets that genkit knows.

    A field at transformers' global default is left unset (genkit's defaults are the same), so that a
    config transformers resolved reads as the settings it was resolved from, except where it means
    more than the default: ``max_length`` (set, it is the whole length; unset, 20 tokens after the
    prompt), and a field that ``base`` (the model's generation config, which fills what the caller's
    leaves unset) sets otherwise: ``do_sample=False`` passed for a model whose config samples."""
    from ..config import GenerationConfig, field_table

    diff = hf_config.to_diff_dict()
    defaults = hf_config._get_default_generation_params() if hasattr(hf_config, "_get_default_generation_params") else {}
    table = field_table()

    def meant(k: str, v: Any) -> bool:
        if k == "max_length" or k not in defaults or defaults[k] != v:
            return True
        under = getattr(base, k, None) if base is not None else None
        return under is not None and under != v

    kept = {k: v for k, v in diff.items() if k in table and not k.startswith("_") and meant(k, v)}
    dropped = sorted(k for k in diff if k not in table and not k.startswith("_") and k != "transformers_version")
    if dropped:
        logger.debug("generation_config fields genkit does not know, ignored: %s", dropped)
    return GenerationConfig(**kept)


def _final_norm(model: Any) -> Any:
    """The final normalisation layer of a transformers causal LM, or None."""
    base = getattr(model, "base_model", model)
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        layer = getattr(base, name, None)
        if isinstance(layer, torch.nn.Module):
            return layer
    return None


class TransformersModelAdapter:
    """A transformers causal LM seen through genkit's model protocol.

    Attributes not defined here (``named_parameters``, ``get_input_embeddings``...) are read from
    the wrapped model, available as ``.hf_model``.
    """

    _genkit_protocol = True

    def __init__(self, model: Any) -> None:
        from ..config import GenerationConfig

        self.hf_model = model
        self.config = model.config
        hf_gen = getattr(model, "generation_config", None)
        self.generation_config = genkit_generation_config(hf_gen) if hf_gen is not None else GenerationConfig()
        # transformers >= 5.24 names the cache argument `cache` (`past_key_values` is deprecated)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # the position of a row's first token: PaliGemma's are 1-indexed (transformers adds 1 to the
        # positions its generate builds, in PaliGemmaForConditionalGeneration.prepare_inputs_for_generation)
        self._first_position = 1 if getattr(model.config, "model_type", None) == "paligemma" else 0

    # -- protocol -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.hf_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.dtype

    def new_cache(self, max_length: int = 0) -> TransformersCache:
        """An empty ``DynamicCache`` for this model, in genkit's cache protocol."""
        from transformers import DynamicCache

        return TransformersCache(DynamicCache(config=self.hf_model.config))

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from any layer's hidden state: final norm, then the LM head."""
        norm = _final_norm(self.hf_model)
        if norm is not None:
            hidden = norm(hidden)
        return self.hf_model.get_output_embeddings()(hidden)

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        if position_ids is None:
            # left padding: positions count real tokens only (what transformers' generate does)
            t = input_ids.shape[1] if input_ids is not None else kwargs["inputs_embeds"].shape[1]
            position_ids = positions_from_mask(attention_mask, t)
        if position_ids is not None and self._first_position:
            position_ids = position_ids + self._first_position
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        cache = as_genkit_cache(past_key_values)
        kwargs[self._cache_arg] = cache.cache if isinstance(cache, TransformersCache) else cache
        out = self.hf_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
            output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep, return_dict=True, **kwargs,
        )
        # genkit's output class, the caller's cache object in genkit's protocol: transformers >= 5.24's
        # outputs name the field `cache` and log a deprecation warning when `past_key_values` is used
        return CausalLMOutput(loss=out.get("loss"), logits=out.logits, past_key_values=cache if use_cache else None,
                              hidden_states=out.get("hidden_states"), attentions=out.get("attentions"))

    forward = __call__

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``genkit.generate`` on the wrapped model (through the public namespace: generation sits
        above the models, docs/architecture.md)."""
        import genkit

        return genkit.generate(self, inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "hf_model":  # not set yet (during unpickling)
            raise AttributeError(name)
        return getattr(self.hf_model, name)

    def __repr__(self) -> str:
        return f"TransformersModelAdapter({type(self.hf_model).__name__})"


def wrap_transformers_model(model: Any) -> TransformersModelAdapter:
    """Wrap a transformers ``PreTrainedModel`` in genkit's model protocol: a causal LM, or an
    encoder-decoder model (``genkit.models.seq2seq.TransformersSeq2SeqAdapter``)."""
    if isinstance(model, TransformersModelAdapter):
        return model
    if not callable(model) or not hasattr(model, "config"):
        raise ConfigError(f"`model` must be a transformers PreTrainedModel; got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        from .seq2seq import TransformersSeq2SeqAdapter

        if not hasattr(model, "get_encoder"):
            raise NotSupportedError(f"{type(model).__name__} is an encoder-decoder model without `get_encoder()`: "
                                    "genkit runs the encoder once through it")
        return TransformersSeq2SeqAdapter(model)
    return TransformersModelAdapter(model)
