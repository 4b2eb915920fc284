"""The Llama family's inference path: the decoder layers as one plain function over laid-out weights.

Under ``torch.no_grad`` / ``torch.inference_mode``, with no module hooks, ``LlamaForCausalLM``
runs its layers through :func:`run_layers` instead of calling its ``nn.Module`` tree (GPT-2 too:
:class:`InferencePathModel` is what both models share, and a :class:`PreparedLayer` may hold
LayerNorms, an un-gated activation and no rotary positions; :func:`genkit.models.gpt2.prepare_layers`
makes GPT-2's, its ``Conv1D`` weights' transposes already column-major). Before the
first such call, :func:`prepare_layers` lays the weights out for it, in place: the q/k/v
projections of a layer share one storage, gate/up another, and the parameters become views of
those storages (so an in-place edit of a parameter is an edit of the fused matrix). On the CPU
every linear weight is stored column-major (``(in, out)`` in memory): a batch-1 decode step is a
chain of matrix-vector products bound by memory bandwidth, and BLAS streams that layout about 1.4x
faster. Float32 CPU models with big enough matrices also get oneDNN-packed copies of the weights
(:func:`pack`), the one place this path holds weights twice. The prepared weights are checked
against the module tree and the parameters' identity, storage and version counters when a cache
starts, and then kept for every step on that cache.

On a small model a decode step is dominated by per-call overhead, not arithmetic; this path cuts
a 2-layer, 64-wide step by about a third. The module path stays the reference (training, hooks)
and both give the same logits (tested).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_state
from torch.utils.hooks import RemovableHandle

from ..errors import NotSupportedError
from . import weight_arena
from .base import GenkitModel
from .dense_kernel import PRE_GATE, PRE_NONE, PRE_RMS, Gemv
from .kernel_choice import CLASSES, SMALL_MAX_ROWS
from .numerics import is_llama_numerics
from .quant import Int4Linear, WithBias

logger = logging.getLogger("genkit.models")

# below ~128K weights the fixed cost of a packed call (~10 us) outweighs its faster kernel
PACK_MIN_ELEMENTS = 1 << 17
# automatic packing keeps a second copy of the packed weights: only for models up to this size
PACK_MAX_BYTES = 2 << 30


class PreparedLayer(NamedTuple):
    wqkv: Any  # a weight tensor, or an Int4Linear
    bqkv: torch.Tensor | None
    norm1: torch.Tensor
    wo: Any  # a weight tensor, or an Int4Linear
    bo: torch.Tensor | None
    wgu: Any  # a weight tensor, or an Int4Linear
    bgu: torch.Tensor | None
    norm2: torch.Tensor
    wd: Any  # a weight tensor, or an Int4Linear
    bd: torch.Tensor | None
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    rotation: torch.Tensor | None  # rope's rotation (rotation_matrix); None: no rotary positions (GPT-2)
    packed: bool  # wqkv, wo, wgu, wd are oneDNN-packed copies (see pack())
    # Qwen3's per-head RMSNorms of q and k (weight, eps of q_norm; of k_norm), applied before rope; None: none
    qk_norm: tuple[torch.Tensor, float, torch.Tensor, float] | None = None
    # the biases of LayerNorms norm1 and norm2 (GPT-2); None: norm1 and norm2 are RMSNorms (the Llama family)
    norm_biases: tuple[torch.Tensor, torch.Tensor] | None = None
    # the MLP's activation on wgu's output, un-gated (GPT-2); None: SwiGLU over wgu's (gate, up) halves
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    scale: float | None = None  # the attention's score scale; None: 1 / sqrt(head_dim)


class PreparedModel:
    """Every layer's prepared weights and the packed LM head weight (None: call ``lm_head``). The
    model holds it; a cache refers to it weakly, so weights rebuilt since stay alive for no cache.

    ``routes`` maps each shape class (:func:`genkit.models.kernel_choice.shape_class`) to the
    ``(layers, head)`` its products run on (oneDNN-packed or plain, as the kernel choice decided);
    ``layers``/``head`` are the batch-1 decode class's."""

    __slots__ = ("__weakref__", "choice", "decoder", "head", "layers", "routes")

    def __init__(self, layers: list[PreparedLayer], head: torch.Tensor | None, decoder: Any = None,
                 routes: dict[str, tuple[list[PreparedLayer], torch.Tensor | None]] | None = None,
                 choice: Any = None) -> None:
        self.routes = routes or {cls: (layers, head) for cls in CLASSES}
        self.layers, self.head = self.routes["decode"]
        self.decoder = decoder  # a BlockDecoder: decode steps in one kernel call (quantized models; float32 on gemv)
        self.choice = choice  # the kernel_choice.Choice that made the routes (None: fixed by the caller)

    def for_rows(self, rows: int) -> tuple[list[PreparedLayer], torch.Tensor | None]:
        """``(layers, head)`` for products over ``rows`` rows (tokens times sequences)."""
        return self.routes["decode" if rows <= 1 else ("small" if rows <= SMALL_MAX_ROWS else "prefill")]


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU can pack ``dtype`` linear weights for oneDNN (float32: x86
    and most CPU builds; bfloat16: CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.equal(out.float(), torch.full((1, 4), 4.0)))
    except Exception as exc:  # noqa: BLE001 - any failure means: not available
        logger.debug("oneDNN weight packing unavailable for %s: %s", dtype, exc)
        return False


