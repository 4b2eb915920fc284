"""Recipes written for transformers run unchanged on genkit's native models (issue 30, item 2).

Each recipe folder is written here and run three ways on the same weights: by transformers'
own ``custom_generate`` loader on a transformers Llama (the reference), by ``genkit.generate`` on
the genkit Llama (the recipe gets a transformers view sharing the genkit weights, see
docs/recipes.md), and by ``genkit.generate`` on the transformers Llama (the recipe gets that
model itself). The tokens must be identical.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hub_server import group_beam_recipe, write_recipe
from windowed_model import windowed_mistral

import genkit

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 42, 7], [1, 99, 3, 64]])

# transformers' guide example, verbatim (transformers-community/custom_generate_example)
GUIDE = '''import torch

def generate(model, input_ids, generation_config=None, left_padding=None, **kwargs):
    generation_config = generation_config or model.generation_config  # default to the model generation config
    cur_length = input_ids.shape[1]
    max_length = generation_config.max_length or cur_length + generation_config.max_new_tokens

    # Example of custom argument: add `left_padding` (integer) pad tokens before the prompt
    if left_padding is not None:
        if not isinstance(left_padding, int) or left_padding < 0:
            raise ValueError(f"left_padding must be an integer larger than 0, but is {left_padding}")

        pad_token = kwargs.pop("pad_token", None) or generation_config.pad_token_id or model.config.pad_token_id
        if pad_token is None:
            raise ValueError("pad_token is not defined")
        batch_size = input_ids.shape[0]
        pad_tensor = torch.full(size=(batch_size, left_padding), fill_value=pad_token).to(input_ids.device)
        input_ids = torch.cat((pad_tensor, input_ids), dim=1)
        cur_length = input_ids.shape[1]

    # Simple greedy decoding loop
    while cur_length < max_length:
        logits = model(input_ids).logits
        next_token_logits = logits[:, -1, :]
        next_tokens = torch.argmax(next_token_logits, dim=-1)
        input_ids = torch.cat((input_ids, next_tokens[:, None]), dim=-1)
        cur_length += 1

    return input_ids
'''

# a greedy recipe with a custom argument, on transformers' generate internals (a callable
# custom_generate with the decoding-method signature, and the helpers it calls on the model)
GREEDY = '''import torch
from transformers import GenerationMixin


def _greedy_banning(model, input_ids, logits_processor, stopping_criteria, generation_config, banned_token=None,
                    **model_kwargs):
    finished = False
    while not finished:  # the prompt once, then one new token a step on the cache
        step = {"next_sequence_length": 1} if model_kwargs["cache"].get_seq_length() else {"is_first_iteration": True}
        model_inputs = model.prepare_inputs_for_generation(input_ids, **step, **model_kwargs)
        outputs = model(**model_inputs, return_dict=True)
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                 is_encoder_decoder=model.config.is_encoder_decoder)
        scores = logits_processor(input_ids, outputs.logits[:, -1, :].float())
        if banned_token is not None:
            scores[:, banned_token] = -float("inf")
        input_ids = torch.cat([input_ids, scores.argmax(-1, keepdim=True)], dim=-1)
        finished = bool(stopping_criteria(input_ids, scores).all())
    return input_ids


def generate(model, *args, banned_token=None, **kwargs):
    return GenerationMixin.generate(model, *args, custom_generate=_greedy_banning, banned_token=banned_token, **kwargs)
'''

# a sampling recipe that reads its settings from generation_config and keeps a cache
SAMPLING = '''import copy

import torch


def generate(model, input_ids, generation_config=None, seed=0, **kwargs):
    config = copy.deepcopy(generation_config or model.generation_config)
    config.update(**kwargs)
    rng = torch.Generator().manual_seed(seed)
    cache, step_ids, ids = None, input_ids, input_ids
    for _ in range(config.max_new_tokens):
        out = model(step_ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float() / config.temperature
        kth = torch.topk(logits, config.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
        step_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=rng)
        ids = torch.cat([ids, step_ids], dim=-1)
    return ids
'''


def _recipe(tmp_path, name, code):
    return str(write_recipe(tmp_path / name, {"custom_generate/generate.py": code,
                                              "README.md": "---\ntags: [custom_generate]\n---\n"}))


def _three_ways(pair, folder, *args, **kwargs):
    """The recipe on transformers (its own loader), on the genkit model, and on the transformers
    model through genkit."""
    hf, ours = pair
    reference = hf.generate(*args, custom_generate=folder, trust_remote_code=True, **kwargs)
    return reference, genkit.generate(ours, *args, custom_generate=folder, **kwargs), \
        genkit.generate(hf, *args, custom_generate=folder, **kwargs)


def test_guide_recipe_verbatim_gives_20_new_tokens_with_no_length_set(tiny_pair, tmp_path):
    hf, ours = tiny_pair
    folder = _recipe(tmp_path, "guide", GUIDE)
    out = genkit.generate(ours, input_ids=IDS, custom_generate=folder)  # no config, no length
    assert out.shape == (2, IDS.shape[1] + 20)  # 20 new tokens, as transformers' generate with no length
    assert torch.equal(out, hf.generate(IDS, do_sample=False))
    assert torch.equal(genkit.generate(hf, input_ids=IDS, custom_generate=folder), out)
    padded = genkit.generate(ours, input_ids=IDS, custom_generate=folder, left_padding=5)
    assert padded.shape == (2, IDS.shape[1] + 20)  # the guide sizes max_length before padding
    assert torch.equal(padded[:, :5], torch.zeros(2, 5, dtype=torch.long))


# a recipe that hands everything on to genkit.generate (as docs/examples/demo_recipe does)
PASS_ON = '''import genkit


def generate(model, input_ids, generation_config=None, **kwargs):
    return genkit.generate(model, input_ids, generation_config=generation_config, **kwargs)
'''


def test_the_callers_length_reaches_the_recipes_config_and_conflicts_with_nothing(tiny_pair, tmp_path, caplog):
    """With no generation_config from the caller, the recipe's config carries the caller's
    max_new_tokens (no made-up max_length of prompt + 20 beside it): the guide recipe, which reads
    only the config, gives the 8 tokens asked for, and a recipe passing both config and arguments on
    to generate raises no "both max_new_tokens and max_length" warning."""
    hf, ours = tiny_pair
    guide = _recipe(tmp_path, "guide", GUIDE)
    out = genkit.generate(ours, input_ids=IDS, custom_generate=guide, max_new_tokens=8)
    assert out.shape == (2, IDS.shape[1] + 8)
    assert torch.equal(out, hf.generate(IDS, do_sample=False, max_new_tokens=8))
    passing = _recipe(tmp_path, "pass_on", PASS_ON)
    with caplog.at_level(logging.WARNING, logger="genkit"):
        out = genkit.generate(ours, input_ids=IDS, custom_generate=passing, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, IDS.shape[1] + 6)
    assert torch.equal(out, genkit.generate(ours, IDS, max_new_tokens=6, do_sample=False))
    assert not [r for r in caplog.records if "takes precedence" in r.getMessage()]
    # the caller's max_length is passed the same way (a total length, prompt included)
    assert genkit.generate(ours, input_ids=IDS, custom_generate=guide, max_length=7).shape == (2, 7)


def test_greedy_recipe_with_a_custom_argument_same_tokens(tiny_pair, tmp_path):
    folder = _recipe(tmp_path, "greedy", GREEDY)
    plain = _three_ways(tiny_pair, folder, IDS, max_new_tokens=8, do_sample=False)
    banned_token = int(plain[0][0, 4])
    banned = _three_ways(tiny_pair, folder, IDS, max_new_tokens=8, banned_token=banned_token)
    for outs in (plain, banned):
        assert outs[0].shape == (2, 12)
        assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert banned_token not in banned[1][:, 4:].tolist()[0]
    assert torch.equal(plain[1], genkit.generate(tiny_pair[1], IDS, max_new_tokens=8, do_sample=False))


def _greedy_loop():
    """GREEDY's decoding loop itself: a transformers ``custom_generate=<callable>`` (it reads
    ``model_kwargs["cache"]`` and calls GenerationMixin's helpers on the model)."""
    namespace: dict = {}
    exec(compile(GREEDY, "greedy_loop", "exec"), namespace)
    return namespace["_greedy_banning"]


