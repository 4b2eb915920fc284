"""The SynthID text watermark pack (plugins/genkit-synthid-pack; issue 19, item 1): pip-installed
into a private folder (as tests/test_packs.py does) and discovered through its entry point, then
compared with transformers 5 on the same inputs, seeds and weights: g-values, masks, the
processor's scores step by step, greedy and sampled generations, the Bayesian detector; detection
on the tiny model and on SmolLM2; the config's JSON round trip and validation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from test_packs import MARK, REPO, install_packs, pack_env

import genkit
from genkit.errors import ConfigError
from genkit.plugins import reset_registry

transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as T  # noqa: E402 (after the importorskip)
from transformers.generation import watermarking as TW  # noqa: E402

PACK = "genkit-synthid-pack"
KEYS = [654, 400, 836, 123, 340, 443, 597, 160, 57]
IDS = torch.tensor([[1, 5, 9, 17, 33, 60], [0, 0, 1, 44, 45, 46]])
MASK = (IDS != 0).long()


@pytest.fixture(scope="module")
def pack_site(tmp_path_factory):
    return install_packs(tmp_path_factory.mktemp("synthid"), (PACK,))


@pytest.fixture(scope="module")
def pack(pack_site):
    """The installed pack, importable and discovered by genkit's registry in this process."""
    sys.path.insert(0, str(pack_site))
    reset_registry()
    import genkit_synthid_pack

    try:
        yield genkit_synthid_pack
    finally:
        sys.path.remove(str(pack_site))
        reset_registry()


def _processors(pack, **kw):
    from genkit_synthid_pack.processor import SynthIDTextWatermarkLogitsProcessor

    args = dict(ngram_len=3, keys=KEYS[:5], sampling_table_size=2**16, sampling_table_seed=0,
                context_history_size=1024, device="cpu")
    args.update(kw)
    return SynthIDTextWatermarkLogitsProcessor(**args), T.SynthIDTextWatermarkLogitsProcessor(**args)


# -- the pack as a pack ------------------------------------------------------------------------

