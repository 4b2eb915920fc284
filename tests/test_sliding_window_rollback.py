"""Strategies that roll the cache back (prompt lookup, draft-model assisted decoding, early exit,
contrastive search, classifier-free guidance under assisted decoding) on models with sliding-window
attention, once the sequence is past the window: transformers' ``DynamicCache`` then drops the
positions that leave the window unless it records them (``activate_past_recording``), which genkit
turns on only while such a strategy runs (``Stepper.rollback``), as transformers' own assisted
decoding does. Tokens are compared with transformers' ``generate`` on the same tiny models (window 8,
prompts of 24 tokens, drafts of 6), greedy and seeded sampling; genkit's native Mistral too."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

import genkit

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

V, WINDOW, NEW = 128, 8, 20
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = ("mistral", "gemma3", "gemma2", "qwen2")
PLAIN = {"max_new_tokens": NEW, "eos_token_id": None, "pad_token_id": 0}


def _config(family: str) -> object:
    t = transformers
    if family == "mistral":
        return t.MistralConfig(**BASE, sliding_window=WINDOW)
    if family == "qwen2":  # the second layer slides
        return t.Qwen2Config(**BASE, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    layers = {"head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 8,
              "layer_types": ["sliding_attention", "full_attention"]}
    return (t.Gemma3TextConfig if family == "gemma3" else t.Gemma2Config)(**BASE, **layers)


def _build(family: str) -> object:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval()
    model.config._attn_implementation = "eager"
    return model


def _assistant(model: object) -> object:
    """The target with its weights perturbed: it drafts some of the target's tokens, not all."""
    assistant = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in assistant.parameters():
            if p.numel() > 1:
                p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    policy = assistant.generation_config
    policy.num_assistant_tokens, policy.num_assistant_tokens_schedule = 6, "constant"
    policy.assistant_confidence_threshold = 0.0
    return assistant


def _prompt(model: object) -> torch.Tensor:
    """24 tokens: the model's own greedy continuation of 4 random ones (a tiny random model loops,
    so prompt lookup finds drafts)."""
    start = torch.randint(3, V, (1, 4), generator=torch.Generator().manual_seed(1))
    return model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = _build(request.param)
    return model, _assistant(model), _prompt(model)


@pytest.fixture(scope="module")
def native_mistral(tmp_path_factory):
    """(transformers' Mistral, its assistant, genkit's native copies of both, the prompt)."""
    hf = _build("mistral")
    hf_assistant = _assistant(hf)
    folder = tmp_path_factory.mktemp("windowed")
    hf.save_pretrained(folder / "target")
    hf_assistant.save_pretrained(folder / "assistant")
    ours, ours_assistant = genkit.load_model(folder / "target"), genkit.load_model(folder / "assistant")
    policy = ours_assistant.generation_config
    policy.num_assistant_tokens, policy.num_assistant_tokens_schedule = 6, "constant"
    policy.assistant_confidence_threshold = 0.0
    return hf, hf_assistant, ours, ours_assistant, _prompt(hf)


def _accepted(caplog) -> int:
    """Drafted tokens the target accepted in the last assisted run (the strategy's DEBUG summary)."""
    return int(re.findall(r"assisted decoding: \d+ rounds, \d+ drafted, (\d+) accepted", caplog.text)[-1])


def _assisted(caplog, model, ids, **kw):
    with caplog.at_level(logging.DEBUG, logger="genkit.assisted"):
        out = genkit.generate(model, ids, **kw)
    return out, _accepted(caplog)


def test_prompt_lookup_past_the_window_gives_transformers_tokens(family, caplog):
    hf, _, ids = family
    assert ids.shape[1] > WINDOW
    out, accepted = _assisted(caplog, hf, ids, prompt_lookup_num_tokens=6, do_sample=False, **PLAIN)
    assert out.tolist() == hf.generate(ids, do_sample=False, **PLAIN).tolist()
    assert accepted > 0
    for seed in (0, 1):
        kw = {"prompt_lookup_num_tokens": 6, "do_sample": True, "top_k": 3, **PLAIN}
        torch.manual_seed(seed)
        ref = hf.generate(ids, **kw)
        torch.manual_seed(seed)
        assert genkit.generate(hf, ids, **kw).tolist() == ref.tolist(), seed


def test_draft_model_past_the_window_gives_transformers_tokens(family, caplog, monkeypatch):
    from assisted_reference import corrected

    hf, assistant, ids = family
    out, accepted = _assisted(caplog, hf, ids, assistant_model=assistant, do_sample=False, **PLAIN)
    assert out.tolist() == hf.generate(ids, do_sample=False, **PLAIN).tolist()
    assert accepted > 0
    # eos_token_id set: transformers' assistant stops its drafts at its own EOS whatever the call says
    kw = {"assistant_model": assistant, "do_sample": True, "top_k": 3, **PLAIN, "eos_token_id": 2}
    for seed in (0, 1):
        with corrected(monkeypatch):
            torch.manual_seed(seed)
            ref = hf.generate(ids, **kw)
        torch.manual_seed(seed)
        assert genkit.generate(hf, ids, **kw).tolist() == ref.tolist(), seed


