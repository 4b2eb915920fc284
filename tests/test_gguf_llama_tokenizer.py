"""GGUF files with a SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama 1/2, Mistral,
TinyLlama...), written here with ``gguf.GGUFWriter``: a tiny random Llama model and a SentencePiece-style
BPE vocabulary (``<unk>``/``<s>``/``</s>``, the 256 ``<0xNN>`` byte tokens, ``▁``-prefixed pieces whose
scores give the merge order, single characters last). transformers loads the same files
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) and is the reference.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import genkit
from genkit.tokenizer import sentencepiece_merges, tokenizer_from_gguf_metadata

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

SP = "\u2581"
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello tokenizers!",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "The theory of everything is the thing they were thinking about.",
    "def main():\n    return 0", "numbers 12345 and 3.14159", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00e9t\u00e9",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440", "\u65e5\u672c\u8a9e \u65e5\u672c",
    "It's what we're doing, isn't it? I'm sure they'll come.", "<html><body>tag</body></html>",
] * 5
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# beyond the trained vocabulary: chat control tokens (type 3) and a user-defined token (type 4)
EXTRA = [("<|user|>", 3), ("<|assistant|>", 3), ("<|system|>", 3), ("<think>", 4)]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) laid out like a Llama GGUF vocabulary.

    The pieces are learned from CORPUS with the ``tokenizers`` BPE trainer (on ``▁``-spelled words);
    a piece's score is minus its merge rank, single characters come last with the lowest scores,
    and newlines / tabs are left to byte fallback, as in Llama's vocabulary.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="always", split=True)
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, show_progress=False))
    model = json.loads(backend.to_str())["model"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    pieces: list[str] = [SP * 2, SP * 4]  # runs of spaces, as Llama has (▁▁ is one merge of ▁ + ▁)
    for left, right in merges:
        piece = left + right
        if piece not in pieces and not set(piece) & set("\n\t\r"):
            pieces.append(piece)
    pieces.insert(2, SP * 3)
    chars = sorted({c for c in model["vocab"] if len(c) == 1 and c not in "\n\t\r"} | {SP})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces + [c for c in chars if c not in pieces]):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    for tok, kind in EXTRA:
        tokens.append(tok)
        types.append(kind)
        scores.append(0.0)
    return tokens, scores, types


def write_tiny_llama_gguf(path, *, model="llama", add_bos=None, add_eos=None, add_space_prefix=None,
                          with_merges=False, pad_id=None, seed=0, arch="llama") -> list[str]:
    """A tiny random Llama (one layer, hidden 16) under llama.cpp's tensor names, with the vocabulary
    (``arch="qwen2"``: with q/k/v biases, as Qwen2 files have)."""
    tokens, scores, types = sentencepiece_vocab()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if with_merges:
        w.add_token_merges([f"{a} {b}" for a, b in sentencepiece_merges(tokens, scores)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if pad_id is not None:
        w.add_pad_token_id(pad_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template(CHAT)
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    vocab, hidden, ffn, kv = len(tokens), 16, 32, 8
    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    tensor("blk.0.attn_norm.weight", hidden)
    tensor("blk.0.ffn_norm.weight", hidden)
    tensor("blk.0.attn_q.weight", hidden, hidden)
    tensor("blk.0.attn_k.weight", kv, hidden)
    tensor("blk.0.attn_v.weight", kv, hidden)
    if arch == "qwen2":
        tensor("blk.0.attn_q.bias", hidden)
        tensor("blk.0.attn_k.bias", kv)
        tensor("blk.0.attn_v.bias", kv)
    tensor("blk.0.attn_output.weight", hidden, hidden)
    tensor("blk.0.ffn_gate.weight", ffn, hidden)
    tensor("blk.0.ffn_up.weight", ffn, hidden)
    tensor("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _pair(folder, name="tiny.gguf", **kwargs):
    """(genkit tokenizer, transformers tokenizer) of a freshly written GGUF."""
    folder.mkdir(parents=True, exist_ok=True)
    write_tiny_llama_gguf(folder / name, **kwargs)
    ours = genkit.load_tokenizer(folder / name)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return ours, ref


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gguf")
    write_tiny_llama_gguf(folder / "tiny.gguf")
    return folder


@pytest.fixture(scope="module")
def tokenizers_pair(gguf_dir):
    return (genkit.load_tokenizer(gguf_dir / "tiny.gguf"),
            transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="tiny.gguf"))


def _strings() -> list[str]:
    base = [
        "Hello world", "hello world", "hello  world", "  leading spaces", "trailing spaces   ", " one leading",
        "the theory of the thing", "The quick brown fox jumps over the lazy dog.", "Once upon a time",
        "\ttabs\tand\nnewlines\n", "\n\n\nmany newlines", "\r\nwindows\r\nline ends", "line one\nline two",
        "mixed \u00a0non-breaking\u2009thin spaces", "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
        "Stra\u00dfe \u00fcber \u00c4rger", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0", "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u6807\u70b9\u3002",
        "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440", "\ud55c\uad6d\uc5b4 \ubb38\uc7a5",
        "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
        "emoji \U0001f600\U0001f389\U0001f680", "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",
        "flags \U0001f1eb\U0001f1f7", "skin \U0001f44d\U0001f3fd", "zero\u200bwidth", "combining e\u0301",
        "math \u2211\u222b\u221a\u03c0 \u2264 \u221e", "def main():\n    return 0", "    indented\n        twice",
        "{\"json\": [1, 2, 3], \"ok\": true}", "<html><body>tag</body></html>", "1234567890 3.14159 -42 1e10",
        "a" * 40, "ab " * 20, "It's what we're doing, isn't it?", "URL https://example.com/path?q=1&r=2",
        "<s>", "</s>", "<unk>", "<s>inside</s>", "text <s> more", "x <|user|> y", "<|user|>\nhi</s>\n<|assistant|>\n",
        "<think>reasoning</think> answer", "literal <0x41> byte name", "\u2581already spelled \u2581\u2581",
        "", " ", "  ", "\n", "\u3000full-width space", "!!!???...,,,;;;", "___---+++===", "\u00ff\u00fe\u00fd",
    ]
    pieces = base + ["the", " quick", " fox", "\U0001f98a", " jumps", "\n", "  ", "\u00e9t\u00e9", "\u043c\u0438\u0440",
                     "42", "\t", "\u2603", " over", "</s>", "<|assistant|>", " hello", "\u65e5\u672c"]
    rng = random.Random(20240611)
    out = list(base)
    while len(out) < 120:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(2, 6))))
    return out


def test_metadata_is_read_from_the_file(gguf_dir):
    from genkit.models.gguf import read_gguf

    meta = read_gguf(gguf_dir / "tiny.gguf", tensors=False).tokenizer
    tokens, scores, types = sentencepiece_vocab()
    assert meta["model"] == "llama"
    assert meta["tokens"] == tokens and meta["token_type"] == types
    assert [float(s) for s in meta["scores"]] == scores
    assert (meta["bos_token_id"], meta["eos_token_id"], meta["unknown_token_id"]) == (1, 2, 0)
    assert "add_bos_token" not in meta and "merges" not in meta


def test_merges_from_scores_match_transformers_converter():
    from transformers.tokenization_utils_base import generate_merges

    tokens, scores, _ = sentencepiece_vocab()
    ours = sentencepiece_merges(tokens, scores)
    ref = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert ours == ref
    assert ours[0] == ("\u2581", "\u2581")  # the best-scored piece first


def test_llama_gguf_tokenizer_matches_transformers_on_120_strings(tokenizers_pair):
    ours, ref = tokenizers_pair
    strings = _strings()
    assert len(strings) == 120
    byte_fallback = 0
    for s in strings:
        ids = ours(s)["input_ids"]
        assert ids == ref(s)["input_ids"], s
        assert ours.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        assert ids[:1] == [1]  # BOS: the file does not say, so it is added (llama.cpp's default)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (s, skip)
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), s
        byte_fallback += any(3 <= i < 259 for i in ids)
    assert byte_fallback > 30  # emoji, CJK, newlines... went through the <0xNN> tokens
    # text made only of vocabulary characters round-trips exactly
    for s in ["hello world", "the  theory", "caf\u00e9 \u00e9t\u00e9", "trailing  "]:
        assert ours.decode(ours.encode(s), skip_special_tokens=True) == s
    # as in transformers, text that already starts with a space gets no second one, so decoding
    # (which drops one leading space) loses it
    assert ours.decode(ours.encode(" leading"), skip_special_tokens=True) == "leading"
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.vocab_size == len(sentencepiece_vocab()[0])
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
        assert getattr(ours, f"{name}_id") == getattr(ref, f"{name}_id"), name
    assert ours.chat_template == CHAT


def test_known_llama_tokenization(tokenizers_pair):
    ours, _ = tokenizers_pair
    assert ours.tokenize("the theory") == ["\u2581the", "\u2581theory"]
    assert ours.tokenize("  two") == ["\u2581\u2581", "t", "w", "o"]  # the prefix is not added to a leading space
    # a character missing from the vocabulary becomes its UTF-8 bytes
    assert ours.tokenize("\U0001f600") == ["\u2581", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ours.tokenize("a\nb")[1] == "<0x0A>"
    assert ours.decode(ours.encode("\U0001f600 ok\n")) == "<s> \U0001f600 ok\n"
    # control and user-defined tokens are matched whole; special ones are dropped by skip_special_tokens
    ids = ours.encode("<|user|>\nhi</s><think>")
    assert ours.convert_ids_to_tokens(ids)[:2] == ["<s>", "<|user|>"] and ids[-1] == ours.convert_tokens_to_ids("<think>")
    assert ours.decode(ids, skip_special_tokens=True) == "\nhi<think>"
    assert {0, 1, 2, ours.convert_tokens_to_ids("<|user|>")} <= set(ours.all_special_ids)
    assert ours.convert_tokens_to_ids("<think>") not in ours.all_special_ids


@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (False, False), (True, True), (False, True)])
def test_add_bos_and_eos_flags_are_honoured(tmp_path, add_bos, add_eos):
    ours, ref = _pair(tmp_path, add_bos=add_bos, add_eos=add_eos)
    for s in _strings()[:40]:
        ids = ours(s)["input_ids"]
        assert ids == ref(s)["input_ids"], s
        plain = ours(s, add_special_tokens=False)["input_ids"]
        assert ids == [1] * add_bos + plain + [2] * add_eos
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours("")["input_ids"] == [1] * add_bos + [2] * add_eos
    assert ours.init_config["add_bos_token"] is add_bos and ours.init_config["add_eos_token"] is add_eos


def test_merges_stored_in_the_file_and_a_pad_token(tmp_path):
    ours, ref = _pair(tmp_path, with_merges=True, pad_id=0)
    from_scores = genkit.load_tokenizer(write_and_path(tmp_path / "plain"))
    assert ours.pad_token == ref.pad_token == "<unk>" and ours.pad_token_id == 0
    for s in _strings():
        ids = ours(s)["input_ids"]
        assert ids == ref(s)["input_ids"] == from_scores(s)["input_ids"], s
    batch = ["short", "a somewhat longer sentence \U0001f600", "\u65e5\u672c"]
    for side in ("left", "right"):
        a = ours(batch, padding=True, padding_side=side, return_tensors="pt")
        b = ref(batch, padding=True, padding_side=side, return_tensors="pt")
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])


def write_and_path(folder):
    folder.mkdir(parents=True, exist_ok=True)
    write_tiny_llama_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf"


def test_no_space_prefix_when_the_file_says_so(tmp_path):
    path = tmp_path / "noprefix.gguf"
    write_tiny_llama_gguf(path, add_space_prefix=False)
    tok = genkit.load_tokenizer(path)
    with_prefix = genkit.load_tokenizer(write_and_path(tmp_path / "prefix"))
    assert with_prefix.tokenize("the dog")[0].startswith("\u2581")
    assert not tok.tokenize("the dog")[0].startswith("\u2581")
    assert tok.tokenize(" the dog") == with_prefix.tokenize("the dog")
    for s in ["the dog", " leading", "hello world  ", "\U0001f600x"]:
        assert tok.decode(tok.encode(s), skip_special_tokens=True) == s


def test_chat_template_from_the_file(tokenizers_pair):
    ours, ref = tokenizers_pair
    conv = [{"role": "user", "content": "Hi \U0001f44b"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "the quick fox"}]
    text = ours.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|user|>\nHi") and text.endswith("<|assistant|>\n")
    assert ours.apply_chat_template(conv, add_generation_prompt=True, return_dict=False) == \
        ref.encode(text, add_special_tokens=False)


def test_tiny_llama_gguf_generates_like_transformers(gguf_dir, tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file="tiny.gguf").eval()
    model = genkit.load_model(gguf_dir / "tiny.gguf")
    for prompt in ["the quick brown fox", "Once upon a time \U0001f600\n"]:
        enc = ours_tok(prompt, return_tensors="pt")
        ref = hf.generate(**enc, do_sample=False, max_new_tokens=16, min_new_tokens=16)
        out = model.generate(**enc, max_new_tokens=16, min_new_tokens=16)
        assert torch.equal(out, ref), prompt
        assert isinstance(ours_tok.decode(out[0], skip_special_tokens=True), str)


def test_tiny_qwen2_gguf_generates_like_transformers(tmp_path, tokenizers_pair):
    """A Qwen2 GGUF: q/k/v biases, and no o_proj bias (none is stored)."""
    write_tiny_llama_gguf(tmp_path / "qwen2.gguf", arch="qwen2", seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="qwen2.gguf").eval()
    model = genkit.load_model(tmp_path / "qwen2.gguf")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    enc = tokenizers_pair[0]("the quick brown fox", return_tensors="pt")
    ref = hf.generate(**enc, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(model.generate(**enc, max_new_tokens=16, min_new_tokens=16), ref)


def test_unsupported_tokenizer_model_names_the_field_and_the_accepted_values(tmp_path):
    message = (r"`tokenizer\.ggml\.model`: GGUF tokenizer model 't5' is not supported; "
               r"accepted: 'gpt2' \(byte-level BPE\), 'llama' \(SentencePiece BPE with byte fallback\)")
    path = tmp_path / "t5.gguf"
    write_tiny_llama_gguf(path, model="t5")
    with pytest.raises(ValueError, match=message):
        genkit.load_tokenizer(path)
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf_metadata({"model": "t5", "tokens": ["a"]})
    with pytest.raises(ValueError, match=r"`tokenizer\.ggml\.model`: GGUF tokenizer model None"):
        tokenizer_from_gguf_metadata({"tokens": ["a"]})
    with pytest.raises(ValueError, match=r"`tokenizer\.ggml\.scores` has 1 entries for 2 tokens"):
        tokenizer_from_gguf_metadata({"model": "llama", "tokens": ["a", "b"], "scores": [0.0]})
