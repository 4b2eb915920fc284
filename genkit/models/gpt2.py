"""GPT-2: learned positions, LayerNorm, fused QKV projection, GELU MLP, SDPA attention.

Parameter names and shapes follow transformers' checkpoints, including GPT-2's ``Conv1D`` layers
whose weight is stored transposed (``(in_features, out_features)``), so safetensors files load as
they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from .base import GenkitModel, ModelConfig, eager_attention
from .cache import KVCache
from .llama import build_attention_mask
from .mixin import GenerationMixin

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class Conv1D(nn.Module):
    """A linear layer whose weight is stored ``(in_features, out_features)``, as GPT-2 checkpoints do."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        scale = self.head_dim ** -0.5 if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.scale = scale
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None,
                attentions: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.embed_dim, dim=2)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if attentions is not None:  # output_attentions: the weights, computed step by step
            out, weights = eager_attention(q, k, v, mask, self.scale)
            attentions.append(weights)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                                 scale=self.scale)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, self.embed_dim))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inner = config.get("n_inner") or 4 * config.n_embd
        self.c_fc = Conv1D(inner, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, inner)
        name = config.get("activation_function", "gelu_new")
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation_function {name!r} in config.json; "
                                        f"accepted: {', '.join(sorted(_ACTIVATIONS))}")
        self.act = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None,
                attentions: list[torch.Tensor] | None = None) -> torch.Tensor:
        if attentions is not None:
            x = x + self.attn(self.ln_1(x), mask, cache, attentions)
        else:
            x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Inner(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=float(config.get("layer_norm_epsilon", 1e-5)))


class GPT2LMHeadModel(GenkitModel, GenerationMixin):
    """GPT-2 with transformers' calling convention (``num_hidden_layers`` = ``n_layer``)."""

    supports_partial_depth = True

    def __init__(self, config: ModelConfig) -> None:
        if config.num_hidden_layers is None:
            config.num_hidden_layers = config.n_layer
        if config.hidden_size is None:
            config.hidden_size = config.n_embd
        super().__init__(config)
        self.transformer = GPT2Inner(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """GPT-2 always shares the input embedding with the LM head (unless the config says not to)."""
        if self.config.get("tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(hidden))

    def input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def decoder(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cache: KVCache | None, past_len: int, hidden: list[torch.Tensor] | None,
                attentions: list[torch.Tensor] | None = None, num_layers: int | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + t, device=x.device)[None].expand(b, t)
        x = x + self.transformer.wpe(position_ids)
        mask = build_attention_mask(attention_mask, t, past_len, x.device, dtype=x.dtype)
        for block in self.transformer.h if num_layers is None else self.transformer.h[:num_layers]:
            if hidden is not None:
                hidden.append(x)
            x = block(x, mask, cache, attentions) if attentions is not None else block(x, mask, cache)
        return self.transformer.ln_f(x)
