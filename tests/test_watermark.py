"""Watermarking (issue 19, item 1): ``watermarking_config`` against transformers 5 on the same
weights (tokens, green lists, detector scores), the config's dict/JSON forms, its validation, and
detection on the real demo model."""

from __future__ import annotations

import json

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama
from genkit.watermarking import WatermarkDetector, WatermarkingConfig

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 17, 33, 60], [0, 0, 1, 44, 45, 46]])
MASK = (IDS != 0).long()
SETTINGS = [
    {"bias": 2.5, "seeding_scheme": "lefthash"},
    {"bias": 2.5, "seeding_scheme": "selfhash"},
    {"bias": 2.0, "seeding_scheme": "lefthash", "context_width": 3, "greenlist_ratio": 0.5, "hashing_key": 12345},
    {"bias": 1.5, "seeding_scheme": "selfhash", "context_width": 2, "greenlist_ratio": 0.3},
]


def _hf_generate(hf, **kw):
    return hf.generate(IDS, attention_mask=MASK, max_new_tokens=24, pad_token_id=0, **kw)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s['seeding_scheme']}-w{s.get('context_width', 1)}")
def test_greedy_tokens_and_detector_match_transformers(tiny_pair, settings):
    hf, ours = tiny_pair
    theirs = _hf_generate(hf, do_sample=False, watermarking_config=transformers.WatermarkingConfig(**settings))
    mine = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=24, watermarking_config=WatermarkingConfig(**settings))
    assert torch.equal(mine, theirs)
    plain = _hf_generate(hf, do_sample=False)
    assert not torch.equal(mine, plain)  # the watermark changed the text

    hf_detector = transformers.WatermarkDetector(hf.config, "cpu", transformers.WatermarkingConfig(**settings))
    detector = WatermarkDetector(ours.config, "cpu", settings)  # a dict works too
    new, plain_new = mine[:, IDS.shape[1]:], plain[:, IDS.shape[1]:]
    with_bos = torch.cat([torch.full((2, 1), hf.config.bos_token_id), new], dim=1)  # the detector drops it
    for sequences in (new, plain_new, with_bos):
        want = hf_detector(sequences, return_dict=True)
        got = detector(sequences, return_dict=True)
        for name in ("num_tokens_scored", "num_green_tokens", "green_fraction", "z_score", "p_value", "confidence"):
            assert torch.allclose(getattr(got, name), torch.as_tensor(getattr(want, name)), atol=1e-9), name
        assert got.prediction.tolist() == want.prediction.tolist()
        assert detector(sequences).tolist() == hf_detector(sequences).tolist()
        assert detector(sequences, z_threshold=1.0).tolist() == hf_detector(sequences, z_threshold=1.0).tolist()


def test_ignore_repeated_ngrams_matches_transformers(tiny_pair):
    hf, ours = tiny_pair
    cfg = {"bias": 3.0, "seeding_scheme": "lefthash"}
    seqs = _hf_generate(hf, do_sample=False, watermarking_config=transformers.WatermarkingConfig(**cfg))[:, 6:]
    seqs = torch.cat([seqs, seqs], dim=1)  # every bigram twice
    want = transformers.WatermarkDetector(hf.config, "cpu", transformers.WatermarkingConfig(**cfg),
                                          ignore_repeated_ngrams=True)(seqs, return_dict=True)
    got = WatermarkDetector(ours.config, "cpu", WatermarkingConfig(**cfg), ignore_repeated_ngrams=True)(
        seqs, return_dict=True)
    assert got.num_tokens_scored.tolist() == want.num_tokens_scored.tolist()
    assert torch.allclose(got.z_score, torch.as_tensor(want.z_score))


def test_sampling_with_a_watermark_matches_transformers_under_the_same_seed(tiny_pair):
    hf, ours = tiny_pair
    cfg = {"bias": 2.5, "seeding_scheme": "selfhash"}
    torch.manual_seed(7)
    theirs = _hf_generate(hf, do_sample=True, top_k=20, watermarking_config=transformers.WatermarkingConfig(**cfg))
    torch.manual_seed(7)
    mine = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=24, do_sample=True, top_k=20,
                           watermarking_config=cfg)
    assert torch.equal(mine, theirs)


def test_the_watermark_runs_after_the_users_processors_and_warpers(tiny_pair):
    """As in transformers: the user's processors, then the warpers, then the watermark."""
    from genkit.builtin_strategies.watermark import WatermarkLogitsProcessor
    from genkit.generation.api import prepare

    _, ours = tiny_pair
    user = genkit.SequenceBiasLogitsProcessor({(5,): 1.0})
    prepared = prepare(ours, IDS, None, [user], None, None, None,
                       {"attention_mask": MASK, "max_new_tokens": 2, "do_sample": True, "top_k": 5,
                        "watermarking_config": {"bias": 1.0}})
    kinds = [type(p).__name__ for p in prepared.logits_processor]
    assert kinds == ["SequenceBiasLogitsProcessor", "TopKLogitsWarper", "WatermarkLogitsProcessor"]
    assert isinstance(prepared.logits_processor[-1], WatermarkLogitsProcessor)


# -- the config: dict, JSON as transformers writes it, validation -------------------------------

