"""Decode steps in one call to the block kernel (:mod:`genkit.models.block_kernel`).

For a model whose projections all run on the block kernel, a one-token step of a few sequences is
mostly fixed cost: some sixty small torch operations per layer around four products. The kernel's
``gk_decode`` runs the same steps as :func:`genkit.models.llama_infer.run_layers` (RMSNorm, fused
q/k/v, rotary embedding, the key/value cache write, grouped attention, o projection, fused
gate/up with SiLU, down projection) for all layers and every row in one call, writing into
genkit's :class:`~genkit.models.cache.KVCache` buffers in place. The rows must be at the same
position with no padding (one sequence, beams, samples of one prompt); anything else (a prompt,
a padding mask, a sliding window, hidden states asked for, a cache of another kind or without
room) takes the torch path. A model whose attention normalises q and k per head (Qwen3's
``q_norm``/``k_norm``) has them applied in the step too, each head in float32 before the rotary
embedding, as the torch path does. Under ``numerics="llama.cpp"`` a prompt runs here too, its tokens as rows
of one step (:meth:`BlockDecoder.steps`).

A decode step on genkit's own model also takes its ends into the call (``gk_decode_logits``,
:meth:`BlockDecoder.logits`): the token ids in, the embedding, the layers, the final RMSNorm and the
LM head, the logits out (``gk_logits`` alone: :meth:`BlockDecoder.final_logits`). Between two calls
the layers have streamed the weights through the CPU caches, so the small torch operations that ran
those ends cost several times their warm time.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import NotSupportedError
from . import block_kernel
from .cache import KVCache
from .dense_kernel import Gemv
from .numerics import is_llama_numerics, llama_float_order
from .quant import GROUP, Int4Linear, QuantizedEmbedding

logger = logging.getLogger("genkit.models")

PROMPT_ROWS = 32  # numerics="llama.cpp": prompt tokens per one-call step (BlockDecoder.steps)
UNSUPPORTED = ("`numerics`='llama.cpp' runs every step on the block kernel's decoder: rows at one position with no "
               "padding mask, genkit's KVCache or the paged store, no hidden states or attentions asked for")


class _Layer(ctypes.Structure):
    _fields_ = [("wqkv", ctypes.c_void_p), ("wo", ctypes.c_void_p), ("wgu", ctypes.c_void_p),
                ("wd", ctypes.c_void_p), ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("bits_qkv", ctypes.c_int), ("bits_o", ctypes.c_int), ("bits_gu", ctypes.c_int),
                ("bits_d", ctypes.c_int), ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("eps", ctypes.c_float),
                ("act_qkv", ctypes.c_int), ("act_o", ctypes.c_int), ("act_gu", ctypes.c_int), ("act_d", ctypes.c_int),
                ("llama", ctypes.c_int), ("gemv", ctypes.c_void_p), ("ld_qkv", ctypes.c_long), ("ld_o", ctypes.c_long),
                ("ld_gu", ctypes.c_long), ("ld_d", ctypes.c_long), ("window", ctypes.c_int), ("sink", ctypes.c_int),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("q_eps", ctypes.c_float),
                ("k_eps", ctypes.c_float), ("norm1_b", ctypes.c_void_p), ("norm2_b", ctypes.c_void_p),
                ("b_qkv", ctypes.c_void_p), ("b_o", ctypes.c_void_p), ("b_gu", ctypes.c_void_p), ("b_d", ctypes.c_void_p),
                ("gelu", ctypes.c_int), ("no_rope", ctypes.c_int), ("scale", ctypes.c_float),
                ("amx_rows", ctypes.c_int)]


class _Ends(ctypes.Structure):
    """``gk_ends``: the token embedding, the final norm and the LM head around the layers."""

    _fields_ = [("embed", ctypes.c_void_p), ("s0", ctypes.c_longlong), ("s1", ctypes.c_longlong),
                ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("vocab", ctypes.c_longlong),
                ("norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("llama", ctypes.c_int), ("head", ctypes.c_void_p),
                ("head_bits", ctypes.c_int), ("head_act", ctypes.c_int), ("outputs", ctypes.c_int),
                ("gemv", ctypes.c_void_p), ("head_ld", ctypes.c_long), ("proxy", ctypes.c_void_p),
                ("bound", ctypes.c_void_p), ("proxy_rows", ctypes.c_int), ("gemv_cols", ctypes.c_void_p),
                ("rescore_w", ctypes.c_void_p), ("rescore_ld", ctypes.c_long), ("rescore", ctypes.c_int),
                ("norm_b", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("p0", ctypes.c_longlong),
                ("p1", ctypes.c_longlong), ("position_rows", ctypes.c_longlong), ("live", ctypes.c_int),
                ("amx_rows", ctypes.c_int)]


def _end_tensors(embed: Any, norm: Any, head: Any) -> tuple[torch.Tensor, ...] | None:
    """The tensors the step's ends read: the embedding's table (or codes and scales), the final
    norm's weight and the LM head's blocks (or float32 weight); None for other kinds of module.
    (Read from the modules' own dicts: this runs every step, and a missing attribute of a module
    costs an exception.)"""
    if type(embed) is QuantizedEmbedding:
        table: tuple[Any, ...] = (embed._buffers.get("codes"), embed._buffers.get("scales"))
    elif type(embed) is torch.nn.Embedding:
        table = (embed._parameters.get("weight"),)
    else:
        return None
    if type(head) is Int4Linear:
        weight = head._buffers.get("blocks")
    elif type(head) is Gemv:
        weight = head.weight
    else:
        return None
    tensors = (*table, norm._parameters.get("weight") if isinstance(norm, torch.nn.Module) else None, weight)
    return tensors if all(isinstance(t, torch.Tensor) for t in tensors) else None


def _table(embed: Any, hidden: int) -> tuple[int, int, int, int, int, int] | None:
    """``gk_ends``' embedding fields (table, its strides, codes, scales, rows) for a float32
    :class:`torch.nn.Embedding` (no ``max_norm``; any strides, a tied head's column-major layout
    included) or a float32-out :class:`~genkit.models.quant.QuantizedEmbedding`; None for others."""
    if type(embed) is QuantizedEmbedding:
        if embed.dtype != torch.float32 or embed.embedding_dim != hidden or hidden % GROUP:
            return None
        return 0, 0, 0, embed.codes.data_ptr(), embed.scales.data_ptr(), embed.num_embeddings
    if type(embed) is torch.nn.Embedding and embed.max_norm is None:
        w = embed.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2 and w.shape[1] == hidden:
            return w.data_ptr(), w.stride(0), w.stride(1), 0, 0, int(w.shape[0])
    return None


def _head(head: Any, hidden: int, gemv: int | None) -> tuple[int, int, int, int, int, int] | None:
    """``gk_ends``' head fields (weight, bits, activation rounding, outputs, product, leading
    dimension): a block-kernel :class:`~genkit.models.quant.Int4Linear`, or with ``gemv`` (the dense
    kernel's column-major product) a :class:`~genkit.models.dense_kernel.Gemv` on it; None for others."""
    if gemv is None:
        if type(head) is Int4Linear and head.kernel == "blocks" and head.in_features == hidden:
            return head.blocks.data_ptr(), head.bits, head.act, head.panel_rows, 0, 0
        return None
    if type(head) is Gemv and head.fn is not None and ctypes.cast(head.fn, ctypes.c_void_p).value == gemv:
        n, k = head.shape
        return (head.weight.data_ptr(), 0, 0, int(n), gemv, head.ld) if k == hidden else None
    return None


def _ends(embed: Any, norm: torch.Tensor, eps: float, llama: bool, head: Any, hidden: int,
          gemv: int | None, extras: tuple[torch.Tensor, ...] = ()) -> _Ends | None:
    """The ends of a step (:func:`_table`, :func:`_head`, the final RMSNorm's float32 weight
    ``norm`` computed as ggml does with ``llama``; with ``extras``, :func:`gpt2_extras`, a LayerNorm
    with that bias and learned positions), or None when one does not fit the kernel."""
    table, out = _table(embed, hidden), _head(head, hidden, gemv)
    if table is None or out is None or norm.dtype != torch.float32 or norm.shape != (hidden,) or not norm.is_contiguous():
        return None
    ends = _Ends(*table, norm.data_ptr(), eps, int(llama), *out)
    if type(head) is Int4Linear:  # (a last panel padded with rows of zeros: its own rows only are logits)
        ends.live, ends.amx_rows = head.out_features, head.amx_rows
    if extras:
        bias, positions = extras
        ends.norm_b, ends.positions = bias.data_ptr(), positions.data_ptr()
        ends.p0, ends.p1, ends.position_rows = positions.stride(0), positions.stride(1), positions.shape[0]
    return ends


def gpt2_extras(norm: Any, positions: Any, hidden: int) -> tuple[torch.Tensor, ...] | None:
    """GPT-2's part of a step's ends: the final LayerNorm's bias and the learned positions' table
    (``positions``: an :class:`torch.nn.Embedding` of float32 rows ``hidden`` wide; any strides); ``()``
    for a model with neither (an RMSNorm, rotary positions); None where they do not fit the kernel."""
    if positions is None:
        return () if type(norm) is not torch.nn.LayerNorm else None
    if type(norm) is not torch.nn.LayerNorm or type(positions) is not torch.nn.Embedding or positions.max_norm is not None:
        return None
    bias, table = norm._parameters.get("bias"), positions._parameters.get("weight")
    if not _vector(bias, hidden) or table is None:
        return None
    if table.dtype != torch.float32 or table.device.type != "cpu" or table.dim() != 2 or table.shape[1] != hidden:
        return None
    return bias, table


def _vector(t: Any, n: int) -> bool:
    """Whether ``t`` is what the kernel reads as ``n`` floats: a contiguous float32 CPU tensor of shape ``(n,)``
    (a norm's weight or bias, a product's bias)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and t.shape == (n,))


def _live(logits: torch.Tensor, ends: _Ends) -> torch.Tensor:
    """``logits`` ``(..., ends.outputs)`` without a padded head's rows of zeros (``ends.live``)."""
    return logits[..., :ends.live] if 0 < ends.live < ends.outputs else logits


def _address(t: torch.Tensor | None) -> int | None:
    """A tensor's address for the kernel; None (NULL) for none."""
    return None if t is None else t.data_ptr()


def _dense_library() -> Any:
    from . import dense_kernel

    return dense_kernel.library()


def _dims(w: Any) -> tuple[int, int]:
    """``(out, in)`` of a block weight (:class:`genkit.models.quant.Int4Linear`) or a dense one."""
    return (w.out_features, w.in_features) if hasattr(w, "out_features") else (int(w.shape[0]), int(w.shape[1]))


def _with_extras(layer: _Layer, p: Any) -> _Layer:
    """``layer`` with what the prepared layer has beyond the Llama graph: per-head q/k norms (Qwen3's
    ``qk_norm``), the products' biases (Qwen2's, GPT-2's), and GPT-2's block (LayerNorms, the un-gated
    GELU MLP, no rotary embedding, the attention's scale); NULL / 0 where it has none."""
    if p.qk_norm is not None:
        qw, layer.q_eps, kw, layer.k_eps = p.qk_norm
        layer.q_norm, layer.k_norm = qw.data_ptr(), kw.data_ptr()
    if p.norm_biases is not None:
        layer.norm1_b, layer.norm2_b = (b.data_ptr() for b in p.norm_biases)
    layer.b_qkv, layer.b_o, layer.b_gu, layer.b_d = (None if b is None else b.data_ptr()
                                                     for b in (p.bqkv, p.bo, p.bgu, p.bd))
    layer.gelu, layer.no_rope = int(p.act is not None), int(p.rotation is None)
    layer.scale = 0.0 if p.scale is None else p.scale
    return layer


def _block_layer(p: Any, llama: int) -> _Layer:
    """A quantized layer's entry: its block weights, bit widths and activation roundings, and the
    rows from which its products run on AMX tiles (the model's kernel choice, made before: the entry
    keeps the weights' ``amx_rows``)."""
    layer = _with_extras(_Layer(
        p.wqkv.blocks.data_ptr(), p.wo.blocks.data_ptr(), p.wgu.blocks.data_ptr(), p.wd.blocks.data_ptr(),
        p.norm1.data_ptr(), p.norm2.data_ptr(), p.wqkv.bits, p.wo.bits, p.wgu.bits, p.wd.bits,
        p.num_heads, p.num_kv_heads, p.head_dim, p.wd.in_features, p.eps,
        p.wqkv.act, p.wo.act, p.wgu.act, p.wd.act, llama, None, 0, 0, 0, 0), p)
    layer.amx_rows = p.wgu.amx_rows
    return layer


def _dense_layer(p: Any, gemv: int) -> _Layer:
    """A float32 layer's entry: its column-major weights for the dense kernel's product at ``gemv``."""
    w = (p.wqkv, p.wo, p.wgu, p.wd)
    return _with_extras(_Layer(*(g.weight.data_ptr() for g in w), p.norm1.data_ptr(), p.norm2.data_ptr(), 0, 0, 0, 0,
                                p.num_heads, p.num_kv_heads, p.head_dim, int(p.wd.shape[1]), p.eps, 0, 0, 0, 0, 0,
                                gemv, *(g.ld for g in w)), p)


class _Buffers:
    """An owner's per-layer key/value buffers with their pointer arrays for the kernel, held weakly
    and reused while the owner holds the same buffer objects (a grown, cloned or reordered cache, or
    a replaced buffer, has new ones, and is checked again)."""

    __slots__ = ("karr", "keys", "owner", "values", "varr")

    def __init__(self, owner: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.owner = weakref.ref(owner)
        self.keys = [weakref.ref(k) for k in keys]
        self.values = [weakref.ref(v) for v in values]
        self.karr = (ctypes.c_void_p * len(keys))(*[k.data_ptr() for k in keys])
        self.varr = (ctypes.c_void_p * len(values))(*[v.data_ptr() for v in values])

    def holds(self, owner: Any, keys: list[Any], values: list[Any]) -> bool:
        """Whether ``owner`` still holds exactly these checked buffers."""
        return (self.owner() is owner and len(self.keys) == len(keys) and len(self.values) == len(values)
                and all(r() is k for r, k in zip(self.keys, keys)) and all(r() is v for r, v in zip(self.values, values)))


class _CacheState(_Buffers):
    """A KVCache's buffers checked once (same batch and capacity, float32, contiguous)."""

    __slots__ = ("capacity", "inference", "rows")

    def __init__(self, cache: KVCache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__(cache, keys, values)
        self.rows, self.capacity = int(keys[0].shape[0]), int(keys[0].shape[2])
        self.inference = any(k.is_inference() or v.is_inference() for k, v in zip(keys, values))

    @staticmethod
    def check(cache: KVCache, keys: list[Any], values: list[Any], rows: int) -> _CacheState | None:
        first = keys[0]
        if first is None or first.shape[0] != rows:
            return None
        for k, v in zip(keys, values):
            if (k is None or v is None or k.shape != first.shape or v.shape != first.shape
                    or k.dtype != torch.float32 or v.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous())):
                return None
        return _CacheState(cache, keys, values)


class BlockDecoder:
    """The decoder layers of a prepared quantized model as one ``gk_decode`` call per token; or of a
    float32 model whose batch-1 products run on the dense kernel (``dense``: the same step with
    :mod:`genkit.models.dense_kernel`'s product, for one row at a time only)."""

    def __init__(self, layers: list[Any], gemv: int | None = None) -> None:
        self.layers = layers  # keeps the weights (and so the pointers below) alive
        self.gemv = gemv  # the dense kernel's product (float32 layers), or None: block weights
        self.hidden = int(layers[0].norm1.shape[0])
        self.head_dim = int(layers[0].head_dim)
        self.dense = gemv is not None
        # numerics="llama.cpp" (genkit.models.quant.set_numerics): every step must run here; its float order
        self.llama = 0 if self.dense else llama_float_order(getattr(layers[0].wqkv, "numerics", "genkit"))
        self.table = (_Layer * len(layers))(*[
            _dense_layer(p, gemv) if gemv is not None else _block_layer(p, self.llama) for p in layers])
        weights = (lambda w: w.weight) if self.dense else (lambda w: w.blocks)
        self.pointers = tuple(t.data_ptr() for p in layers for t in (weights(p.wqkv), weights(p.wo), weights(p.wgu),
                                                                       weights(p.wd), p.norm1, p.norm2))
        self._state: _CacheState | None = None  # the last cache's checked buffers
        self._paged: _Buffers | None = None  # the last paged store's, likewise
        # the last ends, with their key and the tensors they point into
        self._ends: tuple[tuple[Any, ...], _Ends | None, tuple[torch.Tensor, ...]] | None = None
        # greedy and top-k steps of a float32 head: its 8-bit copy and bounds (block_kernel.head_proxy), with its key
        # and the address of the dense kernel's gk_gemv_t_cols (which computes the exact blocks)
        self._proxy: tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor] | None, int | None] | None = None

    @staticmethod
    def build(layers: list[Any]) -> BlockDecoder | None:
        """A decoder for these prepared layers, or None when they do not all fit the kernel."""
        if not layers or not block_kernel.available():
            return None
        for p in layers:
            weights = (p.wqkv, p.wo, p.wgu, p.wd)
            if any(type(w) is not Int4Linear or w.kernel != "blocks" for w in weights):
                return None
            if not BlockDecoder._fits(p, layers[0]):
                return None
        return BlockDecoder(layers)

    @staticmethod
    def build_dense(layers: list[Any]) -> BlockDecoder | None:
        """A one-call decoder for float32 layers whose products all run on the dense kernel's
        column-major product (:class:`genkit.models.dense_kernel.Gemv`, the kernel choice's ``gemv``
        route), or None when they do not all fit."""
        from . import dense_kernel

        if not layers or not block_kernel.available() or not dense_kernel.available():
            return None
        fn = dense_kernel.library().gk_gemv_t
        for p in layers:
            weights = (p.wqkv, p.wo, p.wgu, p.wd)
            if any(type(w) is not dense_kernel.Gemv or w.fn is not fn for w in weights):
                return None
            if not BlockDecoder._fits(p, layers[0]):
                return None
        return BlockDecoder(layers, ctypes.cast(fn, ctypes.c_void_p).value)

    @staticmethod
    def _fits(p: Any, first: Any) -> bool:
        """Whether a prepared layer's shapes and extras fit the kernel's step (``first``: the first layer):
        the Llama graph (RMSNorm, rope, SwiGLU, 1 / sqrt(head_dim)), or GPT-2's block (:meth:`_fits_gpt2`);
        float32 biases of their products' widths (Qwen2's q/k/v, GPT-2's), or none."""
        hidden = first.norm1.shape[0]
        if p.window is not None or p.packed or (p.rotation is None) != (first.rotation is None):
            return False
        gpt2 = p.norm_biases is not None
        if not gpt2 and (p.act is not None or p.rotation is None or p.scale is not None):
            return False
        if gpt2 and not BlockDecoder._fits_gpt2(p, hidden):
            return False
        widths = [_dims(w)[0] for w in (p.wqkv, p.wo, p.wgu, p.wd)]
        if not all(b is None or _vector(b, n) for b, n in zip((p.bqkv, p.bo, p.bgu, p.bd), widths)):
            return False
        # Qwen3's per-head q/k norms: float32 weights of one head's width
        if p.qk_norm is not None and not all(_vector(n, p.head_dim) for n in p.qk_norm[::2]):
            return False
        if not (_vector(p.norm1, hidden) and _vector(p.norm2, hidden)):
            return False
        if p.head_dim != first.head_dim or p.head_dim % 2 or p.head_dim > 512 or p.num_heads % p.num_kv_heads:
            return False
        (qkv, _), (o_out, o_in), (gu, _), (_, d_in) = (_dims(w) for w in (p.wqkv, p.wo, p.wgu, p.wd))
        return (qkv == (p.num_heads + 2 * p.num_kv_heads) * p.head_dim and gu == (d_in if gpt2 else 2 * d_in)
                and o_in == p.num_heads * p.head_dim)

    @staticmethod
    def _fits_gpt2(p: Any, hidden: int) -> bool:
        """Whether GPT-2's block fits the step: LayerNorms (float32 biases), GELU's tanh form
        (:func:`~genkit.models.llama_infer.gelu_tanh`; the kernel has no other activation), no rotary
        embedding, no per-head norms."""
        from .llama_infer import gelu_tanh

        if p.act is not gelu_tanh or p.rotation is not None or p.qk_norm is not None:
            return False
        return all(_vector(b, hidden) for b in p.norm_biases)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, masks: dict[Any, Any], cache: Any,
                 num_layers: int | None) -> torch.Tensor | None:
        """``x`` ``(rows, T, hidden)`` after the first ``num_layers`` layers (all when None), or None:
        take the torch path. ``T`` tokens per row (``cos``/``sin``: one ``head_dim`` row per token,
        shared by the rows) run as ``rows * T`` rows of one step, each attending to its own row's
        positions up to its own (a prompt's causal pattern; :meth:`steps`)."""
        rows, t = x.shape[0], x.shape[1]
        if type(cache) is not KVCache or x.shape != (rows, t, self.hidden) or x.dtype != torch.float32:
            return None
        if self.dense and rows * t != 1:  # the gemv route is batch-1 decode's; more rows take their own route
            return None
        if any(m is not None for m in masks.values()) or torch.is_grad_enabled() and x.requires_grad:
            return None
        n = len(self.layers) if num_layers is None else num_layers
        pos = cache.lengths[0]
        state = self._cache_state(cache, rows, t, n)
        if state is None:
            return None
        tables = self._tables(cos, sin, t, rows)
        if tables is None:
            return None
        cos, sin = tables
        out = x.contiguous().clone()
        rc = block_kernel.library().gk_decode(n, self.table, out.data_ptr(), rows * t, self.hidden, _address(cos),
                                              _address(sin), pos, t, state.karr, state.varr, state.capacity,
                                              torch.get_num_threads())
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        cache.lengths[:n] = [pos + t] * n
        cache.ahead = None
        return out

    def _tables(self, cos: torch.Tensor | None, sin: torch.Tensor | None, t: int, rows: int
                ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The rotary tables for a step of ``t`` tokens of ``rows`` rows as the kernel reads them (one
        ``head_dim`` row per token, repeated per row when ``t > 1``); (None, None) for layers without
        rotary positions (GPT-2, whose callers pass no tables); None when they do not fit: take the
        torch path."""
        if self.layers[0].rotation is None:
            return (None, None) if cos is None and sin is None else None
        if cos is None or sin is None or cos.numel() != t * self.head_dim or sin.numel() != t * self.head_dim:
            return None
        cos, sin = cos.reshape(t, self.head_dim), sin.reshape(t, self.head_dim)
        if t > 1 and rows > 1:  # one row per step row (row r is token r % t of cache row r // t)
            cos, sin = cos.repeat(rows, 1), sin.repeat(rows, 1)
        cos = cos if cos.dtype == torch.float32 and cos.is_contiguous() else cos.float().contiguous()
        sin = sin if sin.dtype == torch.float32 and sin.is_contiguous() else sin.float().contiguous()
        return cos, sin

    def _cache_state(self, cache: KVCache, rows: int, t: int, n: int) -> _CacheState | None:
        """The checked buffers of the first ``n`` layers of ``cache`` when a step of ``t`` tokens of
        ``rows`` rows can write them in place (every layer at one length, room for the tokens)."""
        pos = cache.lengths[0]
        keys, values = cache.keys[:n], cache.values[:n]
        state = self._state
        if state is None or not state.holds(cache, keys, values):
            state = self._state = _CacheState.check(cache, keys, values, rows)
            if state is None:
                return None
        if (pos + t > state.capacity or state.rows != rows or cache.lengths[:n] != [pos] * n
                or state.inference and not torch.is_inference_mode_enabled()):
            return None
        return state

    def step_ends(self, embed: Any, norm: Any, lm_head: Any, head: Any = None, positions: Any = None
                  ) -> _Ends | None:
        """:func:`_ends` for the modules around the layers: ``embed`` the input embedding, ``norm``
        the final norm (an RMSNorm module: ``weight``, ``eps``, ``numerics``; GPT-2's
        :class:`torch.nn.LayerNorm` with ``positions``, its learned positions' embedding), ``lm_head``
        the LM head module and ``head`` what computes it (the prepared inference route's; default the
        module). None when one does not fit or has a hook (they then run as modules). Kept while
        the modules, their tensors' memory and the hooks registered anywhere
        (``RemovableHandle.next_id``) stay the same; it holds references to the tensors, so its
        pointers stay valid."""
        head = lm_head if head is None else head
        tensors, extras = _end_tensors(embed, norm, head), gpt2_extras(norm, positions, self.hidden)
        if tensors is None or extras is None:
            return None
        held = extras + tensors  # (the head's weight last: _copy_ends reads it there)
        eps, llama = float(norm.eps), is_llama_numerics(norm.__dict__.get("numerics", "genkit"))
        key = (RemovableHandle.next_id, id(embed), id(norm), id(lm_head), id(head), id(positions), eps, llama,
               *((id(t), t.data_ptr()) for t in held))
        if self._ends is not None and self._ends[0] == key:
            return self._ends[1]
        from .llama_infer import has_hooks

        fits = not has_hooks([embed, norm, lm_head] + ([] if positions is None else [positions]))
        ends = _ends(embed, tensors[-2], eps, llama, head, self.hidden, self.gemv, extras) if fits else None
        self._ends = (key, ends, held)
        return ends

    def logits(self, ids: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any, ends: _Ends
               ) -> torch.Tensor | None:
        """A decode step of token ``ids`` ``(rows, 1)`` through every layer in one call, embedding,
        final norm and LM head included (``ends``: :meth:`step_ends`): the logits ``(rows, 1,
        vocab)``, or None: take the usual path (nothing has been written then; an id outside the
        vocabulary too, so that the embedding module reports it)."""
        out = torch.empty(ids.shape[0], 1, ends.outputs)
        return _live(out, ends) if self._one_call(ids, cos, sin, cache, ends, out, 0, None) else None

    def argmax(self, ids: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any, ends: _Ends
               ) -> torch.Tensor | None:
        """A greedy decode step: :meth:`logits`' step, and of each row's logits only the index of the
        first maximum ``(rows,)`` (numpy's argmax: a NaN counts as the largest), computed in the same
        call. A float32 head (the gemv route) is read through its 8-bit copy, and only the logits that
        can be the largest are computed exactly (``gk_decode_top`` in block_kernel.c says why the
        token is the one all of them give); the copy is made at the first such step (1.125 bytes per
        head weight, kept while the head's tensor is unchanged). None: take the usual path."""
        tokens = torch.empty(ids.shape[0], dtype=torch.long)
        return tokens if self._one_call(ids, cos, sin, cache, ends, None, -1, tokens) else None

    def top(self, ids: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any, ends: _Ends, k: int
            ) -> torch.Tensor | None:
        """:meth:`logits`' step for a filter to the ``k`` largest logits: the logits ``(rows, 1,
        vocab)`` exact at every entry that can be among the ``k`` largest (ties included, and with room
        for a temperature's rounding), -inf elsewhere; through the float32 head's 8-bit copy as
        :meth:`argmax` (batch 1 on the gemv route; elsewhere every logit is computed). None: take the
        usual path."""
        out = torch.empty(ids.shape[0], 1, ends.outputs)
        return _live(out, ends) if self._one_call(ids, cos, sin, cache, ends, out, k, None) else None

    def _one_call(self, ids: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any, ends: _Ends,
                  logits: torch.Tensor | None, top: int, tokens: torch.Tensor | None) -> bool:
        """``gk_decode_top`` for a step of ``ids`` ``(rows, 1)`` into ``logits`` or ``tokens`` (``top``:
        0 every logit, k > 0 those that can be among the k largest, -1 the argmax alone); False
        (nothing written) where it does not take this step."""
        rows = ids.shape[0]
        if type(cache) is not KVCache or ids.shape != (rows, 1) or ids.device.type != "cpu" or self.dense and rows != 1:
            return False  # (the gemv route is batch-1 decode's)
        n = len(self.layers)
        state, tables = self._cache_state(cache, rows, 1, n), self._tables(cos, sin, 1, 1)
        if state is None or tables is None:
            return False
        ids = ids if ids.dtype == torch.long and ids.is_contiguous() else ids.long().contiguous()
        cos, sin = tables
        pos = cache.lengths[0]
        ends, copy = self._copy_ends(ends) if top else (ends, None)  # (held through the call: see _copy_ends)
        rc = block_kernel.library().gk_decode_top(
            n, self.table, ctypes.byref(ends), ids.data_ptr(), rows, self.hidden, _address(cos), _address(sin), pos,
            state.karr, state.varr, state.capacity, torch.get_num_threads(), 0 if logits is None else logits.data_ptr(),
            top, 0 if tokens is None else tokens.data_ptr())
        del copy
        if rc == -5:
            return False
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        cache.lengths[:n] = [pos + 1] * n
        cache.ahead = None
        return True

    def verify(self, ids: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any, ends: _Ends,
               logits: torch.Tensor | None = None, head_copy: bool = True) -> torch.Tensor | None:
        """A speculative step's check on a batch-1 cache: the tokens ``ids`` ``(T,)`` (T <= 16) at the
        cache's next T positions, run as rows of one step (``gk_decode_verify``; ``cos``/``sin``: one
        ``head_dim`` row per token), and for each the first maximum of its logits ``(T,)``: the token
        greedy search picks after it, as a one-token step computes it. Writes the T positions'
        keys and values and advances the cache by T; with ``logits`` (a contiguous float32 ``(T,
        vocab)`` tensor) the logits are left there too, and without, with ``head_copy``, a float32 head
        is read through its 8-bit copy as :meth:`argmax` reads it (once for all T rows). None, with
        nothing written, where this step does not apply (another cache, no room)."""
        t = ids.shape[0]
        tables = self._tables(cos, sin, t, 1)
        if type(cache) is not KVCache or ids.dim() != 1 or not 1 <= t <= 16 or tables is None:
            return None
        if logits is not None and (logits.shape != (t, ends.outputs) or logits.dtype != torch.float32
                                   or not logits.is_contiguous()):
            return None
        n = len(self.layers)
        state = self._cache_state(cache, 1, t, n)
        if state is None:
            return None
        ids = ids if ids.dtype == torch.long and ids.is_contiguous() else ids.long().contiguous()
        cos, sin = tables
        pos, tokens = cache.lengths[0], torch.empty(t, dtype=torch.long)
        copy = None
        if logits is None and head_copy:
            ends, copy = self._copy_ends(ends)  # (held through the call)
        elif logits is None and ends.proxy:
            # the whole head: the ends without the copy an earlier step filled in (which other steps read)
            ends = type(ends).from_buffer_copy(ends)
            ends.proxy = None
        rc = block_kernel.library().gk_decode_verify(
            n, self.table, ctypes.byref(ends), ids.data_ptr(), t, self.hidden, _address(cos), _address(sin), pos,
            state.karr, state.varr, state.capacity, torch.get_num_threads(), tokens.data_ptr(),
            None if logits is None else logits.data_ptr())
        del copy
        if rc == -5:
            return None
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        cache.lengths[:n] = [pos + t] * n
        cache.ahead = None
        return tokens

    def _copy_ends(self, ends: _Ends) -> tuple[_Ends, Any]:
        """``ends`` with the 8-bit copy of its float32 head filled in (made now if the head's tensor is
        new or was written since; left empty where the copy cannot be made or the head is of blocks),
        and the copy's tensors, which the caller holds while the kernel reads them (another thread
        making a copy at the same time may replace this one)."""
        if not self.dense or self._ends is None or self._ends[1] is not ends:
            return ends, None
        weight = self._ends[2][-1]
        key = (id(weight), weight.data_ptr(), weight._version, ends.head_ld)
        if self._proxy is None or self._proxy[0] != key:
            self._proxy = None  # the old copy goes first
            try:
                copy = block_kernel.head_proxy(weight)
            except (RuntimeError, MemoryError) as exc:  # (torch's out-of-memory error is a RuntimeError)
                logger.warning("no 8-bit copy of the LM head for greedy steps (%s): every logit is computed", exc)
                copy = None
            # the exact columns' product, looked up once with the copy (the library lookup is 24 us a step)
            cols = ctypes.cast(_dense_library().gk_gemv_t_cols, ctypes.c_void_p).value if copy is not None else None
            self._proxy = (key, copy, cols)
        _, made, cols = self._proxy
        ends.proxy, ends.bound = (made[0].data_ptr(), made[1].data_ptr()) if made is not None else (None, None)
        ends.proxy_rows = made[0].shape[0] * block_kernel.ROWS if made is not None else 0
        ends.gemv_cols = cols
        return ends, made

    def final_logits(self, x: torch.Tensor, ends: _Ends) -> torch.Tensor:
        """The logits ``(rows, vocab)`` of hidden states ``x`` ``(rows, hidden)`` that came out of this
        decoder: the final norm and LM head of ``ends`` (:meth:`step_ends`) in one call, computed as
        :meth:`logits` computes them."""
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        out = torch.empty(x.shape[0], ends.outputs)
        rc = block_kernel.library().gk_logits(ctypes.byref(ends), x.data_ptr(), x.shape[0], self.hidden, out.data_ptr(),
                                              torch.get_num_threads())
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        return _live(out, ends)

    def final_argmax(self, x: torch.Tensor, ends: _Ends) -> torch.Tensor:
        """The greedy tokens ``(rows,)`` of hidden states ``x`` ``(rows, hidden)`` that came out of this
        decoder: the first maximum of the logits :meth:`final_logits` gives (a NaN counts as the
        largest), a float32 head read through its 8-bit copy as :meth:`argmax` reads it (``gk_argmax``)."""
        x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.long)
        ends, copy = self._copy_ends(ends)  # (held through the call)
        rc = block_kernel.library().gk_argmax(ctypes.byref(ends), x.data_ptr(), x.shape[0], self.hidden,
                                              tokens.data_ptr(), torch.get_num_threads())
        del copy
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        return tokens

    def steps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: dict[Any, Any], cache: Any,
              num_layers: int | None) -> torch.Tensor:
        """``numerics="llama.cpp"``: ``x`` ``(rows, T, hidden)`` through :meth:`__call__`, up to
        :data:`PROMPT_ROWS` tokens per call as rows of one step (llama.cpp computes a prompt batch's rows
        independently, each as a decode step computes its row, so the rows give the same bits);
        NotSupportedError where a step cannot run here (a padding mask, a cache of another kind...)."""
        t = x.shape[1]
        if type(cache) is KVCache:  # room for the whole prompt first (the one-call step needs its buffers)
            n = len(self.layers) if num_layers is None else num_layers
            end = cache.lengths[0] + t
            for i, p in enumerate(self.layers[:n]):
                k = cache.keys[i]
                if k is None or end > k.shape[2] or k.shape[0] != x.shape[0]:
                    cache._grow(i, x.new_empty(x.shape[0], p.num_kv_heads, 1, p.head_dim), end)
        outs = []
        for i in range(0, t, PROMPT_ROWS):
            j = min(t, i + PROMPT_ROWS)
            ci = cos[i:j] if cos.dim() == 2 else cos[..., i:j, :]
            si = sin[i:j] if sin.dim() == 2 else sin[..., i:j, :]
            # a batch-1 mask of a prompt is the causal pattern, which the step's rows follow
            out = self(x[:, i:j], ci, si, masks if t == 1 else dict.fromkeys(masks), cache, num_layers)
            if out is None:
                raise NotSupportedError(UNSUPPORTED)
            outs.append(out)
        return outs[0] if t == 1 else torch.cat(outs, dim=1)

    def paged(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor,
              store: Any, blocks: list[list[int]]) -> torch.Tensor | None:
        """Continuous batching's decode step in one ``gk_decode_paged`` call: ``x`` ``(T, hidden)``,
        one token of each of ``T`` requests, token ``i`` at ``positions[i]`` holding ``blocks[i]`` of
        the paged ``store`` (:class:`genkit.models.paged.PagedKVStore`), its rotary tables' rows
        ``cos[i]``, ``sin[i]`` (None for layers without rotary positions: GPT-2); its keys and values
        are written there. Returns ``x`` after every layer, or None: take the torch path."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.shape != (rows, self.hidden):
            return None
        tables = self._tables(cos, sin, rows, 1)
        buffers = self._store_buffers(store)
        if tables is None or buffers is None:
            return None
        cos, sin = tables
        width = max(len(b) for b in blocks)
        table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
        pos = positions.to(torch.int32).contiguous()
        out = x.contiguous().clone()
        rc = block_kernel.library().gk_decode_paged(len(self.layers), self.table, out.data_ptr(), rows, self.hidden,
                                                    _address(cos), _address(sin), pos.data_ptr(), buffers.karr,
                                                    buffers.varr, table.data_ptr(), width, store.block_size,
                                                    torch.get_num_threads())
        if rc:
            raise MemoryError("the block kernel could not allocate its scratch memory")
        return out

    def _store_buffers(self, store: Any) -> _Buffers | None:
        """The paged ``store``'s checked buffers (float32, contiguous, one per layer, this head
        size), or None when they do not fit the kernel; checked once per store (:class:`_Buffers`)."""
        keys, values = store.keys, store.values
        if self._paged is not None and self._paged.holds(store, keys, values):
            return self._paged
        if len(keys) != len(self.layers) or len(values) != len(keys) or keys[0].shape[3] != self.head_dim:
            return None
        if any(k.dtype != torch.float32 or not k.is_contiguous() for k in (*keys, *values)):
            return None
        self._paged = _Buffers(store, keys, values)
        return self._paged
