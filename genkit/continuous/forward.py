"""One batching step through a native Llama-family model, on the paged cache.

The step's tokens from every request are one flat stream: the projections and MLPs run once over
all of them (no padding of the batch to its longest member). Attention is per request kind:
requests decoding one token share one batched attention call, their keys gathered from their
blocks (a key mask covers their different lengths); each request computing part of its prompt
gets its own call, causal over its cached and new positions. The step writes every new key and
value into the requests' slots, and returns the logits of the last token of each request that
asks for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from genkit.errors import NotSupportedError
from genkit.models.llama_infer import linear, rms_norm

from .paged_cache import PagedKVCache

__all__ = ["StepBatch", "check_model", "paged_step"]


@dataclass
class StepBatch:
    """The tokens of one step: ``ids``/``positions`` (flat), each request's span in them, its
    cached length before the step and its blocks; ``want_logits[i]`` when request ``i``'s last
    token's logits are needed."""

    ids: torch.Tensor
    positions: torch.Tensor
    spans: list[tuple[int, int]]  # (start in the stream, number of tokens)
    cached: list[int]
    blocks: list[list[int]]
    want_logits: list[bool]


def check_model(model: Any) -> Any:
    """The model's prepared inference weights; NotSupportedError for models continuous batching
    cannot run (not a native Llama-family model, sliding windows, hooks)."""
    from genkit.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise NotSupportedError(f"continuous batching runs native Llama-family models (genkit.load_model); got "
                                f"{type(model).__name__}")
    if any(w is not None for w in model.windows):
        raise NotSupportedError("continuous batching does not support sliding-window attention yet")
    prepared = model._inference_weights(None, 0)
    if prepared is None:
        raise NotSupportedError("continuous batching needs the model's inference path (no forward hooks, no "
                                "replaced submodules)")
    return prepared


@torch.inference_mode()
def paged_step(model: Any, prepared: Any, cache: PagedKVCache, batch: StepBatch) -> torch.Tensor:
    """Run ``batch`` (see :class:`StepBatch`); returns the logits ``(k, vocab)`` of the requests
    with ``want_logits``, in order."""
    dtype = model.dtype
    x = model.model.embed_tokens(batch.ids)[None]  # (1, T, hidden)
    cos_table, sin_table = model._rope_table(int(batch.positions.max()) + 1, x.dtype)
    cos, sin = cos_table[batch.positions], sin_table[batch.positions]  # (T, head_dim)
    t = batch.ids.shape[0]
    new_slots = torch.cat([cache.slots(b, c, c + n) for b, c, (_, n) in zip(batch.blocks, batch.cached, batch.spans)])
    decode = [i for i, (_, n) in enumerate(batch.spans) if n == 1 and batch.cached[i] > 0]
    in_decode = set(decode)
    chunked = [i for i in range(len(batch.spans)) if i not in in_decode]
    bs = cache.block_size
    dec_rows = torch.tensor([batch.spans[i][0] for i in decode], dtype=torch.long)
    dec_blocks = dec_mask = None
    if decode:
        lengths = [batch.cached[i] + 1 for i in decode]
        width = max(cache.blocks_for(n) for n in lengths)
        dec_blocks = torch.tensor([batch.blocks[i][:width] + [0] * (width - len(batch.blocks[i][:width]))
                                   for i in decode], dtype=torch.long).reshape(-1)
        dec_mask = (torch.arange(width * bs)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    spans = []
    for i in chunked:
        start, n = batch.spans[i]
        c = batch.cached[i]
        blocks = torch.tensor(batch.blocks[i][:cache.blocks_for(c + n)], dtype=torch.long)
        mask = None
        if c > 0:  # query j (position c + j) sees keys 0..c + j
            mask = (torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None])[None, None]
        spans.append((start, n, c + n, blocks, mask))
    for layer, p in enumerate(prepared.layers):
        nq, nkv, d = p.num_heads, p.num_kv_heads, p.head_dim
        qkv = linear(rms_norm(x, p.norm1, p.eps), p.wqkv, p.bqkv, p.packed)[0].view(t, nq + 2 * nkv, d)
        qkv = qkv.transpose(0, 1)  # (heads, T, d)
        qk = qkv[: nq + nkv]
        qk = torch.addcmul(qk * cos, torch.matmul(qk, p.rotation), sin)
        q, k, v = qk[:nq], qk[nq:], qkv[nq + nkv:]
        kc, vc = cache.keys[layer], cache.values[layer]
        kc.view(-1, nkv, d).index_copy_(0, new_slots, k.transpose(0, 1).to(kc.dtype))
        vc.view(-1, nkv, d).index_copy_(0, new_slots, v.transpose(0, 1).to(vc.dtype))
        out = torch.empty(t, nq, d, dtype=x.dtype)
        if decode:
            assert dec_blocks is not None
            r = len(decode)
            keys = kc.index_select(0, dec_blocks).view(r, -1, nkv, d).transpose(1, 2)
            values = vc.index_select(0, dec_blocks).view(r, -1, nkv, d).transpose(1, 2)
            qd = q.index_select(1, dec_rows).transpose(0, 1)[:, :, None]  # (r, nq, 1, d)
            o = F.scaled_dot_product_attention(qd, keys.to(dtype), values.to(dtype), attn_mask=dec_mask,
                                               enable_gqa=nkv != nq)
            out.index_copy_(0, dec_rows, o[:, :, 0])
        for start, n, length, blocks, mask in spans:
            keys = kc.index_select(0, blocks).view(-1, nkv, d)[:length].transpose(0, 1)[None]
            values = vc.index_select(0, blocks).view(-1, nkv, d)[:length].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[None, :, start:start + n], keys.to(dtype), values.to(dtype),
                                               attn_mask=mask, is_causal=mask is None and n > 1,
                                               enable_gqa=nkv != nq)
            out[start:start + n] = o[0].transpose(0, 1)
        x = x + linear(out.reshape(1, t, nq * d), p.wo, p.bo, p.packed)
        gate, up = linear(rms_norm(x, p.norm2, p.eps), p.wgu, p.bgu, p.packed).chunk(2, dim=-1)
        x = x + linear(F.silu(gate).mul_(up), p.wd, p.bd, p.packed)
    last = torch.tensor([s + n - 1 for (s, n), w in zip(batch.spans, batch.want_logits) if w], dtype=torch.long)
    if last.numel() == 0:
        return torch.empty(0, model.config.vocab_size)
    h = model.model.norm(x[0].index_select(0, last))
    if prepared.head is not None:  # the oneDNN-packed LM head of the inference path
        return linear(h, prepared.head, None, True).float()
    return model.lm_head(h).float()