def test_a_dict_becomes_a_watermarking_config_and_round_trips_through_json(tmp_path):
    config = genkit.GenerationConfig(watermarking_config={"bias": 2.5, "seeding_scheme": "selfhash"})
    assert config.watermarking_config == WatermarkingConfig(bias=2.5, seeding_scheme="selfhash")
    config.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "generation_config.json").read_text())
    assert saved["watermarking_config"] == {"bias": 2.5, "context_width": 1, "greenlist_ratio": 0.25,
                                            "hashing_key": 15485863, "seeding_scheme": "selfhash"}
    # transformers reads what genkit wrote ...
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path / "ours")
    assert isinstance(theirs.watermarking_config, transformers.WatermarkingConfig)
    assert theirs.watermarking_config.to_dict() == saved["watermarking_config"]
    # ... and genkit reads what transformers wrote
    transformers.GenerationConfig(watermarking_config=transformers.WatermarkingConfig(
        bias=1.5, context_width=2, greenlist_ratio=0.4)).save_pretrained(tmp_path / "theirs")
    back = genkit.GenerationConfig.from_pretrained(tmp_path / "theirs")
    assert back.watermarking_config == WatermarkingConfig(bias=1.5, context_width=2, greenlist_ratio=0.4)
    assert genkit.GenerationConfig.from_pretrained(tmp_path / "ours") == config
    # update() and merging into generate take dicts too
    other = genkit.GenerationConfig()
    other.update(watermarking_config={"context_width": 4})
    assert other.watermarking_config.context_width == 4


@pytest.mark.parametrize(("value", "message"), [
    ({"seeding_scheme": "hash"}, r'`watermarking_config.seeding_scheme` must be "lefthash" or "selfhash"; got \'hash\''),
    ({"greenlist_ratio": 1.0}, r"`watermarking_config.greenlist_ratio` must be a number in \(0, 1\); got 1.0"),
    ({"greenlist_ratio": 0}, r"`watermarking_config.greenlist_ratio` must be a number in \(0, 1\)"),
    ({"context_width": 0}, r"`watermarking_config.context_width` must be an int >= 1; got 0"),
    ({"bias": "big"}, r"`watermarking_config.bias` must be a finite number; got 'big'"),
    ({"bias": float("nan")}, r"`watermarking_config.bias` must be a finite number"),
    ({"hashing_key": 1.5}, r"`watermarking_config.hashing_key` must be an int; got 1.5"),
    ({"bais": 2.0}, r"`watermarking_config` has an unknown key `bais`.*Did you mean `bias`\?"),
    ("selfhash", r"`watermarking_config` must be a genkit.WatermarkingConfig, a dict"),
    (2.5, r"`watermarking_config` must be a genkit.WatermarkingConfig, a dict"),
])
def test_bad_watermarking_values_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        genkit.GenerationConfig(watermarking_config=value)
    with pytest.raises(ConfigError, match=message):
        genkit.generate(tiny_llama(seed=0), IDS[:1], max_new_tokens=2, watermarking_config=value)


def test_watermarking_config_object_validates_and_detector_checks_its_arguments():
    with pytest.raises(ConfigError, match="`watermarking_config.context_width`"):
        WatermarkingConfig(context_width=-1)
    wm = WatermarkingConfig()
    with pytest.raises(ConfigError, match="`watermarking_config` has no key `colour`"):
        wm.update(colour=1)
    model = tiny_llama(seed=0)
    with pytest.raises(ConfigError, match="`ignore_repeated_ngrams` must be True or False"):
        WatermarkDetector(model.config, "cpu", wm, ignore_repeated_ngrams="yes")
    with pytest.raises(ConfigError, match="`watermarking_config` must be a genkit.WatermarkingConfig"):
        WatermarkDetector(model.config, "cpu", "lefthash")
    detector = WatermarkDetector(model.config, "cpu", wm)
    with pytest.raises(ConfigError, match="at least one token to score"):
        detector(torch.tensor([[7]]))
    with pytest.raises(ConfigError, match="`input_ids` must be a 2-D tensor"):
        detector(torch.tensor([7, 8, 9]))
    bos = model.config.bos_token_id
    with pytest.raises(ConfigError, match="some rows start with the BOS token"):
        detector(torch.tensor([[bos, 5, 6], [7, 5, 6]]))


# -- the real demo model: sampled text is detected, plain text is not ---------------------------

def test_smollm2_watermarked_samples_are_detected_and_plain_samples_are_not():
    """20 sampled completions of 128 tokens each, batched: every watermarked one has z > 4 and no
    unwatermarked one does (~30 s on two cores)."""
    pytest.importorskip("gguf")
    model, tok = genkit.load_model("smollm2"), genkit.load_tokenizer("smollm2")
    animals = "cat dog bird fish horse lion tiger bear wolf fox owl frog snake mouse rabbit deer goat sheep cow duck"
    chats = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about a {a}."}],
                                     tokenize=False, add_generation_prompt=True) for a in animals.split()]
    tok.padding_side = "left"
    enc = tok(chats, return_tensors="pt", padding=True)
    wm = genkit.WatermarkingConfig(bias=2.5)
    detector = genkit.WatermarkDetector(model.config, "cpu", wm)
    z = {}
    for name, setting in (("marked", wm), ("plain", None)):
        torch.manual_seed(0)
        out = genkit.generate(model, **enc, do_sample=True, max_new_tokens=128, min_new_tokens=128,
                              watermarking_config=setting)
        new = out[:, enc["input_ids"].shape[1]:]
        assert new.shape == (20, 128)
        z[name] = detector(new, return_dict=True).z_score
    assert bool((z["marked"] > 4).all()), z["marked"]
    assert not bool((z["plain"] > 4).any()), z["plain"]