def test_a_transformers_decoding_method_runs_marked_with_transformers_method(tiny_pair):
    hf, ours = tiny_pair
    loop, marked = _greedy_loop(), genkit.transformers_method(_greedy_loop())
    reference = hf.generate(IDS, custom_generate=loop, max_new_tokens=8, do_sample=False)
    banned_token = int(reference[0, 4])
    banned = hf.generate(IDS, custom_generate=loop, max_new_tokens=8, do_sample=False, banned_token=banned_token)
    assert not torch.equal(banned, reference)  # the loop's own argument reaches it
    for model in (ours, hf):  # the native model (on its transformers view) and a transformers model
        assert torch.equal(genkit.generate(model, IDS, custom_generate=marked, max_new_tokens=8, do_sample=False),
                           reference)
        assert torch.equal(genkit.generate(model, IDS, custom_generate=marked, max_new_tokens=8, do_sample=False,
                                           banned_token=banned_token), banned)
        # a genkit GenerationConfig is read field by field as transformers' own
        config = genkit.GenerationConfig(max_new_tokens=5, do_sample=False)
        assert torch.equal(genkit.generate(model, IDS, generation_config=config, custom_generate=marked),
                           reference[:, :IDS.shape[1] + 5])
    assert torch.equal(ours.generate(IDS, custom_generate=marked, max_new_tokens=8, do_sample=False), reference)