@pytest.mark.parametrize("low_memory", [False, True])
def test_contrastive_search_past_the_window(family, low_memory):
    """The same tokens as on a cache of full layers (transformers' masks still slide), which never
    has to roll back past a window."""
    hf, _, ids = family
    kw = {"penalty_alpha": 0.6, "top_k": 4, "low_memory": low_memory, **PLAIN}
    full = genkit.generate(hf, ids, past_key_values=DynamicCache(), **kw)
    assert genkit.generate(hf, ids, **kw).tolist() == full.tolist()


def _sliding_layers(cache):
    return [layer for layer in getattr(cache, "cache", cache).layers if getattr(layer, "is_sliding", False)]


def test_the_cache_records_past_states_only_while_rolling_back(caplog):
    """Plain decoding leaves the sliding layers at their window; assisted decoding records, cuts
    them back every round and hands the cache back not recording, ready to continue from."""
    hf = _build("gemma3")
    ids = _prompt(hf)
    plain = genkit.generate(hf, ids, do_sample=False, return_dict_in_generate=True, **PLAIN)
    assisted = genkit.generate(hf, ids, prompt_lookup_num_tokens=6, do_sample=False, return_dict_in_generate=True,
                               **PLAIN)
    assert assisted.sequences.tolist() == plain.sequences.tolist()
    for out in (plain, assisted):
        layers = _sliding_layers(out.past_key_values)
        assert layers and all(not layer.record_past and layer.keys.shape[-2] == WINDOW - 1 for layer in layers)
    more = genkit.generate(hf, assisted.sequences, past_key_values=assisted.past_key_values, do_sample=False, **PLAIN)
    assert more.tolist() == hf.generate(plain.sequences, do_sample=False, **PLAIN).tolist()


def test_native_mistral_past_the_window_gives_transformers_tokens(native_mistral, caplog, monkeypatch):
    """genkit's native Mistral (its KVCache keeps every position) and the same model writing into a
    transformers ``DynamicCache`` passed in (which slides): prompt lookup, a draft model, early exit."""
    from assisted_reference import corrected

    hf, hf_assistant, ours, ours_assistant, ids = native_mistral
    greedy = hf.generate(ids, do_sample=False, **PLAIN).tolist()
    for cache in (lambda: {}, lambda: {"past_key_values": DynamicCache(config=hf.config)}):
        out, accepted = _assisted(caplog, ours, ids, prompt_lookup_num_tokens=6, do_sample=False, **cache(), **PLAIN)
        assert out.tolist() == greedy and accepted > 0
        out, accepted = _assisted(caplog, ours, ids, assistant_model=ours_assistant, do_sample=False, **cache(),
                                  **PLAIN)
        assert out.tolist() == greedy and accepted > 0
        out = genkit.generate(ours, ids, assistant_early_exit=1, num_assistant_tokens=6, do_sample=False, **cache(),
                              **PLAIN)
        assert out.tolist() == greedy
        kw = {"do_sample": True, "top_k": 3, **PLAIN, "eos_token_id": 2}
        for seed in (0, 1):
            torch.manual_seed(seed)
            ref = hf.generate(ids, prompt_lookup_num_tokens=6, **kw)
            torch.manual_seed(seed)
            assert genkit.generate(ours, ids, prompt_lookup_num_tokens=6, **cache(), **kw).tolist() == ref.tolist()
            with corrected(monkeypatch):
                torch.manual_seed(seed)
                ref = hf.generate(ids, assistant_model=hf_assistant, **kw)
            torch.manual_seed(seed)
            out = genkit.generate(ours, ids, assistant_model=ours_assistant, **cache(), **kw)
            assert out.tolist() == ref.tolist(), seed


def test_early_exit_into_a_transformers_cache_crops_each_layer_by_its_own_length(tmp_path):
    """Early exit drafts with the first layers only, so the layers of a passed ``DynamicCache`` hold
    different lengths; a crop keeps the same positions in each (before: one count removed from
    every layer, and the deeper ones lost verified positions). Full attention, no window."""
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**BASE, sliding_window=None)).eval()
    hf.save_pretrained(tmp_path)
    ours = genkit.load_model(tmp_path)
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(1))
    out = genkit.generate(ours, ids, assistant_early_exit=1, num_assistant_tokens=4, do_sample=False,
                          past_key_values=DynamicCache(config=hf.config), **PLAIN)
    assert out.tolist() == hf.generate(ids, do_sample=False, **PLAIN).tolist()


