"""issue 32, float32 batch 1: genkit's own matrix-vector kernel (genkit/models/dense_kernel.c, the
"gemv" path of the kernel choice). Its products equal torch's within the float32 bound of two
summation orders, on both weight layouts, views of fused weights, 1-4 rows, odd sizes and 1-2
threads, in the native and the portable build; the AVX-512 branch compiles everywhere; without a C
compiler (or with GENKIT_BLOCK_KERNEL=0) the path does not exist and GENKIT_KERNEL=decode:gemv is
refused by name."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F
from test_block_kernel import one_call_and_torch_path
from test_continuous_batching import _greedy
from tolerance import U32, gamma, hidden_bound, matmul_bound, norm_and_head_bound

from genkit.cli import main as cli_main
from genkit.errors import ConfigError
from genkit.models import block_kernel, dense_kernel, kernel_choice
from genkit.models.block_decode import BlockDecoder
from genkit.models.llama_infer import rms_norm
from genkit.models.tiny import tiny_llama

CC = block_kernel._compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler: the gemv path does not exist here")

SHAPES = [(49, 37), (960, 576), (130, 1536), (3, 2), (2053, 67)]  # (out, in): odd sizes, tails of 4 and 16


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path))
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    kernel_choice.CHOSEN.clear()
    yield tmp_path
    torch.set_num_threads(torch.get_num_threads())


def _layouts(n: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    fused = torch.randn(n + 7, k, generator=g).t().contiguous().t()  # a row block of a fused column-major weight
    wide = torch.randn(n, k + 5, generator=g)
    return {"column-major": w.t().contiguous().t(), "row-major": w, "fused view": fused[3:3 + n],
            "row view": wide[:, 2:2 + k]}


def _check(threads: int) -> None:
    g = torch.Generator().manual_seed(threads)
    torch.set_num_threads(threads)
    for n, k in SHAPES:
        for layout, w in _layouts(n, k, g).items():
            gemv = dense_kernel.Gemv(w)
            assert gemv.fn is not None, layout
            for rows in (1, 2, 3, 4, 8, 16):
                x = torch.randn(rows, k, generator=g)
                got, want = gemv(x), F.linear(x, w)
                bound = matmul_bound(x, w).float() + torch.finfo(torch.float32).tiny
                assert ((got - want).abs() <= bound).all(), (layout, n, k, rows, (got - want).abs().max())
            bias = torch.randn(n, generator=g)
            x = torch.randn(2, 1, k, generator=g)
            got = gemv(x, bias)
            assert got.shape == (2, 1, n)
            assert ((got - F.linear(x, w, bias)).abs() <= matmul_bound(x[:, 0], w).float()[:, None] + 1e-6).all()


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
def test_products_equal_torchs_within_the_float32_bound(threads):
    assert dense_kernel.available()
    _check(threads)


def _prepared_input(pre: int, x: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, float]:
    """What Gemv.fused multiplies, as torch computes it, and the relative bound on the kernel's own
    evaluation of it (RMSNorm: a K-term sum of squares, then sqrt, division and two products;
    the gate: exp, a sum, a division and a product, with exp's implementations up to 2 ulps apart)."""
    k = x.shape[-1] // (2 if pre == dense_kernel.PRE_GATE else 1)
    if pre == dense_kernel.PRE_RMS:
        return rms_norm(x, norm, 1e-5), gamma(k) + 6 * U32
    if pre == dense_kernel.PRE_GATE:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up, 8 * U32
    return x, 0.0


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pre", ["none", "rms", "gate"])
def test_fused_products_equal_torchs_ops_within_the_float32_bound(threads, pre):
    """Gemv.fused (the layer's RMSNorm or MLP gate before the product, the residual add after it,
    in one kernel call) against torch's ops one by one: the product's bound for two summation
    orders, plus the prepared input's own rounding carried through |W|, plus the residual add's."""
    code = {"none": dense_kernel.PRE_NONE, "rms": dense_kernel.PRE_RMS, "gate": dense_kernel.PRE_GATE}[pre]
    g = torch.Generator().manual_seed(7)
    torch.set_num_threads(threads)
    for n, k in SHAPES:
        for layout, w in _layouts(n, k, g).items():
            gemv = dense_kernel.Gemv(w)
            for rows in (1, 2, 4, 8):
                x = torch.randn(1, rows, 2 * k if code == dense_kernel.PRE_GATE else k, generator=g)
                norm, residual = torch.randn(k, generator=g), torch.randn(1, rows, n, generator=g)
                got = gemv.fused(x, code, norm, 1e-5, residual)
                xs, rel = _prepared_input(code, x[0], norm)
                product = F.linear(xs, w)
                want = residual[0] + product
                bound = (matmul_bound(xs, w) + rel * (xs.abs().double() @ w.abs().double().t())
                         + 2 * U32 * want.abs().double()).float() + torch.finfo(torch.float32).tiny
                assert got is not None and got.shape == (1, rows, n)
                assert ((got[0] - want).abs() <= bound).all(), (layout, n, k, rows, (got[0] - want).abs().max())
                assert gemv.fused(x, code, norm, 1e-5, None) is not None


@needs_cc
def test_fused_declines_what_the_kernel_does_not_take():
    """More rows than MAX_ROWS, another dtype, a non-contiguous input or a residual of the wrong
    size: None, and the layer runs torch's ops instead (genkit/models/llama_infer.py:_gemv)."""
    w = torch.randn(40, 24).t().contiguous().t()
    gemv = dense_kernel.Gemv(w)
    assert gemv.fused(torch.randn(dense_kernel.MAX_ROWS + 1, 24), dense_kernel.PRE_NONE) is None
    assert gemv.fused(torch.randn(1, 24, dtype=torch.float64), dense_kernel.PRE_NONE) is None
    assert gemv.fused(torch.randn(24, 2).t()[:1], dense_kernel.PRE_NONE) is None
    assert gemv.fused(torch.randn(1, 24), dense_kernel.PRE_NONE, residual=torch.randn(1, 39)) is None
    assert gemv.fused(torch.randn(1, 24), dense_kernel.PRE_GATE) is None  # the gate needs 2 x 24 values per row
    assert gemv.fused(torch.randn(3, 24), dense_kernel.PRE_GATE) is None


@needs_cc
def test_it_is_built_into_the_verified_kernel_cache(home, monkeypatch, capsys):
    monkeypatch.setattr(dense_kernel, "_libs", {})  # this process loads it again, from this GENKIT_HOME
    assert cli_main(["info"]) == 0
    assert "float32 gemv kernel (dense path 'gemv'): built" in capsys.readouterr().out
    built = list((home / "kernels").glob("genkit_dense-*.so"))
    assert len(built) == 1 and built[0].with_name(built[0].name + ".sha256").exists()


@needs_cc
def test_the_portable_build_gives_the_same_bound(monkeypatch):
    monkeypatch.setenv(block_kernel.ENV_SWITCH, "portable")
    assert dense_kernel.available()
    _check(2)


@needs_cc
def test_more_rows_than_the_kernel_takes_run_on_torchs_linear():
    w = torch.randn(64, 48).t().contiguous().t()
    x = torch.randn(dense_kernel.MAX_ROWS + 1, 48)
    assert torch.equal(dense_kernel.Gemv(w)(x), F.linear(x, w))  # the same call, bit for bit
    row_major = torch.randn(64, 48)
    x = torch.randn(dense_kernel.MAX_ROWS_ROW_MAJOR + 1, 48)
    assert torch.equal(dense_kernel.Gemv(row_major)(x), F.linear(x, row_major))


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
def test_a_laid_out_weights_rows_up_to_max_rows_have_the_bits_of_each_row_alone(threads):
    """Up to MAX_ROWS rows of a laid-out weight run on the kernel (not torch's linear, which a batch of 5-16
    rows took before session 36 at 1.6-2x the time), each row's product the bits it has alone: a batch's
    rows (sequences, a speculative check's tokens) get batch-1's products."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g).t().contiguous().t()
    gemv = dense_kernel.Gemv(w)
    for rows in (5, 8, dense_kernel.MAX_ROWS):
        x = torch.randn(rows, 80, generator=g)
        got = gemv(x)
        assert all(torch.equal(got[i], gemv(x[i:i + 1])[0]) for i in range(rows)), rows
        # torch's linear within the bound of two float32 summation orders (tolerance.matmul_bound), as _check
        assert ((got - F.linear(x, w)).abs() <= matmul_bound(x, w).float() + torch.finfo(torch.float32).tiny).all()


@needs_cc
@pytest.mark.parametrize("flags", [[], ["-mavx2", "-mfma"], ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]])
def test_every_vector_branch_compiles_without_warnings(tmp_path, flags):
    """The vector code is written once for 16 floats: check it compiles, warnings as errors, for the
    portable, AVX2 and AVX-512 targets on any machine (only the native one runs here)."""
    out = tmp_path / "dense.so"
    proc = subprocess.run([CC, "-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall", "-Werror", *flags,
                           str(dense_kernel.SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and "unrecognized" in proc.stderr:
        pytest.skip(f"{CC} does not know {flags}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nm = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True, check=False).stdout
    assert "gk_gemv_t" in nm and "gk_gemv_n" in nm and "gk_gemv_pre" in nm


@pytest.mark.parametrize("why", ["no compiler", "switched off"])
def test_without_the_kernel_a_forced_gemv_is_refused_by_name(why, monkeypatch, tmp_path, capsys):
    if why == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        monkeypatch.setenv(block_kernel.ENV_SWITCH, "0")
    assert not dense_kernel.available()
    assert cli_main(["info"]) == 0
    assert "float32 gemv kernel (dense path 'gemv'): not available" in capsys.readouterr().out
    monkeypatch.setenv(kernel_choice.ENV, "decode:gemv")
    model = tiny_llama(seed=5)
    with pytest.raises(ConfigError, match=r"GENKIT_KERNEL asks for 'gemv' \(decode\), which this CPU or build does "
                                          r"not have; available here: plain"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("num_layers", [None, 1])
def test_the_gemv_route_runs_a_decode_step_in_one_call_as_the_torch_path_does(num_layers, monkeypatch):
    """Batch-1 decode on the gemv route runs every layer in one block-kernel call (gk_decode with the
    dense kernel's product): the torch path's hidden state within the float32 bound of the same
    computation summed in another order, the new keys and values written into the same cache;
    more rows keep their own routes."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = tiny_llama(seed=5)
    ids = torch.tensor([[1, 17, 33, 5, 60, 9]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)  # prepares the routes
        prepared = model._prepared[1]
        decoder = prepared.decoder
        assert isinstance(decoder, BlockDecoder) and decoder.dense and not decoder.llama
        pos = ids.shape[1]
        x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        cos, sin = model.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
        ours_cache, torch_cache = (model(ids, use_cache=True).past_key_values for _ in range(2))
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, ours_cache, torch_cache, num_layers)
        assert ours is not None and not torch.equal(ours, x)
        n = num_layers or len(prepared.layers)
        torch.testing.assert_close(ours, want, rtol=0, atol=hidden_bound(model.config, pos + 1, n, want))
        assert ours_cache.lengths == torch_cache.lengths == [pos + 1] * n + [pos] * (len(prepared.layers) - n)
        for got, ref in zip(ours_cache.keys[:n], torch_cache.keys[:n]):
            torch.testing.assert_close(got[:, :, :pos], ref[:, :, :pos], rtol=0, atol=0)  # the prompt's, untouched
            assert got[:, :, pos].abs().sum() > 0  # the new position's, written
        three = torch.randn(3, 1, model.config.hidden_size)
        assert decoder(three, cos, sin, {None: None}, model(ids.repeat(3, 1), use_cache=True).past_key_values,
                       None) is None  # 3 rows: the small route's products


def _step_fast_and_with_ends_as_modules(model, norm, ids):
    """A decode step of token 77 after ``ids`` on the one-call decoder with its ends in the call, and the
    same step with the ends as modules (a hook on the final ``norm`` keeps them there), each on its own
    cache: (fast logits, usual logits, the norm's output, the two caches)."""
    seen = []
    with torch.no_grad():
        fast_cache, usual_cache = (model(ids, use_cache=True).past_key_values for _ in range(2))
        fast = model(torch.tensor([[77]]), past_key_values=fast_cache).logits
        assert model._prepared[1].decoder._ends[1] is not None  # the step took its ends into the call
        handle = norm.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
        try:
            usual = model(torch.tensor([[77]]), past_key_values=usual_cache).logits
        finally:
            handle.remove()
    assert len(seen) == 1 and fast.shape == usual.shape == (1, 1, model.config.vocab_size)
    for a, b in zip(fast_cache.keys + fast_cache.values, usual_cache.keys + usual_cache.values):
        assert torch.equal(a[:, :, :7], b[:, :, :7])  # the same layers on the same embedding (and position) row
    return fast.reshape(1, -1), usual.reshape(1, -1), seen[0].reshape(1, -1)


@pytest.mark.parametrize("tied", [False, True])
def test_the_gemv_routes_step_with_its_ends_in_one_call_equals_the_modules(tied, monkeypatch):
    """On the gemv route a batch-1 decode step runs from token id to logits in one call: the float32
    embedding row (a tied head's column-major table read with its strides), every layer, the final
    RMSNorm and the LM head on the dense kernel. Against the same step with the ends as modules (a
    hook on the final norm keeps them there): the same layers, the norm summed in another order, the
    head the same float product on either norm's output (tolerance.norm_and_head_bound)."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = tiny_llama(seed=6, tie_word_embeddings=tied)
    if tied:
        model.tie_weights()
    ids = torch.tensor([[1, 17, 33, 5, 60, 9]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)  # prepares the routes (and lays out a tied table)
    assert model._prepared[1].decoder.dense
    assert (model.model.embed_tokens.weight.stride(0) == 1) is tied  # column-major when it is the head's
    fast, usual, h = _step_fast_and_with_ends_as_modules(model, model.model.norm, ids)
    assert ((fast - usual).abs() <= norm_and_head_bound(h, model.lm_head.weight.detach(), matmul_bound)).all()


def test_continuous_batching_steps_one_request_on_the_gemv_route_with_generates_bits(monkeypatch):
    """A continuous-batching step of one decoding request runs where the kernel choice put one row
    (the gemv route: the one-call decoder, over the paged store) and so gives generate's logits bit
    for bit; a prompt of several tokens takes the route chosen for that many rows (plain here), as
    generate's prompt does."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    from genkit.models.paged import StepBatch

    monkeypatch.setenv(kernel_choice.ENV, "decode:gemv,small:plain,prefill:plain")
    model = tiny_llama(seed=7)
    ids = [1, 17, 33, 5, 60, 9]
    n, steps = len(ids), 4
    kw = {"max_new_tokens": steps, "do_sample": False, "eos_token_id": None, "output_scores": True,
          "return_dict_in_generate": True}
    with torch.no_grad():
        one = model.generate(torch.tensor([ids]), **kw)
    assert model._prepared[1].decoder.dense
    store, blocks = model.new_paged_store(block_size=4, num_blocks=8), [[5, 2, 7]]
    with torch.inference_mode():
        got = [model.forward_paged(StepBatch(torch.tensor(ids), torch.arange(n), [(0, n)], [0], blocks, [True]), store)]
        for k in range(1, steps):
            token = one.sequences[0, n + k - 1:n + k]
            got.append(model.forward_paged(StepBatch(token, torch.tensor([n + k - 1]), [(0, 1)], [n + k - 1], blocks,
                                                     [True]), store))
    for k in range(steps):
        assert torch.equal(got[k][0], one.scores[k][0].float()), k


def test_continuous_batching_on_the_gemv_route_gives_greedy_generates_tokens(monkeypatch):
    """Where gemv won the small class, steps of up to 16 decoding requests run on the one-call
    decoder (the kernel's products over 5-16 rows too): six requests' greedy tokens are each one's
    own greedy generate's."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "decode:gemv,small:gemv,prefill:plain")
    model = tiny_llama(seed=8)
    prompts = [[3 + i, 40 + 7 * i, 9, 100 - i] + [11] * i for i in range(6)]
    with torch.no_grad():
        want = [_greedy(model, p, 12) for p in prompts]
    assert model._prepared[1].decoder.dense
    got = model.generate_batch(prompts, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert [o.generated_tokens for o in got.values()] == want


def _gpt2(tmp_path, **config):
    """genkit's GPT-2 loaded from a small random transformers checkpoint (2 layers of 64, 4 heads)."""
    transformers = pytest.importorskip("transformers")
    import genkit

    torch.manual_seed(1234)
    cfg = transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, initializer_range=0.1, **config)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path / "gpt2")
    return genkit.load_model(str(tmp_path / "gpt2"))


