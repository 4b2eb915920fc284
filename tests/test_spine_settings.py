"""One spine, settings: a generation setting means the same on ``generate()``, the continuous
batching manager, ``generate_batch``, ``generate(cache_implementation="paged")`` and ``genkit
batch``'s engines, whether the call, a ``GenerationConfig`` or the model folder's
``generation_config.json`` sets it; a request's settings never reach another request of the same
batch; a setting a path cannot run is an error naming it, never dropped.

The reference is ``generate()`` on the same tiny random model, token for token."""

from __future__ import annotations

import json

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama

PROMPT = [5, 17, 33, 8, 90]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=1)


def _generate(model, prompt=PROMPT, **kw):
    return model.generate(torch.tensor([prompt]), **kw)[0, len(prompt):].tolist()


def _manager(model, prompt=PROMPT, **kw):
    with model.init_continuous_batching() as manager:
        out = manager.get_result(manager.add_request(prompt, **kw), timeout=120)
    assert out is not None
    return out


def _cb_engines(model, prompt=PROMPT, **kw):
    """The new tokens of the manager, generate_batch and generate(cache_implementation="paged")."""
    by_manager = _manager(model, prompt, **kw)
    assert by_manager.error is None, by_manager.error
    by_batch = model.generate_batch([prompt], **kw)["req_0"]
    assert by_batch.error is None, by_batch.error
    paged = model.generate(torch.tensor([prompt]), cache_implementation="paged", **kw)[0, len(prompt):].tolist()
    return by_manager.generated_tokens, by_batch.generated_tokens, paged


def test_max_length_counts_the_prompt_on_every_engine(model):
    want = _generate(model, max_length=9, eos_token_id=None)
    assert len(want) == 9 - len(PROMPT)
    assert _cb_engines(model, max_length=9, eos_token_id=None) == (want, want, want)
    # max_new_tokens still wins over max_length, as in generate
    want = _generate(model, max_length=9, max_new_tokens=6, eos_token_id=None)
    assert len(want) == 6
    assert _cb_engines(model, max_length=9, max_new_tokens=6, eos_token_id=None) == (want, want, want)
    # a GenerationConfig's max_length too
    config = genkit.GenerationConfig(max_length=8, eos_token_id=None)
    want = _generate(model, generation_config=config)
    assert len(want) == 3
    assert model.generate_batch([PROMPT], generation_config=config)["req_0"].generated_tokens == want


def test_max_length_on_a_left_padded_batch_with_the_paged_cache(model):
    """generate counts a batch's max_length from its padded width; the paged cache gives every row
    the same new tokens, the same sequences."""
    ids = torch.tensor([[0, 0, 0, 5, 6], PROMPT])
    mask = torch.tensor([[0, 0, 0, 1, 1], [1] * 5])
    kw = {"attention_mask": mask, "eos_token_id": None, "pad_token_id": 0, "max_length": 9}
    want = model.generate(ids, **kw)
    assert want.shape == (2, 9)
    assert torch.equal(model.generate(ids, cache_implementation="paged", **kw), want)


@pytest.mark.parametrize(("rows", "settings"), [
    # generate forbids the EOS (54, the short row's 4th new token) for 8 - 5 new tokens, the batch's
    # width: not for 8 - 2, the short row's own prompt
    ([[0, 0, 0, 5, 6], PROMPT], {"min_length": 8, "eos_token_id": 54}),
    ([[0, 0, 0, 5, 6], PROMPT], {"min_length": 3, "eos_token_id": 54}),  # at most the width: no effect
    # generate forces a BOS only where the whole sequence is one token: never on a batch 5 tokens wide
    ([[0, 0, 0, 0, 7], PROMPT], {"forced_bos_token_id": 99, "eos_token_id": None}),
], ids=["min_length", "min_length_within_the_width", "forced_bos_token_id"])
def test_lengths_counted_on_a_left_padded_batch_with_the_paged_cache(model, rows, settings):
    """The lengths generate counts from a batch's padded width, the paged cache (each row without its
    padding) counts from that width too: the same sequences."""
    ids = torch.tensor(rows)
    kw = {"attention_mask": (ids != 0).long(), "pad_token_id": 0, "max_new_tokens": 10, **settings}
    want = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, cache_implementation="paged", **kw), want)