def test_guidance_under_prompt_lookup_past_the_window(caplog):
    """The unconditional branch's own cache rolls back with the drafts: greedy tokens stay plain
    classifier-free guidance's."""
    hf = _build("mistral")
    ids = _prompt(hf)
    negative = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(2))
    kw = {"guidance_scale": 1.5, "negative_prompt_ids": negative, "do_sample": False, **PLAIN}
    out, accepted = _assisted(caplog, hf, ids, prompt_lookup_num_tokens=6, **kw)
    assert out.tolist() == hf.generate(ids, **kw).tolist()
    assert accepted > 0


# -- classifier-free guidance under assisted decoding -------------------------------------------------

NEGATIVE = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(2))
GUIDED = {"guidance_scale": 1.5, "negative_prompt_ids": NEGATIVE, **PLAIN}


@pytest.fixture(scope="module", params=[None, WINDOW], ids=["full", "window"])
def guided(request):
    """(transformers' Mistral with or without a sliding window, its assistant, the prompt)."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**BASE, sliding_window=request.param)).eval()
    model.config._attn_implementation = "eager"
    return model, _assistant(model), _prompt(model)


def _drafts(name, assistant):
    return {"prompt_lookup_num_tokens": 6} if name == "prompt_lookup" else {"assistant_model": assistant}


@pytest.mark.parametrize("source", ["prompt_lookup", "draft_model"])
def test_guidance_under_assisted_decoding_gives_transformers_tokens(guided, source, caplog, monkeypatch):
    """Greedy: plain classifier-free guidance's tokens (transformers' ``generate`` without drafts).
    Seeded sampling: transformers' assisted decoding with its guidance processor made to follow the
    history (``assisted_reference.guidance_followed``; unpatched, its unconditional branch keeps
    every rejected draft, see the next test)."""
    from assisted_reference import corrected, guidance_followed

    hf, assistant, ids = guided
    drafts = _drafts(source, assistant)
    out, accepted = _assisted(caplog, hf, ids, do_sample=False, **drafts, **GUIDED)
    assert out.tolist() == hf.generate(ids, do_sample=False, **GUIDED).tolist()
    assert accepted > 0
    with guidance_followed(monkeypatch), corrected(monkeypatch):
        assert hf.generate(ids, do_sample=False, **drafts, **GUIDED).tolist() == out.tolist()
        for seed in (0, 1):
            kw = {"do_sample": True, "top_k": 3, **drafts, **GUIDED}
            torch.manual_seed(seed)
            ref = hf.generate(ids, **kw)
            torch.manual_seed(seed)
            assert genkit.generate(hf, ids, **kw).tolist() == ref.tolist(), seed


def test_transformers_guidance_branch_keeps_the_rejected_drafts(guided):
    """The evidence for ``assisted_reference.guidance_followed``, in transformers 5.24 as installed
    (when this fails, transformers has fixed it: drop the correction): under prompt lookup its
    unconditional branch ends up holding far more positions than the negative prompt and the
    generated tokens, and its greedy tokens are not plain guidance's."""
    from transformers import LogitsProcessorList
    from transformers import UnbatchedClassifierFreeGuidanceLogitsProcessor as TheirGuidance

    hf, _, ids = guided
    plain = hf.generate(ids, do_sample=False, **GUIDED)
    theirs = TheirGuidance(1.5, hf, unconditional_ids=NEGATIVE)
    out = hf.generate(ids, do_sample=False, prompt_lookup_num_tokens=6, logits_processor=LogitsProcessorList([theirs]),
                      **PLAIN)
    assert theirs.unconditional_context["cache"].get_seq_length() > NEGATIVE.shape[1] + NEW
    assert out.tolist() != plain.tolist()


@pytest.mark.parametrize("source", ["prompt_lookup", "draft_model"])
def test_a_guidance_processor_given_by_the_caller_rolls_back_with_the_drafts(guided, source):
    """genkit's ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` built by the caller on the
    transformers model itself (transformers' signature) and passed in ``logits_processor``: plain
    guidance's tokens under assisted decoding, and at the end its unconditional branch holds the
    negative prompt and every generated token but the last, as after plain decoding, its
    sliding-window layers their window, recording no more (before: transformers' ``crop`` refused
    genkit's count, a ValueError; past the window a RuntimeError)."""
    hf, assistant, ids = guided
    plain = hf.generate(ids, do_sample=False, **GUIDED)
    for drafts in ({}, _drafts(source, assistant)):
        ours = genkit.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, hf, unconditional_ids=NEGATIVE)
        out = genkit.generate(hf, ids, do_sample=False, logits_processor=[ours], **drafts, **PLAIN)
        assert out.tolist() == plain.tolist(), drafts
        assert ours.cache.get_seq_length() == NEGATIVE.shape[1] + NEW - 1
        sliding = _sliding_layers(ours.cache)
        assert bool(sliding) == bool(hf.config.sliding_window)
        assert all(not layer.record_past and layer.keys.shape[-2] == WINDOW - 1 for layer in sliding)