@pytest.mark.parametrize("config", [{}, {"scale_attn_by_inverse_layer_idx": True, "layer_norm_epsilon": 1e-3,
                                         "activation_function": "gelu_pytorch_tanh"}], ids=["gelu_new", "scaled"])
def test_gpt2s_decode_step_runs_in_one_call_as_the_torch_path_does(config, tmp_path, monkeypatch):
    """GPT-2's blocks on the gemv route run a batch-1 decode step in one block-kernel call too: the
    LayerNorms with their biases, every product's bias, GELU's tanh form, no rotary embedding, each
    layer's attention scale; the torch path's hidden state within the float32 bound of the same
    computation summed in another order, the new keys and values written."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = _gpt2(tmp_path, **config)
    ids = torch.tensor([[1, 17, 42, 99, 5, 23]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)  # prepares the routes
        prepared = model._prepared[1]
        assert isinstance(prepared.decoder, BlockDecoder) and prepared.decoder.dense
        table = prepared.decoder.table
        assert [(t.gelu, t.no_rope) for t in table] == [(1, 1)] * 2 and all(t.norm1_b and t.b_qkv for t in table)
        assert [t.scale for t in table] == ([0.25, 0.125] if config else [0.25, 0.25])  # 1 / (4 (layer + 1))
        pos = ids.shape[1]
        x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(0))
        ours_cache, torch_cache = (model(ids, use_cache=True).past_key_values for _ in range(2))
        ours, want = one_call_and_torch_path(prepared, x, None, None, ours_cache, torch_cache, None)
    assert ours is not None and not torch.equal(ours, x)
    torch.testing.assert_close(ours, want, rtol=0, atol=hidden_bound(model.config, pos + 1, 2, want))
    for got, ref in zip(ours_cache.keys + ours_cache.values, torch_cache.keys + torch_cache.values):
        torch.testing.assert_close(got[:, :, :pos], ref[:, :, :pos], rtol=0, atol=0)  # the prompt's, untouched
        torch.testing.assert_close(got[:, :, pos], ref[:, :, pos], rtol=0, atol=hidden_bound(
            model.config, pos + 1, 1, ref[:, :, pos]))


def test_gpt2_with_an_activation_the_kernel_lacks_keeps_the_torch_path(tmp_path, monkeypatch):
    """The step knows GELU's tanh form only: GPT-2 with the exact (erf) GELU has no one-call decoder
    and runs its layers on the gemv route's torch path."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = _gpt2(tmp_path, activation_function="gelu")
    with torch.no_grad():
        model.generate(torch.tensor([[1, 17, 42]]), max_new_tokens=1, do_sample=False)
    assert model._prepared[1].decoder is None
    assert type(model._prepared[1].layers[0].wqkv) is dense_kernel.Gemv


