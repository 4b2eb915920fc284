"""GPT-2 GGUF files (``general.architecture`` "gpt2", what llama.cpp's convert_hf_to_gguf.py writes
for GPT-2 and DistilGPT2) load natively: F32/F16 tensors, and the quantized types genkit's kernels
run kept quantized on the matrix products.

The files are written here with ``gguf.GGUFWriter`` in the converter's layout, from a tiny random
``transformers.GPT2LMHeadModel``: llama.cpp's tensor names, the ``Conv1D`` weights transposed to
``(out, in)`` rows, no ``output.weight`` (the head is the embedding; older converters wrote a copy,
``output=True``), the byte-level BPE vocabulary under ``tokenizer.ggml.*``. References: the
transformers model the file was written from (F32), transformers' own GGUF loader on the same file
(``from_pretrained(..., gguf_file=...)``, which de-quantizes), and genkit's de-quantized model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.errors import ConfigError, NotSupportedError, UnsupportedModelError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_quantized import _random_blocks, kernel_of, quantized_roundoff  # noqa: E402

from genkit.models.gpt2 import Conv1D  # noqa: E402
from genkit.models.quant import Int4Linear, QuantizedEmbedding, WithBias, kernel_available  # noqa: E402

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizers!",
          "Once upon a time there was a little girl who lived in a village near the forest."] * 20
EOT = "<|endoftext|>"
# transformers' GPT2 Conv1D weights, stored (in, out); the converter writes them transposed
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
          "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GLOBAL = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm"}


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str], Any]:
    """(tokens, token types, merges, transformers tokenizer) of a GPT-2-style byte-level BPE learned
    from CORPUS, ``<|endoftext|>`` after the learned tokens and ``[PADn]`` up to ``vocab_size``, as
    the converter pads a vocabulary shorter than the model's."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size - 8, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.add_special_tokens([EOT])
    model = json.loads(backend.to_str())["model"]
    by_id = sorted(backend.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    types = [3 if t == EOT else 1 for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [5] * (vocab_size - len(types))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT)
    return tokens, types, merges, hf_tok


def tiny_gpt2(vocab_size: int = 320, n_embd: int = 64, seed: int = 0) -> Any:
    eot = byte_level_vocab(vocab_size)[0].index(EOT)
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_embd=n_embd, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=eot, eos_token_id=eot)
    return transformers.GPT2LMHeadModel(cfg).eval()


def gguf_name(name: str) -> str:
    """llama.cpp's name for a transformers GPT-2 tensor (gguf-py's tensor map for MODEL_ARCH.GPT2)."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, n, *inner = base.split(".")  # transformer.h.N.<inner>
    return f"blk.{n}.{_LAYER['.'.join(inner)]}.{kind}"


def write_gpt2_gguf(path: Path, hf: Any, *, qtype: str = "F32", embed_qtype: str | None = None,
                    output: bool = False, leave_out: tuple[str, ...] = (), positions: str = "F32",
                    seed: int = 0, kinds: dict[str, str] | None = None) -> None:
    """``hf`` (a transformers GPT2LMHeadModel) as llama.cpp's converter writes it: F32 or F16
    (``qtype``), or with its matrices in a quantized type as llama-quantize leaves them (the
    position table and the norms not quantized; the embedding in ``embed_qtype``, default
    ``qtype``; the position table in ``positions``). Q4_0/Q4_1/Q8_0 blocks are quantized from ``hf``'s weights; the K-quants (which the
    gguf package cannot make) are random blocks. ``output``: also an ``output.weight``, a copy of
    the embedding (older converters); ``leave_out``: tensors (llama.cpp names) not written;
    ``kinds``: the type of some tensors (llama.cpp names), over the others'."""
    cfg = hf.config
    tokens, types, merges, _ = byte_level_vocab(cfg.vocab_size)
    w = gguf.GGUFWriter(str(path), arch="gpt2")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_positions)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for add in (w.add_bos_token_id, w.add_eos_token_id, w.add_unk_token_id):
        add(tokens.index(EOT))
    rng = np.random.default_rng(seed)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for name, tensor in state.items():
        data = tensor.detach().numpy().astype(np.float32)
        if name.endswith(_TRANSPOSED):
            data = np.ascontiguousarray(data.T)
        target = gguf_name(name)
        kind = qtype if data.ndim == 2 else "F32"
        if target == "position_embd.weight":
            kind = positions
        elif target == "token_embd.weight":
            kind = embed_qtype or qtype
        kind = (kinds or {}).get(target, kind)
        for out in (target, "output.weight") if output and target == "token_embd.weight" else (target,):
            if out not in leave_out:
                _add(w, out, data, kind, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: Any, name: str, data: np.ndarray, kind: str, rng: Any) -> None:
    if kind == "F32":
        w.add_tensor(name, data)
    elif kind == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        if kind in ("Q4_K", "Q6_K"):
            q = _random_blocks(kind, data.shape[0], data.shape[1], seed=int(rng.integers(1 << 30)))
        else:
            q = gguf.quants.quantize(data, T[kind])
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=T[kind])


