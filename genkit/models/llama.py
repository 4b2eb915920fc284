"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, SDPA; Qwen3's
per-head RMSNorm of q and k (``q_norm``/``k_norm``).

Parameter names follow transformers' checkpoints (``model.layers.0.self_attn.q_proj.weight``) so
safetensors files load as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, NotSupportedError, UnsupportedModelError
from .base import GenkitModel, ModelConfig, eager_attention, has_qk_norm, head_dim_of, kv_heads_of
from .cache import KVCache
from .llama_infer import (
    InferencePathModel,
    PreparedModel,
    has_hooks,
    module_path,
    prepare_layers,
    rms_norm,
    run_layers,
)
from .mixin import GenerationMixin
from .numerics import is_llama_numerics
from .paged import PagedKVStore, StepBatch, paged_forward
from .self_speculation import DRAFT_MAX_BYTES, SelfDraft, build_draft, draft_bytes, speculate, take_ahead

logger = logging.getLogger("genkit.models")


def _drop_draft(model_ref: Any, prepared_ref: Any) -> None:
    """Release a model's self-speculation draft once the prepared weights it copies are gone."""
    model = model_ref()
    kept = None if model is None else model.__dict__.get("_self_draft")
    if kept is not None and kept[0] is prepared_ref:
        model.__dict__["_self_draft"] = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_llama_numerics(getattr(self, "numerics", "genkit")):  # genkit.models.quant.set_numerics
            from .block_kernel import rms_norm_llama

            return rms_norm_llama(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's rope settings."""
    theta = float(config.get("rope_theta", 10000.0))
    scaling = config.rope_scaling or config.rope_parameters or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    theta = float(scaling.get("rope_theta", theta)) if scaling else theta
    partial = float(config.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * partial)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_llama = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_llama), 1.0
    raise UnsupportedModelError(
                   f"unsupported rope_scaling type {rope_type!r} in config.json; accepted: default, linear, llama3"
               )


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        bias = bool(config.get("attention_bias", False)) or config.model_type == "qwen2"
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bool(config.get("attention_bias", False)))
        if has_qk_norm(config):  # Qwen3: an RMSNorm over each head of q and k, before the rotary embedding
            eps = float(config.get("rms_norm_eps", 1e-6))
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, attentions: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if "q_norm" in self._modules:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # sin carries rotate_half's sign, so rotate_half(x) * sin == swap_halves(x) * signed sin
        q = q * cos + swap_halves(q) * sin
        k = k * cos + swap_halves(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if attentions is not None:  # output_attentions: the weights, computed step by step
            out, weights = eager_attention(q, k, v, mask)
            attentions.append(weights)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(config.get("mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, attentions: list[torch.Tensor] | None = None) -> torch.Tensor:
        if attentions is not None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, attentions)
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaInner(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)))


