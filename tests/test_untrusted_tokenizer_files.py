"""Tokenizer files as untrusted input: a folder's tokenizer_config.json, special_tokens_map.json,
chat_template.jinja / .json, and a GGUF's tokenizer metadata. Whatever they hold, loading the
tokenizer either works or raises a CorruptModelError naming the file and the field (it was a bare
UnicodeDecodeError, JSONDecodeError, RecursionError, TypeError or ValueError, or a value of the
wrong type was silently misread: ``add_bos_token: "false"`` added BOS)."""

from __future__ import annotations

import re
import time

import pytest

from genkit.errors import ConfigError, CorruptModelError
from genkit.models.loading import load_tokenizer
from genkit.tokenizer import sentencepiece_merges, tokenizer_from_gguf_metadata

DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _folder(tmp_path, files: dict[str, bytes]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


@pytest.mark.parametrize("name,data,message", [
    ("tokenizer_config.json", b"\xff\xfe{}", "not valid UTF-8 JSON (UnicodeDecodeError"),
    ("tokenizer_config.json", b"{", "not valid UTF-8 JSON (JSONDecodeError"),
    ("tokenizer_config.json", DEEP, "not valid UTF-8 JSON (RecursionError"),
    ("tokenizer_config.json", b"[1]", "must hold a JSON object; got a list"),
    ("special_tokens_map.json", b"[1]", "must hold a JSON object; got a list"),
    ("chat_template.json", b"[1]", "must hold a JSON object; got a list"),
    ("chat_template.jinja", b"\xff", "not UTF-8 text"),
    ("tokenizer_config.json", b'{"chat_template": 5}', '`chat_template` must be a string or a list of {"name", '
                                                       '"template"} strings; got 5'),
    ("chat_template.json", b'{"chat_template": [{"name": 1}]}', "`chat_template` must be a string"),
    ("tokenizer_config.json", b'{"bos_token": {"content": 5}}', "`bos_token` must be a string or an object"),
    ("special_tokens_map.json", b'{"eos_token": 7}', "`eos_token` must be a string or an object"),
    ("tokenizer_config.json", b'{"model_max_length": "x"}', "`model_max_length` must be a positive number"),
    ("tokenizer_config.json", b'{"padding_side": "up"}', "`padding_side` must be 'left' or 'right'; got 'up'"),
    ("tokenizer_config.json", b'{"add_bos_token": "false"}', "`add_bos_token` must be true or false"),
])
def test_bad_tokenizer_files_name_the_file_and_field(tmp_path, name, data, message):
    folder = _folder(tmp_path, {name: data})
    with pytest.raises(CorruptModelError, match=re.escape(f"{folder / name}: {message}")):
        load_tokenizer(folder)


def test_good_tokenizer_files_still_load(tmp_path):
    folder = _folder(tmp_path, {"tokenizer_config.json": b'{"bos_token": {"content": "<s>"}, "model_max_length": '
                                                         b'1e30, "padding_side": "left", "chat_template": null}',
                                "chat_template.json": b'{"chat_template": "{{ messages[0].content }}!"}'})
    tok = load_tokenizer(folder)
    assert (tok.bos_token_id, tok.padding_side, tok.model_max_length) == (2, "left", int(1e30))
    assert tok.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False) == "a b!"


