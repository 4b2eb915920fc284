"""genkit on a CUDA GPU: the tokens of the CPU and of transformers on the same GPU and weights.

CI has no GPU, so these tests run where torch sees one (``GENKIT_TEST_DEVICE`` names another
device, e.g. ``cpu``, to check the tests themselves without one). On a tiny random Llama: greedy
search with every processor ``tests/test_greedy_parity.py`` covers (against genkit on the CPU, whose
tokens that file holds to transformers'), and against transformers on the same device beam search,
seeded sampling, prompt lookup and genkit's strategies run on a transformers model; draft-model
assisted decoding, continuous batching, ``genkit serve`` and ``genkit generate --device``, a
de-quantized GGUF and bfloat16. docs/benchmarks.md ("genkit on a GPU") records a run.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_greedy_parity import CASES, IDS1, IDS3, MASK3
from tolerance import U_BF16, logits_bound

import genkit
from genkit.models.tiny import tiny_llama

transformers = pytest.importorskip("transformers")

DEVICE = os.environ.get("GENKIT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
if not DEVICE:
    pytest.skip("no CUDA device (GENKIT_TEST_DEVICE names another)", allow_module_level=True)
NEW = 16


@pytest.fixture(scope="module")
def pair(tiny_hf_dir):
    """(transformers model, genkit model) with the same weights, both on DEVICE."""
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval().to(DEVICE)
    ours = genkit.load_model(tiny_hf_dir, device=DEVICE)
    assert next(ours.parameters()).device.type == torch.device(DEVICE).type
    return hf, ours


def _on(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


@pytest.fixture(scope="module")
def emitted(pair):
    _, ours = pair
    one = ours.generate(_on(IDS1), max_new_tokens=NEW, eos_token_id=None)[0, IDS1.shape[1]:]
    return one.cpu()


def _assert_same_or_tie(model, got: torch.Tensor, ref, mask: torch.Tensor | None, scale: float) -> None:
    """The same tokens, or each row's first difference comes at a tie within rounding: there,
    the reference's processed score of its token beats that of the other token by no more than two
    evaluations of the logits can differ (:func:`tolerance.logits_bound`), times ``scale``, how much
    the processors can multiply a logit's error. A GPU sums in another order than the CPU, so a near
    tie can go either way. ``got``: the other sequences (on the CPU); ``ref``: the reference's
    output with its scores. Where one ended earlier, the positions both have are compared."""
    assert got.shape[0] == ref.sequences.shape[0]
    width = IDS1.shape[1] if mask is None else mask.shape[1]
    n = min(got.shape[1], ref.sequences.shape[1])
    for row in range(ref.sequences.shape[0]):
        diff = (got[row, :n] != ref.sequences[row, :n]).nonzero()
        if len(diff) == 0:
            continue
        at = int(diff[0])
        prefix = ref.sequences[row:row + 1, :at]
        prefix_mask = torch.ones_like(prefix)
        if mask is not None:
            prefix_mask[:, :width] = mask[row]
        scores = ref.scores[at - width][row].float()
        mine, theirs = int(got[row, at]), int(ref.sequences[row, at])
        gap = float(scores[theirs] - scores[mine])
        bound = scale * logits_bound(model, prefix, prefix_mask)
        assert gap <= bound, f"row {row}, token {at}: {mine} instead of {theirs}; gap {gap} > {bound}"


# how much a case's processors can multiply a logit's error: a penalty of 0.6 divides by it, the
# length penalty grows the EOS logit by 1.8 per token past the 3rd
SCALE = {"repetition_penalty": 1.8, "repetition_penalty_soft": 1 / 0.6, "renormalize_and_invalid": 2.0,
         "combined": 1.4, "exponential_decay": 1.8 ** NEW}


@pytest.fixture(scope="module")
def on_cpu(tiny_hf_dir):
    return genkit.load_model(tiny_hf_dir)


@pytest.mark.parametrize("batch3", [False, True], ids=["batch1", "padded_batch3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_on_the_device_equal_the_cpus(pair, on_cpu, emitted, case, batch3):
    """Every processor of tests/test_greedy_parity.py, whose CPU tokens equal transformers' (the
    version CI installs; the GPU's image may hold another, whose processors can differ)."""
    _, ours = pair
    ids, mask = (IDS3, MASK3) if batch3 else (IDS1, None)
    extra = {} if mask is None else {"attention_mask": mask}
    kw = {"max_new_tokens": NEW, "pad_token_id": 0, "return_dict_in_generate": True, "output_scores": True,
          **CASES[case](emitted)}
    ref = on_cpu.generate(ids, **extra, **kw)
    got = ours.generate(_on(ids), **({} if mask is None else {"attention_mask": _on(mask)}), **kw)
    assert got.sequences.device.type == torch.device(DEVICE).type
    sequences = got.sequences.cpu()
    if sequences.shape != ref.sequences.shape or not torch.equal(sequences, ref.sequences):
        _assert_same_or_tie(on_cpu, sequences, ref, mask, SCALE.get(case, 1.0))