def transformers_gguf(path: Path, n_positions: int = 128) -> Any:
    """transformers' own loading of the GGUF file (it de-quantizes every tensor). It reads
    ``gpt2.context_length`` as ``n_ctx``, which GPT2Config no longer reads: the position table's
    length is given."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             n_positions=n_positions).eval()


IDS = torch.tensor([[11, 17, 33, 5, 250, 9], [0, 0, 40, 44, 45, 46]])
MASK = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
POS = (MASK.cumsum(-1) - 1).clamp(min=0)  # the positions generate gives a left-padded row
GREEDY = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}


@pytest.mark.parametrize("output", [False, True], ids=["tied", "with_output_weight"])
def test_an_f32_gpt2_gguf_gives_transformers_tokens_and_logits(tmp_path, output):
    hf = tiny_gpt2()
    path = tmp_path / "gpt2.gguf"
    write_gpt2_gguf(path, hf, output=output)
    ours = genkit.load_model(path)
    assert type(ours.transformer.h[0].attn.c_attn) is Conv1D
    assert ours.config.model_type == "gpt2" and ours.config.n_positions == 128
    assert (ours.lm_head.weight is ours.transformer.wte.weight) is not output
    with torch.no_grad():
        want = hf(IDS, attention_mask=MASK, position_ids=POS).logits
        got = ours(IDS, attention_mask=MASK, position_ids=POS).logits
    assert (got - want)[MASK.bool()].abs().max() <= logits_bound(hf, IDS, MASK)  # padding's rows: any
    assert torch.equal(ours.generate(IDS, attention_mask=MASK, **GREEDY),
                       hf.generate(IDS, attention_mask=MASK, **GREEDY))


def test_an_f16_gpt2_gguf_matches_transformers_loading_the_same_file(tmp_path):
    path = tmp_path / "f16.gguf"
    write_gpt2_gguf(path, tiny_gpt2(seed=1), qtype="F16")
    ref, ours = transformers_gguf(path), genkit.load_model(path)
    with torch.no_grad():
        want = ref(IDS, attention_mask=MASK, position_ids=POS).logits
        got = ours(IDS, attention_mask=MASK, position_ids=POS).logits
    assert (got - want)[MASK.bool()].abs().max() <= logits_bound(ref, IDS, MASK)
    assert torch.equal(ours.generate(IDS, attention_mask=MASK, **GREEDY),
                       ref.generate(IDS, attention_mask=MASK, **GREEDY))


def _matrices(model) -> list[torch.nn.Module]:
    block = model.transformer.h[0]
    return [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]


quantized = pytest.mark.skipif(not kernel_available(), reason="torch build without CPU int4 kernels")


@quantized
@pytest.mark.parametrize(("qtype", "embed", "n_embd", "output"), [
    ("Q8_0", "Q8_0", 64, False), ("Q4_0", "Q8_0", 64, False), ("Q4_1", "Q4_1", 64, False),
    ("Q4_K", "Q6_K", 256, False), ("Q4_0", "Q8_0", 64, True)])
def test_a_quantized_gpt2_gguf_runs_on_the_int4_layers(tmp_path, qtype, embed, n_embd, output):
    """The matrices run quantized (with their float biases); the tied head runs on the embedding's
    codes (``output``: on its own copy, as older converters wrote it); an embedding table in another
    type than Q8_0 is de-quantized (Q4_K_M files hold the tied table as Q6_K). The de-quantized
    model is transformers' on the same file; the quantized one gives its greedy tokens, its logits
    within the kernels' rounding."""
    from genkit.models.gguf_quantized import kernel_types

    path = tmp_path / "q.gguf"
    write_gpt2_gguf(path, tiny_gpt2(n_embd=n_embd, seed=2), qtype=qtype, embed_qtype=embed, output=output)
    q, f, ref = genkit.load_model(path), genkit.load_model(path, dequantize=True), transformers_gguf(path)
    assert all(type(m) is WithBias and type(m.inner) is Int4Linear for m in _matrices(q))
    assert type(q.lm_head) is Int4Linear if embed in kernel_types() else type(q.lm_head) is torch.nn.Linear
    assert q.config.tie_word_embeddings is not output
    assert type(q.transformer.wte) is (QuantizedEmbedding if embed == "Q8_0" else torch.nn.Embedding)
    assert type(q.transformer.wpe) is torch.nn.Embedding and type(f.transformer.h[0].attn.c_attn) is Conv1D
    with torch.no_grad():
        want = ref(IDS, attention_mask=MASK, position_ids=POS).logits
        lf = f(IDS, attention_mask=MASK, position_ids=POS).logits
        lq = q(IDS, attention_mask=MASK, position_ids=POS).logits
    valid = MASK.bool()
    assert (lf - want)[valid].abs().max() <= logits_bound(ref, IDS, MASK)
    bound = logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q), rounded_scales=qtype == "Q4_K"))
    assert (lq - lf)[valid].abs().max() <= bound
    out = q.generate(IDS, attention_mask=MASK, **GREEDY)
    assert torch.equal(out, ref.generate(IDS, attention_mask=MASK, **GREEDY))
    assert torch.equal(out, f.generate(IDS, attention_mask=MASK, **GREEDY))