@pytest.mark.parametrize("settings", [
    {"max_length": 8, "min_new_tokens": 5},  # max_length leaves 3 new tokens, the minimum is past them
    {"min_new_tokens": 25},  # the default length: 20 new tokens
    {"max_new_tokens": 3, "min_length": 20},  # min_length counts the prompt: 15 new tokens
    {"max_new_tokens": 3, "max_length": 7, "min_length": 9},  # max_new_tokens wins over max_length
], ids=["max_length", "default_length", "min_length", "max_new_tokens_and_max_length"])
def test_a_minimum_past_the_length_runs_as_generate_runs_it(model, settings):
    """generate (as transformers) stops at the length whatever minimum is asked past it: the EOS id
    never comes. The manager and the paged cache turned the length into `max_new_tokens`, then
    refused it beside the larger `min_new_tokens` ("must be <= `max_new_tokens`"), a request generate
    runs; generate_batch checked the settings without the call's `max_new_tokens` and refused
    `min_length` > `max_length`."""
    eos = _generate(model, eos_token_id=None)[1]
    want = _generate(model, eos_token_id=eos, **settings)
    assert eos not in want
    assert _cb_engines(model, eos_token_id=eos, **settings) == (want, want, want)


def test_a_prompt_as_long_as_max_length_fails_as_generate_does(model):
    with pytest.raises(ConfigError, match=r"`max_length` \(5\) must be larger than the input length \(5\)") as exc:
        _generate(model, max_length=5)
    out = _manager(model, max_length=5)
    assert out.error == str(exc.value)


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory):
    """The tiny model from a folder whose generation_config.json sets a total length, a penalty,
    an n-gram ban and a list of EOS ids."""
    folder = tmp_path_factory.mktemp("tiny_gc")
    tiny_llama(seed=1).save_pretrained(folder)
    settings = {"max_length": 12, "repetition_penalty": 1.4, "no_repeat_ngram_size": 2, "eos_token_id": [3, 4]}
    (folder / "generation_config.json").write_text(json.dumps(settings))
    return genkit.load_model(folder)


def test_generation_config_json_applies_on_every_engine(folder_model):
    want = _generate(folder_model)
    assert len(want) == 12 - len(PROMPT)  # the file's max_length counts the prompt
    assert want != _generate(folder_model, repetition_penalty=1.0)  # the file's penalty acts
    assert _cb_engines(folder_model) == (want, want, want)


def test_generation_config_json_applies_on_genkit_batch(folder_model):
    from test_batch import _raw_tokenizer

    from genkit.batch import ContinuousEngine, LocalEngine, make_local_engine
    from genkit.batch.rows import BatchRow
    from genkit.tokenizer import Tokenizer

    tok = Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    # prompts of different lengths: a static batch pads them to one width, which must not shorten the short one
    rows = [BatchRow("a", 1, prompt="alpha bravo charlie delta"), BatchRow("b", 2, prompt="alpha bravo"),
            BatchRow("c", 3, prompt="alpha bravo", settings={"max_length": 6, "eos_token_id": None}),
            BatchRow("d", 4, prompt="alpha bravo charlie", settings={"max_length": 6, "eos_token_id": None})]
    prompts = [tok(row.prompt)["input_ids"] for row in rows]
    want = [_generate(folder_model, p, **row.settings) for p, row in zip(prompts, rows)]
    assert [len(w) for w in want] == [12 - len(prompts[0]), 12 - len(prompts[1]), 6 - len(prompts[2]),
                                      6 - len(prompts[3])]
    continuous = make_local_engine(folder_model, tok, batching="continuous")
    static = make_local_engine(folder_model, tok, batching="static")
    assert isinstance(continuous, ContinuousEngine) and isinstance(static, LocalEngine)
    for engine in (continuous, static):
        assert [out["token_ids"] for out in engine.run(rows)] == want


