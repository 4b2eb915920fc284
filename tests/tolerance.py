"""Tolerances of the numeric tests, derived from the computation compared -- never tuned to one CPU.

The model of floating point (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2.2 and
3.1): every operation rounds its exact result to the format, a relative error of at most the unit
roundoff ``u = eps / 2`` (float32 ``2**-24``, bfloat16 ``2**-8``, float16 ``2**-11``). A sum of ``K``
terms, in any order, is within ``gamma_K * sum |term|`` of the exact sum, ``gamma_K = K u / (1 - K u)``.
Two evaluations of the same sum that differ only in their order -- SIMD width, blocking, threads,
the kernel the CPU dispatches to (AVX2, AVX-512, AMX, oneDNN's packed weights) -- are therefore
within ``2 gamma_K sum |term|`` of each other. Every bound below is that, summed along a computation.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: the largest relative error of one rounding to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


U32 = unit_roundoff(torch.float32)  # 2**-24
U_BF16 = unit_roundoff(torch.bfloat16)  # 2**-8
# genkit's block kernel writes each activation as two int8 digits per block of 32 (x ~ dx * (q1 + q2 / 254),
# genkit/models/block_kernel.c): each element's error is at most 1/64,516 of its block's largest |x|, so the
# error vector's norm is at most sqrt(32) / 64,516 of the activation's (a block's largest square is at most
# the sum of its 32 squares)
U_BLOCK_ACTIVATION = 1 / 64516
U_BLOCK_ACTIVATION_NORM = math.sqrt(32) * U_BLOCK_ACTIVATION


def gamma(k: int, u: float = U32) -> float:
    """``gamma_K``: the relative error bound of a ``k``-term sum, to ``sum |term|``."""
    ku = k * u
    assert ku < 1, f"{k} terms at unit roundoff {u}: no useful bound"
    return ku / (1 - ku)


def matmul_bound(a: torch.Tensor, b: torch.Tensor, u: float = U32) -> torch.Tensor:
    """Elementwise bound on the difference of two evaluations of ``a @ b.T`` (``K = a.shape[-1]``
    terms each) summed in different orders: ``2 gamma_K (|a| @ |b|.T)``, in float64."""
    terms = a.abs().double() @ b.abs().double().transpose(-1, -2)
    return 2 * gamma(a.shape[-1], u) * terms


def _dims(config) -> tuple[int, int, int, int]:
    """(hidden, intermediate, head_dim, layers) of a genkit or transformers config (GPT-2 names too)."""
    def get(key: str) -> int | None:
        return getattr(config, key, None)

    hidden = get("hidden_size") or get("n_embd")
    heads = get("num_attention_heads") or get("n_head")
    inner = get("intermediate_size") or get("n_inner") or 4 * hidden
    head_dim = get("head_dim") or (128 if get("model_type") == "qwen3" else hidden // heads)  # Qwen3Config's default
    layers = get("num_hidden_layers") or get("n_layer")
    return int(hidden), int(inner), int(head_dim), int(layers)


def forward_relative_bound(config, seq_len: int, *, store_u: float = 0.0, linear_u: float = 0.0,
                           layers: int | None = None) -> float:
    """Relative bound (to the norm of the vectors compared) on the difference of two forward passes
    of one decoder (Llama family or GPT-2) through ``layers`` blocks (default all, then the final
    norm and the LM head) computing the same function in different orders.

    Along a block the dependent steps are: the norm (a sum of ``H`` squares), q/k/v (``H`` terms), the
    attention scores (``head_dim``), the softmax denominator and the weighted values (``seq_len``
    each), o_proj (``H``), the second norm (``H``), gate/up (``H``), down (``I``), and about ten
    elementwise roundings (rotary, exp, SiLU, products, residual adds). Each evaluation's error is
    within ``gamma`` of the sum of those lengths (float32 accumulation); ``store_u`` adds one rounding
    per stored tensor (12 per block; bfloat16 outputs: ``U_BF16``) and ``linear_u`` one per linear
    layer's input (5 per block: an activation rounding such as ``U_BLOCK_ACTIVATION_NORM``). To first order
    the relative errors add along the chain (each block's condition number taken as 1: the norms and
    the residual stream keep these models there), and two evaluations differ by twice one's bound.
    Qwen3's per-head norms of q and k add a sum of ``head_dim`` squares and five roundings (the mean,
    eps, the inverse square root, two products) before the scores, and two stored tensors. GPT-2's
    LayerNorms sum ``H`` values before their ``H`` squares (two more sums of ``H`` per block) and its
    GELU adds about ten roundings (the cube, the tanh or exp, the products).
    """
    hidden, inner, head_dim, n_layers = _dims(config)
    n = n_layers if layers is None else layers
    qk_norm = getattr(config, "model_type", None) == "qwen3"
    gpt2 = getattr(config, "model_type", None) == "gpt2"
    block_terms = (6 * hidden + head_dim + 2 * seq_len + inner + 10 + ((head_dim + 5) if qk_norm else 0)
                   + ((2 * hidden + 10) if gpt2 else 0))
    # the final norm (H terms; counted for a hidden state too, which may be the normalised last one) and the head
    terms = n * block_terms + (2 * hidden if layers is None else hidden)
    stores = n * (14 if qk_norm else 12) + (2 if layers is None else 0)
    linears = n * 5 + (1 if layers is None else 0)
    return 2 * (gamma(terms) + stores * store_u + linears * linear_u)


def _final_norm_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The final norm and the LM head of a Llama-family or GPT-2 model (genkit's, transformers', or
    one wrapped by genkit's adapter)."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        for norm in ("model.norm", "transformer.ln_f"):
            if name == norm or name.endswith("." + norm):
                head = name[: -len(norm)] + "lm_head"
                return module, modules[head]
    raise TypeError(f"{type(model).__name__}: no final norm (model.norm or transformer.ln_f)")


def head_terms(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> float:
    """The largest ``sum_i |h_i W_ji|`` of the LM head on this input: ``h`` the final norm's output
    (caught by a hook on a reference run), ``W_j`` the head's rows, read through the layer itself
    (``head(I)``: packed or quantized alike). The logits' error is relative to this, not to the logits
    (which cancellation can make small)."""
    (norm, head), caught = _final_norm_and_head(model), []
    handle = norm.register_forward_hook(lambda _m, _a, out: caught.append(out.detach()))
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask)
            eye = torch.eye(norm.weight.shape[-1], dtype=caught[0].dtype, device=caught[0].device)
            rows = head(eye).float()  # (H, V)
    finally:
        handle.remove()
    return float((caught[0].float().abs() @ rows.abs()).max())


def logits_bound(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 seq_len: int | None = None, **kw: float) -> float:
    """Absolute bound on the difference of two evaluations of ``model``'s logits on ``input_ids``
    (``seq_len``: the attended length when it is not the input's, e.g. decode steps on a cache; see
    :func:`forward_relative_bound` for ``kw``): the relative bound times :func:`head_terms`."""
    length = input_ids.shape[-1] if seq_len is None else seq_len
    return forward_relative_bound(model.config, length, **kw) * head_terms(model, input_ids, attention_mask)


def hidden_bound(config, seq_len: int, layers: int, reference: torch.Tensor, **kw: float) -> float:
    """Absolute bound on the difference of two evaluations of the hidden state after ``layers``
    blocks, elementwise: ``|d h_i| <=`` the relative bound times the largest ``|h_i|`` of the reference."""
    return forward_relative_bound(config, seq_len, layers=layers, **kw) * float(reference.float().abs().max())


def block_product_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|block_kernel.matmul(x, W) - x @ W.T|`` (``x``: (M, K), ``W``: (N, K)
    dense float32). The kernel's integer sums are exact; its activations are rounded to two int8
    digits per block of 32 (each ``|dx_i| <= U_BLOCK_ACTIVATION * max |x|`` of its block), and its
    float32 scaling and the sum over blocks, like the float reference, stay within ``gamma_K``:
    ``sum_i |W_ji| blockmax_i / 64,516 + 2 gamma_K sum_i |x_i W_ji|``."""
    k = x.shape[-1]
    blockmax = x.abs().reshape(*x.shape[:-1], k // 32, 32).amax(-1, keepdim=True).expand(*x.shape[:-1], k // 32, 32)
    rounding = U_BLOCK_ACTIVATION * (blockmax.reshape(x.shape).double() @ w.abs().double().t())
    return rounding + matmul_bound(x, w)


def norm_and_head_bound(h: torch.Tensor, w: torch.Tensor, product=None, layer_norm: bool = False) -> torch.Tensor:
    """Elementwise bound on the difference of two evaluations of an LM head after two RMSNorms of the
    same hidden states (the kernel's sum of squares and torch's, in other orders): ``h`` (M, K) one
    norm's output, ``W`` (N, K) the head's rows. Each norm is within ``gamma(K + 6)`` of the exact
    one, relative, per element (K squares summed, the mean, eps, the square root, its inverse and two
    products), so the two differ by ``rel = 2 gamma(K + 6)`` of ``|h|``; the head's float product
    carries that over (``rel |h| |W|``), and each side's product stays within ``product(h, W)`` (of
    inputs up to ``1 + rel`` times larger): :func:`block_product_bound` (the default, the block
    kernel's head) or :func:`matmul_bound` (a float32 head). ``layer_norm`` (GPT-2's LayerNorm): K
    values summed for the mean before the K squared differences, and the subtraction and the bias
    after: ``gamma(2K + 8)`` each."""
    rel = 2 * gamma(2 * h.shape[-1] + 8 if layer_norm else h.shape[-1] + 6)
    one = (product or block_product_bound)(h, w).double()
    return 2 * one * (1 + rel) + rel * (h.abs().double() @ w.abs().double().t())


def bf16_operands_bound(x: torch.Tensor, w: torch.Tensor, w_terms: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|kernel(x, W) - x @ W.T|`` for a kernel that rounds the activations and
    the weights' parts (scale times code, offset: ``w_terms = |d| u + |m|`` summed over the parts) to
    bfloat16 and accumulates in float32: each term moves by at most ``U_BF16 (|x_i| |W_ji| + |x_i|
    w_terms_ji)`` (plus the second-order product), on top of the two summation orders."""
    ax = x.abs().double()
    rounding = U_BF16 * (ax @ w.abs().double().t() + (1 + U_BF16) * (ax @ w_terms.double().t()))
    return rounding + matmul_bound(x, w)


def score_bound(model, sequences: torch.Tensor, scores: torch.Tensor) -> float:
    """Bound on the difference of two evaluations of beam scores ``scores`` (sums of the log-probs of
    a beam's new tokens, divided by a length penalty ``len**p``, ``p >= 0``) of ``sequences``: a
    log-softmax moves each entry by at most twice its input's largest error (the log-sum-exp moves
    by at most that), so each of the ``n`` terms by ``2 logits_bound``; summing them adds
    ``gamma_n sum |log p| = gamma_n |sum|`` (log-probs are all <= 0); the division only shrinks it."""
    n = sequences.shape[-1]
    return 2 * n * logits_bound(model, sequences) + sum_bound(n, scores)


def sum_bound(n: int, sums: torch.Tensor) -> float:
    """Bound on the difference of two ``n``-term float32 sums of terms of one sign, in two orders:
    ``2 gamma_n |sum|`` (for terms of one sign ``sum |term| = |sum|``)."""
    return 2 * gamma(n) * float(sums.abs().max())


def frequency_bound(n: int, k: int, delta: float = 1e-6) -> float:
    """The L1 distance between the frequencies of ``n`` independent draws from a distribution on
    ``k`` outcomes and the distribution, exceeded with probability at most ``delta`` (1e-6: whatever
    the seed or the CPU): ``P(||f - p||_1 >= e) <= (2**k - 2) exp(-n e**2 / 2)`` (Weissman et al.,
    2003), so ``e = sqrt(2 (k ln 2 + ln(1 / delta)) / n)``. Any one outcome's frequency is within
    half of it (the deviations above and below sum to the same)."""
    return math.sqrt(2 * (k * math.log(2) + math.log(1 / delta)) / n)
