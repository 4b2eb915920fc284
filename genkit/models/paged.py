"""The paged forward: one batching step through a native model (the Llama family, GPT-2), on a paged K/V store.

The model side of continuous batching (``genkit.continuous`` decides which requests run and which
blocks each one holds; this module holds the tensors and runs the layers). A model that can run it
implements :class:`genkit.protocols.PagedLM`: ``paged_unsupported()``, ``new_paged_store(...)`` and
``forward_paged(batch, store)``.

The step's tokens from every request are one flat stream: the projections and MLPs run once over
all of them (no padding of the batch to its longest member), with the per-layer math of
:mod:`genkit.models.llama_infer` (:func:`~genkit.models.llama_infer.project_qkv`,
:func:`~genkit.models.llama_infer.layer_output`). Attention is per request kind: requests decoding
one token share one batched attention call, their keys gathered from their blocks (a key mask
covers their different lengths); each request computing part of its prompt gets its own call,
causal over its cached and new positions. The step writes every new key and value into the
requests' slots, and returns the logits of the last token of each request that asks for one.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from genkit.errors import ConfigError, NotSupportedError

from . import block_kernel
from .kernel_choice import SMALL_MAX_ROWS
from .llama_infer import InferencePathModel, PreparedModel, layer_output, linear, project_qkv

__all__ = ["PagedKVStore", "PagedModel", "StepBatch", "blocks_for", "paged_forward", "paged_store_for", "paged_unsupported",
           "require_paged"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on the CPU in private anonymous memory (``mmap``), whose pages the OS hands out zeroed
    on first touch: a cache sized for the model's whole context (up to 1 GiB) costs nothing until its
    blocks are used (``torch.zeros`` wrote all of it: 0.36 s per ``generate_batch`` for SmolLM2).
    Private, not ``mmap``'s default shared mapping: shared anonymous memory is shmem, whose first
    touches cost half as much again (1.2 against 0.8 us per 4 KB page on a Zen 5 EPYC VM) and which
    transparent huge pages set to ``always`` leave out."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    private = getattr(mmap, "MAP_PRIVATE", None)  # POSIX; Windows' anonymous maps are the process's own
    size = count * dtype.itemsize
    mapping = mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` slots hold ``tokens`` tokens."""
    return -(-tokens // block_size)


class PagedKVStore:
    """The K/V tensors of the paged cache: per layer, ``num_blocks`` blocks of ``block_size`` slots,
    each K/V head's slots of a block together (``(blocks, kv_heads, block_size, head_dim)``: a head's
    keys for consecutive positions are adjacent, as in the KVCache). A request holding ``blocks``
    keeps its token ``i`` in slot ``blocks[i // block_size] * block_size + i % block_size``: block
    ``slot // block_size``, offset ``slot % block_size``. Which blocks a request holds is the block
    allocator's business (``genkit.continuous``).

    ``prepared`` are the model's inference weights, checked once when the store is made."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", prepared: PreparedModel | None = None) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ConfigError(f"the paged cache needs block_size >= 1 and num_blocks >= 1; got {block_size}, "
                             f"{num_blocks}")
        self.block_size, self.num_blocks = block_size, num_blocks
        # a block is contiguous, so gathering a request's blocks copies whole blocks
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        # one tensor for all layers' keys (and one for values), so that copying a block is one op each
        self._all_keys, self._all_values = (_zeros((num_layers, *shape), dtype, device) for _ in range(2))
        self.keys = list(self._all_keys.unbind(0))
        self.values = list(self._all_values.unbind(0))
        self.prepared = prepared

    @property
    def device(self) -> torch.device:
        """Where the cache lives (the model's device): a step's index tensors are built there."""
        return self._all_keys.device

    def slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Slot indices of token positions ``start..stop-1`` of a request holding ``blocks``."""
        pos = torch.arange(start, stop, device=self.device)
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst``, in every layer."""
        self._all_keys[:, dst, :, :n] = self._all_keys[:, src, :, :n]
        self._all_values[:, dst, :, :n] = self._all_values[:, src, :, :n]

    def gather(self, layer: int, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(kv_heads, length, head_dim)`` of layer ``layer`` at positions
        ``0..length-1`` of a request holding ``blocks`` (new tensors, as the paged attention reads them:
        :func:`_gathered`)."""
        table = torch.tensor(blocks[:blocks_for(length, self.block_size)], dtype=torch.long, device=self.device)
        k, v = (_gathered(c, table, 1)[0, :, :length] for c in (self.keys[layer], self.values[layer]))
        return k, v

    def gather_into(self, layer: int, blocks: list[int], length: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write what :meth:`gather` returns into ``k`` and ``v`` ``(kv_heads, length, head_dim)``,
        each head's positions contiguous (a KVCache's buffers): one copy of each element."""
        full, rest = divmod(length, self.block_size)
        table = torch.tensor(blocks[:full], dtype=torch.long, device=self.device)
        for src, dst in ((self.keys[layer], k), (self.values[layer], v)):
            for h in range(dst.shape[0]):
                if full:
                    torch.index_select(src[:, h], 0, table, out=dst[h, :full * self.block_size].view(
                        full, self.block_size, -1))
                if rest:
                    dst[h, full * self.block_size:length] = src[blocks[full], h, :rest]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(kv_heads, T, head_dim)`` of layer ``layer`` at ``slots`` ``(T,)`` (what
        :meth:`write` stored there)."""
        block, offset = slots // self.block_size, slots % self.block_size
        return self.keys[layer][block, :, offset].transpose(0, 1), self.values[layer][block, :, offset].transpose(0, 1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values ``(kv_heads, T, head_dim)`` of layer ``layer`` at ``slots`` ``(T,)``."""
        kc, vc = self.keys[layer], self.values[layer]
        block, offset = slots // self.block_size, slots % self.block_size
        kc[block, :, offset] = k.transpose(0, 1).to(kc.dtype)  # (T, kv_heads, head_dim) into each slot
        vc[block, :, offset] = v.transpose(0, 1).to(vc.dtype)


@dataclass
class StepBatch:
    """The tokens of one step: ``ids``/``positions`` (flat), each request's span in them, its
    cached length before the step and its blocks; ``want_logits[i]``: how many of request ``i``'s
    last tokens' logits are needed (``True``: its last token's; a prompt scored wants every
    token's of its span)."""

    ids: torch.Tensor
    positions: torch.Tensor
    spans: list[tuple[int, int]]  # (start in the stream, number of tokens)
    cached: list[int]
    blocks: list[list[int]]
    want_logits: list[int]  # (bools count as 0 / 1)


def paged_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run the paged forward (continuous batching) as it is now; None when it can."""
    method = getattr(model, "paged_unsupported", None)
    if not callable(method):
        return (f"continuous batching runs native Llama-family and GPT-2 models (genkit.load_model); got "
                f"{type(model).__name__}")
    reason: str | None = method()
    return reason


def require_paged(model: Any) -> None:
    """NotSupportedError naming the reason unless ``model`` can run the paged forward now."""
    reason = paged_unsupported(model)
    if reason is not None:
        raise NotSupportedError(reason)


def paged_store_for(model: Any, *, block_size: int, num_blocks: int) -> PagedKVStore:
    """``model.new_paged_store(...)``; NotSupportedError (with the reason) for a model that has no
    paged forward or cannot run it now."""
    require_paged(model)
    store: PagedKVStore = model.new_paged_store(block_size=block_size, num_blocks=num_blocks)
    return store


class _Attention:
    """The step's attention plan: which requests decode one token (one batched call: the block
    kernel's over their blocks in place, or SDPA over a gathered copy) and which compute prompt
    chunks (one causal call each)."""

    def __init__(self, store: PagedKVStore, batch: StepBatch, dtype: torch.dtype) -> None:
        self.dtype, self.block_size = dtype, store.block_size
        bs = store.block_size
        on = {"dtype": torch.long, "device": store.device}  # the plan's index tensors live with the cache
        decode = [i for i, (_, n) in enumerate(batch.spans) if n == 1 and batch.cached[i] > 0]
        self.decode_rows = torch.tensor([batch.spans[i][0] for i in decode], **on)
        # decoding rows attend on the block kernel over their blocks where they are (float32 on the
        # CPU): SDPA needs a gathered copy of every request's blocks per layer, which cost more than
        # the attention itself (120 -> 51 ms a SmolLM2 step of 4 requests at 2000 positions)
        keys = store.keys[0]
        self.in_place = (bool(decode) and dtype == torch.float32 and keys.dtype == torch.float32
                         and store.device.type == "cpu" and block_kernel.attends(keys.shape[3]))
        self.decode_blocks = self.decode_mask = None
        if decode:
            lengths = [batch.cached[i] + 1 for i in decode]
            width = max(blocks_for(n, bs) for n in lengths)
            table = [batch.blocks[i][:width] + [0] * (width - len(batch.blocks[i][:width])) for i in decode]
            if self.in_place:
                self.decode_blocks = torch.tensor(table, dtype=torch.int32)
                self.decode_positions = torch.tensor(lengths, dtype=torch.int32) - 1
            else:
                self.decode_blocks = torch.tensor(table, **on).reshape(-1)
                self.decode_mask = (torch.arange(width * bs, **on)[None, :]
                                    < torch.tensor(lengths, **on)[:, None])[:, None, None, :]
        in_decode = set(decode)
        self.chunks = []
        for i in (i for i in range(len(batch.spans)) if i not in in_decode):
            start, n = batch.spans[i]
            c = batch.cached[i]
            blocks = torch.tensor(batch.blocks[i][:blocks_for(c + n, bs)], **on)
            mask = None
            if c > 0:  # query j (position c + j) sees keys 0..c + j
                mask = (torch.arange(c + n, **on)[None, :] <= (c + torch.arange(n, **on))[:, None])[None, None]
            self.chunks.append((start, n, c + n, blocks, mask))

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Attention output ``(T, heads, head_dim)`` for queries ``q`` ``(heads, T, head_dim)``, the
        scores times ``scale`` (None: ``1 / sqrt(head_dim)``)."""
        nq, t, d = q.shape
        nkv, dtype = kc.shape[1], self.dtype
        out = torch.empty(t, nq, d, dtype=q.dtype, device=q.device)
        if self.in_place:
            qd = q.index_select(1, self.decode_rows).transpose(0, 1)  # (r, nq, d)
            o = block_kernel.attend_paged(qd, kc, vc, self.decode_blocks, self.decode_positions, self.block_size, scale)
            out.index_copy_(0, self.decode_rows, o)
        elif self.decode_blocks is not None:
            r = self.decode_rows.shape[0]
            keys, values = (_gathered(c, self.decode_blocks, r) for c in (kc, vc))  # (r, kv_heads, slots, d)
            qd = q.index_select(1, self.decode_rows).transpose(0, 1)[:, :, None]  # (r, nq, 1, d)
            o = F.scaled_dot_product_attention(qd, keys.to(dtype), values.to(dtype), attn_mask=self.decode_mask,
                                               enable_gqa=nkv != nq, scale=scale)
            out.index_copy_(0, self.decode_rows, o[:, :, 0])
        for start, n, length, blocks, mask in self.chunks:
            keys, values = (_gathered(c, blocks, 1)[:, :, :length] for c in (kc, vc))
            o = F.scaled_dot_product_attention(q[None, :, start:start + n], keys.to(dtype), values.to(dtype),
                                               attn_mask=mask, is_causal=mask is None and n > 1,
                                               enable_gqa=nkv != nq, scale=scale)
            out[start:start + n] = o[0].transpose(0, 1)
        return out


def _gathered(cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """The blocks ``blocks`` (``rows`` requests' in turn, as many each) of one layer's keys or values as
    ``(rows, kv_heads, slots, head_dim)``, each request's slots in block order."""
    got = cache.index_select(0, blocks)  # (rows * width, kv_heads, block_size, d): only these blocks copied
    _, nkv, bs, d = got.shape
    # index_select over dim 1 of the head-major view would need one copy less, but torch copies the
    # whole store to make that view contiguous first (10x slower steps, session 19)
    return got.view(rows, -1, nkv, bs, d).transpose(1, 2).reshape(rows, nkv, -1, d)


def _paged_layers(prepared: PreparedModel, store: PagedKVStore, batch: StepBatch, x: torch.Tensor,
                  cos: torch.Tensor | None, sin: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The decoder layers of one step in torch (any mix of decoding requests and prompt chunks)."""
    t = batch.ids.shape[0]
    new_slots = torch.cat([store.slots(b, c, c + n) for b, c, (_, n) in zip(batch.blocks, batch.cached, batch.spans)])
    attention = _Attention(store, batch, dtype)
    layers, _ = prepared.for_rows(t)
    for layer, p in enumerate(layers):
        q, k, v = project_qkv(p, x, cos, sin)  # (1, heads, T, d) each
        store.write(layer, new_slots, k[0], v[0])
        out = attention(q[0], store.keys[layer], store.values[layer], p.scale)
        x = layer_output(p, x, out.reshape(1, t, p.num_heads * p.head_dim))
    return x


_FUSED_SCORES = 1 << 23  # attention scores (rows x heads x positions) the fused step may hold at once (32 MB)


def _fused_fits(batch: StepBatch, heads: int, positions: int) -> bool:
    """Whether the block kernel's one-call step takes ``batch`` (whose rows attend over at most
    ``positions`` positions): its tokens in span order, and its attention scores within
    :data:`_FUSED_SCORES` (a long prompt chunk takes the torch path)."""
    start = 0
    for s, n in batch.spans:
        if s != start:
            return False
        start += n
    return start * heads * positions <= _FUSED_SCORES


def _one_call(prepared: PreparedModel, rows: int) -> bool:
    """Whether a step of ``rows`` tokens may run on ``prepared``'s one-call decoder: a quantized
    model's always; a float32 model's (its products the dense kernel's, the gemv route) only where
    the kernel choice chose that route for this many rows: one decoding request, and up to
    ``SMALL_MAX_ROWS`` where gemv won the small class. (The route's own modules run 5-16 rows on
    torch's linear; the one-call step runs them on the kernel, as self-speculation's checks do:
    2.2-2.8x faster steps of 6-16 SmolLM2 requests at 1 thread, docs/benchmarks.md, session 19.)"""
    decoder = prepared.decoder
    if decoder is None:
        return False
    return not decoder.dense or (rows <= SMALL_MAX_ROWS and prepared.for_rows(rows) is prepared.routes["decode"])


def logit_rows(batch: StepBatch) -> list[int]:
    """The rows of a step's tokens whose logits are wanted, in order: each request's last
    ``want_logits[i]`` tokens (distinct and increasing: as many as the step's tokens means all)."""
    return [r for (s, n), w in zip(batch.spans, batch.want_logits) for r in range(s + n - int(w), s + n)]


@torch.inference_mode()
def paged_forward(model: Any, store: PagedKVStore, batch: StepBatch, greedy: bool = False) -> torch.Tensor:
    """Run ``batch`` (see :class:`StepBatch`) through ``model`` (a :class:`PagedModel`: the Llama
    family, GPT-2) whose inference weights are ``store.prepared``; returns the logits ``(k, vocab)``
    of the rows ``want_logits`` asks for (:func:`logit_rows`), in order. With ``greedy`` (every such request picks its
    logits' first maximum and reads nothing else of them) a step run in one kernel call returns
    those tokens instead, ``(k,)`` int64: its float32 head read through the 8-bit copy greedy
    ``generate`` reads (:meth:`~genkit.models.block_decode.BlockDecoder.final_argmax`), the same
    tokens; other steps return the logits."""
    prepared = store.prepared
    assert prepared is not None, "a paged store made by model.new_paged_store() carries the prepared weights"
    device = store.device
    if batch.ids.device != device:  # the manager builds a step's ids on the CPU; the model may be on a GPU
        batch = replace(batch, ids=batch.ids.to(device), positions=batch.positions.to(device))
    x, cos, sin = model.paged_inputs(batch.ids, batch.positions)  # (T, hidden), (T, head_dim) or None each
    positions = int(batch.positions.max()) + 1
    fused = None
    if _one_call(prepared, batch.ids.shape[0]) and _fused_fits(batch, prepared.layers[0].num_heads, positions):
        # the whole step is one block-kernel call: every token is a row at its own position with
        # its request's blocks; the kernel stores a layer's keys and values of all rows before any
        # row attends, so a prompt chunk's rows see each other causally
        rows = [blocks for blocks, (_, n) in zip(batch.blocks, batch.spans) for _ in range(n)]
        fused = prepared.decoder.paged(x, cos, sin, batch.positions, store, rows)
    ends = None
    if fused is not None:
        h = fused
        ends = model.kernel_ends(prepared)  # the final norm and LM head as the fused decode step runs them
    elif prepared.decoder is not None and prepared.decoder.llama:  # numerics="llama.cpp": no torch path
        from .block_decode import UNSUPPORTED

        raise NotSupportedError(f"{UNSUPPORTED}; this step's prompt chunks are too long for it "
                                "(a smaller --max-batch-tokens splits them)")
    else:
        h = _paged_layers(prepared, store, batch, x[None], cos, sin, model.dtype)[0]
    rows = logit_rows(batch)
    if len(rows) != h.shape[0]:  # not every row's logits: the wanted ones
        if not rows:
            return torch.empty(0, model.config.vocab_size, device=device)
        h = h.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    if ends is not None:
        return prepared.decoder.final_argmax(h, ends) if greedy else prepared.decoder.final_logits(h, ends)
    h = model.final_norm()(h)
    head = prepared.for_rows(h.shape[0])[1]
    if head is not None:  # the oneDNN-packed LM head of the inference path
        return linear(h, head, None, True).float()
    return model.lm_head(h).float()


class PagedModel(InferencePathModel):
    """A model on the inference path that runs the paged forward (:class:`genkit.protocols.PagedLM`,
    continuous batching): the Llama family and GPT-2. Each names what comes before and after its
    layers (:meth:`paged_inputs`, :meth:`final_norm`); the layers are the inference path's."""

    def paged_unsupported(self) -> str | None:
        """Why this model cannot run the paged forward now (None: it can)."""
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
        prepared = self._inference_weights(None, 0)
        assert prepared is not None  # (paged_unsupported said so)
        layer = prepared.layers[0]
        return PagedKVStore(len(prepared.layers), layer.num_kv_heads, layer.head_dim, block_size=block_size,
                            num_blocks=num_blocks, dtype=self.dtype, device=self.device, prepared=prepared)

    def forward_paged(self, batch: StepBatch, store: PagedKVStore, greedy: bool = False) -> torch.Tensor:
        """One continuous-batching step (:func:`paged_forward`): the logits ``(k, vocab)`` of the
        requests in ``batch`` that want them; with ``greedy``, their greedy tokens ``(k,)`` (int64)
        where the step runs in one kernel call."""
        return paged_forward(self, store, batch, greedy)

    def paged_inputs(self, ids: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The first layer's input ``(T, hidden)`` for tokens ``ids`` at ``positions`` (both ``(T,)``),
        and their rotary tables ``(T, head_dim)`` each (None, None: no rotary positions)."""
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        """The norm between the last layer and the LM head."""
        raise NotImplementedError