class Ban:
    """A user's logits processor: one token never comes."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = -float("inf")
        return scores


REQUESTS = [
    (PROMPT, {"repetition_penalty": 1.5}),
    (PROMPT, {}),
    (PROMPT, {"do_sample": True, "top_k": 10, "seed": 3}),
    (PROMPT, {"logits_processor": [Ban(73)]}),
    ([9, 9, 9], {"no_repeat_ngram_size": 1}),
    (PROMPT, {"do_sample": True, "temperature": 0.5, "presence_penalty": 1.0, "seed": 9}),
    (PROMPT, {"sequence_bias": {(39,): 4.0}, "min_new_tokens": 5, "eos_token_id": [39]}),
    ([7, 8], {"suppress_tokens": [116, 73], "begin_suppress_tokens": [0], "max_length": 9}),
]


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
def test_requests_in_one_batch_keep_their_own_settings(model, scheduler):
    want = []
    for prompt, kw in REQUESTS:
        kw = {"max_new_tokens": 10, "eos_token_id": None, **kw}
        if "max_length" in kw:
            del kw["max_new_tokens"]
        seed = kw.pop("seed", None)
        if seed is not None:
            torch.manual_seed(seed)
        want.append(_generate(model, prompt, **kw))
    assert len({tuple(w) for w in want}) == len(want)  # every setting changes the tokens
    with model.init_continuous_batching(continuous_batching_config={"scheduler_type": scheduler}) as manager:
        ids = []
        for prompt, kw in REQUESTS:  # all queued before the first step: they run side by side
            kw = {"max_new_tokens": None if "max_length" in kw else 10, "eos_token_id": None, **kw}
            ids.append(manager.add_request(prompt, **kw))
        got = [manager.get_result(rid, timeout=120) for rid in ids]
    assert [o.generated_tokens for o in got] == want


def test_a_kept_manager_refuses_another_config_instead_of_dropping_it(model):
    first = genkit.GenerationConfig(max_new_tokens=6, eos_token_id=None)
    other = genkit.GenerationConfig(max_new_tokens=6, eos_token_id=None, repetition_penalty=1.5)
    try:
        out = model.generate_batch([PROMPT], generation_config=first, persistent_manager=True)
        assert next(iter(out.values())).generated_tokens == _generate(model, generation_config=first)
        # the same config again runs on the kept manager
        out = model.generate_batch([PROMPT], generation_config=first, persistent_manager=True)
        assert next(iter(out.values())).generated_tokens == _generate(model, generation_config=first)
        with pytest.raises(ConfigError, match="made with another `generation_config`.*"
                                              "destroy_cached_continuous_batching_manager"):
            model.generate_batch([PROMPT], generation_config=other)
        with pytest.raises(ConfigError, match="made with another `continuous_batching_config`"):
            model.init_continuous_batching(continuous_batching_config={"block_size": 16})
        # a request's own settings still act on the kept manager
        out = model.generate_batch([PROMPT], generation_config=first, repetition_penalty=1.5)
        assert next(iter(out.values())).generated_tokens == _generate(model, generation_config=other)
    finally:
        model.destroy_cached_continuous_batching_manager()
    out = model.generate_batch([PROMPT], generation_config=other)["req_0"]
    assert out.generated_tokens == _generate(model, generation_config=other)


# -- a transformers model: transformers' own continuous batching, with what it cannot run refused ----
def test_a_transformers_models_generate_batch_reads_the_length_as_generate_does(tiny_pair):
    hf, _ = tiny_pair
    for kw in ({}, {"max_length": 9}, {"max_new_tokens": 6, "suppress_tokens": [78, 12]}):
        want = genkit.generate(hf, torch.tensor([PROMPT]), eos_token_id=None, **kw)[0, len(PROMPT):].tolist()
        out = genkit.generate_batch(hf, [PROMPT], eos_token_id=None, **kw)
        assert [o.generated_tokens for o in out.values()] == [want], kw
    assert len(want) == 6
    with pytest.raises(genkit.errors.NotSupportedError, match="`max_length`=9 counts the prompt, and these prompts "
                                                             "have 2 to 5 tokens.*set `max_new_tokens`"):
        genkit.generate_batch(hf, [PROMPT, [3, 4]], max_length=9)


@pytest.mark.parametrize(("setting", "message"), [
    ({"repetition_penalty": 1.5}, "`repetition_penalty`=1.5: .* set it to 1.0 to run without it"),
    ({"min_new_tokens": 3}, "`min_new_tokens`=3"),
    ({"no_repeat_ngram_size": 2}, "`no_repeat_ngram_size`=2: .* set it to 0 to run without it"),
    ({"bad_words_ids": [[5]]}, r"`bad_words_ids`=\[\[5\]\]"),
    ({"max_time": 5.0}, "`max_time`=5.0"),
    ({"num_beams": 2}, "`num_beams`=2"),
    ({"do_sample": True, "min_p": 0.1}, "`min_p`=0.1"),
])
def test_a_transformers_models_continuous_batching_refuses_what_it_would_drop(tiny_pair, setting, message):
    hf, _ = tiny_pair
    with pytest.raises(genkit.errors.NotSupportedError, match=message):
        genkit.generate_batch(hf, [PROMPT], max_new_tokens=4, **setting)
    with pytest.raises(genkit.errors.NotSupportedError, match=message):
        genkit.init_continuous_batching(hf, genkit.GenerationConfig(max_new_tokens=4, **setting))


def test_a_transformers_models_paged_generate_names_the_setting_the_caller_gave(tiny_pair):
    """min_length (counting the prompt) is turned into the new tokens it asks for on the way to the
    engine: the refusal names min_length, as the caller set it, not the derived min_new_tokens."""
    hf, _ = tiny_pair
    with pytest.raises(genkit.errors.NotSupportedError, match="`min_length`=8: .* set it to 0 to run without it"):
        genkit.generate(hf, torch.tensor([PROMPT]), max_new_tokens=6, min_length=8, cache_implementation="paged")
    with pytest.raises(genkit.errors.NotSupportedError, match="`min_new_tokens`=3"):
        genkit.generate(hf, torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=3, cache_implementation="paged")


def test_a_transformers_models_manager_starts_with_a_max_length_from_its_generation_config(tiny_pair):
    """A model file's max_length (Llama 3's generation_config.json has one) counts each prompt: the manager
    still starts, and a request giving max_new_tokens gets generate's tokens."""
    hf, _ = tiny_pair
    saved = hf.generation_config.max_length
    hf.generation_config.max_length = 64
    try:
        want = genkit.generate(hf, torch.tensor([PROMPT]), max_new_tokens=5, eos_token_id=None)[0, len(PROMPT):].tolist()
        manager = genkit.init_continuous_batching(hf)
        manager.start()
        try:
            rid = manager.add_request(PROMPT, max_new_tokens=5)
            result = manager.get_result(request_id=rid, timeout=60)
        finally:
            manager.stop(block=True)
        assert result is not None and list(result.generated_tokens) == want
    finally:
        hf.generation_config.max_length = saved