def test_biased_projections_run_in_one_call_as_the_torch_path_does(monkeypatch):
    """Biases of the q/k/v and o products (Qwen2's, ``attention_bias``) are added in the one-call step
    as the torch path adds them: its hidden state within the float32 bound."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = tiny_llama(seed=5, attention_bias=True)
    ids = torch.tensor([[1, 17, 33, 5, 60, 9]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prepared = model._prepared[1]
        assert prepared.decoder is not None and all(t.b_qkv and t.b_o and not t.b_gu for t in prepared.decoder.table)
        pos = ids.shape[1]
        x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        cos, sin = model.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
        ours_cache, torch_cache = (model(ids, use_cache=True).past_key_values for _ in range(2))
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, ours_cache, torch_cache, None)
    assert ours is not None
    torch.testing.assert_close(ours, want, rtol=0, atol=hidden_bound(model.config, pos + 1, 2, want))


def test_gpt2s_step_with_its_ends_in_one_call_equals_the_modules(tmp_path, monkeypatch):
    """On the gemv route GPT-2's batch-1 decode step runs from token id to logits in one call too:
    the token's embedding row plus its position's row of the learned positions, every layer, the
    final LayerNorm with its bias and the tied head (column-major) on the dense kernel. Against the
    same step with the ends as modules (a hook on ln_f keeps them there): the same layers on the same
    embedding (bit for bit: the same keys and values), the norm in another order
    (tolerance.norm_and_head_bound for a LayerNorm)."""
    if not dense_kernel.available() or not block_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    model = _gpt2(tmp_path)
    ids = torch.tensor([[1, 17, 42, 99, 5, 23]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)
    fast, usual, h = _step_fast_and_with_ends_as_modules(model, model.transformer.ln_f, ids)
    bound = norm_and_head_bound(h, model.lm_head.weight.detach(), matmul_bound, layer_norm=True)
    assert ((fast - usual).abs() <= bound).all()
