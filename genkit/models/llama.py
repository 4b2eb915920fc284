"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, SDPA; Qwen3's
per-head RMSNorm of q and k (``q_norm``/``k_norm``).

Parameter names follow transformers' checkpoints (``model.layers.0.self_attn.q_proj.weight``) so
safetensors files load as they are.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, NotSupportedError, UnsupportedModelError
from .base import ModelConfig, eager_attention, embedding, has_qk_norm, head_dim_of, kv_heads_of
from .cache import KVCache
from .llama_infer import PreparedModel, prepare_layers, rms_norm, run_layers
from .mixin import GenerationMixin
from .numerics import is_llama_numerics
from .one_call import OneCallModel
from .paged import PagedModel

logger = logging.getLogger("genkit.models")


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
    """Inverse frequencies and attention scaling for the config's rope settings, on the default device.
    (Computed on the CPU, then moved: on the meta device loaders build on, the ops would import
    torch._dynamo.)"""
    inv, scaling = _rope_inv_freq_cpu(config, head_dim)
    return inv.to(torch.get_default_device()), scaling


def _rope_inv_freq_cpu(config: ModelConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    theta = float(config.get("rope_theta", 10000.0))
    scaling = config.rope_scaling or config.rope_parameters or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    theta = float(scaling.get("rope_theta", theta)) if scaling else theta
    dim = head_dim  # (rope turns every dimension of a head: transformers' Llama family ignores partial_rotary_factor)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
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
    if attention_mask.shape[-1] < kv_len:
        raise ConfigError(f"a 2-D `attention_mask` must have a column for each key: the cache's {past_len} positions "
                          f"and the {q_len} new ones ({kv_len}) here; got {attention_mask.shape[-1]}")
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


class LlamaForCausalLM(OneCallModel, PagedModel, GenerationMixin):
    """A Llama-family causal LM with transformers' calling convention (``GenerationMixin`` among its
    direct bases, as transformers requires of its generative classes). Its layers run on the
    inference path (:class:`~genkit.models.llama_infer.InferencePathModel`; ``cpu_weight_packing``),
    its decode steps in one kernel call where they can (:class:`~genkit.models.one_call.OneCallModel`;
    ``self_speculation``)."""

    supports_partial_depth = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaInner(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim_of(config))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        partial = config.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            logger.warning("`partial_rotary_factor`=%s is ignored, as transformers' %s ignores it: rope turns every "
                           "dimension of each head", partial, (config.architectures or ["LlamaForCausalLM"])[0])
        self.windows = layer_windows(config)
        self._prepared = None

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head when the config says so."""
        # (a quantized head runs on its own codes: its read-only ``weight`` is a de-quantized copy, quant_weight)
        if self.config.get("tie_word_embeddings", self.ties_embeddings_by_default) and type(self.lm_head) is nn.Linear:
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

    # -- the paged forward (continuous batching; genkit.protocols.PagedLM; genkit.models.paged.PagedModel) ----
    def paged_unsupported(self) -> str | None:
        """Why this model cannot run the paged forward now (None: it can)."""
        if any(w is not None for w in self.windows):
            return "continuous batching does not support sliding-window attention yet"
        return super().paged_unsupported()

    def paged_inputs(self, ids: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = self.model.embed_tokens(ids)
        cos, sin = self._rope_table(int(positions.max()) + 1, x.dtype)
        return x, cos[positions], sin[positions]

    def final_norm(self) -> nn.Module:
        return self.model.norm

    def _end_modules(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module | None] | None:
        norm = self.model.norm
        return (self.model.embed_tokens, norm, self.lm_head, None) if type(norm) is RMSNorm else None

    def _rotary(self, start: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.rope(None, torch.float32, start, n)

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