# -- generate(cache_implementation="paged") reads the special tokens as generate does ---------------
def test_the_paged_cache_takes_the_padding_generate_infers_without_a_mask(model):
    """A left-padded batch given without an attention mask: generate masks the pad id (transformers'
    rule); the paged cache took the pad tokens for prompt tokens, and other tokens came."""
    ids = torch.tensor([[0, 0, 0, 5, 6], PROMPT])
    kw = {"max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0}
    want = model.generate(ids, **kw)
    assert torch.equal(want, model.generate(ids, attention_mask=(ids != 0).long(), **kw))  # the mask it infers
    assert torch.equal(model.generate(ids, cache_implementation="paged", **kw), want)


def test_the_paged_cache_pads_finished_rows_with_generates_pad_id():
    """A model without a pad id: generate fills a finished row with the call's first EOS id (its
    resolved pad id, as transformers does); the paged cache filled it with 0."""
    model = tiny_llama(seed=1, pad_token_id=None)
    ids = torch.tensor([PROMPT, [40, 41, 42, 43, 44]])
    eos = _generate(model, eos_token_id=None)[1]
    want = model.generate(ids, max_new_tokens=8, eos_token_id=eos)
    assert want[0, len(PROMPT) + 2:].tolist() == [eos] * 6  # row 0 ends at its second token
    assert torch.equal(model.generate(ids, cache_implementation="paged", max_new_tokens=8, eos_token_id=eos), want)


def test_a_transformers_models_paged_generate_gives_generates_tokens(tiny_pair):
    """generate(cache_implementation="paged") on a transformers model ran to the end, then failed with
    an AttributeError (transformers' config has no ``get``) instead of returning the sequences."""
    hf, _ = tiny_pair
    ids = torch.tensor([PROMPT])
    want = genkit.generate(hf, ids, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(genkit.generate(hf, ids, max_new_tokens=6, eos_token_id=None, cache_implementation="paged"),
                       want)