@quantized
@pytest.mark.parametrize(("qtype", "embed", "kinds"), [("F32", "Q8_0", None), ("F16", "Q4_1", None),
                                                       ("Q4_1", "Q4_1", {"blk.1.ffn_up.weight": "F16"})])
def test_float_and_quantized_matrices_mixed_run_on_the_modules(tmp_path, qtype, embed, kinds):
    """Float matrices with a quantized tied embedding (its head kept on the codes), or one matrix
    left F16 among quantized ones (as llama-quantize leaves a tensor it cannot quantize): generate
    failed with "AttributeError: 'Tensor' object has no attribute 'kernel'" (the block kernel's
    route took every projection as quantized). Such a model runs on its modules: the tokens of the
    de-quantized model, its logits within the kernels' rounding."""
    path = tmp_path / "mixed.gguf"
    write_gpt2_gguf(path, tiny_gpt2(seed=2), qtype=qtype, embed_qtype=embed, kinds=kinds)
    q, f = genkit.load_model(path), genkit.load_model(path, dequantize=True)
    assert type(q.lm_head) is Int4Linear
    with torch.no_grad():
        lq, lf = q(IDS, attention_mask=MASK, position_ids=POS).logits, f(IDS, attention_mask=MASK, position_ids=POS).logits
    bound = logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    assert (lq - lf)[MASK.bool()].abs().max() <= bound
    assert torch.equal(q.generate(IDS, attention_mask=MASK, **GREEDY), f.generate(IDS, attention_mask=MASK, **GREEDY))
    assert torch.equal(q.generate(IDS[:1], **GREEDY), f.generate(IDS[:1], **GREEDY))


