"""What every native model shares: its config object, its output type and the base class."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, NotSupportedError
from .mixin import GenerationMixin


class ModelConfig:
    """A model's ``config.json`` as attributes (the fields transformers' configs use)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return None  # absent fields read as None, like optional fields of transformers' configs

    def get(self, key: str, default: Any = None) -> Any:
        value = self.__dict__.get(key, default)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> ModelConfig:
        with open(path, encoding="utf-8") as fh:
            return cls(**json.load(fh))

    def __repr__(self) -> str:
        return f"ModelConfig({json.dumps(self.__dict__, default=str, sort_keys=True)})"


def positions_from_mask(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """Position ids of the last ``q_len`` tokens of a left-padded batch (None when nothing is padded)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)[:, -q_len:]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    def __getitem__(self, key: str) -> Any:  # dict-style access, as on transformers' outputs
        return getattr(self, key)


# transformers' forward arguments genkit accepts without acting on them: their only values that
# mean something are the ones genkit already does (a dataclass output, no attention weights)
_NEUTRAL_KWARGS = {"return_dict": (True, None), "output_attentions": (False, None)}


def _check_forward_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments ``forward`` does not take, by name (none is silently ignored)."""
    from ..errors import ConfigError, NotSupportedError

    unknown = sorted(k for k in kwargs if k not in _NEUTRAL_KWARGS)
    if "labels" in unknown:
        raise NotSupportedError("`labels`: genkit's native models do not compute a loss (they are for "
                                "generation); compute it from `.logits`, or use the transformers model")
    if unknown:
        raise ConfigError(f"unknown keyword argument(s) {', '.join(repr(k) for k in unknown)} for the model's forward; "
                          "accepted: input_ids, attention_mask, position_ids, past_key_values, use_cache, "
                          "output_hidden_states, logits_to_keep, inputs_embeds, num_layers (and return_dict=True, "
                          "output_attentions=False)")
    for key, value in kwargs.items():
        if value not in _NEUTRAL_KWARGS[key]:
            raise NotSupportedError(f"`{key}`={value!r} is not supported by genkit's native models; accepted: "
                                    f"{' or '.join(repr(v) for v in _NEUTRAL_KWARGS[key])}")


class GenkitModel(nn.Module, GenerationMixin):
    """Base class of native models: ``config``, ``generation_config``, ``device``, ``dtype``."""

    config: ModelConfig
    #: whether ``forward`` takes ``num_layers=`` (run the first layers only, then the final norm and
    #: the LM head: early exit). The cache then holds the new positions in those layers only.
    supports_partial_depth: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        from ..config import GenerationConfig

        self.generation_config = GenerationConfig.from_model_config(config)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a hidden state of any layer (final norm + LM head), for DoLa and early exit."""
        raise NotImplementedError

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding module, under transformers' name."""
        return self.input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        """The LM head alone (no final norm), under transformers' name (DoLa contrasts raw layers with it)."""
        return self.lm_head  # type: ignore[no-any-return]

    def input_embeddings(self) -> nn.Module:
        """The token embedding module."""
        raise NotImplementedError

    def decoder(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cache: Any, past_len: int, hidden: list[torch.Tensor] | None) -> torch.Tensor:
        """Run the decoder stack on embeddings ``x`` (appending each layer's input to ``hidden``) and
        return the final-normed hidden state."""
        raise NotImplementedError

    def output_logits(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        """The LM head on the final-normed hidden state of the kept positions."""
        return self.lm_head(x)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        num_layers: int | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """transformers' calling convention (see docs/models.md, "The model protocol").

        ``num_layers`` (models with :attr:`supports_partial_depth`): run only the first that many
        decoder layers; the logits are the final norm and LM head on their output."""
        if kwargs:
            _check_forward_kwargs(kwargs)
        depth = self._partial_depth(num_layers)
        if inputs_embeds is None:
            if input_ids is None:
                raise ConfigError("pass `input_ids` or `inputs_embeds`")
            if input_ids.shape[-1] != 1 or past_key_values is None:  # a prompt (decode steps feed sampled ids)
                self._check_token_ids(input_ids)
            inputs_embeds = self.input_embeddings()(input_ids)
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, inputs_embeds.shape[1])
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        if depth is None:
            x = self.decoder(inputs_embeds, attention_mask, position_ids, cache, past_len, hidden)
        else:
            x = self.decoder(inputs_embeds, attention_mask, position_ids, cache, past_len, hidden, num_layers=depth)
        if hidden is not None:
            hidden.append(x)
        if isinstance(logits_to_keep, int):
            if logits_to_keep > 0:
                x = x[:, -logits_to_keep:]
        else:
            x = x[:, logits_to_keep]
        return CausalLMOutput(logits=self.output_logits(x, cache), past_key_values=cache if use_cache else None,
                              hidden_states=tuple(hidden) if hidden is not None else None)

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Token ids must lie in ``[0, vocab_size)`` (a ConfigError naming the first one outside)."""
        vocab = int(self.input_embeddings().num_embeddings)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            from ..errors import ConfigError

            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0]
            raise ConfigError(f"`input_ids` holds the token id {int(bad)}, outside the model's vocabulary "
                              f"(ids 0 to {vocab - 1}); check the tokenizer matches the model")

    def _partial_depth(self, num_layers: int | None) -> int | None:
        """``num_layers`` checked against the model (None when it asks for every layer)."""
        if num_layers is None:
            return None
        if not self.supports_partial_depth:
            raise NotSupportedError(f"{type(self).__name__} does not support partial depth (`num_layers=`)")
        total = int(self.config.num_hidden_layers)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ConfigError(f"`num_layers` must be an int from 1 to {total} (the model's layers); got {num_layers!r}")
        return None if num_layers == total else num_layers

    def new_cache(self, max_length: int = 0) -> Any:
        """An empty cache with room for ``max_length`` positions, at most the model's context
        (``max_position_embeddings``): a huge ``max_new_tokens`` does not allocate for positions the
        model was not made for (the cache still grows, step by step, if generation goes past it)."""
        from .cache import KVCache

        context = self.config.get("max_position_embeddings") or self.config.get("n_positions")
        if isinstance(context, int) and context > 0:
            max_length = min(max_length, context)
        return KVCache(self.config.num_hidden_layers, capacity=max_length)
