"""Image-text-to-text decoder-only transformers models (LLaVA, LLaVA-NeXT, Qwen2-VL, PaliGemma, Gemma3,
Idefics3) through ``genkit.generate``: the tokens of transformers' own ``generate`` for every strategy
(docs/encoder_decoder.md, "Model inputs of decoder-only models"), and what genkit cannot run refused by
name (continuous batching, ``genkit.load_model``)."""

from __future__ import annotations

import pytest
import torch
import vlm_models as VLM

import genkit
from genkit.errors import NotSupportedError, UnsupportedModelError

transformers = pytest.importorskip("transformers")

KW = {"max_new_tokens": 5, "min_new_tokens": 5}


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {name: VLM.build(name) for name in VLM.FAMILIES}


def _both(model, x, seed=3, **kw):
    torch.manual_seed(seed)
    ref = model.generate(**x, **kw, **KW)
    torch.manual_seed(seed)
    return genkit.generate(model, **x, **kw, **KW), ref


STRATEGIES = [{}, {"do_sample": True, "top_k": 20}, {"do_sample": True, "num_return_sequences": 2},
              {"num_beams": 3, "num_return_sequences": 2}, {"num_beams": 2, "do_sample": True}]


@pytest.mark.parametrize("family", VLM.FAMILIES)
@pytest.mark.parametrize("kw", STRATEGIES, ids=["greedy", "sample", "sample-nrs", "beams-nrs", "beam-sample"])
def test_left_padded_batch_gives_transformers_tokens(models, family, kw):
    # Qwen2-VL: its multimodal RoPE positions (before: the text's, 2-D; and with num_return_sequences
    # its patch-major pixel_values were repeated row by row). PaliGemma: 1-indexed positions.
    model = models[family]
    x = VLM.inputs(family, model)
    out, ref = _both(model, x, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw", STRATEGIES[:4], ids=["greedy", "sample", "sample-nrs", "beams-nrs"])
def test_mllama_cross_attention_mask_follows_the_tokens(kw):
    """Mllama's `cross_attention_mask` gains a row per new token (its row's last, as Mllama's
    `_update_model_kwargs_for_generation` adds it) and its aspect ratios go with the pixels to the
    prompt's forward only; genkit passed the prompt's mask to every forward, where the model slices
    it at the cache's length: 'cannot reshape tensor of 0 elements' at the first new token."""
    model = VLM.build("mllama")
    x = VLM.inputs("mllama", model)
    out, ref = _both(model, x, **kw)
    assert torch.equal(out, ref)


def _own_generate_models():
    T = transformers
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8, num_channels=3)
    torch.manual_seed(0)
    kosmos = T.Kosmos2ForConditionalGeneration(T.Kosmos2Config(
        text_config=dict(vocab_size=VLM.V, embed_dim=32, layers=1, attention_heads=4, ffn_dim=64,
                         max_position_embeddings=64), vision_config=vision, latent_query_num=4))
    blip2 = T.Blip2ForConditionalGeneration(T.Blip2Config(
        vision_config=vision, num_query_tokens=4, image_token_index=VLM.IMG,
        qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                            encoder_hidden_size=32, vocab_size=VLM.V),
        text_config=T.OPTConfig(vocab_size=VLM.V, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                                max_position_embeddings=64, word_embed_proj_dim=32).to_dict()))
    return [kosmos.eval(), blip2.eval()]


def test_a_model_with_its_own_generate_is_refused_before_decoding():
    """BLIP-2 and Kosmos-2 prepare their image inputs in their own `generate` (their forward wants
    `pixel_values` at every step): genkit refuses them by name instead of failing inside the model
    at the first new token (a TypeError for BLIP-2, a ValueError for Kosmos-2)."""
    ids = torch.tensor([[VLM.IMG] * 4 + [2, 10, 11]])
    for model in _own_generate_models():
        rec = []
        streamer = type("R", (), {"put": lambda s, v: rec.append(v), "end": lambda s: None})()
        with pytest.raises(NotSupportedError, match=f"{type(model).__name__} has its own `generate`, which prepares "
                                                    "`pixel_values` for its language model"):
            genkit.generate(model, input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), max_new_tokens=3,
                            streamer=streamer)
        assert rec == []


