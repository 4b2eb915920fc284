"""What every native model shares: its config object, its output type and the base class."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, NotSupportedError
from .hf_api import PreTrainedAPI
from .mixin import GenerationMixin
from .outputs import CausalLMOutput

# sub-configs of transformers' composite configs: code written for transformers tells a composite
# config by `hasattr(config, "text_config")`, so absent ones are no attribute (not None)
_SUB_CONFIGS = frozenset({"text_config", "vision_config", "audio_config"})
# transformers' PretrainedConfig defaults of fields a config.json leaves out, read by code written for
# transformers (`if model.config.is_encoder_decoder is False`, `return_dict=config.use_return_dict`)
_PRETRAINED_DEFAULTS = {"is_encoder_decoder": False, "return_dict": True, "output_attentions": False,
                        "output_hidden_states": False}


class ModelConfig:
    """A model's ``config.json`` as attributes (the fields transformers' configs use). A field may
    not have the name of a method or attribute (``{"get": 5}`` would replace the method every reader
    of the config calls): a ``ConfigError`` naming it (:func:`shadowing_fields`)."""

    def __init__(self, **kwargs: Any) -> None:
        shadowing = _shadowing(kwargs)
        if shadowing:
            raise ConfigError(f"{', '.join(map(repr, shadowing))} cannot be a config field (the name of a "
                              "ModelConfig method or attribute)")
        self.__dict__.update(kwargs)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key in _SUB_CONFIGS:
            raise AttributeError(key)
        if key in _PRETRAINED_DEFAULTS:
            return _PRETRAINED_DEFAULTS[key]
        if key == "use_return_dict":  # transformers' property
            return self.return_dict
        if key == "torch_dtype":  # transformers' older name of `dtype`
            return self.__dict__.get("dtype")
        if key == "_name_or_path":  # where it was loaded from (transformers' name)
            return self.__dict__.get("name_or_path") or ""
        return None  # absent fields read as None, like optional fields of transformers' configs

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> ModelConfig:
        """The config of the text model (transformers' ``PretrainedConfig.get_text_config``): its
        ``text_config`` when it has one, else this config."""
        sub = self.__dict__.get("text_config")
        return ModelConfig(**sub) if isinstance(sub, dict) else self

    def get(self, key: str, default: Any = None) -> Any:
        value = self.__dict__.get(key, default)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to_diff_dict(self) -> dict[str, Any]:
        """The fields (transformers' name; a genkit config holds only the fields it was given)."""
        return self.to_dict()

    def json_fields(self) -> dict[str, Any]:
        """The fields a ``config.json`` holds: a dtype by its name, without where it was loaded from."""
        return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
                for k, v in self.__dict__.items() if k not in ("name_or_path", "_name_or_path")}

    def to_json_string(self, use_diff: bool = True) -> str:
        """The fields as JSON, as transformers writes a config (:meth:`json_fields`)."""
        return json.dumps(self.json_fields(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike[str], use_diff: bool = True) -> None:
        """:meth:`to_json_string` written atomically (``genkit.fileutil.atomic_path``)."""
        from ..fileutil import atomic_path

        with atomic_path(json_file_path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            fh.write(self.to_json_string(use_diff))

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> None:
        """``config.json`` in ``save_directory`` (created when missing), as transformers' method does."""
        os.makedirs(save_directory, exist_ok=True)
        self.to_json_file(os.path.join(save_directory, "config.json"))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> ModelConfig:
        with open(path, encoding="utf-8") as fh:
            return cls(**json.load(fh))

    def __repr__(self) -> str:
        return f"ModelConfig({json.dumps(self.__dict__, default=str, sort_keys=True)})"


#: Qwen3Config's ``head_dim`` when a config.json leaves it out (not ``hidden_size // num_attention_heads``)
QWEN3_HEAD_DIM = 128


def head_dim_of(config: Any) -> int:
    """The attention head size of a Llama-family config (a :class:`ModelConfig` or a dict) as
    transformers reads it: ``head_dim`` when set; else Qwen3's default (:data:`QWEN3_HEAD_DIM`); else
    ``hidden_size // num_attention_heads``."""
    explicit = config.get("head_dim")
    if explicit:
        return int(explicit)
    if config.get("model_type") == "qwen3":
        return QWEN3_HEAD_DIM
    return int(config.get("hidden_size")) // int(config.get("num_attention_heads"))


def kv_heads_of(config: Any) -> int:
    """The key/value heads of a Llama-family config: ``num_key_value_heads``, or
    ``num_attention_heads`` when config.json leaves it out (transformers' default: no GQA)."""
    return int(config.get("num_key_value_heads") or config.get("num_attention_heads"))


def has_qk_norm(config: Any) -> bool:
    """Whether the config's attention normalises each head of q and k (Qwen3's ``q_norm``/``k_norm``,
    an RMSNorm over ``head_dim`` after the projections, before the rotary embedding)."""
    return config.get("model_type") == "qwen3"


def shadowing_fields(data: dict[str, Any]) -> list[str]:
    """The fields of a config's ``data`` that :class:`ModelConfig` refuses (the name of one of its
    methods or attributes), its ``text_config``'s included (as ``text_config.<name>``: the config
    ``get_text_config()`` builds)."""
    sub = data.get("text_config")
    nested = [f"text_config.{key}" for key in _shadowing(sub)] if isinstance(sub, dict) else []
    return sorted(_shadowing(data) + nested)


def _shadowing(fields: dict[str, Any]) -> list[str]:
    """The names among ``fields`` that name a :class:`ModelConfig` method or attribute, sorted."""
    return sorted(key for key in fields if hasattr(ModelConfig, key))


def positions_from_mask(attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """Position ids of the last ``q_len`` tokens of a left-padded batch (None when nothing is padded)."""
    if attention_mask is None or attention_mask.dim() == 4 or bool(attention_mask.all()):
        return None  # a 4-D mask is the attention pattern itself: positions count from the cache
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)[:, -q_len:]


def _kept(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of ``x`` (batch, seq, hidden) whose logits a forward returns: the last
    ``logits_to_keep`` (all for 0), or those a tensor of indices names."""
    if isinstance(logits_to_keep, int):
        return x[:, -logits_to_keep:] if logits_to_keep > 0 else x
    return x[:, logits_to_keep]


def _output(out: CausalLMOutput, return_dict: bool | None) -> Any:
    """A forward's output as asked: the output, or its tuple with ``return_dict=False``."""
    return out.to_tuple() if return_dict is False else out


def _refuse_forward_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments ``forward`` does not take, by name (none is silently ignored)."""
    unknown = sorted(kwargs)
    if unknown:
        raise ConfigError(f"unknown keyword argument(s) {', '.join(repr(k) for k in unknown)} for the model's forward; "
                          "accepted: input_ids, attention_mask, position_ids, past_key_values (or cache), cache_position, "
                          "use_cache, output_hidden_states, output_attentions, logits_to_keep, inputs_embeds, labels, "
                          "num_items_in_batch, return_dict, num_layers")


def cache_arguments(past_key_values: Any, cache: Any, cache_position: torch.Tensor | None, use_cache: bool | None,
                    config: ModelConfig, inputs: torch.Tensor | None) -> tuple[Any, bool]:
    """A forward's cache and ``use_cache`` as transformers' arguments give them: the cache as
    ``past_key_values`` or under transformers 5.24's name ``cache`` (not both); ``use_cache=None``
    the config's (True when unset); ``cache_position`` checked (:func:`check_cache_position`)."""
    if cache is not None:
        if past_key_values is not None:
            raise ConfigError("pass `cache` or `past_key_values` (its old name), not both")
        past_key_values = cache
    if use_cache is None:
        use_cache = config.use_cache is not False
    if cache_position is not None:
        check_cache_position(cache_position, past_key_values, inputs)
    return past_key_values, use_cache


def check_cache_position(cache_position: torch.Tensor, cache: Any, inputs: torch.Tensor | None) -> None:
    """``cache_position`` must be the positions of ``inputs`` (ids or embeddings) after the ones
    ``cache`` holds: genkit writes the new keys and values at the end of the cache, whatever it
    says (a ConfigError else)."""
    from .cache import native_cache

    if inputs is None:
        return  # no input: the forward refuses the call itself
    layers_cache = native_cache(cache)
    past = layers_cache.get_seq_length() if layers_cache is not None else 0
    new = int(inputs.shape[1])
    want = torch.arange(past, past + new)
    if not isinstance(cache_position, torch.Tensor) or not torch.equal(cache_position.reshape(-1).cpu(), want):
        got = cache_position.tolist() if isinstance(cache_position, torch.Tensor) else cache_position
        raise ConfigError(f"`cache_position` must be the positions after the cache's, torch.arange({past}, "
                          f"{past + new}) here (genkit writes new keys and values at the end of the cache); got {got}")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None,
                   ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal-LM loss: the logits at position ``i`` predict ``labels[i + 1]`` (cross
    entropy in float32), positions labelled ``ignore_index`` left out; the mean over the counted
    positions, or the sum over ``num_items_in_batch`` when given (gradient accumulation)."""
    if labels.shape != logits.shape[:-1]:
        raise ConfigError(f"`labels` must have the shape of `input_ids` {tuple(logits.shape[:-1])} (with "
                          f"logits_to_keep=0); got {tuple(labels.shape)}")
    labels = F.pad(labels.to(logits.device), (0, 1), value=ignore_index)[..., 1:]
    source = logits.float().reshape(-1, logits.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(source, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)``, its weight left as it is on the meta device:
    loaders build models there and copy the file's weights in, and torch's ``normal_`` on a meta
    tensor imports ``torch._dynamo`` (about 1 s of a fresh process's first ``load_model``) to draw
    nothing. A plain ``nn.Embedding`` either way (the one-call decoder takes that type only)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed step by step, as transformers' eager implementation does, for the
    attention weights (``output_attentions=True``): ``(output, weights)``, the weights
    ``(batch, heads, query, key)``. ``mask`` as for SDPA (boolean: True attends; float: added);
    None is causal, the queries being the last positions of the keys."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    t, n = q.shape[2], k.shape[2]
    if mask is None and t > 1:
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - t, n, device=q.device)[:, None]
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v), weights


class GenkitModel(PreTrainedAPI, nn.Module, GenerationMixin):
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

    def get_decoder(self) -> DecoderStack:
        """The decoder without the LM head, as transformers' ``get_decoder()`` gives it (its base
        model, ``LlamaModel``...): :class:`DecoderStack`."""
        return DecoderStack(self)

    def input_embeddings(self) -> nn.Module:
        """The token embedding module."""
        raise NotImplementedError

    def decoder(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cache: Any, past_len: int, hidden: list[torch.Tensor] | None,
                attentions: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run the decoder stack on embeddings ``x`` (appending each layer's input to ``hidden``, and
        its attention weights to ``attentions`` when that is a list) and return the final-normed
        hidden state."""
        raise NotImplementedError

    def one_call_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, cache: Any, logits_to_keep: int | torch.Tensor
                      ) -> torch.Tensor | None:
        """The logits of a decode step (one new token per row, on a cache) computed in one kernel
        call, embedding to LM head, or None: :meth:`forward` takes its usual path. None here; a
        model with such a kernel overrides it (:class:`~genkit.models.llama.LlamaForCausalLM`)."""
        return None

    def greedy_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor | None:
        """Each row's greedy token ``(rows,)`` after a decode step of one new token per row on a
        cache: the first maximum of the logits :meth:`forward` would give for the same arguments,
        computed without them where a model can (the cache advances as in :meth:`forward`); or None,
        with nothing done: the caller runs :meth:`forward`. None here; a model with such a kernel
        overrides it (:class:`~genkit.models.one_call.OneCallModel`: the Llama family, GPT-2). Greedy
        search asks for it when nothing else reads the step's scores
        (:meth:`genkit.strategy.Stepper.forward_greedy`)."""
        return None

    def top_logits_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, cache: Any, k: int) -> torch.Tensor | None:
        """:meth:`greedy_step` for a filter to the ``k`` largest logits (top-k sampling): the step's
        logits ``(rows, 1, vocab)`` float32, equal to :meth:`forward`'s at every entry that can be
        among the ``k`` largest (ties included; room left for a temperature's rounding) and -inf
        elsewhere, where a model can compute fewer than all of them; or None, with nothing done.
        Sampling asks for it when its processors begin with such a filter (after a temperature), so that
        what they give is the same (:meth:`genkit.strategy.Stepper.forward_top`). None here."""
        return None

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
        use_cache: bool | None = True,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_dict: bool | None = None,
        num_layers: int | None = None,
        cache: Any = None,
        cache_position: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' calling convention (see docs/models.md, "The model protocol").

        ``cache`` (transformers 5.24's ``past_key_values``), ``cache_position``, ``use_cache=None``:
        as transformers reads them (:func:`cache_arguments`).
        ``labels``: the loss as transformers computes it (:func:`causal_lm_loss`) in ``.loss``.
        ``output_attentions``: every layer's attention weights in ``.attentions`` (the layers then
        run as modules, with attention computed step by step). ``return_dict=False`` returns
        :meth:`~genkit.models.outputs.ModelOutput.to_tuple`. ``num_layers`` (models with
        :attr:`supports_partial_depth`): run only the first that many decoder layers; the logits
        are the final norm and LM head on their output."""
        if kwargs:
            _refuse_forward_kwargs(kwargs)
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        past_key_values, use_cache = cache_arguments(past_key_values, cache, cache_position, use_cache, self.config, inputs)
        depth = self._partial_depth(num_layers)
        if (past_key_values is not None and use_cache and input_ids is not None and inputs_embeds is None
                and labels is None and depth is None and not output_hidden_states and not output_attentions):
            logits = self.one_call_step(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)
            if logits is not None:
                return _output(CausalLMOutput(logits=logits, past_key_values=past_key_values), return_dict)
        inputs_embeds = self._embed(input_ids, inputs_embeds, past_key_values)
        past_key_values, layers_cache, past_len = self._caches(past_key_values, use_cache)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, inputs_embeds.shape[1])
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        extra: dict[str, Any] = {} if depth is None else {"num_layers": depth}
        if output_attentions or self.attn_implementation == "eager":  # eager: the layers compute the weights
            extra["attentions"] = []
        x = self.decoder(inputs_embeds, attention_mask, position_ids, layers_cache, past_len, hidden, **extra)
        if hidden is not None:
            hidden.append(x)
        logits = self.output_logits(_kept(x, logits_to_keep), layers_cache)
        out = CausalLMOutput(
            loss=None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch),
            logits=logits, past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(extra["attentions"]) if output_attentions else None)
        return _output(out, return_dict)

    def _caches(self, past_key_values: Any, use_cache: bool) -> tuple[Any, Any, int]:
        """The forward's cache (a new one when it needs one and has none), the cache its layers
        write (:func:`~genkit.models.cache.native_cache`) and the positions it holds."""
        from .cache import native_cache

        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        layers_cache = native_cache(past_key_values)
        return past_key_values, layers_cache, layers_cache.get_seq_length() if layers_cache is not None else 0

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """``inputs_embeds``, or the embeddings of ``input_ids`` (checked against the vocabulary)."""
        if inputs_embeds is not None:
            return inputs_embeds
        if input_ids is None:
            raise ConfigError("pass `input_ids` or `inputs_embeds`")
        if input_ids.shape[-1] != 1 or cache is None:  # a prompt (decode steps feed sampled ids)
            self._check_token_ids(input_ids)
        return self.input_embeddings()(input_ids)  # type: ignore[no-any-return]

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Token ids must lie in ``[0, vocab_size)`` (a ConfigError naming the first one outside)."""
        vocab = int(self.input_embeddings().num_embeddings)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            from ..config.checks import outside_vocabulary
            from ..errors import ConfigError

            bad = sorted({int(i) for i in input_ids[(input_ids < 0) | (input_ids >= vocab)].tolist()})
            raise ConfigError(outside_vocabulary("input_ids", bad, vocab) + "; check the tokenizer matches the model")

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

        context = self.config.get("max_position_embeddings")  # (GPT-2 reads its n_positions as this name)
        if isinstance(context, int) and context > 0:
            max_length = min(max_length, context)
        return KVCache(self.config.num_hidden_layers, capacity=max_length)


class DecoderStack(nn.Module):
    """A model's decoder without its LM head (``model.get_decoder()``), called as transformers'
    base model: the model's forward (same arguments: ``input_ids`` or ``inputs_embeds``, the mask,
    positions, the cache) returning a ``BaseModelOutputWithPast`` whose ``last_hidden_state`` is the
    final norm's output. It holds the model (its parameters are the model's, the head's included).
    ``output``: the output class (genkit's :class:`~genkit.models.outputs.BaseModelOutputWithPast`
    by default; the transformers view passes transformers' own), whose cache field ``cache_field``
    names, read from the forward's output under the same name."""

    def __init__(self, model: nn.Module, output: type | None = None, cache_field: str = "past_key_values") -> None:
        super().__init__()
        from .outputs import BaseModelOutputWithPast

        self.model = model
        self._output, self._cache_field = output or BaseModelOutputWithPast, cache_field

    @property
    def device(self) -> torch.device:
        """The model's device (as a transformers base model's ``device``)."""
        return self.model.device  # type: ignore[no-any-return]

    @property
    def dtype(self) -> torch.dtype:
        """The model's float dtype (as a transformers base model's ``dtype``)."""
        return self.model.dtype  # type: ignore[no-any-return]

    def forward(self, *args: Any, output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> Any:
        kwargs.pop("logits_to_keep", None)
        out = self.model(*args, output_hidden_states=True, logits_to_keep=1, **kwargs)
        result = self._output(last_hidden_state=out.hidden_states[-1],
                              hidden_states=out.hidden_states if output_hidden_states else None,
                              attentions=out.attentions, **{self._cache_field: getattr(out, self._cache_field)})
        return result.to_tuple() if return_dict is False else result