PACKED_DTYPES = (torch.float32, torch.bfloat16)  # oneDNN packs both; bfloat16 runs on the CPU's bf16 units


def packing_wanted(weights: list[torch.Tensor], setting: bool | None) -> bool:
    """Pack (``setting``: True forces, False refuses, None decides) float32 and bfloat16 CPU weights
    when the kernels exist, every matrix is big enough to gain and the copies stay under
    PACK_MAX_BYTES."""
    if setting is False or not weights:
        return False
    if any(w.device.type != "cpu" or w.dtype not in PACKED_DTYPES for w in weights):
        return False
    if not all(packing_available(dtype) for dtype in {w.dtype for w in weights}):
        return False
    if setting is None:
        too_small = min(w.numel() for w in weights) < PACK_MIN_ELEMENTS
        return not too_small and sum(w.numel() * w.element_size() for w in weights) <= PACK_MAX_BYTES
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed copy of an ``(out, in)`` weight: its small-batch matrix products run 1.5-3x
    faster than BLAS on the plain layout (batch-1 decode, beams)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    if type(weight) is Int4Linear:  # quantized: the layer runs its own kernel (no hooks on this path)
        return weight.forward(x) if bias is None else weight.forward(x) + bias
    if type(weight) is Gemv:  # genkit's own matrix-vector kernel on the plain weight (dense_kernel)
        return weight(x, bias)
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's ``gelu_new``; ``gelu_pytorch_tanh``, ``gelu_fast``): the
    activation the block kernel's one-call step computes for an un-gated MLP (``PreparedLayer.act``)."""
    return F.gelu(x, approximate="tanh")