def test_several_images_per_prompt_with_num_return_sequences(models):
    # prompt 0 has two images, prompt 1 one: pixel_values' rows are images, not prompts (before, each
    # image was repeated in place, [A, A, B, B, C, C], giving prompt 0's second sequence image B)
    model = models["llava"]
    ids, mask = VLM.padded([[1] + [VLM.IMG] * 4 + [5, 6] + [VLM.IMG] * 4 + [7], [1, 8] + [VLM.IMG] * 4 + [9, 10, 11]])
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    x = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
    for kw in ({"do_sample": True, "num_return_sequences": 3}, {"num_beams": 2, "num_return_sequences": 2}):
        out, ref = _both(model, x, **kw)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("family", VLM.FAMILIES)
def test_prompt_lookup_gives_transformers_tokens(models, family):
    # (Gemma3 with a window wider than the sequence: genkit's rollback of a transformers sliding-window
    # cache past its window is a separate matter)
    model = models[family] if family != "gemma3" else VLM.build("gemma3", window=64)
    x = VLM.inputs(family, model, batch=1)
    tail = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])  # the last tokens occur earlier: candidates are checked
    x["input_ids"] = torch.cat([x["input_ids"], tail], dim=1)
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in x:
            x[name] = torch.cat([x[name], torch.zeros_like(tail)], dim=1)
    out, ref = _both(model, x, prompt_lookup_num_tokens=2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "paligemma"])
def test_scores_and_logits_of_return_dict(models, family):
    model = models[family]
    x = VLM.inputs(family, model)
    for kw in ({}, {"num_beams": 2}):
        opts = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
        out, ref = _both(model, x, **opts)
        assert torch.equal(out.sequences, ref.sequences)
        assert [s.shape for s in out.scores] == [s.shape for s in ref.scores]
        for ours, theirs in zip(out.logits, ref.logits):
            if kw:  # beams: genkit runs the prompt on one row per prompt, transformers on each beam's
                assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
            else:  # the same positions (PaliGemma's count from 1: before, 3e-6 off in a padded batch)
                assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_streamer_gets_transformers_puts(models, family):
    model = models[family]
    x = VLM.inputs(family, model, batch=1)

    class Recorder:
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.puts.append("end")

    ours, theirs = Recorder(), Recorder()
    genkit.generate(model, **x, streamer=ours, **KW)
    model.generate(**x, streamer=theirs, **KW)
    assert ours.puts == theirs.puts and len(ours.puts) == 1 + 5 + 1  # the prompt, one put per token, end


def _merged_embeddings(model, x):
    """The embeddings the language model reads for the prompt: text and image features merged."""
    seen = {}

    def keep(_module, _args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach()

    hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**x)
    finally:
        hook.remove()
    return seen["embeds"]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_contrastive_search_reads_the_image_at_the_prompt_only(models, family):
    # transformers 5 runs contrastive search from the Hub only (unreachable here): the images given as
    # pixels must give the tokens of the same prompt given as its merged embeddings (Qwen2-VL: the ids,
    # grid and token types still give the multimodal RoPE positions), a path with no pixels to misplace
    model = models[family]
    x = VLM.inputs(family, model)
    kw = dict(penalty_alpha=0.6, top_k=4, **KW)
    out = genkit.generate(model, **x, **kw)
    given = {k: v for k, v in x.items() if k != "pixel_values"}
    same = genkit.generate(model, **given, inputs_embeds=_merged_embeddings(model, x), **kw)
    assert torch.equal(out, same)
    assert not torch.equal(out, genkit.generate(model, **given, **kw))  # the image matters


def test_continuous_batching_refuses_model_inputs_by_name(models):
    model = models["llava"]
    x = VLM.inputs("llava", model, batch=1)
    why = "model inputs besides the prompt's token ids \\(`pixel_values`\\) are not taken"
    with pytest.raises(NotSupportedError, match=why):  # before: "`pixel_values` is not a generation parameter"
        genkit.generate(model, **x, max_new_tokens=3, cache_implementation="paged")
    with pytest.raises(NotSupportedError, match=why):
        genkit.generate_batch(model, [x["input_ids"][0].tolist()], max_new_tokens=3, pixel_values=x["pixel_values"])
    from genkit.continuous.gate import refusal_for_kwargs

    assert "`pixel_values`" in refusal_for_kwargs(model, {"pixel_values": x["pixel_values"]})  # serve/batch: generate


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_load_model_refuses_a_multimodal_checkpoint_by_name(models, family, tmp_path):
    models[family].save_pretrained(tmp_path)
    cls = type(models[family]).__name__
    # before: "`num_hidden_layers` is missing" (it is in the text_config)
    with pytest.raises(UnsupportedModelError, match=f"{cls} is a multimodal model .*AutoModelForImageTextToText"):
        genkit.load_model(str(tmp_path))
