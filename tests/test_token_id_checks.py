"""Token ids in the settings are checked against the model's vocabulary (the width of its logits,
not the tokenizer's length), in one place (:func:`genkit.config.checks.check_vocabulary`), on
``generate``, continuous batching and ``genkit serve`` alike: an id the model can never score is a
``ConfigError`` naming the field and the vocabulary size. Before, ``bad_words_ids`` and
``sequence_bias`` were refused at the first step while ``suppress_tokens``, ``eos_token_id``,
``forced_bos_token_id``, ``pad_token_id``... were accepted and ignored, or failed in the middle of a
generation (``forced_eos_token_id``: an IndexError; ``pad_token_id`` on a finished row: the
embedding's IndexError), and serve's ``logit_bias`` was checked against the tokenizer's length."""

from __future__ import annotations

import json

import pytest
import torch
from serve_client import post_json
from test_engine_gate import _serving

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama

VOCAB = 128  # the tiny model's logits width
PROMPT = [1, 5, 6]

OUTSIDE = [
    ({"suppress_tokens": [3, 500]}, "suppress_tokens", [500]),
    ({"begin_suppress_tokens": [128]}, "begin_suppress_tokens", [128]),
    ({"eos_token_id": 500}, "eos_token_id", [500]),
    ({"eos_token_id": [2, 130, 129]}, "eos_token_id", [129, 130]),
    ({"forced_bos_token_id": 500}, "forced_bos_token_id", [500]),
    ({"forced_eos_token_id": 500}, "forced_eos_token_id", [500]),
    ({"forced_eos_token_id": [2, 500]}, "forced_eos_token_id", [500]),
    ({"sequence_bias": {(4, 500): 1.0}}, "sequence_bias", [500]),
    ({"sequence_bias": {"(500,)": 1.0}}, "sequence_bias", [500]),  # as generation_config.json writes it
    ({"sequence_bias": [[[500], 1.0]]}, "sequence_bias", [500]),
    ({"bad_words_ids": [[4, 500]]}, "bad_words_ids", [500]),
    ({"pad_token_id": 500}, "pad_token_id", [500]),
    ({"bos_token_id": 500}, "bos_token_id", [500]),
]


def _message(field: str, ids: list[int]) -> str:
    return (f"`{field}` holds token ids {ids} outside the model's vocabulary (size {VOCAB}); "
            f"accepted ids are 0..{VOCAB - 1}")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=0)


@pytest.mark.parametrize(("settings", "field", "ids"), OUTSIDE, ids=lambda v: str(v)[:40])
def test_generate_refuses_token_ids_outside_the_vocabulary(model, settings, field, ids):
    with pytest.raises(ConfigError) as exc:
        genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False, **settings)
    assert str(exc.value) == _message(field, ids)


@pytest.mark.parametrize(("settings", "field", "ids"), OUTSIDE, ids=lambda v: str(v)[:40])
def test_continuous_batching_refuses_them_before_anything_runs(model, settings, field, ids):
    with pytest.raises(ConfigError) as exc:
        model.generate_batch([PROMPT], max_new_tokens=3, do_sample=False, **settings)
    assert str(exc.value) == _message(field, ids)


def test_the_last_id_of_the_vocabulary_and_the_negative_sentinel_are_accepted(model):
    out = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False,
                          suppress_tokens=[VOCAB - 1], eos_token_id=[-1, VOCAB - 1], pad_token_id=0)
    assert out.shape == (1, len(PROMPT) + 3)


def test_a_model_configs_special_tokens_outside_its_vocabulary_are_warned_about(model, caplog):
    """transformers' configs keep their special ids when a test model shrinks the vocabulary
    (GPT2Config(vocab_size=64) keeps GPT-2's 50256) and transformers generates with them: so does
    genkit, with a warning; the EOS id never ends a row."""
    odd = tiny_llama(seed=0, eos_token_id=300, bos_token_id=300)
    with caplog.at_level("WARNING", logger="genkit.config"):
        out = genkit.generate(odd, torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)
    want = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.tolist() == want.tolist()
    assert "the model's `eos_token_id` holds token ids [300] outside its vocabulary (size 128): it never ends a row" \
        in caplog.text
    assert "the model's `bos_token_id` holds token ids [300]" in caplog.text


def test_a_model_pad_id_outside_its_vocabulary_pads_with_the_eos_id(model, caplog):
    """A model whose pad id its embedding cannot take: a row that finished early was fed it (an
    IndexError in the middle of the batch); it is padded with the first EOS id instead."""
    odd = tiny_llama(seed=0, pad_token_id=300)
    prompts = torch.tensor([PROMPT, [1, 7, 8]])
    first = genkit.generate(model, prompts[:1], max_new_tokens=1, do_sample=False)[0, -1].item()
    with caplog.at_level("WARNING", logger="genkit.config"):
        out = genkit.generate(odd, prompts, max_new_tokens=4, do_sample=False, eos_token_id=first)
    want = genkit.generate(model, prompts, max_new_tokens=4, do_sample=False, eos_token_id=first,
                           pad_token_id=first)
    assert out.tolist() == want.tolist()
    assert out[0, len(PROMPT):].tolist() == [first] * 4  # finished at once, padded with the EOS id
    assert out[1, len(PROMPT):].tolist() != [first] * 4
    assert "the model's `pad_token_id` holds token ids [300] outside its vocabulary (size 128): rows that " \
        "finish early are padded with the first EOS id inside it, else 0" in caplog.text


def test_generation_config_json_with_a_token_id_outside_the_vocabulary(model, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"suppress_tokens": [7, 4000]}))
    config = genkit.GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError) as exc:
        genkit.generate(model, torch.tensor([PROMPT]), generation_config=config, max_new_tokens=3)
    assert str(exc.value) == _message("suppress_tokens", [4000])


