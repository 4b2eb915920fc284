"""Qwen3ForCausalLM (dense): per-head RMSNorms of q and k (``q_norm``/``k_norm``) after the projections,
before the rotary embedding. The module, inference, packed and sliding-window paths are in
test_models_parity.py (its ``qwen3*`` configs); here: sampling, continuous batching, the one-call
decoders (quantized, float32 gemv, self-speculation: the norms in the kernel's step), save_pretrained,
the transformers view, and GGUF files (F32, Q8_0, Q4_0) against transformers' GGUF loader on the same
file. References: transformers on the same weights, and the per-layer torch path."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_block_kernel import _prefilled, one_call_and_torch_path
from test_models_parity import CONFIGS, _hf_model
from test_quantized import IDS, MASK, _same_or_near_tie, kernel_of, quantized_roundoff, write_quantized_gguf
from tolerance import U_BLOCK_ACTIVATION_NORM, hidden_bound, logits_bound

import genkit
from genkit.errors import ModelFileError, NotSupportedError, UnsupportedModelError
from genkit.models import block_kernel, dense_kernel
from genkit.models.block_decode import BlockDecoder

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROMPT = torch.tensor([[1, 17, 42, 99, 5, 23]])
IDS3 = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
MASK3 = (IDS3 != 0).long()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(folder, transformers model, genkit model): a tiny Qwen3 with random q/k norms, GQA, head_dim 128."""
    torch.manual_seed(1234)
    hf = _hf_model(CONFIGS["qwen3"]())
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return path, hf, genkit.load_model(path)


def test_the_norms_are_loaded_and_run(qwen3):
    _path, hf, ours = qwen3
    attn = ours.model.layers[1].self_attn
    assert attn.head_dim == 128 and attn.q_norm.weight.shape == (128,)
    assert torch.equal(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    ours.generate(PROMPT, max_new_tokens=2)
    prepared = ours._prepared[1]
    assert prepared.layers[1].qk_norm[2] is attn.k_norm.weight  # the inference path reads the module's norms


@pytest.mark.parametrize("kw", [{"temperature": 0.9}, {"temperature": 0.7, "top_k": 8, "top_p": 0.9}])
def test_sampling_draws_identical_to_transformers_under_the_same_seed(qwen3, kw):
    _path, hf, ours = qwen3
    torch.manual_seed(7)
    ref = hf.generate(IDS3, attention_mask=MASK3, do_sample=True, max_new_tokens=32, pad_token_id=0,
                      eos_token_id=None, **kw)
    torch.manual_seed(7)
    got = ours.generate(IDS3, attention_mask=MASK3, do_sample=True, max_new_tokens=32, eos_token_id=None, **kw)
    assert torch.equal(got, ref)


def test_continuous_batching_gives_the_tokens_of_generate(qwen3):
    _path, hf, ours = qwen3
    assert ours.paged_unsupported() is None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 160, (int(n),), generator=g).tolist() for n in (3, 9, 1, 14, 6)]
    config = genkit.GenerationConfig(prefill_chunk_size=4, continuous_batching_config={
        "block_size": 4, "num_blocks": 64, "max_batch_tokens": 16})
    results = ours.generate_batch(prompts, config, max_new_tokens=32, do_sample=False, eos_token_id=None)
    for out, prompt in zip(results.values(), prompts):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert out.error is None and out.generated_tokens == ref[0, len(prompt):].tolist()


def _without_decoder(model, run):
    """``run()`` on the per-layer torch path: the prepared model's one-call decoder set aside meanwhile."""
    prepared = model._prepared[1]
    decoder, prepared.decoder = prepared.decoder, None
    try:
        return run()
    finally:
        prepared.decoder = decoder


@pytest.mark.skipif(block_kernel._compiler() is None or not dense_kernel.available(),
                    reason="no C compiler: no gemv route nor one-call decoder here")
def test_gemv_route_runs_the_one_call_decoder_and_self_speculation(qwen3, gemv_route):
    """On the gemv route a Qwen3's batch-1 decode steps run on the float32 one-call decoder, its q/k norms
    in the kernel's step: greedy tokens are transformers' and the torch path's, and self-speculation
    (which drafts and checks on that decoder) gives the same tokens."""
    path, hf, _ = qwen3
    ours = genkit.load_model(path)
    ref = hf.generate(PROMPT, do_sample=False, max_new_tokens=32, min_new_tokens=32)
    kw = {"max_new_tokens": 32, "eos_token_id": None}  # (no logits processor: greedy steps give the token alone)
    ours.self_speculation = False
    assert torch.equal(ours.generate(PROMPT, **kw), ref)
    prepared = ours._prepared[1]
    assert type(prepared.layers[0].wqkv).__name__ == "Gemv"  # the route ran
    assert isinstance(prepared.decoder, BlockDecoder) and prepared.decoder.dense
    assert prepared.decoder.table[0].q_norm == prepared.layers[0].qk_norm[0].data_ptr()
    assert torch.equal(_without_decoder(ours, lambda: ours.generate(PROMPT, **kw)), ref)
    ours.self_speculation = True
    assert torch.equal(ours.generate(PROMPT, **kw), ref)
    assert ours.speculation_stats["checks"] > 0 and ours.speculation_stats["drafted"] > 0