@pytest.mark.parametrize("kw", [
    {"num_beams": 4, "max_new_tokens": 10},
    {"num_beams": 3, "num_return_sequences": 3, "length_penalty": 0.5, "max_new_tokens": 9},
    {"num_beams": 4, "early_stopping": True, "no_repeat_ngram_size": 2, "max_new_tokens": 12},
])
def test_beam_search_equals_transformers_on_the_device(pair, kw):
    hf, ours = pair
    common = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "return_dict_in_generate": True,
              "output_scores": True, **kw}
    ref = hf.generate(_on(IDS3), attention_mask=_on(MASK3), **common)
    got = genkit.generate(ours, _on(IDS3), attention_mask=_on(MASK3), **common)
    assert torch.equal(got.sequences.cpu(), ref.sequences.cpu())
    assert torch.equal(got.beam_indices.cpu().long(), ref.beam_indices.cpu().long())
    assert got.sequences_scores.device.type == torch.device(DEVICE).type


@pytest.mark.parametrize("kw", [{"temperature": 0.9}, {"temperature": 0.7, "top_k": 8},
                                {"top_p": 0.8, "top_k": 0, "repetition_penalty": 1.2}])
def test_seeded_sampling_draws_equal_transformers_on_the_device(pair, kw):
    hf, ours = pair
    args = {"do_sample": True, "max_new_tokens": 20, "eos_token_id": None, "pad_token_id": 0, **kw}
    torch.manual_seed(7)
    ref = hf.generate(_on(IDS3), attention_mask=_on(MASK3), **args)
    torch.manual_seed(7)
    got = ours.generate(_on(IDS3), attention_mask=_on(MASK3), **args)
    assert torch.equal(got.cpu(), ref.cpu())


def test_prompt_lookup_equals_transformers_on_the_device(pair):
    hf, ours = pair
    base = torch.tensor([[1, 17, 40, 9, 88, 23, 5, 61]])
    ids = _on(torch.cat([base, base, base[:, :4]], dim=1))
    args = {"do_sample": False, "max_new_tokens": 20, "eos_token_id": None, "pad_token_id": 0,
            "prompt_lookup_num_tokens": 3}
    ref = hf.generate(ids, **args)
    got = ours.generate(ids, **args)
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(got, ours.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None))


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_prompt_lookup_draws_transformers_tokens_on_the_device(pair, seed):
    """transformers samples a whole draft's positions at once (drafts past max_length too): the
    same random numbers on the device give the same tokens."""
    hf, ours = pair
    base = torch.tensor([[1, 17, 40, 9, 88, 23, 5, 61]])
    ids = _on(torch.cat([base, base, base[:, :4]], dim=1))
    args = {"do_sample": True, "top_k": 2, "max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0,
            "prompt_lookup_num_tokens": 5}
    torch.manual_seed(seed)
    ref = hf.generate(ids, **args)
    torch.manual_seed(seed)
    assert torch.equal(ours.generate(ids, **args).cpu(), ref.cpu())


def test_draft_model_verification_reproduces_greedy_on_the_device(pair):
    _, ours = pair
    draft = tiny_llama(seed=1, vocab_size=ours.config.vocab_size).to(DEVICE)
    args = {"do_sample": False, "max_new_tokens": 20, "eos_token_id": None}
    got = ours.generate(_on(IDS1), assistant_model=draft, **args)
    assert torch.equal(got, ours.generate(_on(IDS1), **args))