def rotation_matrix(head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """``R`` with ``x @ R == cat(x2, x1)`` (the halves swapped); rope's sin table carries the sign."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim, dtype=like.dtype, device=like.device)
    idx = torch.arange(half, device=like.device)
    r[idx + half, idx] = 1.0
    r[idx, idx + half] = 1.0
    return r


def _column_major(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu"


def lay_out(weight: torch.Tensor) -> None:
    """Store one ``(out, in)`` weight column-major on the CPU (same values, same Parameter object)."""
    if _column_major(weight) and weight.dim() == 2 and weight.stride() != (1, weight.shape[0]):
        weight.data = column_major_copy(weight.detach())


def column_major_copy(weight: torch.Tensor) -> torch.Tensor:
    """A column-major copy of a 2-D ``weight`` in storage of its own: not ``.t().contiguous().t()``, a view
    whose base tensor would keep that storage alive after the weight is moved on (weight_arena.place
    replaces a tensor's data, not its base: SmolLM2's fused q/k/v and gate/up kept 265 MB twice)."""
    out = torch.empty_strided(weight.shape, (1, weight.shape[0]), dtype=weight.dtype, device=weight.device)
    return out.copy_(weight)


def fuse(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``(sum of outs, in)`` weight (and bias) whose row blocks the linears' parameters become views of."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if _column_major(weight):
        weight = column_major_copy(weight)
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                          for lin in linears])
    share_rows(linears, weight, bias)
    return weight, bias


def share_rows(linears: tuple[nn.Linear, ...], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Make the linears' parameters views of their row blocks of the fused ``weight`` (and ``bias``)."""
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[start:start + n]
        if lin.bias is not None:
            assert bias is not None
            lin.bias.data = bias[start:start + n]
        start += n


def has_hooks(modules: list[nn.Module]) -> bool:
    """True when any forward hook (global or on one of ``modules``) would be skipped by the plain path."""
    if getattr(_module_state, "_global_forward_hooks", None) or getattr(_module_state, "_global_forward_pre_hooks", None):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _qk_norms_fit(attn: nn.Module, norm_type: type) -> bool:
    """Whether an attention's q/k norms are none, or both ``norm_type`` (genkit's RMSNorm, not replaced)."""
    norms = [attn._modules.get(name) for name in ("q_norm", "k_norm")]
    return norms == [None, None] or all(type(n) is norm_type for n in norms)


def qk_norm(attn: nn.Module) -> tuple[torch.Tensor, float, torch.Tensor, float] | None:
    """A layer's :attr:`PreparedLayer.qk_norm`: the weights and epsilons of its attention's
    ``q_norm`` and ``k_norm`` (Qwen3), or None when it has none."""
    q, k = attn._modules.get("q_norm"), attn._modules.get("k_norm")
    if q is None or k is None:
        return None
    return q.weight, float(q.eps), k.weight, float(k.eps)


def prepare_layers(layers: nn.ModuleList, windows: list[int | None], lm_head: nn.Linear,
                   packing: bool | None) -> PreparedModel | None:
    """Lay out each layer's weights (see the module docstring), pack them when wanted, and list
    them; None when a submodule was replaced (e.g. by an adapter), which leaves the model to its
    modules."""
    from .llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm

    for layer in layers:
        if type(layer) is not LlamaDecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if (type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP
                or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                or not _qk_norms_fit(attn, RMSNorm)):
            return None
        lins = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if all(type(int4_of(lin)) is Int4Linear for lin in lins):
            continue
        if any(type(lin) is not nn.Linear for lin in lins):
            return None
    if all(type(int4_of(layer.self_attn.q_proj)) is Int4Linear for layer in layers):
        return _prepare_quantized(layers, windows, lm_head)
    if any(type(int4_of(layer.self_attn.q_proj)) is Int4Linear for layer in layers) or type(lm_head) is not nn.Linear:
        return None  # (float layers with a quantized head, a GGUF's tied Q8_0 embedding: the modules run)
    prepared = []
    # plain tensors even when the first call comes from inside generate(): the parameters keep them
    with torch.no_grad(), torch.inference_mode(False):
        fused = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            wqkv, bqkv = fuse((attn.q_proj, attn.k_proj, attn.v_proj))
            wgu, bgu = fuse((mlp.gate_proj, mlp.up_proj))
            lay_out(attn.o_proj.weight)
            lay_out(mlp.down_proj.weight)
            fused.append((wqkv, bqkv, wgu, bgu))
        lay_out(lm_head.weight)
        matrices = [w for (wqkv, _, wgu, _), layer in zip(fused, layers)
                    for w in (wqkv, layer.self_attn.o_proj.weight, wgu, layer.mlp.down_proj.weight)]
        if weight_arena.place([*matrices, lm_head.weight]):  # huge pages: the q/k/v and gate/up views follow
            for layer, (wqkv, bqkv, wgu, bgu) in zip(layers, fused):
                share_rows((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), wqkv, bqkv)
                share_rows((layer.mlp.gate_proj, layer.mlp.up_proj), wgu, bgu)
        rotations: dict[int, torch.Tensor] = {}  # one per head size, shared by the layers
        for layer, window, (wqkv, bqkv, wgu, bgu) in zip(layers, windows, fused):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.head_dim not in rotations:
                rotations[attn.head_dim] = rotation_matrix(attn.head_dim, wqkv)
            prepared.append(PreparedLayer(
                wqkv, bqkv, layer.input_layernorm.weight, attn.o_proj.weight, attn.o_proj.bias, wgu, bgu,
                layer.post_attention_layernorm.weight, mlp.down_proj.weight, mlp.down_proj.bias,
                layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, window,
                rotations[attn.head_dim], False, qk_norm(attn)))
    return finish_dense(prepared, lm_head, matrices, packing)


def finish_dense(layers: list[PreparedLayer], lm_head: nn.Linear, matrices: list[torch.Tensor],
                 packing: bool | None) -> PreparedModel:
    """The prepared model of float layers laid out for this path (``matrices``: their weights):
    plain, oneDNN-packed or gemv products per shape class (:func:`_dense_routes`), and batch-1
    decode in one kernel call where it runs on the gemv route and the layers fit the block kernel's
    step (the Llama graph: :meth:`~genkit.models.block_decode.BlockDecoder.build_dense`)."""
    from .block_decode import BlockDecoder

    with torch.no_grad(), torch.inference_mode(False):  # packed copies are plain tensors, as the parameters
        routes, choice = _dense_routes(layers, lm_head, matrices, packing)
    return PreparedModel(*routes["decode"], BlockDecoder.build_dense(routes["decode"][0]), routes=routes, choice=choice)


def _dense_routes(plain: list[PreparedLayer], lm_head: nn.Linear, matrices: list[torch.Tensor],
                  setting: bool | None) -> tuple[dict[str, tuple[list[PreparedLayer], Any]], Any]:
    """Per shape class, the plain, the oneDNN-packed or the gemv layers (:mod:`genkit.models.dense_kernel`):
    ``setting`` True packs every class, False none; None lets :mod:`genkit.models.kernel_choice`
    decide for models that can pack (or when ``GENKIT_KERNEL`` names a path)."""
    from . import kernel_choice

    wanted = packing_wanted(matrices, setting)
    asked = [p for p in kernel_choice.parse_override().values() if p in kernel_choice.FAMILIES["dense"]]
    if setting is None and "packed" in asked and not wanted and packing_wanted(matrices, True):
        wanted = True  # GENKIT_KERNEL=packed on a model below the packing size
    paths: dict[str, tuple[list[PreparedLayer], Any]] = {"plain": (plain, None)}
    if _gemv_wanted(matrices, setting, wanted, asked):
        paths["gemv"] = ([p._replace(wqkv=Gemv(p.wqkv), wo=Gemv(p.wo), wgu=Gemv(p.wgu), wd=Gemv(p.wd)) for p in plain],
                         Gemv(lm_head.weight) if lm_head.bias is None else None)
    if not wanted:  # with GENKIT_KERNEL set, the choice records it (and refuses a path it cannot run)
        choice = None if setting is not None or not asked else kernel_choice.choose(
            "dense", kernel_choice.dense_signature(matrices), tuple(paths), _dense_probe(paths, lm_head))
        return {cls: paths[choice.paths[cls] if choice else "plain"] for cls in CLASSES}, choice
    logger.info("packing %d linear weights for oneDNN (%.0f MB)", len(matrices) + 1,
                sum(w.numel() * w.element_size() for w in [*matrices, lm_head.weight]) / 2**20)
    packed = [p._replace(wqkv=pack(p.wqkv), wo=pack(p.wo), wgu=pack(p.wgu), wd=pack(p.wd), packed=True)
              for p in plain]
    paths = {"packed": (packed, pack(lm_head.weight) if lm_head.bias is None else None), **paths}
    if setting is True:
        return {cls: paths["packed"] for cls in CLASSES}, None
    choice = kernel_choice.choose("dense", kernel_choice.dense_signature(matrices), tuple(paths),
                                  _dense_probe(paths, lm_head))
    return {cls: paths[choice.paths[cls]] for cls in CLASSES}, choice


def _gemv_wanted(matrices: list[torch.Tensor], setting: bool | None, packing: bool, asked: list[str]) -> bool:
    """Whether the gemv path is offered: float32 CPU weights, the kernel built here, and a choice to
    make (a model that packs, or ``GENKIT_KERNEL`` naming gemv; the classes it does not name are
    then probed between plain and gemv)."""
    if setting is not None or not (packing or "gemv" in asked) or not matrices:
        return False
    if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in matrices):
        return False
    from . import dense_kernel

    return dense_kernel.available()


