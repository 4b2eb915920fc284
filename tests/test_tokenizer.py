"""genkit.load_tokenizer on a small byte-level BPE folder, compared with transformers' AutoTokenizer
on the same files; padding, truncation, tensors, decoding, chat templates and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import write_bpe_tokenizer

import genkit
from genkit.tokenizer import BatchEncoding, Tokenizer

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pair(tok_dir):
    return genkit.load_tokenizer(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)


STRINGS = ["the quick brown fox", "  two leading spaces", "tabs\tand\nnewlines\n", "caf\u00e9 \u00fcber",
           "\u65e5\u672c\u8a9e", "emoji \U0001f600\U0001f680", "", "</s> in text <pad>", "unseen zebra quokka"]


def test_encode_decode_match_transformers(pair):
    ours, ref = pair
    for s in STRINGS:
        for special in (True, False):
            a = ours(s, add_special_tokens=special)["input_ids"]
            assert a == ref(s, add_special_tokens=special)["input_ids"], s
            assert ours.encode(s, add_special_tokens=special) == a
        for skip in (False, True):
            assert ours.decode(a, skip_special_tokens=skip) == ref.decode(a, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(a) == ref.convert_ids_to_tokens(a)
    assert ours.get_vocab() == ref.get_vocab()
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 0)
    assert len(ours) == len(ref)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_transformers(pair, side):
    ours, ref = pair
    a = ours(STRINGS, padding=True, padding_side=side, return_tensors="pt")
    b = ref(STRINGS, padding=True, padding_side=side, return_tensors="pt")
    assert isinstance(a, BatchEncoding) and a.input_ids is a["input_ids"]
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert ours.batch_decode(a["input_ids"], skip_special_tokens=True) == \
        ref.batch_decode(b["input_ids"], skip_special_tokens=True)
    c = ours(STRINGS[:2], padding="max_length", max_length=20, padding_side=side)
    d = ref(STRINGS[:2], padding="max_length", max_length=20, padding_side=side)
    assert c["input_ids"] == d["input_ids"] and c["attention_mask"] == d["attention_mask"]


def test_truncation_matches_transformers(pair):
    ours, ref = pair
    long = "the quick brown fox jumps over the lazy dog " * 5
    assert ours(long, truncation=True, max_length=7)["input_ids"] == \
        ref(long, truncation=True, max_length=7)["input_ids"]
    assert len(ours(long * 3, truncation=True)["input_ids"]) == 64  # model_max_length


def test_chat_template_matches_transformers(pair):
    ours, ref = pair
    conv = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello world"}]
    for gen in (False, True):
        assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == \
            ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
    a = ours.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
    b = ref.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert ours.apply_chat_template(conv, add_generation_prompt=True, return_dict=False) == \
        a["input_ids"][0].tolist()


def test_generate_accepts_tokenizer_output(pair, tiny_model):
    ours, _ = pair
    enc = ours(["the quick", "hello world, hello"], padding=True, padding_side="left", return_tensors="pt")
    ids = enc["input_ids"] % tiny_model.config.vocab_size
    out = tiny_model.generate(input_ids=ids, attention_mask=enc["attention_mask"], max_new_tokens=3,
                              eos_token_id=None)
    assert out.shape == (2, ids.shape[1] + 3)


def test_save_and_reload_round_trip(pair, tmp_path):
    ours, _ = pair
    ours.save_pretrained(tmp_path)
    again = genkit.load_tokenizer(tmp_path)
    for s in STRINGS:
        assert again(s)["input_ids"] == ours(s)["input_ids"]
    assert again.chat_template == ours.chat_template and again.eos_token == "</s>"


def test_errors_name_the_parameter(pair, tmp_path):
    ours, _ = pair
    with pytest.raises(ValueError, match="`padding_side`='middle' is not valid; accepted: 'left', 'right'"):
        ours("x", padding=True, padding_side="middle")
    with pytest.raises(ValueError, match="`padding`='some' is not valid"):
        ours("x", padding="some")
    with pytest.raises(ValueError, match="`return_tensors`='np' is not supported"):
        ours("x", return_tensors="np")
    with pytest.raises(ValueError, match="different lengths; pass `padding=True`"):
        ours(["a", "a much longer one"], return_tensors="pt")
    with pytest.raises(ValueError, match="`text` must be a string or a list of strings"):
        ours(3)
    with pytest.raises(ValueError, match="`padding='max_length'` needs `max_length`"):
        ours(["a", "a much longer one"], padding="max_length")
    no_template = Tokenizer(ours.backend_tokenizer, {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    no_pad = Tokenizer(ours.backend_tokenizer, {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="no pad token"):
        no_pad(["a", "a much longer one"], padding=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        genkit.load_tokenizer(tmp_path)


def test_gguf_metadata_rejects_unsupported_tokenizer_model():
    from genkit.tokenizer import tokenizer_from_gguf_metadata

    with pytest.raises(ValueError, match="GGUF tokenizer model 'bert' is not supported; accepted: 'gpt2'"):
        tokenizer_from_gguf_metadata({"model": "bert", "tokens": ["a"]})
