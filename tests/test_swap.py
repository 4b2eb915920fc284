"""The one-import swap (issue 30, item 3): ``from genkit import AutoTokenizer, AutoModelForCausalLM``
runs a transformers quick start unchanged; the tokenizer methods the guides use give what
transformers' give on the same files; warnings reach transformers' logging;
``GenerationConfig.save_pretrained(config_name=)``; ``WatermarkLogitsProcessor.greenlist_size``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_bpe_tokenizer

import genkit
from genkit.errors import ConfigError

transformers = pytest.importorskip("transformers")

QUICKSTART = Path(__file__).parent / "examples" / "transformers_quickstart.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """``tiny-model/``: a random 2-layer Llama saved by transformers, with a 400-token BPE tokenizer."""
    root = tmp_path_factory.mktemp("swap")
    folder = write_bpe_tokenizer(root / "tiny-model")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _run_script(source: str, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "quickstart_run.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_quickstart_runs_with_only_its_import_line_changed(model_dir):
    """tests/examples/transformers_quickstart.py (transformers' quick start, import line and
    checkpoint path changed) runs on genkit and prints what the same script prints on transformers."""
    source = QUICKSTART.read_text()
    assert "from genkit import AutoModelForCausalLM, AutoTokenizer" in source
    ours = _run_script(source, model_dir.parent)
    assert ours.returncode == 0, ours.stderr
    ref = _run_script(source.replace("from genkit import", "from transformers import"), model_dir.parent)
    assert ref.returncode == 0, ref.stderr
    assert ours.stdout == ref.stdout
    assert "<|assistant|>" in ours.stdout and "torch.Size([1, 13])" in ours.stdout


def test_auto_classes_load_what_load_model_loads(model_dir):
    model = genkit.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16, device_map="cpu")
    assert isinstance(model, genkit.LlamaForCausalLM) and model.dtype == torch.bfloat16
    assert model.device == torch.device("cpu")
    model = genkit.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", device_map={"": "cpu"})
    assert model.dtype == torch.float32
    tok = genkit.AutoTokenizer.from_pretrained(model_dir, padding_side="left", pad_token="</s>")
    assert tok.padding_side == "left" and tok.pad_token_id == 2
    loaded = genkit.load_model(model_dir, torch_dtype="bfloat16", device_map="auto")
    assert loaded.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, message", [
    ({"device_map": "balanced"}, r"`device_map`='balanced' spreads the model over devices; accepted: 'auto', 'cpu'"),
    ({"device_map": {"model.layers.0": "cpu", "lm_head": "cpu"}}, r"`device_map`=.* splits the model"),
    ({"device_map": 3.5}, r"`device_map`=3.5 is not valid; accepted: 'auto', 'cpu'"),
    ({"device_map": "cpu", "device": "meta"}, r"`device`='meta' and `device_map`='cpu' disagree"),
    ({"dtype": "float16", "torch_dtype": "bfloat16"}, r"`dtype`='float16' and `torch_dtype`='bfloat16' disagree"),
    ({"torch_dtype": "int8"}, r"`dtype`='int8' is not supported; accepted: float32, bfloat16, float16, 'auto'"),
])
def test_load_model_refuses_what_it_cannot_honour(model_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        genkit.load_model(model_dir, **kwargs)


def test_auto_classes_refuse_unknown_keywords(model_dir):
    with pytest.raises(ConfigError, match=r"`attn_implementation` not supported by genkit; accepted: dtype, "):
        genkit.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match=r"`use_fast`=False is not supported"):
        genkit.AutoTokenizer.from_pretrained(model_dir, use_fast=False)
    with pytest.raises(ConfigError, match=r"`padding_side`='top' is not valid; accepted: 'left', 'right'"):
        genkit.AutoTokenizer.from_pretrained(model_dir, padding_side="top")
    with pytest.raises(ConfigError, match="AutoModelForCausalLM is not instantiated"):
        genkit.AutoModelForCausalLM()


def test_import_genkit_does_not_load_torch():
    code = "import sys, genkit; genkit.AutoTokenizer; genkit.AutoModelForCausalLM; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", "import sys, genkit; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # the names load torch when first used, not before


# -- tokenizer methods against transformers' on the same files ----------------------------------
@pytest.fixture(scope="module")
def toks(model_dir):
    return genkit.AutoTokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


TEXTS = ["the quick brown fox", "hello world, hello tokenizers!", "numbers 12345 and 3.14 ."]


def test_encode_with_return_tensors(toks):
    ours, ref = toks
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)
        assert torch.equal(ours.encode(text, return_tensors="pt"), ref.encode(text, return_tensors="pt"))
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, truncation=True, max_length=3) == ref.encode(text, truncation=True, max_length=3)
    with pytest.raises(ConfigError, match="`text_pair` is not supported"):
        ours.encode("a", "b")


def test_decode_and_batch_decode(toks):
    ours, ref = toks
    batch = ref(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == ref.batch_decode(batch, skip_special_tokens=skip)
        for row in batch:
            for clean in (False, True):
                assert ours.decode(row, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == \
                    ref.decode(row, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
    with pytest.raises(TypeError):
        ours.decode([1, 2], no_such_option=True)


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_matches_transformers(toks, side):
    ours, ref = toks
    features = [ref(t) for t in TEXTS]
    got = ours.pad([dict(f) for f in features], padding_side=side, return_tensors="pt")
    want = ref.pad(features, padding_side=side, return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    as_dict = ours.pad({"input_ids": [f["input_ids"] for f in features]}, padding="max_length", max_length=16,
                       padding_side=side)
    ref_dict = ref.pad({"input_ids": [f["input_ids"] for f in features]}, padding="max_length", max_length=16,
                       padding_side=side)
    assert as_dict["input_ids"] == ref_dict["input_ids"]
    assert as_dict["attention_mask"] == ref_dict["attention_mask"]
    with pytest.raises(ConfigError, match="`encoded_inputs` must be a dict with `input_ids`"):
        ours.pad([[1, 2]])


def test_call_apply_chat_template_and_special_tokens(toks):
    ours, ref = toks
    got = ours(TEXTS, padding=True, return_tensors="pt")
    want = ref(TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.attention_mask, want.attention_mask)
    messages = [{"role": "user", "content": "hello world"}]
    for kwargs in ({"tokenize": False}, {"tokenize": True, "return_dict": False},
                   {"return_tensors": "pt", "return_dict": True}):
        a = ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        b = ref.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        if isinstance(b, str) or isinstance(b, list):
            assert a == b
        else:
            assert torch.equal(a["input_ids"], b["input_ids"])
    for tok in (ours, ref):
        tok.pad_token = tok.eos_token
    assert ours.pad_token_id == ref.pad_token_id == 2
    ours.pad_token_id = 0
    assert ours.pad_token == "<pad>"
    with pytest.raises(ConfigError, match=r"`pad_token`='\[PAD\]' is not a token of this vocabulary"):
        ours.pad_token = "[PAD]"


# -- warnings, save_pretrained(config_name=), greenlist_size -------------------------------------
def _length_warning(tiny_model):
    genkit.generate(tiny_model, torch.tensor([[1, 5, 6]]))  # no length set: the default-length warning


def test_warnings_reach_transformers_logging(tiny_model):
    """transformers loaded: genkit's config warnings go through transformers' generation logger, so
    its verbosity silences them and its handlers capture them."""
    from transformers.utils import logging as tf_logging

    from genkit.config.warn import TRANSFORMERS_LOGGER, WARNED

    WARNED.clear()  # (another test in this process may have given the warning already: it shows once)
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Capture()
    tf_logging.add_handler(handler)
    before = tf_logging.get_verbosity()
    try:
        tf_logging.set_verbosity_error()
        _length_warning(tiny_model)
        assert records == []
        tf_logging.set_verbosity_warning()
        _length_warning(tiny_model)  # silenced before, so not counted as given: it shows now
        assert [r.name for r in records] == ["genkit.config"]
        assert "the model-agnostic default" in records[0].getMessage()
        assert logging.getLogger(TRANSFORMERS_LOGGER).isEnabledFor(logging.WARNING)
    finally:
        tf_logging.remove_handler(handler)
        tf_logging.set_verbosity(before)


def test_warnings_still_reach_genkit_handlers(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        _length_warning(tiny_model)
    found = [(r.name, r.getMessage()) for r in caplog.records if "model-agnostic default" in r.getMessage()]
    assert [name for name, _ in found] == ["genkit.config"], found


def test_generation_config_save_pretrained_config_name(tmp_path):
    config = genkit.GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.5)
    path = config.save_pretrained(tmp_path, config_name="short.json")
    assert Path(path) == tmp_path / "short.json" and not (tmp_path / "generation_config.json").exists()
    assert json.loads((tmp_path / "short.json").read_text())["max_new_tokens"] == 7
    loaded = genkit.GenerationConfig.from_pretrained(tmp_path, config_name="short.json")
    assert (loaded.max_new_tokens, loaded.temperature) == (7, 0.5)
    ref = transformers.GenerationConfig.from_pretrained(tmp_path, config_file_name="short.json")
    assert (ref.max_new_tokens, ref.temperature) == (7, 0.5)
    with pytest.raises(ConfigError, match="pass the file name once"):
        config.save_pretrained(tmp_path, "a.json", config_name="b.json")


def test_watermark_processor_has_transformers_attributes():
    from transformers.generation.logits_process import WatermarkLogitsProcessor as Reference

    ours = genkit.WatermarkLogitsProcessor(vocab_size=1000, device="cpu", greenlist_ratio=0.3, hashing_key=7)
    ref = Reference(vocab_size=1000, device="cpu", greenlist_ratio=0.3, hashing_key=7)
    assert ours.greenlist_size == ref.greenlist_size == 300
    assert (ours.vocab_size, ours.hash_key, ours.table_size) == (ref.vocab_size, ref.hash_key, ref.table_size)
    assert torch.equal(ours.fixed_table, ref.fixed_table)