def test_a_bare_transformers_loop_on_a_native_model_names_transformers_method(tiny_pair):
    _, ours = tiny_pair
    with pytest.raises(KeyError) as raised:  # genkit's strategy contract has no model_kwargs["cache"]
        genkit.generate(ours, IDS, custom_generate=_greedy_loop(), max_new_tokens=3)
    if hasattr(raised.value, "add_note"):  # (Python 3.11+)
        assert any("custom_generate=genkit.transformers_method(fn)" in note for note in raised.value.__notes__)
    with pytest.raises(genkit.errors.ConfigError, match="`transformers_method` takes a decoding function"):
        genkit.transformers_method("org/repo")


def test_group_beam_search_recipe_on_generation_mixin_internals_same_tokens(tiny_pair, tmp_path):
    """transformers 4.x's group beam search as a recipe (tests/group_beam_recipe.py, shared with
    tests/test_diverse_beams.py): the same hypotheses three ways and from genkit's built-in strategy."""
    folder = group_beam_recipe(tmp_path / "group-beam-search")
    kw = dict(max_new_tokens=6, num_beams=4, num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=4,
              do_sample=False)
    outs = _three_ways(tiny_pair, folder, IDS, **kw)
    assert outs[0].shape == (8, 10)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert torch.equal(genkit.generate(tiny_pair[1], IDS, **kw), outs[0])
    # diversity works: without the penalty the hypotheses differ
    assert not torch.equal(genkit.generate(tiny_pair[1], IDS, **{**kw, "diversity_penalty": 0.0}), outs[0])


def test_sampling_recipe_reading_generation_config_same_tokens(tiny_pair, tmp_path):
    folder = _recipe(tmp_path, "sampling", SAMPLING)
    config = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_k=10, max_new_tokens=7)
    outs = _three_ways(tiny_pair, folder, input_ids=IDS, generation_config=config, seed=3)
    assert outs[0].shape == (2, 11)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    # kwargs over the resolved config (no generation_config given: transformers' defaults, top_k 50)
    hf, ours = tiny_pair
    assert torch.equal(genkit.generate(ours, input_ids=IDS, custom_generate=folder, max_new_tokens=5, seed=4),
                       genkit.generate(hf, input_ids=IDS, custom_generate=folder, max_new_tokens=5, seed=4))


def test_what_the_recipe_is_given(tiny_pair, tmp_path):
    hf, ours = tiny_pair
    folder = _recipe(tmp_path, "probe", "def generate(model, generation_config=None, **kwargs):\n"
                                        "    return model, generation_config\n")
    given, config = genkit.generate(hf, IDS, custom_generate=folder)
    assert given is hf  # a transformers model is given as it is
    assert isinstance(config, transformers.GenerationConfig) and config.max_length == IDS.shape[1] + 20
    assert hf.generation_config.max_length is None  # the model's own config is untouched
    given, config = genkit.generate(ours, IDS, custom_generate=folder)
    assert isinstance(given, transformers.PreTrainedModel) and isinstance(given, transformers.GenerationMixin)
    assert given.genkit_model is ours  # the view holds the genkit model: same parameters, nothing copied
    assert {id(p) for p in given.parameters()} == {id(p) for p in ours.parameters()}
    assert config.max_length == IDS.shape[1] + 20 and config.do_sample is False
    # a recipe may hand the view (and the transformers config it got) back to genkit.generate
    assert torch.equal(genkit.generate(given, IDS, generation_config=config, max_new_tokens=4),
                       genkit.generate(ours, IDS, max_new_tokens=4))


# a recipe's own loop over a left-padded batch: the mask, no positions (transformers' forward then
# counts positions from the cache's length, pads included), the cache under transformers 5.24's name
PADDED_LOOP = '''import torch


def generate(model, input_ids, attention_mask=None, max_new_tokens=5, **kwargs):
    ids, mask, step, cache = input_ids, attention_mask, input_ids, None
    for _ in range(max_new_tokens):
        out = model(step, attention_mask=mask, cache=cache, use_cache=True)
        cache, step = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, step], dim=-1)
        mask = torch.cat([mask, torch.ones_like(step)], dim=-1)
    return ids
'''