# every other built-in strategy, and the outputs a dict carries: greedy-like choices, so the device's
# tokens must be the CPU's (float32, the same weights: the logits differ by rounding only)
STRATEGIES = {
    "contrastive": {"penalty_alpha": 0.6, "top_k": 4},
    "contrastive_low_memory": {"penalty_alpha": 0.6, "top_k": 4, "low_memory": True},
    "dola_low": {"dola_layers": "low"},
    "dola_high_penalty": {"dola_layers": "high", "repetition_penalty": 1.2},
    "diverse_beams": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "num_return_sequences": 2},
    "constrained_beams": {"num_beams": 3, "force_words_ids": [[30, 31]]},
    "guidance": {"guidance_scale": 1.5},
    "early_exit": {"assistant_early_exit": 1},
    "prompt_lookup_batch": {"prompt_lookup_num_tokens": 2},
    "outputs": {"return_dict_in_generate": True, "output_scores": True, "output_logits": True,
                "output_attentions": True, "output_hidden_states": True},
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_gives_the_cpus_tokens_on_the_device(pair, on_cpu, name):
    _, ours = pair
    kw = {"max_new_tokens": 10, "eos_token_id": None, "pad_token_id": 0, "do_sample": False, **STRATEGIES[name]}
    batch = name not in ("guidance", "early_exit", "prompt_lookup_batch")
    ids, mask = (IDS3, MASK3) if batch else (IDS1, torch.ones_like(IDS1))
    ref = genkit.generate(on_cpu, ids, attention_mask=mask, **kw)
    got = genkit.generate(ours, _on(ids), attention_mask=_on(mask), **kw)
    if isinstance(ref, torch.Tensor):
        assert got.device.type == torch.device(DEVICE).type
        assert torch.equal(got.cpu(), ref), f"{name}: {got.tolist()} vs the CPU's {ref.tolist()}"
        return
    assert torch.equal(got.sequences.cpu(), ref.sequences)
    for field in ("scores", "logits"):
        for a, b in zip(getattr(got, field), getattr(ref, field)):
            assert a.device.type == torch.device(DEVICE).type
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=logits_bound(on_cpu, ref.sequences, None))
    assert len(got.attentions) == len(ref.attentions) and len(got.hidden_states) == len(ref.hidden_states)
    assert got.hidden_states[-1][-1].device.type == torch.device(DEVICE).type


@pytest.mark.parametrize("scheme", ["lefthash", "selfhash"])
def test_watermark_and_detector_equal_transformers_on_the_device(pair, scheme):
    """The green lists come from ``torch.randperm`` on the device (transformers' design), so the
    reference is transformers on the same device, generator and detector alike."""
    from genkit.watermarking import WatermarkDetector

    hf, ours = pair
    settings = {"bias": 4.0, "seeding_scheme": scheme}
    kw = {"max_new_tokens": 12, "pad_token_id": 0, "eos_token_id": None, "attention_mask": _on(MASK3)}
    ref = hf.generate(_on(IDS3), do_sample=False, watermarking_config=transformers.WatermarkingConfig(**settings), **kw)
    got = genkit.generate(ours, _on(IDS3), watermarking_config=settings, **kw)
    assert torch.equal(got.cpu(), ref.cpu())
    new = got[:, IDS3.shape[1]:]
    want = transformers.WatermarkDetector(hf.config, DEVICE, transformers.WatermarkingConfig(**settings))(new)
    assert WatermarkDetector(ours.config, DEVICE, settings)(new).tolist() == want.tolist()


@pytest.mark.parametrize("kw", [{"num_beams": 3, "max_new_tokens": 8}, {"max_new_tokens": 12},
                                {"repetition_penalty": 1.5, "max_new_tokens": 12}])
def test_genkit_strategies_run_a_transformers_model_on_the_device(pair, kw):
    hf, _ = pair
    args = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kw}
    ref = hf.generate(_on(IDS3), attention_mask=_on(MASK3), **args)
    got = genkit.generate(hf, _on(IDS3), attention_mask=_on(MASK3), **args)
    assert torch.equal(got.cpu(), ref.cpu())