def build_attention_mask(attention_mask: torch.Tensor | None, q_len: int, past_len: int,
                         device: torch.device, window: int | None = None,
                         dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Boolean SDPA mask ``(batch, 1, q_len, past_len + q_len)``, or None when causal alone will do.

    ``window``: sliding-window attention (Mistral, Qwen2, Qwen3), a query sees only the ``window`` most
    recent positions, itself included. A query position whose every key is padding may still
    attend to itself, so padded rows never produce NaN (their outputs are never read).

    A 4-D ``attention_mask`` is the pattern itself, as in transformers, used as given (boolean:
    True attends; float: added to the scores, 0 attends and a large negative value masks; cast to
    ``dtype``): its shape must be ``(batch, 1 or heads, q_len, past_len + q_len)``.
    """
    kv_len = past_len + q_len
    if attention_mask is not None and attention_mask.dim() == 4:
        return _custom_mask(attention_mask, q_len, kv_len, device, dtype)
    no_padding = attention_mask is None or bool(attention_mask.all())
    if window is not None and kv_len <= window:
        window = None  # the window covers everything
    if no_padding and window is None and (q_len == 1 or past_len == 0):
        return None  # decode step, or plain causal prefill
    q_pos = torch.arange(past_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos  # (q, k)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    if no_padding:
        return allowed[None, None]
    assert attention_mask is not None
    am = attention_mask[:, -kv_len:].to(device=device, dtype=torch.bool)
    mask = (allowed[None] & am[:, None, :]) | (k_pos == q_pos)[None]  # (b, q, k)
    return mask[:, None]


def _custom_mask(mask: torch.Tensor, q_len: int, kv_len: int, device: torch.device,
                 dtype: torch.dtype | None) -> torch.Tensor:
    """A caller's 4-D attention mask, checked against the query and key lengths."""
    if tuple(mask.shape[-2:]) != (q_len, kv_len):
        raise ConfigError(f"a 4-D `attention_mask` must be (batch, 1, query length, key length) = "
                          f"(batch, 1, {q_len}, {kv_len}) here; got {tuple(mask.shape)}")
    mask = mask.to(device)
    if mask.dtype != torch.bool and dtype is not None:
        mask = mask.to(dtype)
    return mask


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding-window size (None: full attention), read as transformers reads it."""
    n = config.num_hidden_layers
    window = config.sliding_window
    if config.model_type == "mistral" and "sliding_window" not in config.to_dict():
        window = 4096  # MistralConfig's default when config.json does not name one
    if config.model_type in ("qwen2", "qwen3") and not config.use_sliding_window:
        window = None  # Qwen2Config's and Qwen3Config's use_sliding_window defaults to False
    if not window:
        return [None] * n
    if config.layer_types:
        return [int(window) if kind == "sliding_attention" else None for kind in config.layer_types]
    if config.model_type in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", 28))
        return [int(window) if i >= first else None for i in range(n)]
    return [int(window)] * n


def _implied(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, past_len: int) -> bool:
    """Whether a decode step's mask and positions are the ones a cache of ``past_len`` positions
    implies: no mask or one of all ones, no positions or ``past_len`` in every row."""
    if attention_mask is not None and (attention_mask.shape != (rows, past_len + 1) or not bool(attention_mask.all())):
        return False
    return position_ids is None or (position_ids.numel() == rows and bool((position_ids == past_len).all()))


class LlamaForCausalLM(InferencePathModel, GenerationMixin):
    """A Llama-family causal LM with transformers' calling convention (``GenerationMixin`` among its
    direct bases, as transformers requires of its generative classes). Its layers run on the
    inference path (:class:`~genkit.models.llama_infer.InferencePathModel`; ``cpu_weight_packing``)."""

    #: greedy steps of a float32 model on the dense one-call decoder draft tokens with an 8-bit copy of
    #: the model and check them in one step (genkit.models.self_speculation; the same tokens, bit for
    #: bit): None does so where the copy stays under 2 GiB (about 2B parameters) and a round is measured
    #: faster than one token per step (long contexts may not be), True always, False never (one token
    #: per step)
    self_speculation: bool | None = None
    supports_partial_depth = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaInner(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim_of(config))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.windows = layer_windows(config)
        self._prepared = None

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head when the config says so."""
        if self.config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute the non-persistent rope buffer (after building the model on the meta device)."""
        inv_freq, self.attention_scaling = rope_inv_freq(self.config, head_dim_of(self.config))
        self.inv_freq = inv_freq.to(self.device)
        self._rope_cache = None

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def _rope_table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed-sin tables for positions ``0..n-1`` (grown by doubling, cached)."""
        table = getattr(self, "_rope_cache", None)
        if (table is None or table[0].shape[0] < n or table[0].dtype != dtype or table[0].device != self.inv_freq.device
                or (table[0].is_inference() and not torch.is_inference_mode_enabled())):  # built by generate()
            size = max(n, 2 * table[0].shape[0] if table is not None else 0, 256)
            if is_llama_numerics(getattr(self, "numerics", "genkit")):  # genkit.models.quant.set_numerics
                from .block_kernel import rope_table_llama

                cos, sin = rope_table_llama(float(self.config.get("rope_theta", 10000.0)),
                                            2 * self.inv_freq.shape[0], size)
                table = (cos.to(dtype), sin.to(dtype))
            else:
                pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
                freqs = pos[:, None] * self.inv_freq[None, :]
                cos = (torch.cat((freqs, freqs), dim=-1).cos() * self.attention_scaling).to(dtype)
                s = freqs.sin() * self.attention_scaling
                sin = torch.cat((-s, s), dim=-1).to(dtype)  # rotate_half(x) * sin == roll(x) * signed sin
                table = (cos, sin)
            self._rope_cache = table
        return table

    def rope(self, position_ids: torch.Tensor | None, dtype: torch.dtype, start: int = 0, length: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin shaped to broadcast over ``(batch, heads, seq, head_dim)``."""
        if position_ids is None:
            cos, sin = self._rope_table(start + length, dtype)
            return cos[start:start + length], sin[start:start + length]
        cos, sin = self._rope_table(int(position_ids.max()) + 1, dtype)
        return cos[position_ids][:, None], sin[position_ids][:, None]

    def _path_modules(self) -> list[nn.Module]:
        return [self.model.layers, self.lm_head]

    def _prepare(self) -> PreparedModel | None:
        return prepare_layers(self.model.layers, self.windows, self.lm_head, self.cpu_weight_packing)

    # -- the paged forward (continuous batching; genkit.protocols.PagedLM) ---------------------------
    def paged_unsupported(self) -> str | None:
        """Why this model cannot run the paged forward now (None: it can)."""
        if any(w is not None for w in self.windows):
            return "continuous batching does not support sliding-window attention yet"
        if self.attn_implementation != "sdpa":
            return (f"continuous batching runs SDPA attention; this model is set to attn_implementation="
                    f"{self.attn_implementation!r} (model.set_attn_implementation('sdpa'))")
        if self._inference_weights(None, 0) is None:
            return ("continuous batching needs the model's inference path (no forward hooks, no replaced "
                    "submodules)")
        return None

    def new_paged_store(self, *, block_size: int, num_blocks: int) -> PagedKVStore:
        """An empty paged K/V store for this model, holding its prepared inference weights."""
        reason = self.paged_unsupported()
        if reason is not None:
            raise NotSupportedError(reason)
        cfg = self.config
        return PagedKVStore(cfg.num_hidden_layers, kv_heads_of(cfg), head_dim_of(cfg), block_size=block_size,
                            num_blocks=num_blocks, dtype=self.dtype, device=self.device,
                            prepared=self._inference_weights(None, 0))

    def forward_paged(self, batch: StepBatch, store: PagedKVStore, greedy: bool = False) -> torch.Tensor:
        """One continuous-batching step (:func:`genkit.models.paged.paged_forward`): the logits
        ``(k, vocab)`` of the requests in ``batch`` that want them; with ``greedy``, their greedy
        tokens ``(k,)`` (int64) where the step runs in one kernel call."""
        return paged_forward(self, store, batch, greedy)

    def __getstate__(self) -> dict[str, Any]:
        # the self-speculation draft copies the prepared weights: rebuilt on first use, as they are
        return {**super().__getstate__(), "_self_draft": None}

    def one_call_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, cache: Any, logits_to_keep: int | torch.Tensor
                      ) -> torch.Tensor | None:
        """A decode step on the block kernel's one-call decoder with the embedding, the final norm
        and the LM head in the same call (:meth:`BlockDecoder.logits`): between two calls of a
        step's kernel the CPU caches are cold, and the small torch operations around the layers
        cost several times what they cost warm. Only where the usual path would compute the same
        step: every row one token at the cache's length, positions and mask implied by it."""
        if not isinstance(logits_to_keep, int):
            return None
        return self._one_call("logits", input_ids, attention_mask, position_ids, cache)

    def greedy_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor | None:
        """:meth:`one_call_step`'s step giving each row's greedy token ``(rows,)`` (the argmax of
        the logits :meth:`forward` would give) instead of the logits
        (:meth:`~genkit.models.block_decode.BlockDecoder.argmax`: a float32 head is read through an
        8-bit copy, and only the logits that can be the largest are computed exactly); None where
        that step does not apply, or where calling the model would run more than
        :meth:`GenkitModel.forward` (a forward hook or pre-hook on it or global, a ``forward`` of a
        subclass or of the instance: they may change the logits)."""
        if not self._forward_as_is():
            return None
        if self.self_speculation is not False:
            token = self._speculative(input_ids, attention_mask, position_ids, cache)
            if token is not None:
                return token
        return self._one_call("argmax", input_ids, attention_mask, position_ids, cache)

    def _speculative(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor | None:
        """:meth:`greedy_step` by exact self-speculation (:mod:`genkit.models.self_speculation`): the
        token computed ahead, or a round of drafts checked in one step; None where that does not
        apply (batch 1, a float32 model on the dense one-call decoder, as :meth:`one_call_step`)."""
        if self.self_speculation not in (None, True):
            raise ConfigError(f"`self_speculation` must be None, True or False; got {self.self_speculation!r}")
        prepared = self._step_prepared(input_ids, attention_mask, position_ids, cache) if input_ids.shape[0] == 1 else None
        decoder = None if prepared is None else prepared.decoder
        if decoder is None or not decoder.dense:
            if self.self_speculation and prepared is not None and not self.__dict__.get("_speculation_warned"):
                self.__dict__["_speculation_warned"] = True  # (said once per model)
                logger.warning("self_speculation=True: this model's decode steps do not run on the float32 one-call "
                               "decoder (%s), so greedy search takes one token per step",
                               "a float32 model on the kernel choice's 'gemv' route: GENKIT_KERNEL=decode:gemv")
            return None
        token = int(input_ids[0, 0])
        known = take_ahead(cache, token, id(decoder))
        draft = self._draft_for(prepared)
        if known is not None:
            if draft is not None:
                draft.stats.answered_ahead += 1
            return torch.tensor([known])
        ends = self.kernel_ends(prepared)
        if ends is None or draft is None:
            return None
        out = speculate(draft, decoder, ends, lambda start, n: self.rope(None, torch.float32, start, n), token, cache,
                        always=self.self_speculation is True)
        return None if out is None else torch.tensor([out])

    def _draft_for(self, prepared: PreparedModel) -> SelfDraft | None:
        """The 8-bit draft of ``prepared`` (made at its first speculative step, kept while it is the
        model's prepared weights), or None where it cannot be made."""
        kept = self.__dict__.get("_self_draft")
        if kept is not None and kept[0]() is prepared and (kept[1] is not None or kept[2] == self.self_speculation):
            return kept[1]  # type: ignore[no-any-return]
        self.__dict__["_self_draft"] = None  # the old draft goes first
        head = prepared.for_rows(1)[1]
        head = self.lm_head.weight if head is None else head
        draft = None
        if self.self_speculation or draft_bytes(prepared, head) <= DRAFT_MAX_BYTES:
            try:
                draft = build_draft(prepared, self.model.embed_tokens, self.model.norm, head)
            except (RuntimeError, MemoryError) as exc:  # (torch's out-of-memory error is a RuntimeError)
                logger.warning("no 8-bit draft for self-speculative greedy steps (%s): one token per step", exc)
        self.__dict__["_self_draft"] = (weakref.ref(prepared, functools.partial(_drop_draft, weakref.ref(self))), draft,
                                        self.self_speculation)
        return draft

    @property
    def speculation_stats(self) -> dict[str, int] | None:
        """What self-speculative greedy steps did on the current prepared weights (checks run, tokens
        drafted, drafts kept, tokens answered from what was computed ahead), or None before any."""
        kept = self.__dict__.get("_self_draft")
        return None if kept is None or kept[1] is None else dataclasses.asdict(kept[1].stats)

    def top_logits_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, cache: Any, k: int) -> torch.Tensor | None:
        """:meth:`one_call_step`'s step for a filter to the ``k`` largest logits
        (:meth:`~genkit.models.block_decode.BlockDecoder.top`: exact where an entry can be among them,
        -inf elsewhere; a float32 head read through its 8-bit copy); None as for :meth:`greedy_step`."""
        if not self._forward_as_is():
            return None
        return self._one_call("top", input_ids, attention_mask, position_ids, cache, k)

    def _forward_as_is(self) -> bool:
        """Whether calling the model runs :meth:`GenkitModel.forward` and nothing else: no forward hook
        or pre-hook on it or global, no ``forward`` of a subclass or of the instance (they may change
        the logits a step gives)."""
        return "forward" not in self.__dict__ and type(self).forward is GenkitModel.forward and not has_hooks([self])

    def _one_call(self, what: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None, cache: Any, *extra: Any) -> torch.Tensor | None:
        """The one-call decoder's ``what`` (:meth:`BlockDecoder.logits`, :meth:`BlockDecoder.argmax`,
        :meth:`BlockDecoder.top` with ``extra``) for a decode step where the usual path would compute
        the same step (see :meth:`one_call_step`), else None."""
        prepared = self._step_prepared(input_ids, attention_mask, position_ids, cache)
        ends = None if prepared is None else self.kernel_ends(prepared)
        if prepared is None or ends is None:
            return None
        cos, sin = self.rope(None, torch.float32, cache.get_seq_length(), 1)
        return getattr(prepared.decoder, what)(input_ids, cos, sin, cache, ends, *extra)  # type: ignore[no-any-return]

    def _step_prepared(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, cache: Any) -> PreparedModel | None:
        """The prepared weights a one-call decode step of ``input_ids`` runs on, or None where the usual
        path would compute another step (see :meth:`one_call_step`), the cache did not start on this
        model or runs the modules."""
        if (input_ids.dim() != 2 or input_ids.shape[1] != 1 or type(cache) is not KVCache
                or self.attn_implementation == "eager" or module_path()):
            return None
        past_len = cache.get_seq_length()
        if past_len == 0 or not _implied(attention_mask, position_ids, input_ids.shape[0], past_len):
            return None
        return self._weights_on(cache)[1]

    def kernel_ends(self, prepared: PreparedModel) -> Any:
        """The embedding, final norm and LM head as ``prepared``'s one-call decoder (a
        :class:`~genkit.models.block_decode.BlockDecoder`) runs them in its calls, or None when there
        is none or they must run as modules (:meth:`BlockDecoder.step_ends`; a final norm of another
        kind)."""
        norm, decoder = self.model.norm, prepared.decoder
        if decoder is None or type(norm) is not RMSNorm:
            return None
        return decoder.step_ends(self.model.embed_tokens, norm, self.lm_head, prepared.for_rows(1)[1])

    def input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def decoder(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cache: KVCache | None, past_len: int, hidden: list[torch.Tensor] | None,
                attentions: list[torch.Tensor] | None = None, num_layers: int | None = None) -> torch.Tensor:
        t = x.shape[1]
        cos, sin = self.rope(position_ids, x.dtype, past_len, t)
        masks = {w: build_attention_mask(attention_mask, t, past_len, x.device, w, x.dtype) for w in set(self.windows)}
        prepared = self.inference_path(cache, past_len, attentions)
        if prepared is not None:
            x = run_layers(prepared, x, cos, sin, masks, cache, hidden, num_layers)
        else:
            if is_llama_numerics(getattr(self, "numerics", "genkit")):  # the modules compute genkit's operations
                from .block_decode import UNSUPPORTED

                why = ("autograd is on: call it under torch.no_grad() or torch.inference_mode()"
                       if torch.is_grad_enabled() else "attentions asked for" if attentions is not None
                       else "torch.compile" if torch.compiler.is_compiling() else "a layer replaced or hooked")
                raise NotSupportedError(f"{UNSUPPORTED}; this call would run the model's modules ({why})")
            layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
            for layer, window in zip(layers, self.windows):
                if hidden is not None:
                    hidden.append(x)
                if attentions is not None:
                    x = layer(x, cos, sin, masks[window], cache, attentions)
                else:
                    x = layer(x, cos, sin, masks[window], cache)
        return self.model.norm(x)
