"""The Llama family (Llama 1-3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE, GQA, SwiGLU, SDPA.

Parameter names follow transformers' checkpoints (``model.layers.0.self_attn.q_proj.weight``) so
safetensors files load as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLMOutput, GenkitModel, ModelConfig
from .cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r} in config.json; accepted: default, linear, llama3"
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim", config.hidden_size // self.num_heads)
        bias = bool(config.get("attention_bias", False)) or config.model_type == "qwen2"
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bool(config.get("attention_bias", False)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        is_causal = mask is None and t > 1
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
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
                cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaInner(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, float(config.get("rms_norm_eps", 1e-6)))


def build_attention_mask(attention_mask: torch.Tensor | None, q_len: int, past_len: int,
                         device: torch.device) -> torch.Tensor | None:
    """Boolean SDPA mask ``(batch, 1, q_len, past_len + q_len)``, or None when causal alone will do.

    A query position whose every key is padding may still attend to itself, so padded rows never
    produce NaN (their outputs are never read).
    """
    kv_len = past_len + q_len
    if attention_mask is None or bool(attention_mask.all()):
        if q_len == 1 or past_len == 0:
            return None  # decode step, or plain causal prefill
        q_pos = torch.arange(past_len, kv_len, device=device)[:, None]
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]
    am = attention_mask[:, -kv_len:].to(device=device, dtype=torch.bool)
    q_pos = torch.arange(past_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    causal = k_pos <= q_pos  # (q, k)
    mask = causal[None] & am[:, None, :]  # (b, q, k)
    mask = mask | (k_pos == q_pos)[None]
    return mask[:, None]


class LlamaForCausalLM(GenkitModel):
    """A Llama-family causal LM with transformers' calling convention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaInner(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = config.get("head_dim", config.hidden_size // config.num_attention_heads)
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = True,
        output_hidden_states: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass `input_ids` or `inputs_embeds`")
            inputs_embeds = self.model.embed_tokens(input_ids)
        b, t, _ = inputs_embeds.shape
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.new_cache()
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and not bool(attention_mask.all()):
                pos = attention_mask.long().cumsum(-1) - 1
                pos = pos.masked_fill(attention_mask == 0, 1)
                position_ids = pos[:, -t:]
            else:
                position_ids = torch.arange(past_len, past_len + t, device=inputs_embeds.device)[None].expand(b, t)
        cos, sin = self.rope(position_ids, inputs_embeds.dtype)
        mask = build_attention_mask(attention_mask, t, past_len, inputs_embeds.device)
        x = inputs_embeds
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        for layer in self.model.layers:
            if hidden is not None:
                hidden.append(x)
            x = layer(x, cos, sin, mask, cache)
        x = self.model.norm(x)
        if hidden is not None:
            hidden.append(x)
        if isinstance(logits_to_keep, int):
            if logits_to_keep > 0:
                x = x[:, -logits_to_keep:]
        else:
            x = x[:, logits_to_keep]
        logits = self.lm_head(x)
        return CausalLMOutput(logits=logits, past_key_values=cache if use_cache else None,
                              hidden_states=tuple(hidden) if hidden is not None else None)
