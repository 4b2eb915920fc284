"""GPT-2: learned positions, LayerNorm, fused QKV projection, GELU MLP, SDPA attention.

Parameter names and shapes follow transformers' checkpoints, including GPT-2's ``Conv1D`` layers
whose weight is stored transposed (``(in_features, out_features)``), so safetensors files load as
they are.

Without autograd and hooks the layers run on the Llama family's inference path
(:mod:`genkit.models.llama_infer`, :func:`prepare_layers`): a ``Conv1D`` weight's transpose is
already that path's column-major ``(out, in)`` layout, so the products take the same routes
(plain, oneDNN-packed or genkit's gemv kernel, per shape class, as the kernel choice decides) with
no copy but the packed ones; quantized projections (``genkit.quantize``, GGUF files) run their
kernel with their float bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from . import weight_arena
from .base import ModelConfig, eager_attention, embedding
from .block_decode import BlockDecoder
from .cache import KVCache
from .llama import build_attention_mask
from .llama_infer import (
    PreparedLayer,
    PreparedModel,
    blocks_choice,
    finish_dense,
    gelu_tanh,
    lay_out,
    place_blocks,
    run_layers,
)
from .mixin import GenerationMixin
from .one_call import OneCallModel
from .paged import PagedModel
from .quant import Int4Linear, WithBias

_ACTIVATIONS = {
    "gelu_new": gelu_tanh,  # (one function: the block kernel's one-call step knows it)
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
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
        if not self.weight.is_meta:  # (see base.embedding)
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
        self.wte = embedding(config.vocab_size, config.n_embd)
        self.wpe = embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=float(config.get("layer_norm_epsilon", 1e-5)))


def _projections(block: nn.Module) -> tuple[nn.Module, ...] | None:
    """A block's four projections (q/k/v, attention output, MLP up and down) when the block is as
    built (GPT-2's modules, affine LayerNorms of one epsilon; each projection a ``Conv1D`` or a
    quantized one, :class:`~genkit.models.quant.WithBias` on an ``Int4Linear``), else None."""
    if type(block) is not GPT2Block or type(block.attn) is not GPT2Attention or type(block.mlp) is not GPT2MLP:
        return None
    norms = (block.ln_1, block.ln_2)
    if any(type(n) is not nn.LayerNorm or n.weight is None or n.bias is None for n in norms) or norms[0].eps != norms[1].eps:
        return None
    projections = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
    if all(type(m) is Conv1D or type(m) is WithBias and type(m.inner) is Int4Linear for m in projections):
        return projections
    return None


def _prepared_layer(block: GPT2Block, projections: tuple[nn.Module, ...]) -> PreparedLayer:
    """A block as the inference path's layer: the ``Conv1D`` weights' transposes (views), LayerNorms,
    the un-gated activation, no rotary positions."""
    attn, mlp = block.attn, block.mlp
    w = [m.weight.t() if type(m) is Conv1D else m.inner for m in projections]
    b = [m.bias for m in projections]
    return PreparedLayer(w[0], b[0], block.ln_1.weight, w[1], b[1], w[2], b[2], block.ln_2.weight, w[3], b[3],
                         block.ln_1.eps, attn.num_heads, attn.num_heads, attn.head_dim, None, None, False,
                         norm_biases=(block.ln_1.bias, block.ln_2.bias), act=mlp.act, scale=attn.scale)


def prepare_layers(blocks: nn.ModuleList, lm_head: nn.Module, packing: bool | None) -> PreparedModel | None:
    """GPT-2's blocks on the inference path, or None when one was replaced (e.g. by an adapter):
    the modules run. Float32/bfloat16 ``Conv1D`` blocks with an ``nn.Linear`` head take the dense
    routes (:func:`~genkit.models.llama_infer.finish_dense`; the head laid out column-major and the
    weights placed in huge pages, as the Llama family's); others run each projection as it is, and a
    batch-1 decode step in one block-kernel call where every projection is on that kernel
    (:class:`~genkit.models.block_decode.BlockDecoder`: LayerNorms, biases, GELU's tanh form), the
    kernel's paths chosen per shape class as the Llama family's (:func:`~genkit.models.llama_infer.blocks_choice`)."""
    projections = [p for p in (_projections(block) for block in blocks) if p is not None]
    if not blocks or len(projections) != len(blocks):
        return None
    dense = type(lm_head) is nn.Linear and all(type(m) is Conv1D for p in projections for m in p)
    if not dense and any(type(m) is Conv1D for p in projections for m in p):
        return None  # float and quantized projections (or a quantized head) mixed: the modules run
    # plain tensors even when the first call comes from inside generate(): the parameters keep them
    with torch.no_grad(), torch.inference_mode(False):
        if dense:
            lay_out(lm_head.weight)
            weight_arena.place([m.weight for p in projections for m in p] + [lm_head.weight])
        layers = [_prepared_layer(block, p) for block, p in zip(blocks, projections)]
    if not dense:  # quantized: decode steps in one block-kernel call where every projection is on that kernel
        place_blocks(layers, lm_head)
        choice = blocks_choice(layers, lm_head)  # (first: the decoder keeps the AMX threshold it sets)
        return PreparedModel(layers, None, BlockDecoder.build(layers), choice=choice)
    return finish_dense(layers, lm_head, [w for p in layers for w in (p.wqkv, p.wo, p.wgu, p.wd)], packing)


class GPT2LMHeadModel(OneCallModel, PagedModel, GenerationMixin):
    """GPT-2 with transformers' calling convention (``num_hidden_layers`` = ``n_layer``,
    ``max_position_embeddings`` = ``n_positions``: the context that generation, continuous batching
    and ``genkit serve`` bound requests by). Its layers
    run on the inference path (:class:`~genkit.models.llama_infer.InferencePathModel`; ``cpu_weight_packing``),
    its decode steps in one kernel call where they can, the learned positions added to the embedding
    there (:class:`~genkit.models.one_call.OneCallModel`; ``self_speculation``), and continuous
    batching's steps on the paged store (:class:`~genkit.models.paged.PagedModel`)."""

    ties_embeddings_by_default = True  # as transformers' GPT2Config
    supports_partial_depth = True

    def __init__(self, config: ModelConfig) -> None:
        if config.num_hidden_layers is None:
            config.num_hidden_layers = config.n_layer
        if config.hidden_size is None:
            config.hidden_size = config.n_embd
        if config.max_position_embeddings is None:  # (transformers' GPT2Config maps the name to n_positions)
            config.max_position_embeddings = config.n_positions
        if config.num_attention_heads is None:  # (and this one to n_head)
            config.num_attention_heads = config.n_head
        super().__init__(config)
        self.transformer = GPT2Inner(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """GPT-2 always shares the input embedding with the LM head (unless the config says not to)."""
        # (a quantized head runs on its own codes: its read-only ``weight`` is a de-quantized copy, quant_weight)
        if self.config.get("tie_word_embeddings", self.ties_embeddings_by_default) and type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.transformer.wte.weight

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(hidden))

    def input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def _end_modules(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module | None] | None:
        t = self.transformer
        return (t.wte, t.ln_f, self.lm_head, t.wpe) if type(t.ln_f) is nn.LayerNorm else None

    def _rotary(self, start: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def _path_modules(self) -> list[nn.Module]:
        return [self.transformer.h, self.lm_head]

    def paged_inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return self.transformer.wte(ids) + self.transformer.wpe(positions), None, None

    def final_norm(self) -> nn.Module:
        return self.transformer.ln_f

    def _prepare(self) -> PreparedModel | None:
        return prepare_layers(self.transformer.h, self.lm_head, self.cpu_weight_packing)

    def decoder(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                cache: KVCache | None, past_len: int, hidden: list[torch.Tensor] | None,
                attentions: list[torch.Tensor] | None = None, num_layers: int | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + t, device=x.device)[None].expand(b, t)
        x = x + self.transformer.wpe(position_ids)
        mask = build_attention_mask(attention_mask, t, past_len, x.device, dtype=x.dtype)
        prepared = self.inference_path(cache, past_len, attentions)
        if prepared is not None:
            return self.transformer.ln_f(run_layers(prepared, x, None, None, {None: mask}, cache, hidden, num_layers))
        for block in self.transformer.h if num_layers is None else self.transformer.h[:num_layers]:
            if hidden is not None:
                hidden.append(x)
            x = block(x, mask, cache, attentions) if attentions is not None else block(x, mask, cache)
        return self.transformer.ln_f(x)
