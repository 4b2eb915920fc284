"""genkit.load_tokenizer on a small byte-level BPE folder, compared with transformers' AutoTokenizer
on the same files; padding, truncation, tensors, decoding, chat templates and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import write_bpe_tokenizer

import genkit
from genkit.errors import CorruptModelError
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


def _plain_bpe_folder(path, config):
    """A byte-level BPE tokenizer.json whose special tokens are plain vocabulary entries (no
    ``added_tokens``), as many hand-made files have; ``config`` is its tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", "<sep>", *"abcdefghij", "\u0120",
                                             "\u0120a"])}
    backend = Backend(models.BPE(vocab=vocab, merges=[("\u0120", "a")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return path


def test_special_tokens_named_only_in_the_config_are_special_as_in_transformers(tmp_path):
    """Before, decode(skip_special_tokens=True) kept ``</s>`` and "a</s>b" was spelled out in
    ``<unk>`` pieces when tokenizer.json did not list ``</s>`` among its added tokens."""
    folder = _plain_bpe_folder(tmp_path / "plain", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                                   "unk_token": "<unk>", "additional_special_tokens": ["<sep>"],
                                                   "mask_token": "j"})
    ours, ref = genkit.load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    ids = [1, 5, 6, 16, 4, 2, 3, 0, 14]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
            ref.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=True) == "ab a"
    for text in ("a</s>b", "<s>a <pad>b<sep>", "<unk>j a"):
        assert ours.encode(text) == ref.encode(text), text
    assert ours.encode("a</s>b") == [5, 2, 6]
    assert sorted(ours.all_special_ids) == sorted(ref.all_special_ids) == [0, 1, 2, 3, 4, 14]
    assert len(ours) == len(ref) == 17


def test_a_special_token_the_vocabulary_lacks_gets_no_id_and_bad_lists_are_refused(tmp_path):
    folder = _plain_bpe_folder(tmp_path / "missing", {"eos_token": "</s>", "pad_token": "<nothere>"})
    ours = genkit.load_tokenizer(folder)
    assert ours.pad_token_id is None and len(ours) == 17  # not given an id past the model's embeddings
    bad = _plain_bpe_folder(tmp_path / "bad", {"eos_token": "</s>", "additional_special_tokens": [3]})
    with pytest.raises(CorruptModelError, match="`additional_special_tokens` must be a list"):
        genkit.load_tokenizer(bad)


def _unigram_folder(path, clean_up):
    """A Unigram (T5-style, Metaspace) tokenizer folder with ``clean_up_tokenization_spaces``."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(["Hello world , this is a test . Don 't stop ! It 's fine ?"] * 50,
                                trainers.UnigramTrainer(vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"],
                                                        unk_token="<unk>", show_progress=False))
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": clean_up}))
    return path


def test_clean_up_on_a_unigram_vocabulary_matches_transformers(tmp_path):
    """transformers 5 skips the clean-up only for BPE; genkit skipped it for every vocabulary but
    WordPiece ("Hello world , this" where transformers gives "Hello world, this" for a T5-style one)."""
    folder = _unigram_folder(tmp_path / "uni", clean_up=True)
    ours, ref = genkit.load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    ids = ref.encode("Hello world , this is a test . Don 't stop ! It 's fine ?")
    for clean in (None, True, False):
        assert ours.decode(ids, clean_up_tokenization_spaces=clean) == \
            ref.decode(ids, clean_up_tokenization_spaces=clean), clean
    assert ours.decode(ids) == "Hello world, this is a test. Don 't stop! It's fine?"
    assert ours.batch_decode([ids, ids[:4]]) == ref.batch_decode([ids, ids[:4]])


def test_clean_up_is_skipped_for_bpe_with_one_warning(pair, caplog):
    ours, ref = pair
    ids = ref.encode("the fox , quick . yes", add_special_tokens=False)
    with caplog.at_level("WARNING"):
        texts = [ours.decode(ids[:n], clean_up_tokenization_spaces=True) for n in range(1, len(ids) + 1)]
    assert texts == [ref.decode(ids[:n], clean_up_tokenization_spaces=True) for n in range(1, len(ids) + 1)]
    assert texts[-1] == "the fox , quick . yes"
    assert [r.getMessage() for r in caplog.records].count(
        "clean_up_tokenization_spaces=True is skipped for this BPE tokenizer: the clean-up is meant for WordPiece "
        "vocabularies and would strip spaces BPE text has (as transformers does); pass "
        "clean_up_tokenization_spaces=False") == 1


def test_decode_of_a_batch_gives_its_texts_as_transformers(pair):
    """``decode(model.generate(...))`` (a 2-D tensor) was a TypeError; transformers 5 answers the texts."""
    ours, ref = pair
    rows = torch.tensor([ref.encode("the quick brown fox"), ref.encode("caf\u00e9 \u00fcber x")[:5]])
    for skip in (False, True):
        assert ours.decode(rows, skip_special_tokens=skip) == ref.decode(rows, skip_special_tokens=skip)
        assert ours.decode(rows.tolist(), skip_special_tokens=skip) == ref.decode(rows.tolist(),
                                                                                  skip_special_tokens=skip)
    assert ours.decode(rows[0]) == ref.decode(rows[0]) and ours.decode(rows[0, 1]) == ref.decode(rows[0, 1])
    assert ours.decode([]) == ref.decode([]) == ""