def _dense_probe(paths: dict[str, tuple[list[PreparedLayer], Any]], lm_head: nn.Linear) -> Any:
    """The probe's unit of work over ``rows`` rows on each path: for decode- and small-sized products,
    every layer's products with the work the route does around them (RMSNorm, rope, the MLP's gate,
    the residual adds: :func:`project_qkv` and :func:`layer_output`, which the gemv path runs inside
    its kernel calls), then the LM head (packed, gemv, or the module's plain weight), so the weights
    stream from memory in the step's own proportions (the head alone is a fifth of SmolLM2's
    bytes); two layers for prefill-sized products, which are bound by arithmetic. Attention and the
    cache, the same on every path, are left out."""
    inputs = _ProbeInputs()
    plain = paths["plain"][0]

    def run(path: str, rows: int) -> None:
        layers, head = paths[path]
        n = 2 if rows > SMALL_MAX_ROWS else len(plain)
        with torch.inference_mode():
            for ref, p in zip(plain[:n], layers[:n]):
                x = inputs(rows, ref.wqkv.shape[1], ref.norm1.dtype).view(1, rows, -1)
                cos = torch.ones(1, 1, rows, p.head_dim, dtype=x.dtype)
                project_qkv(p, x, cos, cos.new_zeros(()))
                layer_output(p, x, inputs(rows, ref.wo.shape[1], ref.norm1.dtype).view(1, rows, -1))
            if rows <= SMALL_MAX_ROWS:
                x = inputs(rows, lm_head.in_features, lm_head.weight.dtype)
                if head is not None:
                    linear(x, head, None, True)
                else:
                    lm_head(x)

    return run