@quantized
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_head_of_rows_not_a_multiple_of_16_runs_on_the_tables_codes(tmp_path, qtype):
    """GPT-2's vocabulary (50,257) is not a multiple of the kernels' 16-row panels: on the block
    kernel the tied head runs on the Q8_0 table's codes, its last panel padded with rows of zeros
    (it was de-quantized to float32: four times the bytes a decode step reads), and a decode step
    runs from token id to logits in one kernel call. Its logits are the vocabulary's 300 (none of
    the padding), within the kernels' rounding of transformers' on the same file; greedy generate,
    the one-call step's logits and continuous batching give transformers' tokens (vocabulary 300)."""
    from genkit.models import block_kernel
    from genkit.models.quant import Int4Part

    if not block_kernel.available():
        pytest.skip("no C compiler: the block kernel (which pads a head's rows) does not exist here")
    path = tmp_path / "v300.gguf"
    write_gpt2_gguf(path, tiny_gpt2(vocab_size=300, seed=3), qtype=qtype, embed_qtype="Q8_0")
    q, ref = genkit.load_model(path), transformers_gguf(path)
    assert all(type(m) is WithBias for m in _matrices(q))
    assert type(q.lm_head) is Int4Linear and (q.lm_head.out_features, q.lm_head.panel_rows) == (300, 304)
    padding = block_kernel.matmul(torch.randn(3, 64), q.lm_head.blocks, q.lm_head.bits, 304, q.lm_head.act)[:, 300:]
    assert torch.equal(padding, torch.zeros(3, 4))  # rows of zeros after the vocabulary's
    bound = logits_bound(ref, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    with torch.no_grad():
        want = ref(IDS, attention_mask=MASK, position_ids=POS).logits
        got = q(IDS, attention_mask=MASK, position_ids=POS).logits
    assert got.shape == want.shape == (2, 6, 300)
    assert (got - want)[MASK.bool()].abs().max() <= bound
    assert torch.equal(q.generate(IDS, attention_mask=MASK, **GREEDY), ref.generate(IDS, attention_mask=MASK, **GREEDY))
    ids = IDS[:1]
    with torch.no_grad():
        cache = q(ids, use_cache=True).past_key_values
        assert q.kernel_ends(q._prepared[1]) is not None  # the ends in the kernel call
        step = q.one_call_step(torch.tensor([[7]]), None, None, cache, 1)
        full = ref(torch.cat([ids, torch.tensor([[7]])], dim=1)).logits[:, -1:]
    assert step is not None and step.shape == (1, 1, 300)
    assert (step - full).abs().max() <= logits_bound(ref, ids, linear_u=quantized_roundoff(kernel_of(q)), seq_len=7)
    want_tokens = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(q.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False), want_tokens)
    batch = q.generate_batch([ids[0].tolist()], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert next(iter(batch.values())).generated_tokens == want_tokens[0, 6:].tolist()
    part = Int4Part(torch.zeros(300, 64, dtype=torch.uint8), torch.ones(300, 2), torch.zeros(300, 2))
    with pytest.raises(ConfigError, match=r"^int4 kernels need out_features divisible by 16 and in_features "
                                          r"divisible by 32; got \(300, 64\)$"):
        Int4Linear(64, 300, [part], kernel="torch")  # torch's int4 kernel takes panels of 16 only


@quantized
def test_a_quantized_position_table_is_de_quantized(tmp_path):
    """llama-quantize keeps GPT-2's position table in float; a file from another tool may not"""
    path = tmp_path / "pos.gguf"
    write_gpt2_gguf(path, tiny_gpt2(seed=4), qtype="Q8_0", positions="Q8_0")
    q, ref = genkit.load_model(path), transformers_gguf(path)
    assert type(q.transformer.wpe) is torch.nn.Embedding and type(q.transformer.h[1].mlp.c_proj) is WithBias
    assert torch.equal(q.transformer.wpe.weight, ref.transformer.wpe.weight)
    assert torch.equal(q.generate(IDS, attention_mask=MASK, **GREEDY), ref.generate(IDS, attention_mask=MASK, **GREEDY))


@quantized
def test_llama_cpp_numerics_are_refused_for_gpt2(tmp_path):
    path = tmp_path / "q.gguf"
    write_gpt2_gguf(path, tiny_gpt2(), qtype="Q8_0")
    with pytest.raises(NotSupportedError, match=r"^`numerics`='llama.cpp' follows llama.cpp's Llama-family graph "
                                                r"\(RMSNorm, rotary positions, SwiGLU\); this gpt2 model runs with "
                                                r"numerics='genkit'$"):
        genkit.load_model(path, numerics="llama.cpp")


def test_the_gguf_tokenizer_and_the_cli(tmp_path):
    """The file's byte-level BPE vocabulary tokenizes as transformers' tokenizer on the same
    vocabulary and merges; ``genkit generate --model x.gguf`` prints what generating in-process does."""
    hf = tiny_gpt2()
    path = tmp_path / "gpt2.gguf"
    write_gpt2_gguf(path, hf)
    tok, hf_tok = genkit.load_tokenizer(path), byte_level_vocab(320)[3]
    for text in CORPUS[:3] + ["  the  quick\n\nbrown foxes, 12345!"]:
        assert tok(text)["input_ids"] == hf_tok(text)["input_ids"]
    prompt = "the quick brown"
    ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
    out = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    cli = subprocess.run([sys.executable, "-m", "genkit", "generate", prompt, "--model", str(path),
                          "--max-new-tokens", "6", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == want + "\n"


@quantized
def test_continuous_batching_runs_a_quantized_gpt2_in_one_kernel_call_per_step(tmp_path):
    """generate_batch on a GPT-2 GGUF (it was refused by name): every request's greedy tokens are
    greedy generate's on its prompt alone; a step is one ``gk_decode_paged`` call (the learned
    positions added to the embedding, no rotary tables), its hidden states and keys/values within the
    bound of the torch path's (the same block products, attention summed in another order), a
    prompt's rows attending to each other causally."""
    from tolerance import U_BLOCK_ACTIVATION_NORM, hidden_bound

    from genkit.continuous import ContinuousBatchingConfig
    from genkit.models.paged import StepBatch, _paged_layers

    path = tmp_path / "q.gguf"
    write_gpt2_gguf(path, tiny_gpt2(seed=3), qtype="Q4_0", embed_qtype="Q8_0")
    model = genkit.load_model(path)
    prompts = [[5, 9, 11, 40], [7, 3, 3, 3, 8, 1, 2, 6, 250, 17, 30], [40], list(range(60, 90))]
    config = genkit.GenerationConfig(continuous_batching_config=ContinuousBatchingConfig(
        block_size=8, num_blocks=64, max_batch_tokens=16).to_dict())
    got = model.generate_batch(prompts, config, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    for out, prompt in zip(got.values(), prompts):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out.generated_tokens == ref[0, len(prompt):].tolist()
    stores = [model.new_paged_store(block_size=4, num_blocks=16) for _ in range(2)]  # fused, torch
    prepared, blocks = stores[0].prepared, [[0, 1, 2], [3, 4]]
    steps = [StepBatch(torch.tensor([5, 9, 11, 7, 3, 3]), torch.tensor([0, 1, 2, 0, 1, 2]), [(0, 3), (3, 3)],
                       [0, 0], blocks, [True, True]),
             StepBatch(torch.tensor([17, 8, 1]), torch.tensor([3, 3, 4]), [(0, 1), (1, 2)], [3, 3], blocks,
                       [True, True])]
    for batch in steps:
        rows = [b for b, (_, n) in zip(batch.blocks, batch.spans) for _ in range(n)]
        with torch.inference_mode():
            x, cos, sin = model.paged_inputs(batch.ids, batch.positions)
            assert cos is None and sin is None
            fused = prepared.decoder.paged(x, None, None, batch.positions, stores[0], rows)
            ref = _paged_layers(prepared, stores[1], batch, x[None], None, None, model.dtype)[0]
        assert fused is not None
        seq, layers = int(batch.positions.max()) + 1, len(prepared.layers)
        torch.testing.assert_close(fused, ref, rtol=0, atol=hidden_bound(model.config, seq, layers, ref,
                                                                         linear_u=U_BLOCK_ACTIVATION_NORM))
        for i in range(layers):
            for mine, theirs in ((stores[0].keys[i], stores[1].keys[i]), (stores[0].values[i], stores[1].values[i])):
                atol = hidden_bound(model.config, seq, i + 1, theirs, linear_u=U_BLOCK_ACTIVATION_NORM)
                torch.testing.assert_close(mine, theirs, rtol=0, atol=atol)


def test_serve_and_batch_run_gpt2_on_continuous_batching(tmp_path):
    """``genkit serve`` and ``genkit batch`` run a GPT-2 on continuous batching (they ran it on their
    generate engines, one request at a time and in static batches): a served completion, greedy, is
    transformers' text for the prompt."""
    pytest.importorskip("starlette")
    from serve_client import post_json
    from test_engine_gate import _serving

    from genkit.batch import continuous
    from genkit.serve import build_app

    path = tmp_path / "gpt2.gguf"
    hf = tiny_gpt2(seed=5)
    write_gpt2_gguf(path, hf)
    hf_tok = byte_level_vocab(320)[3]
    prompt = "the quick brown fox"
    ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
    out = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    with _serving(build_app(str(path), model_name="gpt2"), engine="ContinuousEngine") as base:
        status, body = post_json(base, "/v1/completions", {"model": "gpt2", "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0, "min_new_tokens": 8})
    assert status == 200, body
    assert body["choices"][0]["text"] == want
    model, tok = genkit.load_model(path), genkit.load_tokenizer(path)
    assert type(continuous.make_local_engine(model, tok, {"max_new_tokens": 4})) is continuous.ContinuousEngine


def test_an_unsupported_architecture_lists_gpt2(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), arch="falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"unsupported GGUF architecture 'falcon'; supported: gpt2, "
                                                    r"llama, mistral, qwen2, qwen3$"):
        genkit.load_model(path)


@quantized
def test_a_quantized_gpt2_makes_the_block_kernel_choice(tmp_path):
    """A quantized GPT-2 chooses its block-kernel paths per shape class as the Llama family's models
    do (genkit.models.kernel_choice), and its products' AMX threshold follows its choice: before, it
    ran on whatever threshold the last model prepared had left (0, never AMX, in a process of its own)."""
    from genkit.models import block_kernel, kernel_choice

    if not block_kernel.available() or not block_kernel.simd():
        pytest.skip("no C compiler or no vector path: a quantized GPT-2 runs torch's kernels")
    path = tmp_path / "q.gguf"
    write_gpt2_gguf(path, tiny_gpt2(seed=5), qtype="Q8_0")
    q = genkit.load_model(path)
    q.generate(IDS[:1], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    prepared = q._prepared[1]
    choice = prepared.choice
    assert choice is not None and choice.family == "blocks" and set(choice.paths) == set(kernel_choice.CLASSES)
    assert choice.paths["decode"] == choice.paths["small"] == ("vnni" if block_kernel.simd() == "avx512-vnni"
                                                               else "avx2")
    rows = block_kernel.AMX_PREFILL_MIN_ROWS if choice.paths["prefill"] == "amx" else 0
    assert {w.amx_rows for p in prepared.layers for w in (p.wqkv, p.wo, p.wgu, p.wd)} == {rows}
    assert [entry.amx_rows for entry in prepared.decoder.table] == [rows] * len(prepared.layers)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F32"])
@pytest.mark.parametrize("output", [False, True])  # a head tied to the embedding, or its own copy
def test_num_parameters_counts_the_quantized_weights_as_transformers_counts_the_file(tmp_path, qtype, output):
    """`num_parameters()` of a quantized GGUF counts the matrices its int4/int8 buffers stand for,
    as transformers counts the file it de-quantizes (a tied head once); it counted the float
    parameters only (8832 of 128768 for a Q8_0 file)."""
    path = tmp_path / "m.gguf"
    write_gpt2_gguf(path, tiny_gpt2(), qtype=qtype, output=output)
    ours, theirs = genkit.load_model(str(path)), transformers_gguf(path)
    for kw in ({}, {"exclude_embeddings": True}):
        assert ours.num_parameters(**kw) == theirs.num_parameters(**kw)
    assert ours.num_parameters(only_trainable=True) == sum(p.numel() for p in ours.parameters())