def test_save_pretrained_round_trip(qwen3, tmp_path):
    _path, hf, ours = qwen3
    ours.generate(PROMPT, max_new_tokens=2)  # laid out for the inference path first
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 128
    back_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back_hf).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(back_hf(PROMPT).logits, hf(PROMPT).logits)
    assert torch.equal(genkit.load_model(tmp_path)(PROMPT).logits, ours(PROMPT).logits)


def test_transformers_view_generates_transformers_tokens(qwen3):
    from genkit.models.hf_view import transformers_view

    _path, hf, ours = qwen3
    view = transformers_view(ours)
    assert type(view.config).__name__ == "Qwen3Config"
    ref = hf.generate(PROMPT, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(view.generate(PROMPT, do_sample=False, max_new_tokens=16, min_new_tokens=16), ref)


def test_a_checkpoint_without_its_norms_is_refused_by_name(qwen3, tmp_path):
    from safetensors.torch import load_file

    from genkit.models.saving import write_safetensors

    path, _hf, _ours = qwen3
    state = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if "q_norm" not in k}
    write_safetensors(str(tmp_path / "model.safetensors"), state)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelFileError, match=r"missing tensors \['model\.layers\.0\.self_attn\.q_norm\.weight'"):
        genkit.load_model(tmp_path)


def test_unknown_architectures_list_qwen3(tmp_path):
    config = json.loads(json.dumps(CONFIGS["qwen3"]().to_dict()))
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"unknown architecture 'Qwen3MoeForCausalLM'; supported: .*"
                                                    r"Qwen2ForCausalLM, Qwen3ForCausalLM"):
        genkit.load_model(tmp_path)


# -- GGUF -------------------------------------------------------------------------------------------

def _hf_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