def test_installed_pack_registers_its_watermark_with_origin_and_imports_no_torch(pack_site):
    entry_points = (next(pack_site.glob("genkit_synthid_pack-0.1.0.dist-info")) / "entry_points.txt").read_text()
    assert "[genkit]\nsynthid = genkit_synthid_pack" in entry_points
    code = textwrap.dedent(f'''
        import json, sys
        from genkit.plugins import get_registry
        item = get_registry().items["watermark"]["synthid_text"]
        print("{MARK}" + json.dumps({{"origin": str(item.origin), "torch": "torch" in sys.modules,
                                      "target": item.target, "cls": item.load().__name__}}))
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env=pack_env(pack_site), capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith(MARK))[len(MARK):])
    assert result == {"origin": "genkit-synthid-pack@0.1.0 (synthid)", "torch": False,
                      "target": "genkit_synthid_pack.config:SynthIDTextWatermarkingConfig",
                      "cls": "SynthIDTextWatermarkingConfig"}


def test_genkit_plugins_lists_the_pack(pack_site):
    proc = subprocess.run([sys.executable, "-m", "genkit", "list", "--kind", "watermark", "--json"],
                          env=pack_env(pack_site), capture_output=True, text=True, timeout=120, check=True)
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["synthid_text"]["origin"].startswith("genkit-synthid-pack@0.1.0")
    assert rows["greenlist"]["plugin"] == "builtin"


# -- the processor against transformers' --------------------------------------------------------

@pytest.mark.parametrize("ngram_len", [2, 3, 5])
def test_g_values_and_masks_equal_transformers(pack, ngram_len):
    ours, theirs = _processors(pack, ngram_len=ngram_len, context_history_size=8, sampling_table_seed=11)
    g = torch.Generator().manual_seed(ngram_len)
    ids = torch.randint(0, 7, (4, 40), generator=g)  # a small alphabet: contexts repeat
    assert torch.equal(ours.compute_g_values(ids), theirs.compute_g_values(ids))
    rep = ours.compute_context_repetition_mask(ids)
    assert torch.equal(rep, theirs.compute_context_repetition_mask(ids))
    assert 0 < int(rep.sum()) < rep.numel()  # both repeated and fresh contexts occur
    assert torch.equal(ours.compute_eos_token_mask(ids, 3), theirs.compute_eos_token_mask(ids, 3).bool())
    assert ours.expected_mean_g_value(128) == theirs.expected_mean_g_value(128)


@pytest.mark.parametrize("options", [{}, {"skip_first_ngram_calls": True}, {"debug_mode": True},
                                     {"context_history_size": 2, "sampling_table_size": 1000}],
                         ids=["default", "skip_first", "debug", "short_history"])
def test_scores_equal_transformers_step_by_step(pack, options):
    ours, theirs = _processors(pack, **options)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 8), generator=g)
    changed = 0
    for step in range(12):
        scores = torch.randn(3, 50, generator=g)
        a, b = ours(ids, scores.clone()), theirs(ids, scores.clone())
        assert torch.equal(a, b), step
        changed += int(not torch.equal(a, scores))
        ids = torch.cat([ids, ids[:, -2:-1] if step % 3 == 0 else torch.randint(0, 50, (3, 1), generator=g)], 1)
    assert changed >= 6  # the watermark did act


def test_a_new_batch_size_mid_generation_is_an_error(pack):
    ours, _ = _processors(pack)
    ours(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 10))
    with pytest.raises(ConfigError, match="started with 2 rows and is now called with 3"):
        ours(torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 10))


# -- generate on the same weights -------------------------------------------------------------

@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_generate_equals_transformers(pack, tiny_pair, do_sample):
    """The same tokens as transformers' generate with the same SynthID config (sampling: the same
    seed, as genkit's sampling draws like transformers'); batch 2 with left padding."""
    hf, ours = tiny_pair
    settings = {"ngram_len": 3, "keys": KEYS, "context_history_size": 32}
    kw = dict(attention_mask=MASK, max_new_tokens=24, pad_token_id=0, do_sample=do_sample, top_k=0)
    torch.manual_seed(7)
    theirs = hf.generate(IDS, watermarking_config=transformers.SynthIDTextWatermarkingConfig(**settings), **kw)
    torch.manual_seed(7)
    marked = genkit.generate(ours, IDS, watermarking_config=pack.SynthIDTextWatermarkingConfig(**settings), **kw)
    torch.manual_seed(7)
    plain = genkit.generate(ours, IDS, **kw)
    assert torch.equal(marked, theirs)
    assert not torch.equal(marked, plain)


def test_a_generation_config_file_drives_the_watermark(pack, tiny_pair, tmp_path):
    """generation_config.json with a SynthID watermarking_config (as transformers writes it) makes
    the watermark run: genkit with the pack reads that file back (transformers 5.23-5.24 could not:
    their reader assumed the green-list config; 5.25 can) and gives transformers' tokens."""
    hf, ours = tiny_pair
    tcfg = transformers.SynthIDTextWatermarkingConfig(ngram_len=2, keys=KEYS[:4])
    transformers.GenerationConfig(watermarking_config=tcfg).save_pretrained(tmp_path)
    config = genkit.GenerationConfig.from_pretrained(tmp_path)
    assert config.watermarking_config == pack.SynthIDTextWatermarkingConfig(ngram_len=2, keys=KEYS[:4])
    out = genkit.generate(ours, IDS, attention_mask=MASK, generation_config=config, max_new_tokens=10,
                          pad_token_id=0)
    want = hf.generate(IDS, attention_mask=MASK, watermarking_config=tcfg, max_new_tokens=10, pad_token_id=0,
                       do_sample=False)
    assert torch.equal(out, want)


# -- detection ---------------------------------------------------------------------------------

def test_mean_scores_separate_watermarked_from_plain_samples_on_the_tiny_model(pack, tiny_pair):
    from genkit_synthid_pack.detector import SynthIDTextWatermarkDetector, mean_score, weighted_mean_score

    _, ours = tiny_pair
    wm = pack.SynthIDTextWatermarkingConfig(ngram_len=3, keys=KEYS)
    prompts = torch.randint(3, 128, (8, 4), generator=torch.Generator().manual_seed(0))
    scores = {}
    for name, setting in (("marked", wm), ("plain", None)):
        torch.manual_seed(0)
        out = genkit.generate(ours, prompts, do_sample=True, max_new_tokens=64, min_new_tokens=64,
                              watermarking_config=setting)
        new = out[:, 4:]
        scores[name] = [SynthIDTextWatermarkDetector(fn, wm)(new) for fn in (mean_score, weighted_mean_score)]
    for i in range(2):  # mean, weighted mean
        marked, plain = scores["marked"][i], scores["plain"][i]
        assert float(marked.min()) > float(plain.max()), (marked, plain)
        assert abs(float(plain.mean()) - 0.5) < 0.05
        assert float(marked.mean()) > 0.6


def test_smollm2_watermarked_samples_score_higher_than_plain_ones(pack):
    """8 sampled completions of 64 tokens from the demo model, with and without the watermark:
    every watermarked one has a higher weighted-mean score than every plain one."""
    pytest.importorskip("gguf")
    from genkit_synthid_pack.detector import SynthIDTextWatermarkDetector, weighted_mean_score

    model, tok = genkit.load_model("smollm2"), genkit.load_tokenizer("smollm2")
    topics = "cat river castle robot garden winter ocean library".split()
    chats = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about a {t}."}],
                                     tokenize=False, add_generation_prompt=True) for t in topics]
    tok.padding_side = "left"
    enc = tok(chats, return_tensors="pt", padding=True)
    wm = pack.SynthIDTextWatermarkingConfig(ngram_len=5, keys=KEYS)
    detector = SynthIDTextWatermarkDetector(weighted_mean_score, wm, tok)
    scores = {}
    for name, setting in (("marked", wm), ("plain", None)):
        torch.manual_seed(0)
        out = genkit.generate(model, **enc, do_sample=True, max_new_tokens=64, min_new_tokens=64,
                              watermarking_config=setting)
        scores[name] = detector(out[:, enc["input_ids"].shape[1]:])
    assert float(scores["marked"].min()) > float(scores["plain"].max()), scores


def test_bayesian_detector_equals_transformers_on_the_same_weights(pack):
    from genkit_synthid_pack.detector import (
        BayesianDetectorConfig,
        BayesianDetectorModel,
        SynthIDTextWatermarkDetector,
    )

    torch.manual_seed(0)
    theirs = TW.BayesianDetectorModel(TW.BayesianDetectorConfig(watermarking_depth=len(KEYS))).eval()
    with torch.no_grad():  # a detector with non-trivial weights (as after training)
        theirs.likelihood_model_watermarked.delta.normal_(0, 0.5)
        theirs.likelihood_model_watermarked.beta.normal_(0, 0.5)
    ours = BayesianDetectorModel(BayesianDetectorConfig(watermarking_depth=len(KEYS)))
    ours.load_state_dict(theirs.state_dict())
    cfg = pack.SynthIDTextWatermarkingConfig(ngram_len=3, keys=KEYS, context_history_size=16)
    proc_ours, proc_theirs = cfg.construct_processor(128, "cpu"), transformers.SynthIDTextWatermarkingConfig(
        ngram_len=3, keys=KEYS, context_history_size=16).construct_processor(128, "cpu")

    class Tok:
        eos_token_id = 2

    ids = torch.randint(3, 20, (4, 30), generator=torch.Generator().manual_seed(5))
    ids[1, 20] = 2  # an EOS: the rest of row 1 is not scored
    want = TW.SynthIDTextWatermarkDetector(theirs, proc_theirs, Tok())(ids)[0]
    got = SynthIDTextWatermarkDetector(ours, proc_ours, Tok())(ids)[0]
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g_values, mask = SynthIDTextWatermarkDetector(ours, proc_ours, Tok()).g_values_and_mask(ids)
    loss_ours = ours(g_values, mask, labels=labels, return_dict=True).loss
    loss_theirs = theirs(g_values, mask, labels=labels, return_dict=True).loss
    assert torch.allclose(loss_ours, loss_theirs)


def test_detector_arguments_are_checked(pack):
    from genkit_synthid_pack.detector import SynthIDTextWatermarkDetector, mean_score, weighted_mean_score

    wm = pack.SynthIDTextWatermarkingConfig(ngram_len=4, keys=[1, 2])
    with pytest.raises(ConfigError, match="`logits_processor` must be a SynthIDTextWatermarkLogitsProcessor"):
        SynthIDTextWatermarkDetector(mean_score, genkit.WatermarkingConfig())
    with pytest.raises(ConfigError, match="needs at least ngram_len=4 tokens"):
        SynthIDTextWatermarkDetector(mean_score, wm)(torch.tensor([[5, 6, 7]]))
    with pytest.raises(ConfigError, match="`weights` must be 2 non-negative numbers"):
        weighted_mean_score(torch.ones(1, 3, 2), torch.ones(1, 3), weights=torch.tensor([1.0, -1.0]))


# -- the config ----------------------------------------------------------------------------------

def test_config_matches_transformers_and_round_trips_through_json(pack, tmp_path):
    settings = {"ngram_len": 5, "keys": KEYS, "context_history_size": 512, "sampling_table_seed": 3,
                "sampling_table_size": 4096, "skip_first_ngram_calls": True}
    ours, theirs = pack.SynthIDTextWatermarkingConfig(**settings), transformers.SynthIDTextWatermarkingConfig(**settings)
    assert isinstance(ours, genkit.BaseWatermarkingConfig)
    assert ours.to_dict() == theirs.to_dict()
    assert json.loads(ours.to_json_string()) == json.loads(theirs.to_json_string())
    assert pack.SynthIDTextWatermarkingConfig.from_dict(theirs.to_dict()) == ours
    # through GenerationConfig and generation_config.json, and dicts in code
    config = genkit.GenerationConfig(watermarking_config=ours, do_sample=True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["watermarking_config"] == theirs.to_dict()
    assert genkit.GenerationConfig.from_pretrained(tmp_path) == config
    as_dict = genkit.GenerationConfig(watermarking_config={"ngram_len": 2, "keys": [7]})
    assert as_dict.watermarking_config == pack.SynthIDTextWatermarkingConfig(ngram_len=2, keys=[7])
    # the green-list watermark still reads as before
    assert isinstance(genkit.GenerationConfig(watermarking_config={"bias": 1.0}).watermarking_config,
                      genkit.WatermarkingConfig)
    ours.update(ngram_len=3)
    assert ours.ngram_len == 3


@pytest.mark.parametrize(("key", "value", "accepted"), [
    ("ngram_len", 0, "an int >= 1"),
    ("ngram_len", 2.0, "an int >= 1"),
    ("keys", [], "a non-empty list of 64-bit ints"),
    ("keys", [1, "2"], "a non-empty list of 64-bit ints"),
    ("keys", [2**63], "a non-empty list of 64-bit ints"),
    ("context_history_size", 0, "an int >= 1"),
    ("sampling_table_seed", 1.5, r"an int in \[-2\*\*63, 2\*\*64\)"),
    ("sampling_table_size", 2**24 + 1, r"an int in \[1, 2\*\*24\]"),
    ("sampling_table_size", 0, r"an int in \[1, 2\*\*24\]"),
    ("skip_first_ngram_calls", "yes", "True or False"),
    ("debug_mode", 1, "True or False"),
])
def test_bad_values_are_refused_naming_the_field(pack, key, value, accepted):
    settings = {"ngram_len": 5, "keys": KEYS, key: value}
    message = rf"`watermarking_config.{key}` must be {accepted}; got "
    with pytest.raises(ConfigError, match=message):
        pack.SynthIDTextWatermarkingConfig(**settings)
    with pytest.raises(ConfigError, match=message):
        genkit.GenerationConfig(watermarking_config=settings)
    good = pack.SynthIDTextWatermarkingConfig(ngram_len=5, keys=KEYS)
    with pytest.raises(ConfigError, match=message):
        good.update(**{key: value})


def test_unknown_and_missing_keys_in_a_dict(pack):
    with pytest.raises(ConfigError, match=r"unknown key `ngram_lenn`.*SynthIDTextWatermarkingConfig.*"
                                          r"Did you mean `ngram_len`\?"):
        genkit.GenerationConfig(watermarking_config={"ngram_lenn": 5, "keys": [1]})
    with pytest.raises(ConfigError, match=r"SynthIDTextWatermarkingConfig.*missing 1 required positional "
                                          r"argument: 'keys'"):
        genkit.GenerationConfig(watermarking_config={"ngram_len": 5})


def test_without_the_pack_a_synthid_dict_is_refused_naming_the_key():
    code = textwrap.dedent(f'''
        import genkit
        from genkit.plugins import get_registry
        assert "synthid_text" not in get_registry().items["watermark"]
        try:
            genkit.GenerationConfig(watermarking_config={{"keys": [1, 2], "ngram_len": 5}})
        except ValueError as e:
            print("{MARK}" + str(e))
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env=pack_env(None), capture_output=True, text=True,
                          timeout=120, check=True)
    assert "`watermarking_config` has an unknown key `keys`" in proc.stdout


def test_the_packs_md_example_runs(pack_site):
    """The runnable example of docs/packs.md, section 10, with the pack installed."""
    text = (REPO / "docs" / "packs.md").read_text(encoding="utf-8")
    section = text.split("## 10. A watermark pack: SynthID text", 1)[1]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL) if not b.startswith("# file:")]
    assert len(blocks) == 1
    proc = subprocess.run([sys.executable, "-c", blocks[0]], env=pack_env(pack_site), capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "watermarked" in proc.stdout and "plain" in proc.stdout
