"""Published generation_config.json files (tests/fixtures/generation_configs/hub, sources in its
README.md / sources.json) read, validated, written back and generated with as transformers 5 does:
Llama 2/3, Qwen, Gemma (hybrid cache), Phi-3, Mistral, T5, BART, Marian, NLLB, MusicGen, Whisper
(lang_to_id, alignment_heads, ...), hand-edited and broken files."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import genkit
from genkit import GenerationConfig
from genkit.errors import ConfigError, ConfigFileError

transformers = pytest.importorskip("transformers")

HUB = Path(__file__).resolve().parent / "fixtures" / "generation_configs" / "hub"
FOLDERS = sorted(p for p in HUB.iterdir() if p.is_dir())
IDS = [p.name for p in FOLDERS]
BROKEN = {"qwen15-moe-broken-json"}  # not valid JSON: both refuse it
READABLE = [p for p in FOLDERS if p.name not in BROKEN]


def test_every_file_has_its_source():
    sources = json.loads((HUB / "sources.json").read_text(encoding="utf-8"))
    assert sorted(sources) == IDS and len(IDS) >= 30
    readme = (HUB / "README.md").read_text(encoding="utf-8")
    for name, src in sources.items():
        assert f"| `{name}` | {src['repo']} | `{src['path']}` | `{src['commit'][:12]}` |" in readme


def _hf(folder: Path):
    return transformers.GenerationConfig.from_pretrained(folder)


def _flags(message: str) -> set[str]:
    """The fields a strict validation error names (one ``- `name` ...`` line each, in both libraries)."""
    return set(re.findall(r"^- `(\w+)`", message, flags=re.M))


def _strict(config) -> set[str]:
    try:
        config.validate(strict=True)
    except ValueError as exc:
        return _flags(str(exc))
    return set()


@pytest.mark.parametrize("folder", READABLE, ids=[p.name for p in READABLE])
def test_read_as_transformers_reads_it(folder, caplog):
    with caplog.at_level(logging.WARNING):
        ours = GenerationConfig.from_pretrained(folder)
    ref = _hf(folder)
    # every value transformers holds (fields and the file's other keys) reads the same here
    for key, value in ref.__dict__.items():
        if not key.startswith("_") and key != "transformers_version":
            assert getattr(ours, key) == value, key
    assert set(ours.custom_entries()) <= set(ref.__dict__)
    data = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    assert ours.transformers_version == data.get("transformers_version")
    # the same flags have no effect (a sampling knob without do_sample, a beam knob with one beam)
    flags = _strict(ref)
    assert _strict(ours) == flags
    warned = [r.getMessage() for r in caplog.records if r.name == "genkit.config"]
    assert {re.match(r"`(\w+)`", m).group(1) for m in warned} == flags, warned  # only those, once each
    # a model's own keys are custom entries, never taken for a misspelt field
    assert not [m for m in warned if "Did you mean" in m]
    # from_dict reads the same
    assert GenerationConfig.from_dict(data).to_diff_dict() == ours.to_diff_dict()


@pytest.mark.parametrize("folder", READABLE, ids=[p.name for p in READABLE])
def test_written_as_transformers_writes_it(folder, tmp_path):
    ours, ref = GenerationConfig.from_pretrained(folder), _hf(folder)
    stamp = ours.transformers_version  # genkit keeps the file's stamp (docs/api.md); transformers writes its own

    def restamped(d: dict) -> dict:
        if stamp is None:
            d.pop("transformers_version", None)
        else:
            d["transformers_version"] = stamp
        return d

    assert ours.to_diff_dict() == restamped(ref.to_diff_dict())
    assert ours.to_json_string(ignore_metadata=True) == ref.to_json_string(ignore_metadata=True)
    expected = json.dumps(restamped(json.loads(ref.to_json_string())), indent=2, sort_keys=True) + "\n"
    assert ours.to_json_string() == expected
    ours.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "hf")
    written = (tmp_path / "ours" / "generation_config.json").read_text(encoding="utf-8")
    assert written == expected  # transformers' layout: sorted keys, two-space indent, LF, a final newline
    hf_written = json.loads((tmp_path / "hf" / "generation_config.json").read_text(encoding="utf-8"))
    assert json.loads(written) == restamped(hf_written)
    # a changed config is validated strictly in both: both save it, or both refuse the same flags
    ours.max_new_tokens = ref.max_new_tokens = 7
    flags = _strict(ref)
    if not flags:
        ours.save_pretrained(tmp_path / "changed")
        assert json.loads((tmp_path / "changed" / "generation_config.json").read_text())["max_new_tokens"] == 7
    else:
        with pytest.raises(ValueError):
            ref.save_pretrained(tmp_path / "hf-changed")
        with pytest.raises(ConfigError, match="Fix these issues to save the configuration") as err:
            ours.save_pretrained(tmp_path / "changed")
        assert _flags(str(err.value)) == flags
        assert not (tmp_path / "changed").exists()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_file_that_is_no_json_is_refused_as_transformers_refuses_it(name, tmp_path):
    folder = HUB / name
    with pytest.raises(OSError, match="not a valid JSON file"):
        _hf(folder)
    path = folder / "generation_config.json"
    with pytest.raises(ConfigFileError, match=rf"^{re.escape(str(path))} is not valid JSON: Expecting ','") as err:
        GenerationConfig.from_pretrained(folder)
    # an OSError as transformers raises, so a fallback written for transformers works here too
    assert isinstance(err.value, OSError) and isinstance(err.value, ConfigError)
    try:
        config = GenerationConfig.from_pretrained(folder)
    except OSError:
        config = GenerationConfig.from_model_config({"bos_token_id": 1, "eos_token_id": 2})
    assert config.eos_token_id == 2


# -- generate ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """(transformers Llama, genkit's load of it): one tiny layer over a 152064-token vocabulary, so
    every token id of the corpus (Qwen's 151645 included) is a real token."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=152064, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("wide")
    hf.save_pretrained(path)
    return hf, genkit.load_model(path)


@pytest.mark.parametrize("folder", READABLE, ids=[p.name for p in READABLE])
def test_generate_with_the_file_as_transformers(wide_pair, folder):
    """The file as the model's generation config: the same tokens as transformers (sampling under
    the same seed, beams, suppressed tokens, EOS lists, guidance). Keys only an encoder-decoder or
    Whisper's own generate reads (forced_decoder_ids, lang_to_id, task, ...) are custom entries:
    neither library's decoder-only generate reads them."""
    hf, ours = wide_pair
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kw = {"max_new_tokens": 5, "attention_mask": torch.ones_like(ids)}
    hf.generation_config = _hf(folder)
    ours.generation_config = GenerationConfig.from_pretrained(folder)
    torch.manual_seed(7)
    ref = hf.generate(ids, **kw)
    torch.manual_seed(7)
    got = ours.generate(ids, **kw)
    assert torch.equal(got, ref)