def test_f32_gguf_matches_transformers_gguf_load(tmp_path):
    """llama.cpp's converter writes Qwen3's q/k rows as they are (no rope permutation, as for Qwen2):
    genkit and transformers read the same weights; head_dim from ``qwen3.attention.key_length``."""
    path = tmp_path / "qwen3-f32.gguf"
    write_quantized_gguf(path, "F32", "F32", tied=False, arch="qwen3", head_dim=128, seed=3)
    hf, ours = _hf_gguf(path), genkit.load_model(path)
    assert ours.config.head_dim == 128 and ours.config.model_type == "qwen3"
    for name, ref in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[name], ref), name
    torch.testing.assert_close(ours(IDS, attention_mask=MASK).logits[MASK.bool()],
                               hf(IDS, attention_mask=MASK).logits[MASK.bool()],
                               atol=logits_bound(ours, IDS, MASK), rtol=0)
    ref = hf.generate(IDS[:1], do_sample=False, max_new_tokens=32, min_new_tokens=32)
    assert torch.equal(ours.generate(IDS[:1], max_new_tokens=32, min_new_tokens=32), ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_runs_quantized_on_the_one_call_decoder(tmp_path, qtype):
    """Kept quantized (the block kernel's layers), decode steps on the one-call decoder (its q/k norms
    in the kernel's step) giving the torch path's tokens; the de-quantized model is transformers' GGUF
    load of the same file; continuous batching gives generate's tokens."""
    from genkit.models.quant import Int4Linear

    path = tmp_path / f"qwen3-{qtype}.gguf"
    write_quantized_gguf(path, qtype, "Q8_0", tied=True, arch="qwen3", head_dim=128, seed=4)
    q, f, hf = genkit.load_model(path), genkit.load_model(path, dequantize=True), _hf_gguf(path)
    assert type(q.model.layers[0].self_attn.q_proj) is Int4Linear
    torch.testing.assert_close(f(IDS, attention_mask=MASK).logits[MASK.bool()],
                               hf(IDS, attention_mask=MASK).logits[MASK.bool()],
                               atol=logits_bound(f, IDS, MASK), rtol=0)
    lq, lf = q(IDS, attention_mask=MASK).logits, f(IDS, attention_mask=MASK).logits
    assert (lq - lf).abs().max() <= logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    kw = {"max_new_tokens": 32, "eos_token_id": None, "pad_token_id": 0}
    out_q = q.generate(IDS, attention_mask=MASK, **kw)
    assert torch.equal(f.generate(IDS, attention_mask=MASK, **kw),
                       hf.generate(IDS, attention_mask=MASK, do_sample=False, **kw))
    _same_or_near_tie(f, out_q, f.generate(IDS, attention_mask=MASK, **kw), MASK)
    one = q.generate(IDS[:1], **kw)
    if kernel_of(q) == "blocks":
        assert isinstance(q._prepared[1].decoder, BlockDecoder)
        assert torch.equal(_without_decoder(q, lambda: q.generate(IDS[:1], **kw)), one)
    batch = q.generate_batch([IDS[0].tolist()], max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert batch["req_0"].generated_tokens == one[0, IDS.shape[1]:].tolist()


@pytest.mark.skipif(not block_kernel.available(), reason="no C compiler for the block kernel")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_quantized_qwen2_gguf_runs_its_biased_projections_on_the_one_call_decoder(tmp_path, qtype):
    """Qwen2's q/k/v carry float biases (WithBias on the int4 layers): the layers take the inference
    path, their biases fused as q/k/v are, and decode steps the one-call decoder (the biases added in
    the kernel's step). Against the per-layer torch path: the hidden state within the bound of the
    same computation in another order, the same greedy tokens; the de-quantized model is transformers'
    GGUF load of the file; continuous batching gives generate's tokens."""
    from genkit.models.quant import Int4Linear, WithBias

    path = tmp_path / f"qwen2-{qtype}.gguf"
    write_quantized_gguf(path, qtype, "Q8_0", tied=True, arch="qwen2", seed=4)
    q, f, hf = genkit.load_model(path), genkit.load_model(path, dequantize=True), _hf_gguf(path)
    attn = q.model.layers[0].self_attn
    assert type(attn.q_proj) is WithBias and type(attn.q_proj.inner) is Int4Linear and type(attn.o_proj) is Int4Linear
    torch.testing.assert_close(f(IDS, attention_mask=MASK).logits[MASK.bool()],
                               hf(IDS, attention_mask=MASK).logits[MASK.bool()],
                               atol=logits_bound(f, IDS, MASK), rtol=0)
    lq, lf = q(IDS, attention_mask=MASK).logits, f(IDS, attention_mask=MASK).logits
    assert (lq - lf).abs().max() <= logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    prepared = q._prepared[1]
    assert prepared is not None and isinstance(prepared.decoder, BlockDecoder)
    bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert torch.equal(prepared.layers[0].bqkv, bias) and prepared.layers[0].bo is None
    assert all(t.b_qkv and not t.b_o and not t.b_gu and not t.b_d for t in prepared.decoder.table)
    pos = IDS.shape[1]
    x = torch.randn(1, 1, q.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = q.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
    with torch.no_grad():
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, _prefilled(q, IDS[:1]), _prefilled(q, IDS[:1]), None)
    atol = hidden_bound(q.config, pos + 1, len(prepared.layers), want, linear_u=U_BLOCK_ACTIVATION_NORM)
    torch.testing.assert_close(ours, want, rtol=0, atol=atol)
    kw = {"max_new_tokens": 32, "eos_token_id": None, "pad_token_id": 0}
    one = q.generate(IDS[:1], **kw)
    assert torch.equal(_without_decoder(q, lambda: q.generate(IDS[:1], **kw)), one)
    _same_or_near_tie(f, one, f.generate(IDS[:1], **kw), MASK[:1])
    batch = q.generate_batch([IDS[0].tolist()], max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert batch["req_0"].generated_tokens == one[0, IDS.shape[1]:].tolist()


@pytest.mark.skipif(not block_kernel.available(), reason="no C compiler for the block kernel")
@pytest.mark.parametrize(("qtype", "rows"), [("Q4_0", 1), ("Q8_0", 1), ("Q8_0", 3)])
def test_a_quantized_decode_step_in_one_call_applies_the_norms_as_the_torch_path(tmp_path, qtype, rows):
    """The one-call step's hidden state and new keys/values against the per-layer torch path's, within
    the bound of summing in another order (tolerance.hidden_bound, whose Qwen3 terms count the norms);
    the same decoder without the norms lands outside that bound (the check sees them)."""
    path = tmp_path / f"qwen3-{qtype}.gguf"
    write_quantized_gguf(path, qtype, "Q8_0", tied=True, arch="qwen3", head_dim=128, seed=4)
    model = genkit.load_model(path)
    ids = torch.tensor([[1, 17, 33, 5, 250, 9], [3, 4, 5, 6, 7, 8], [9, 9, 9, 1, 2, 3]])[:rows]
    pos = ids.shape[1]
    x = torch.randn(rows, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    cos, sin = model.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
    with torch.no_grad():
        caches = [_prefilled(model, ids) for _ in range(3)]
        prepared = model._prepared[1]
        assert isinstance(prepared.decoder, BlockDecoder)
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, caches[0], caches[1], None)
        bare = BlockDecoder.build([p._replace(qk_norm=None) for p in prepared.layers])
        without = bare(x, cos, sin, {None: None}, caches[2], None)
    n, u = len(prepared.layers), U_BLOCK_ACTIVATION_NORM
    atol = hidden_bound(model.config, pos + 1, n, want, linear_u=u)
    torch.testing.assert_close(ours, want, rtol=0, atol=atol)
    assert (without - want).abs().max() > 100 * atol
    for i in range(n):
        for got, ref in ((caches[0].keys[i], caches[1].keys[i]), (caches[0].values[i], caches[1].values[i])):
            torch.testing.assert_close(got[:, :, :pos], ref[:, :, :pos], rtol=0, atol=0)
            new = ref[:, :, pos:pos + 1]
            atol = hidden_bound(model.config, pos + 1, i + 1, new, linear_u=u)
            torch.testing.assert_close(got[:, :, pos:pos + 1], new, rtol=0, atol=atol)


def test_gguf_linear_rope_scaling_is_read_and_yarn_refused(tmp_path):
    """``qwen3.rope.scaling.type``: linear is transformers' linear scaling (the same weights in a
    transformers Qwen3 with ``rope_parameters`` linear give the same logits; transformers' GGUF loader
    itself drops the key); YaRN is refused by name, not run with plain rotary tables."""
    path = tmp_path / "linear.gguf"
    write_quantized_gguf(path, "F32", "F32", tied=False, arch="qwen3", head_dim=128, seed=6,
                         rope_scaling=("linear", 4.0))
    ours = genkit.load_model(path)
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = _hf_gguf(path)
    cfg = copy.deepcopy(plain.config)
    cfg.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.load_state_dict(plain.state_dict())
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=logits_bound(ours, ids), rtol=0)
    assert not torch.allclose(ours(ids).logits, plain(ids).logits, atol=logits_bound(ours, ids), rtol=0)
    write_quantized_gguf(tmp_path / "yarn.gguf", "F32", "F32", arch="qwen3", rope_scaling=("yarn", 4.0))
    with pytest.raises(UnsupportedModelError, match=r"metadata 'qwen3\.rope\.scaling\.type' is 'yarn'; "
                                                    r"accepted: 'none', 'linear'"):
        genkit.load_model(tmp_path / "yarn.gguf")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_llama_cpp_numerics_is_refused_by_name(tmp_path, arch):
    """llama.cpp's converter keeps Qwen2's and Qwen3's q/k rows as they are (rotary halves), and ggml
    sums q . k in that order, not in the interleaved order of Llama files that the block kernel's
    llama.cpp numerics follow (checked against llama-server: bench/bench_qwen3_vs_llamacpp.py)."""
    path = tmp_path / f"{arch}-q8.gguf"
    write_quantized_gguf(path, "Q8_0", arch=arch, head_dim=32 if arch == "qwen3" else None)
    with pytest.raises(NotSupportedError, match=rf"`numerics`='llama\.cpp' sums the attention's q \. k in the element "
                                                rf"order of Llama's GGUF files \(rotary pairs interleaved\); llama\.cpp "
                                                rf"sums a {arch} file's heads in their own order \(rotary halves\)"):
        genkit.load_model(path, numerics="llama.cpp")


def test_gguf_norm_tensors_belong_to_qwen3_only(tmp_path):
    """``attn_q_norm`` in a file of another architecture is an unexpected tensor (it would be dropped)."""
    path = tmp_path / "llama-with-norms.gguf"
    write_quantized_gguf(path, "F32", "F32", arch="qwen3", head_dim=16)
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("qwen3."):
            w.add_key_value(field.name.replace("qwen3.", "llama.", 1), field.contents(), field.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"unexpected tensor 'blk\.0\.attn_q_norm\.weight' for architecture 'llama'"):
        genkit.load_model(tmp_path / "llama.gguf")
    with pytest.raises(UnsupportedModelError, match=r"supported: gpt2, llama, mistral, qwen2, qwen3"):
        from genkit.models.gguf import read_gguf_config

        bad = tmp_path / "moe.gguf"
        write_quantized_gguf(bad, "F32", "F32", arch="qwen3moe")
        read_gguf_config(bad)