def test_continuous_batching_equals_generate_on_the_device():
    model = tiny_llama(seed=1).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 30, (12,), generator=g)]
    results = model.generate_batch(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None)
    for out, prompt in zip(results.values(), prompts):
        assert out.error is None
        alone = model.generate(_on(torch.tensor([prompt])), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert out.generated_tokens == alone[0, len(prompt):].tolist()


def test_gguf_is_dequantized_on_the_device(tmp_path):
    pytest.importorskip("gguf")
    from test_quantized import write_quantized_gguf

    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    # a GPU has no int4 kernels: the file is de-quantized there without being asked (the CPU keeps it quantized)
    on_device = genkit.load_model(path, device=DEVICE, **({} if "cuda" in DEVICE else {"dequantize": True}))
    float_cpu = genkit.load_model(path, dequantize=True)
    assert all(p.device.type == torch.device(DEVICE).type for p in on_device.parameters())
    for (name, a), (_, b) in zip(on_device.state_dict().items(), float_cpu.state_dict().items()):
        assert torch.equal(a.cpu(), b), name
    ids = torch.tensor([[1, 10, 20, 30, 40]])
    logits = on_device(_on(ids)).logits.cpu()
    ref = float_cpu(ids).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=logits_bound(float_cpu, ids))


@pytest.fixture
def float32_sums():
    """cuBLAS may add bfloat16 products in bfloat16 unless told not to; the bound assumes float32 sums."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction = before


def test_bfloat16_logits_within_the_bound_of_transformers_on_the_device(tiny_hf_dir, float32_sums):
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.bfloat16).eval().to(DEVICE)
    ours = genkit.load_model(tiny_hf_dir, dtype="bfloat16", device=DEVICE)
    ids = _on(IDS3)
    got = ours(ids, attention_mask=_on(MASK3)).logits.float()
    ref = hf(ids, attention_mask=_on(MASK3)).logits.float()
    # both hold the same bfloat16 weights and round each stored activation to bfloat16 (2**-8)
    bound = logits_bound(ours, ids, _on(MASK3), store_u=U_BF16)
    assert (got - ref).abs()[_on(MASK3).bool()].max() <= bound


def test_a_prompt_on_the_cpu_runs_on_the_models_device(pair):
    _, ours = pair
    got = ours.generate(IDS1, max_new_tokens=NEW, eos_token_id=None)
    assert got.device.type == torch.device(DEVICE).type
    assert torch.equal(got, ours.generate(_on(IDS1), max_new_tokens=NEW, eos_token_id=None))


@pytest.fixture(scope="module")
def word_model_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny Llama's folder with the 128-word tokenizer of tests/test_engine_gate.py (a word per id)."""
    import json
    import shutil

    from test_engine_gate import SPECIALS, _raw_tokenizer

    path = tmp_path_factory.mktemp("word_model")
    for f in tiny_hf_dir.iterdir():
        shutil.copy(f, path / f.name)
    _raw_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(SPECIALS), encoding="utf-8")
    return path


def _words_of(model, prompt: list[int], **kw) -> str:
    from test_engine_gate import EOS, _words

    out = genkit.generate(model, _on(torch.tensor([prompt])), max_new_tokens=8, **kw)[0, len(prompt):].tolist()
    return _words(out[:out.index(EOS) + 1] if EOS in out else out)


@pytest.mark.parametrize("settings", [{}, {"num_beams": 2}, {"repetition_penalty": 1.3}], ids=["greedy", "beams", "rep"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_serve_on_the_device_answers_generates_tokens(word_model_dir, settings, stream):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from test_engine_gate import PROMPT, _complete, _serving

    from genkit.serve import build_app

    model = genkit.load_model(word_model_dir, device=DEVICE)
    tokenizer = genkit.load_tokenizer(word_model_dir)
    want = _words_of(model, PROMPT, **settings)
    with _serving(build_app(model, tokenizer=tokenizer, model_name="tiny")) as base:
        got = _complete(base, {"max_tokens": 8, "temperature": 0, "stream": stream, **settings})
    assert got == [want]


def test_the_cli_generates_on_the_device(word_model_dir):
    import subprocess
    import sys

    model = genkit.load_model(word_model_dir, device=DEVICE)
    want = _words_of(model, [3, 4, 5, 6, 7], eos_token_id=None)
    proc = subprocess.run([sys.executable, "-m", "genkit", "generate", "--model", str(word_model_dir), "--device", DEVICE,
                           "--prompt", "w3 w4 w5 w6 w7", "--max-new-tokens", "8", "--set", "eos_token_id=null"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == want.split()  # the new text