# -- genkit serve: logit_bias against the model's logits, not the tokenizer's length ---------------
def _tokenizer(words: int):
    """A word-level tokenizer of ``words`` tokens, one per id."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers

    from genkit.tokenizer import Tokenizer

    names = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, words)]
    raw = Raw(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(names[:3])
    return Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.mark.parametrize("stream", [False, True])
def test_serve_refuses_a_logit_bias_id_the_model_cannot_score(model, stream):
    """A tokenizer longer than the LM head: id 150 is a word, but no logit; a 400 naming the field
    (was accepted, then failed in the engine)."""
    from genkit.serve import build_app

    with _serving(build_app(model, tokenizer=_tokenizer(200), model_name="tiny")) as base:
        status, body = post_json(base, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": stream,
                                    "logit_bias": {"150": 5}})
        assert status == 400, body
        assert body["error"]["param"] == "logit_bias"
        assert body["error"]["message"] == _message("logit_bias", [150])
        status, body = post_json(base, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": stream,
                                    "suppress_tokens": [3, 128]})
        assert status == 400, body
        assert body["error"]["param"] == "suppress_tokens"
        assert body["error"]["message"] == _message("suppress_tokens", [128])


def test_serve_takes_a_logit_bias_id_past_the_tokenizer_the_model_scores(model):
    """A tokenizer shorter than the LM head (padded heads are common): id 120 has a logit, and a
    bias of 100 makes it the greedy choice (was a 400: checked against the tokenizer's length)."""
    from genkit.serve import build_app

    want = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=2, do_sample=False,
                           sequence_bias={(120,): 100.0})[0, len(PROMPT):].tolist()
    assert want == [120, 120]
    with _serving(build_app(model, tokenizer=_tokenizer(100), model_name="tiny")) as base:
        status, body = post_json(base, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                    "logit_bias": {"120": 100}})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("key", ["²", "-1", "1e3", " "])
def test_serve_logit_bias_keys_must_be_decimal_ids(model, key):
    from genkit.serve import build_app

    with _serving(build_app(model, tokenizer=_tokenizer(128), model_name="tiny")) as base:
        status, body = post_json(base, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "logit_bias": {key: 1}})
    assert status == 400, body
    assert body["error"]["param"] == "logit_bias"
    assert "maps token ids (ints >= 0, as strings)" in body["error"]["message"]


# -- token ids no int64 holds: a ConfigError naming the field, whoever set them ----------------------
HUGE = 10**30
WIDE = [
    ({"eos_token_id": HUGE}, "eos_token_id", [HUGE]),
    ({"eos_token_id": [HUGE, -5]}, "eos_token_id", [HUGE]),  # beside the "matches no token" sentinel
    ({"eos_token_id": -HUGE}, "eos_token_id", [-HUGE]),
    ({"pad_token_id": HUGE}, "pad_token_id", [HUGE]),
    ({"bos_token_id": HUGE}, "bos_token_id", [HUGE]),
    ({"decoder_start_token_id": HUGE}, "decoder_start_token_id", [HUGE]),
    ({"forced_bos_token_id": HUGE}, "forced_bos_token_id", [HUGE]),
    ({"forced_eos_token_id": [2, HUGE]}, "forced_eos_token_id", [HUGE]),
    ({"suppress_tokens": [3, HUGE]}, "suppress_tokens", [HUGE]),
    ({"begin_suppress_tokens": [2**63]}, "begin_suppress_tokens", [2**63]),
    ({"bad_words_ids": [[4, HUGE]]}, "bad_words_ids", [HUGE]),
    ({"sequence_bias": {(4, HUGE): 1.0}}, "sequence_bias", [HUGE]),
]


@pytest.mark.parametrize(("settings", "field", "ids"), WIDE, ids=lambda v: str(v)[:40])
def test_token_ids_no_int64_holds_are_refused_by_name(model, settings, field, ids):
    """eos_token_id=10**30 failed with "Overflow when unpacking long long" where the ids became a
    tensor (-10**30 passed as the sentinel); the other fields named the vocabulary, not the range."""
    for run in (lambda: genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=3, **settings),
                lambda: model.generate_batch([PROMPT], max_new_tokens=3, do_sample=False, **settings)):
        with pytest.raises(ConfigError) as exc:
            run()
        assert str(exc.value) == f"`{field}` holds token ids {ids} outside the int64 range; accepted ids are 0..127"
    top = 2**63 - 1  # no model: a batch row's check
    from genkit.batch.rows import check_settings

    assert check_settings(settings) == (f"invalid generation field: `{field}` holds token ids {ids} outside the int64 "
                                        f"range; accepted ids are 0..{top}")


@pytest.mark.parametrize("file", ["generation_config.json", "config.json"])
@pytest.mark.parametrize("value", [HUGE, [HUGE, -5]])
def test_a_models_own_token_id_no_int64_holds_is_refused(tmp_path, file, value):
    """The audit's model folders: an `eos_token_id` of 10**30 in the model's generation_config.json or
    config.json (alone, or in a list with -5) was the same overflow, in the middle of `generate`."""
    tiny_llama(seed=0).save_pretrained(tmp_path)
    if file == "config.json":
        (tmp_path / "generation_config.json").unlink(missing_ok=True)
    data = json.loads((tmp_path / file).read_text())
    data["eos_token_id"] = value
    (tmp_path / file).write_text(json.dumps(data))
    loaded = genkit.load_model(tmp_path)
    with pytest.raises(ConfigError) as exc:
        loaded.generate(torch.tensor([PROMPT]), max_new_tokens=3)
    assert str(exc.value) == (f"the model's `eos_token_id` holds token ids [{HUGE}] outside the int64 range; "
                              "accepted ids are 0..127")