class _ProbeInputs:
    """The probes' activations, one per ``(rows, width)``, drawn from a private generator: a probe at
    a model's first generation must leave the global RNG (a seeded run's sampling) as it was."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)
        self.made: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = self.made.get((rows, width))
        if x is None:
            x = self.made[(rows, width)] = torch.randn(rows, width, generator=self.generator).to(dtype)
        return x


def int4_of(layer: Any) -> Any:
    """The :class:`Int4Linear` of a quantized projection with a float bias (:class:`WithBias`: Qwen2's
    q/k/v in GGUF files, GPT-2's), else ``layer`` itself."""
    return layer.inner if type(layer) is WithBias and type(layer.inner) is Int4Linear else layer


def fused_bias(layers: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """The float biases of quantized projections computed as one (:class:`WithBias`'s; zeros for a
    layer without one), or None when none has a bias."""
    if not any(type(lin) is WithBias for lin in layers):
        return None
    return torch.cat([lin.bias if type(lin) is WithBias else torch.zeros(int4_of(lin).out_features) for lin in layers])


def _prepare_quantized(layers: nn.ModuleList, windows: list[int | None], lm_head: nn.Module) -> PreparedModel | None:
    """The prepared layers of a model whose projections are :class:`Int4Linear`, with or without a
    float bias (q/k/v and gate/up fused into one int4 layer each, their biases into one; the LM head
    runs as its module); None (the module path) when the sizes do not allow fusing."""
    from .llama import LlamaDecoderLayer

    prepared = []
    rotations: dict[int, torch.Tensor] = {}
    with torch.no_grad(), torch.inference_mode(False):
        for layer, window in zip(layers, windows):
            assert isinstance(layer, LlamaDecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm.weight
            if attn.head_dim not in rotations:
                rotations[attn.head_dim] = rotation_matrix(attn.head_dim, norm)
            qkv, gu = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
            wqkv = Int4Linear.fuse([int4_of(lin) for lin in qkv])
            wgu = Int4Linear.fuse([int4_of(lin) for lin in gu])
            if wqkv is None or wgu is None:
                return None
            prepared.append(PreparedLayer(
                wqkv, fused_bias(qkv), norm, int4_of(attn.o_proj), fused_bias((attn.o_proj,)), wgu, fused_bias(gu),
                layer.post_attention_layernorm.weight, int4_of(mlp.down_proj), fused_bias((mlp.down_proj,)),
                layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                window, rotations[attn.head_dim], False, qk_norm(attn)))
    from .block_decode import BlockDecoder

    place_blocks(prepared, lm_head)
    choice = blocks_choice(prepared, lm_head)  # (first: the decoder keeps the AMX threshold it sets)
    return PreparedModel(prepared, None, BlockDecoder.build(prepared), choice=choice)


def place_blocks(layers: list[PreparedLayer], lm_head: nn.Module) -> None:
    """The block kernel's weights of quantized prepared layers (and of a block-kernel LM head) in huge
    pages, in the order a step reads them: before a decoder keeps pointers to them."""
    head = [lm_head.blocks] if type(lm_head) is Int4Linear and lm_head.kernel == "blocks" else []
    weight_arena.place([w.blocks for p in layers for w in (p.wqkv, p.wo, p.wgu, p.wd) if w.kernel == "blocks"] + head)


def blocks_choice(prepared: list[PreparedLayer], lm_head: Any = None) -> Any:
    """The block kernel's path per shape class (its vector path, or AMX tiles where there are
    some), as :mod:`genkit.models.kernel_choice` decides, for quantized ``prepared`` layers (the
    Llama family's, GPT-2's); their block weights' (and a block ``lm_head``'s) ``amx_rows`` set from
    it: this model's own threshold, whatever other models in the process chose. None for torch's
    int4 kernel. Made before the layers' decoder is built (its entries keep the threshold)."""
    from . import block_kernel, kernel_choice

    if prepared[0].wgu.kernel != "blocks" or not block_kernel.simd():
        return None
    simd = "vnni" if block_kernel.simd() == "avx512-vnni" else "avx2"
    act = prepared[0].wgu.act  # llama.cpp's float order never runs on AMX tiles (gk_matmul): not offered it
    tiles = block_kernel.amx_available() and act not in (block_kernel.ACT_LLAMA_Q8_1, block_kernel.ACT_LLAMA_Q8_0)
    available = (simd, "amx") if tiles else (simd,)  # the default first: the vector path
    inputs = _ProbeInputs()
    probed = [w for p in prepared[:4] for w in (p.wqkv, p.wo, p.wgu, p.wd)]

    def run(path: str, rows: int) -> None:
        for w in probed:
            w.amx_rows = 1 if path == "amx" else 0
            w.forward(inputs(rows, w.in_features))

    # the activation rounding too: AMX's gain differs by it (Xeon guest, session 36: 0.62-0.88x the vector
    # path's time from 32 rows with two digits, 0.70-1.16x with one), so each rounding is probed on its own
    signature = f"{prepared[0].wgu.bits}bit;{prepared[0].wgu.out_features}x{prepared[0].wgu.in_features};act{act}"
    choice = kernel_choice.choose("blocks", signature, available, run)
    rows = {**kernel_choice.PROBE_MIN_ROWS, "prefill": block_kernel.AMX_PREFILL_MIN_ROWS}
    first_amx = next((rows[c] for c in kernel_choice.CLASSES if choice.paths[c] == "amx"), 0)
    head = [lm_head] if type(lm_head) is Int4Linear and lm_head.kernel == "blocks" else []
    for w in [w for p in prepared for w in (p.wqkv, p.wo, p.wgu, p.wd)] + head:
        w.amx_rows = first_amx  # one threshold: AMX from the first class that chose it
    return choice


class WeightsKey:
    """One walk of module trees: their modules and parameters. ``ids()`` is their identity (a
    submodule replaced or wrapped, a parameter's storage or contents changed); parameters made
    under ``torch.inference_mode`` have no version counter to take it from."""

    __slots__ = ("modules", "params")

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = [sub for m in modules for sub in m.modules()]
        self.params = [p for sub in self.modules for p in sub._parameters.values() if p is not None]

    def made_in_inference_mode(self) -> bool:
        return any(p.is_inference() for p in self.params)

    def ids(self) -> tuple[Any, ...]:
        return (tuple((id(sub), type(sub)) for sub in self.modules),
                tuple((id(p), p.data_ptr(), p._version) for p in self.params))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it (in float32 for lower precisions)."""
    if x.dtype == torch.float32:
        return weight * (x * (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_())
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def layer_norm(p: PreparedLayer, x: torch.Tensor, second: bool) -> torch.Tensor:
    """The layer's norm before its attention (``second`` False: ``norm1``) or its MLP (``norm2``):
    an RMSNorm, or a LayerNorm where the layer has :attr:`PreparedLayer.norm_biases` (GPT-2)."""
    weight = p.norm2 if second else p.norm1
    if p.norm_biases is None:
        return rms_norm(x, weight, p.eps)
    return F.layer_norm(x, weight.shape, weight, p.norm_biases[second], p.eps)


def project_qkv(p: PreparedLayer, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a decoder layer: ``(q, k, v)`` of ``x`` ``(batch, seq, hidden)``, each
    ``(batch, heads, seq, head_dim)``, rope applied to ``q`` and ``k`` (after their per-head norms,
    where the layer has them: Qwen3; none where it has no rotation: GPT-2) (the paged forward shares it)."""
    b, t, _ = x.shape
    nq, nkv = p.num_heads, p.num_kv_heads
    qkv = _gemv(p.wqkv, x, PRE_RMS, p.norm1, p.eps, p.bqkv) if p.norm_biases is None else None
    if qkv is None:
        qkv = linear(layer_norm(p, x, False), p.wqkv, p.bqkv, p.packed)
    if t == 1:  # decode step: (b, 1, H*d) is already (b, H, 1, d) in memory
        qkv = qkv.view(b, nq + 2 * nkv, 1, p.head_dim)
    else:
        qkv = qkv.view(b, t, nq + 2 * nkv, p.head_dim).transpose(1, 2)
    if p.qk_norm is None:
        qk = qkv[:, : nq + nkv]
    else:  # Qwen3: each head of q and k RMS-normalised before the rotary embedding
        qw, q_eps, kw, k_eps = p.qk_norm
        qk = torch.cat((rms_norm(qkv[:, :nq], qw, q_eps), rms_norm(qkv[:, nq:nq + nkv], kw, k_eps)), dim=1)
    if p.rotation is not None:
        qk = torch.addcmul(qk * cos, torch.matmul(qk, p.rotation), sin)  # rope on q and k at once
    return qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]


def layer_output(p: PreparedLayer, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The second half of a decoder layer: the output projection of ``attention`` ``(batch, seq,
    heads * head_dim)`` added to ``x``, then the MLP's residual step (the paged forward shares it)."""
    h = _gemv(p.wo, attention, PRE_NONE, None, 0.0, p.bo, x)
    x = x + linear(attention, p.wo, p.bo, p.packed) if h is None else h
    gu = _gemv(p.wgu, x, PRE_RMS, p.norm2, p.eps, p.bgu) if p.norm_biases is None else None
    if gu is None:
        gu = linear(layer_norm(p, x, True), p.wgu, p.bgu, p.packed)
    if p.act is not None:  # un-gated (GPT-2)
        return x + linear(p.act(gu), p.wd, p.bd, p.packed)
    out = _gemv(p.wd, gu, PRE_GATE, None, 0.0, p.bd, x)
    if out is None:
        gate, up = gu.chunk(2, dim=-1)
        out = x + linear(F.silu(gate).mul_(up), p.wd, p.bd, p.packed)
    return out


def _gemv(weight: Any, x: torch.Tensor, pre: int, norm: torch.Tensor | None, eps: float, bias: torch.Tensor | None,
          residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """A product with the work around it (RMSNorm or the MLP's gate before it, the residual after
    it) in one call of genkit's gemv kernel (:meth:`genkit.models.dense_kernel.Gemv.fused`), where
    the weight runs on it and has no bias; None otherwise (the caller runs the torch ops)."""
    if type(weight) is not Gemv or bias is not None:
        return None
    return weight.fused(x, pre, norm, eps, residual)


def run_layers(prepared: PreparedModel, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
               masks: dict[int | None, torch.Tensor | None], cache: Any,
               hidden: list[torch.Tensor] | None, num_layers: int | None = None) -> torch.Tensor:
    """The decoder layers (the first ``num_layers``, or all) on ``x`` (batch, seq, hidden); fills
    ``hidden`` with each layer's input. ``cos``/``sin``: the rotary tables (None where the layers
    have no rotation: GPT-2)."""
    b, t, _ = x.shape
    if prepared.layers and is_llama_numerics(getattr(prepared.layers[0].wqkv, "numerics", "genkit")):
        # numerics="llama.cpp": every step on the block kernel's decoder, no torch path
        if prepared.decoder is None or hidden is not None or any(m is not None and m.shape[0] != 1 for m in masks.values()):
            from .block_decode import UNSUPPORTED

            raise NotSupportedError(UNSUPPORTED)
        return prepared.decoder.steps(x, cos, sin, masks, cache, num_layers)
    if t == 1 and hidden is None and prepared.decoder is not None:
        out = prepared.decoder(x, cos, sin, masks, cache, num_layers)
        if out is not None:
            return out
    layers, _ = prepared.for_rows(b * t)
    for i, p in enumerate(layers[:num_layers]):
        if hidden is not None:
            hidden.append(x)
        q, k, v = project_qkv(p, x, cos, sin)
        if cache is not None:
            k, v = cache.update(i, k, v)
        mask = masks[p.window]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=p.scale, enable_gqa=p.num_kv_heads != p.num_heads)
        out = out.reshape(b, 1, -1) if t == 1 else out.transpose(1, 2).reshape(b, t, -1)
        x = layer_output(p, x, out)
    return x


# torch.compiler.disable in torch's lazy form: torch._dynamo (about 1 s of imports) is imported at the first
# call, not when genkit is; the public decorator where a torch lacks it
_untraced: Callable[[Any], Any] = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def module_path() -> bool:
    """Whether to run the modules rather than the inference path: with autograd on (training), and
    under ``torch.compile`` (preparing edits parameters in place, and inductor cannot lower the
    oneDNN-packed weights)."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling()


class InferencePathModel(GenkitModel):
    """A native model whose decoder layers run on this path (:class:`~genkit.models.llama.LlamaForCausalLM`,
    :class:`~genkit.models.gpt2.GPT2LMHeadModel`): its prepared weights (made by :meth:`_prepare`,
    checked against :meth:`_path_modules` when a cache starts, kept on the cache for its steps),
    dropped when ``.to()`` moves the parameters, made contiguous again for training, never pickled."""

    #: oneDNN-packed copies of the linear weights for the inference path (see docs/models.md):
    #: None packs float32 and bfloat16 CPU models whose matrices are big enough to gain and whose copies stay
    #: under 2 GiB; True always packs (float32 or bfloat16, CPU); False never does.
    cpu_weight_packing: bool | None = None
    _prepared: tuple[tuple[Any, ...], PreparedModel | None] | None = None

    def _path_modules(self) -> list[nn.Module]:
        """The modules the prepared weights come from: the decoder layers and the LM head."""
        raise NotImplementedError

    def _prepare(self) -> PreparedModel | None:
        """The prepared weights of :meth:`_path_modules` (laid out in place), or None: run the modules."""
        raise NotImplementedError

    def inference_path(self, cache: Any, past_len: int, attentions: list[torch.Tensor] | None) -> PreparedModel | None:
        """The prepared weights a forward's layers run on, or None: the modules (autograd on,
        ``torch.compile``, attention weights asked for, hooks, replaced submodules)."""
        if torch.is_grad_enabled() and self._prepared is not None:
            self._contiguous_for_training()
        # output_attentions runs the modules: the inference path computes no attention weights
        return None if module_path() or attentions is not None else self._inference_weights(cache, past_len)

    def _inference_weights(self, cache: Any, past_len: int) -> PreparedModel | None:
        """Prepared weights for the plain inference path, or None for the module path (hooks, adapters).

        Checked when a cache starts and then kept on the cache: later steps on it skip the check.
        """
        if cache is not None and past_len > 0:
            kept, prepared = self._weights_on(cache)
            if kept:
                return prepared
        prepared = None
        key = WeightsKey(self._path_modules())  # one walk of the trees: the check runs at every prefill
        # parameters made under torch.inference_mode (a model built or loaded there) have no version
        # counter to key them by and cannot be laid out in place: such a model runs its modules
        if not has_hooks(key.modules) and not key.made_in_inference_mode():
            if self._prepared is None or self._prepared[0] != self._prepared_key(key.ids(), self._prepared[1]):
                self._prepared = None  # drop old packed copies first
                prepared = self._prepare()
                # laying out changed the parameters' storage: key what they are now
                self._prepared = (self._prepared_key(WeightsKey(self._path_modules()).ids(), prepared), prepared)
            prepared = self._prepared[1]
        if cache is not None:  # weakly: a kept cache keeps neither the model nor weights rebuilt since
            cache.prepared = (weakref.ref(self), None if prepared is None else weakref.ref(prepared),
                              RemovableHandle.next_id)
        return prepared

    def _prepared_key(self, ids: tuple[Any, ...], prepared: PreparedModel | None) -> tuple[Any, ...]:
        """What prepared weights are kept for: the packing setting, the weights' ``ids`` and, where a
        kernel choice made their routes, the thread count (the choice is per count: weights prepared
        at 1 thread are prepared again, and their choice taken, when the process runs at 2)."""
        threads = torch.get_num_threads() if prepared is not None and prepared.choice is not None else None
        return (self.cpu_weight_packing, threads, ids)

    def _weights_on(self, cache: Any) -> tuple[bool, PreparedModel | None]:
        """(True, the prepared weights ``cache`` started with, or None for the module path); (False,
        None) when it did not start on this model, its weights have been rebuilt since, or a hook
        has been registered since (every registration numbers a new handle: e.g. between two
        generations that continue one cache)."""
        if (cache.prepared is None or cache.prepared[0]() is not self
                or cache.prepared[2] != RemovableHandle.next_id):
            return False, None
        if cache.prepared[1] is None:
            return True, None
        prepared = cache.prepared[1]()
        return prepared is not None, prepared

    def _apply(self, fn: Any, recurse: bool = True) -> InferencePathModel:
        # .to() / .half() / .cuda(): prepared weights of the old dtype or device (fused storages,
        # packed copies) must not stay alive until the next generation
        out = super()._apply(fn, recurse)
        if self._prepared is not None:
            storages = [(id(p), p.data_ptr()) for m in self._path_modules() for p in m.parameters()]
            _packing, _threads, (_tree, params) = self._prepared[0]
            if storages != [entry[:2] for entry in params]:
                self._prepared = None
        return out

    @_untraced  # edits parameters in place: never traced
    def _contiguous_for_training(self) -> None:
        """Give trainable parameters their own contiguous storage again (autograd on after a generation).

        Fused optimizers (``fused=True`` on the CPU) step a parameter, its gradient and its state as
        flat memory: with the inference layout's strides their updates land on the wrong elements.
        """
        params = [p for m in self._path_modules() for p in m.parameters()]
        if not any(p.requires_grad for p in params):
            return
        laid_out = [p for p in params if not p.is_contiguous()]
        with torch.no_grad():
            for p in laid_out:
                p.data = p.data.contiguous()
        if laid_out:
            self._prepared = None

    def __getstate__(self) -> dict[str, Any]:
        # deepcopy / torch.save(model) leave the prepared weights behind (oneDNN-packed tensors
        # cannot be copied or pickled); they are rebuilt on first use
        return {**super().__getstate__(), "_prepared": None}

    @property
    def weights_packed(self) -> bool:
        """Whether the inference path runs on oneDNN-packed weights (decided at the last cache start)."""
        prepared = self._prepared[1] if self._prepared is not None else None
        return bool(prepared is not None and any(layers and layers[0].packed for layers, _ in prepared.routes.values()))

    def output_logits(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        prepared = self._weights_on(cache)[1] if cache is not None and not module_path() else None
        head = prepared.for_rows(x.numel() // x.shape[-1])[1] if prepared is not None else None
        if head is not None:
            return linear(x, head, None, True)
        return self.lm_head(x)  # type: ignore[no-any-return]