def test_recipe_loop_on_a_left_padded_batch_gets_transformers_positions(tmp_path):
    """On GPT-2 (learned absolute positions) a recipe that calls the model with a padded mask and no
    positions gets transformers' tokens on the view: the positions transformers' forward gives, not
    genkit's count of real tokens (which the native model keeps, and genkit's own generate matches
    transformers' generate with)."""
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                     bos_token_id=1, eos_token_id=2)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    ours = genkit.load_model(tmp_path / "gpt2")
    folder = _recipe(tmp_path, "padded", PADDED_LOOP)
    ids = torch.tensor([[0, 0, 42, 7, 9], [1, 99, 3, 64, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    outs = _three_ways((hf, ours), folder, input_ids=ids, attention_mask=mask, max_new_tokens=6)
    assert outs[0].shape == (2, 11)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    # genkit's generate counts real tokens, as transformers' generate does: another answer on row 0
    plain = genkit.generate(ours, ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    assert not torch.equal(plain[0], outs[0][0]) and torch.equal(plain[1], outs[0][1])


# greedy decoding two ways a transformers user writes it on a sliding-window model: transformers'
# generate on a static cache, or a loop of the forward on `DynamicCache(config=...)` (whose layers
# keep the window's positions only)
WINDOWED = '''import torch
from transformers import DynamicCache


def generate(model, input_ids, max_new_tokens=6, static=False, **kwargs):
    if static:
        return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="static")
    cache, ids, step = DynamicCache(config=model.config), input_ids, input_ids
    for _ in range(max_new_tokens):
        step = model(step, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, step], dim=-1)
    return ids
'''


@pytest.mark.parametrize("static", [False, True])
def test_recipe_on_transformers_sliding_window_and_static_caches_same_tokens(static, tmp_path):
    """A recipe on transformers' own caches for a sliding-window Mistral (a prompt longer than the
    window): the view's forward writes them (their layers hand back the window's positions, or a
    static buffer) and gives transformers' tokens, as genkit's generate does."""
    _, hf, ours = windowed_mistral(tmp_path / "mistral")
    folder = _recipe(tmp_path, "windowed", WINDOWED)
    ids = torch.randint(3, 128, (2, 12))
    outs = _three_ways((hf, ours), folder, input_ids=ids, max_new_tokens=8, static=static)
    assert outs[0].shape == (2, 20)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    if static:  # (the loop runs past EOS; generate stops there)
        assert torch.equal(genkit.generate(ours, ids, max_new_tokens=8, do_sample=False), outs[0])


def test_a_model_repos_recipe_on_generation_mixin_internals_same_tokens(tiny_pair, tmp_path):
    """A model folder that ships a recipe written for transformers (its own loop on
    ``GenerationMixin.generate(model, ..., custom_generate=loop)``), loaded with
    ``trust_remote_code=True``: ``model.generate`` gives transformers' tokens on genkit's model (the
    recipe is given the transformers view, as transformers gives it its own model; it was given the
    native model, which has none of GenerationMixin's internals: an AttributeError)."""
    hf, _ = tiny_pair
    folder = tmp_path / "model_repo"
    hf.save_pretrained(folder)
    write_recipe(folder, {"custom_generate/generate.py": GREEDY})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ours = genkit.load_model(folder, trust_remote_code=True)
    want = theirs.generate(input_ids=IDS, max_new_tokens=6, do_sample=False)
    assert want.shape == (2, IDS.shape[1] + 6)
    assert torch.equal(ours.generate(input_ids=IDS, max_new_tokens=6, do_sample=False), want)
    assert torch.equal(ours.generate(IDS, max_new_tokens=6, do_sample=False), want)
    banned = int(want[0, 5])
    want = theirs.generate(input_ids=IDS, max_new_tokens=6, banned_token=banned)
    assert torch.equal(ours.generate(input_ids=IDS, max_new_tokens=6, banned_token=banned), want)
    assert banned not in want[0, 4:].tolist()


# a loop on the decoder and the LM head apart (`model.get_decoder()` returns transformers' base
# model, e.g. LlamaModel; its output's `last_hidden_state` is the final norm's output)
DECODER_LOOP = '''import torch


def generate(model, input_ids, max_new_tokens=5, **kwargs):
    decoder, head, ids, step, cache = model.get_decoder(), model.get_output_embeddings(), input_ids, input_ids, None
    for _ in range(max_new_tokens):
        out = decoder(input_ids=step, cache=cache, use_cache=True)
        cache, step = out.cache, head(out.last_hidden_state[:, -1:]).argmax(-1)
        ids = torch.cat([ids, step], dim=-1)
    return ids
'''


def test_recipe_on_get_decoder_and_the_lm_head_same_tokens(tiny_pair, tmp_path):
    """`model.get_decoder()` on the view is the decoder without the head, called as transformers'
    base model (it was the view itself, whose output has no `last_hidden_state`: an AttributeError)."""
    folder = _recipe(tmp_path, "decoder", DECODER_LOOP)
    outs = _three_ways(tiny_pair, folder, input_ids=IDS, max_new_tokens=6)
    assert outs[0].shape == (2, IDS.shape[1] + 6)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert torch.equal(outs[1], genkit.generate(tiny_pair[1], IDS, max_new_tokens=6, do_sample=False))