@pytest.mark.parametrize("template", ["{% for %}", "{{ raise_exception('roles must alternate') }}"])
def test_a_chat_template_that_cannot_render_is_a_config_error(tmp_path, template):
    folder = _folder(tmp_path, {"chat_template.jinja": template.encode()})
    tok = load_tokenizer(folder)
    with pytest.raises(ConfigError, match=rf"the chat template of {re.escape(str(folder))} cannot render this "
                                          r"conversation \(Template(Syntax)?Error: "):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_a_chat_template_past_its_budget_is_a_config_error_naming_it(tmp_path):
    """the text of a nested list (18 MB from three small lists) was built before its size was looked at"""
    template = "{% set a = [0] * 1000 %}{% set b = [a] * 1000 %}{% set c = [b] * 6 %}{{ c }}"
    folder = _folder(tmp_path, {"chat_template.jinja": template.encode()})
    tok = load_tokenizer(folder)
    with pytest.raises(ConfigError, match=rf"the chat template of {re.escape(str(folder))} cannot render this "
                                          r"conversation \(the chat template is too costly: it would make the text of "
                                          r"a value of at least \d+ characters or items; the budget is 16777216 "
                                          r"\(genkit.chat_template.MAX_CHARS\)\)"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


# --- GGUF tokenizer metadata ------------------------------------------------------------------

TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
META = {"model": "llama", "tokens": TOKENS, "scores": [0.0, 0.0, 0.0, -1.0, -2.0, -0.5],
        "token_type": [2, 3, 3, 1, 1, 1], "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


@pytest.mark.parametrize("change,message", [
    ({"bos_token_id": "x"}, "`tokenizer.ggml.bos_token_id` must be an integer; got 'x'"),
    ({"unknown_token_id": 1.5}, "`tokenizer.ggml.unknown_token_id` must be an integer; got 1.5"),
    ({"add_bos_token": "false"}, "`tokenizer.ggml.add_bos_token` must be a boolean; got 'false'"),
    ({"chat_template": 5}, "`tokenizer.chat_template` must be a string; got 5"),
    ({"pre": 5}, "`tokenizer.ggml.pre` must be a string; got 5"),
    ({"tokens": [0, 1, 2]}, "`tokenizer.ggml.tokens` must be an array of strings; got 0 at index 0"),
    ({"merges": ["ab"]}, "`tokenizer.ggml.merges` must be an array of strings of two pieces split by a space; "
                         "got 'ab' at index 0"),
    ({"merges": [1]}, "`tokenizer.ggml.merges` must be an array of strings"),
    ({"scores": ["x"] * 6}, "`tokenizer.ggml.scores` must be an array of numbers (not NaN); got 'x' at index 0"),
    ({"scores": [float("nan")] * 6}, "`tokenizer.ggml.scores` must be an array of numbers (not NaN)"),
    ({"scores": [0.0]}, "`tokenizer.ggml.scores` has 1 entries for 6 tokens"),
    ({"token_type": "x"}, "`tokenizer.ggml.token_type` must be an array of integers; got x"),
    ({"merges": ["zz yy"]}, "`tokenizer.ggml.tokens` / `tokenizer.ggml.merges` do not make a 'llama' tokenizer: "),
    ({"model": "gpt2", "merges": ["zz yy"]}, "`tokenizer.ggml.tokens` / `tokenizer.ggml.merges` do not make a "
                                             "'gpt2' tokenizer: "),
])
def test_bad_gguf_tokenizer_metadata_names_the_key(change, message):
    with pytest.raises(CorruptModelError, match=re.escape(f"model.gguf: metadata {message}")):
        tokenizer_from_gguf_metadata({**META, **change}, name_or_path="model.gguf")


def test_a_gguf_file_with_a_string_bos_id_is_refused_by_load_tokenizer(tmp_path):
    """load_tokenizer reads the metadata without load_model's config checks: int('x') was a
    bare ValueError"""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores(META["scores"])
    w.add_key_value("tokenizer.ggml.bos_token_id", "x", gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CorruptModelError, match=r"t\.gguf: metadata `tokenizer\.ggml\.bos_token_id` must be an "
                                                r"integer; got 'x'"):
        load_tokenizer(tmp_path / "t.gguf")


def test_a_token_array_cut_short_or_not_utf8_names_the_key(tmp_path):
    """The header reads a string array in one loop (gguf_header._Header.strings); a token cut off by
    the end of the file, or bytes that are not UTF-8, still name the key and the bytes."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS + ["zzzz" * 8])
    w.add_token_scores(META["scores"] + [-3.0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    whole = path.read_bytes()
    assert [str(t) for t in load_tokenizer(path).convert_ids_to_tokens([3, 6])] == ["a", "zzzz" * 8]
    last = whole.rindex(b"zzzz" * 8)
    path.write_bytes(whole[:last + 5])  # 5 of the last token's 32 bytes
    with pytest.raises(CorruptModelError, match=rf"t\.gguf: the file is truncated: {last + 5} bytes, but its header "
                                                rf"describes data up to byte {last + 32} at least \(the value of "
                                                r"'tokenizer\.ggml\.tokens'\)"):
        load_tokenizer(path)
    path.write_bytes(whole.replace(b"ab", b"\xff\xfe", 1))
    with pytest.raises(CorruptModelError, match=r"t\.gguf: the value of 'tokenizer\.ggml\.tokens' is not valid UTF-8"):
        load_tokenizer(path)


def test_good_gguf_metadata_still_builds_the_tokenizer():
    tok = tokenizer_from_gguf_metadata(dict(META), name_or_path="model.gguf")
    assert tok.encode("ab") == [1, 0, 5]  # BOS, the unknown "\u2581" prefix, "ab"


def test_long_pieces_do_not_make_the_merges_quadratic():
    """every split point of a piece was sliced and looked up: 100 pieces of 60,000 characters
    (a 6 MB token array) took about half a minute; only split points that leave two pieces of
    lengths the vocabulary has are tried now"""
    tokens = ["a", "b", "ab", "ba"] + [f"{i:03d}" + "ab" * 30_000 for i in range(100)]
    start = time.perf_counter()
    merges = sentencepiece_merges(tokens, [0.0, 0.0, -1.0, -2.0] + [-3.0] * 100)
    assert time.perf_counter() - start < 2.0
    assert merges == [("a", "b"), ("b", "a")]


def test_a_vocabulary_whose_merges_cost_too_much_is_refused_before_the_work(tmp_path, monkeypatch):
    """A 'llama' vocabulary without merges has them derived from its scores; long pieces of many
    lengths make that work grow as pieces x lengths x length (400,000 pieces and 2,500 lengths in a
    9.6 MB file: tens of seconds to hours). Its bound is checked against `tokenizer_merge_work` first."""
    gguf = pytest.importorskip("gguf")
    from genkit.errors import ModelFileError
    from genkit.tokenizer import sentencepiece_merge_work

    tokens = TOKENS + ["Z" + "y" * k for k in range(5, 45)]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    work = sentencepiece_merge_work(tokens)
    lengths = sorted({len(t) for t in tokens})
    assert work == sum(sum(1 for n in lengths if n < len(t)) * len(t) for t in set(tokens))
    monkeypatch.setenv("GENKIT_MAX_TOKENIZER_MERGE_WORK", str(work - 1))
    with pytest.raises(ModelFileError, match=rf"t\.gguf: metadata 'tokenizer\.ggml\.tokens' \({len(tokens)} pieces, no "
                                             rf"merges\) would take {work} steps to derive its merges from the scores; "
                                             rf"the limit is {work - 1}; set GENKIT_MAX_TOKENIZER_MERGE_WORK to raise it"):
        load_tokenizer(tmp_path / "t.gguf")
    monkeypatch.setenv("GENKIT_MAX_TOKENIZER_MERGE_WORK", str(work))
    assert load_tokenizer(tmp_path / "t.gguf").encode("ab")[-1] == tokens.index("ab")


def test_a_tokenizer_json_that_makes_the_tokenizers_library_panic_is_a_corrupt_model_error(tmp_path):
    """(fuzzing) a BPE continuing-subword prefix longer than a merge's right part made the Rust
    library panic: pyo3's PanicException, a BaseException that ``except Exception`` let through"""
    import json

    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {
        "type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"], "continuing_subword_prefix": "#" * 10}}))
    with pytest.raises(CorruptModelError, match=re.escape(f"{tmp_path / 'tokenizer.json'}: cannot be read as a "
                                                          "tokenizers file (range end index")):
        load_tokenizer(tmp_path)


def test_a_post_processor_that_panics_in_every_encode_is_refused_at_load(tmp_path):
    """(fuzzing) a TemplateProcessing naming a special token it does not define loaded, then every
    encode (every request of genkit serve) raised pyo3's PanicException: 'no entry found for key'"""
    import json

    folder = _folder(tmp_path, {})
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "x", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [2], "tokens": ["<s>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CorruptModelError, match=re.escape(f"{folder / 'tokenizer.json'}: cannot be read as a "
                                                          "tokenizers file (no entry found for key")):
        load_tokenizer(folder)
