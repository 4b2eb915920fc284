"""issue 28, model files: every malformed GGUF, safetensors, index or config.json file is refused
with a ModelLoadError naming the field, within 2 s and 500 MB (measured in a subprocess under
RLIMIT_AS), before anything is allocated; an index cannot reach outside the model folder."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import logits_bound

gguf = pytest.importorskip("gguf")
from test_quantized import write_quantized_gguf  # noqa: E402

from genkit.errors import ModelFileError, ModelLoadError  # noqa: E402
from genkit.models.tiny import TINY_LLAMA, tiny_llama  # noqa: E402

# loads argv[1] under a 500 MB address-space budget (on top of what the imports use) and prints
# what happened, with the time the load took
PROBE = r"""
import json, resource, sys, time
import genkit, gguf, torch, genkit.models.gguf, genkit.models.loading, genkit.models.llama
from genkit.models.loading import ARCHITECTURES
from genkit.plugins import resolve
for target in ARCHITECTURES.values():  # imports and plugin discovery happen before the clock starts
    resolve(target)
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 500 * 2**20, resource.RLIM_INFINITY))
start = time.perf_counter()
try:
    genkit.load_model(sys.argv[1])
    out = {"error": None}
except BaseException as exc:
    out = {"error": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
out["seconds"] = time.perf_counter() - start
print(json.dumps(out))
"""


def _refused(path: Path, *fields: str) -> str:
    """Load ``path`` in a subprocess: refused with a ModelLoadError naming each of ``fields``,
    in under 2 s and within 500 MB. Returns the message."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "GENKIT_BLOCK_KERNEL": "0"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] is not None, f"{path} was loaded"
    assert "ModelLoadError" in got["error"], got
    assert "MemoryError" not in got["error"], got
    for field in fields:
        assert field in got["message"], got["message"]
    assert got["seconds"] < 2.0, got
    return str(got["message"])


# --- GGUF: a hand-made header -------------------------------------------------------------------

def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _header(kvs: list[bytes], tensors: list[bytes], n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    return (b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                  len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors))


def _kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(value)


def _tensor(name: str, dims: tuple[int, ...], offset: int, ttype: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, offset)


ARCH = _kv_str("general.architecture", "llama")


def test_an_array_of_8_million_elements_is_refused(tmp_path):
    path = tmp_path / "big_array.gguf"
    n = 8_000_000
    path.write_bytes(_header([ARCH, _s("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 0, n) + bytes(n)], []))
    _refused(path, "'tokenizer.ggml.token_type'", "8000000 elements", "GENKIT_MAX_GGUF_ARRAY_ELEMENTS")


def test_a_string_array_longer_than_the_file_is_refused(tmp_path):
    path = tmp_path / "strings.gguf"
    path.write_bytes(_header([ARCH, _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3_000_000)
                              + _s("a") * 1000], []))
    _refused(path, "array length of 'tokenizer.ggml.tokens'", "3000000")


def test_a_huge_tensor_count_is_refused(tmp_path):
    path = tmp_path / "count.gguf"
    path.write_bytes(_header([ARCH], [_tensor(f"blk.{i}.attn_q.weight", (32, 32), 0) for i in range(10)],
                             n_tensors=2**40))
    _refused(path, "the tensor count", str(2**40))
    many = tmp_path / "many.gguf"  # 200,000 tensor records that do fit in the file: over the count limit
    many.write_bytes(_header([ARCH], [_tensor("x", (32,), 0)] * 200_000))
    _refused(many, "the tensor count is 200000", "GENKIT_MAX_GGUF_TENSORS")


def test_a_tensor_offset_that_wraps_is_refused(tmp_path):
    path = tmp_path / "wrap.gguf"
    body = _header([ARCH], [_tensor("output_norm.weight", (32,), 2**64 - 32)])
    path.write_bytes(body + bytes(-len(body) % 32) + bytes(4096))
    _refused(path, "'output_norm.weight'", "truncated")


def test_a_huge_key_length_is_refused(tmp_path):
    path = tmp_path / "key.gguf"
    path.write_bytes(_header([ARCH, struct.pack("<Q", 2**62) + b"x" * 64], []))
    _refused(path, "metadata key #1")


@pytest.mark.parametrize("ttype", [0, 2])  # F32, Q4_0
def test_a_tensor_of_no_dimensions_is_refused(tmp_path, ttype):
    """(fuzzing) a tensor of 0 dimensions was an IndexError from the gguf package (a quantized type),
    from the Q/K row check or a RuntimeError from a bias's concatenation (F32)"""
    path = tmp_path / "scalar.gguf"
    body = _header([ARCH], [_tensor("blk.0.attn_q.weight", (), 0, ttype)])
    path.write_bytes(body + bytes(-len(body) % 32) + bytes(4096))
    _refused(path, "tensor 'blk.0.attn_q.weight' has 0 dimensions; accepted: 1 to 4")


# --- GGUF: a real file with one value changed -------------------------------------------------

def _patched(tmp_path: Path, key: str, value: int, name: str, **kw) -> Path:
    """A valid 2-layer Q8_0 file whose u32 metadata ``key`` says ``value``."""
    path = tmp_path / name
    write_quantized_gguf(path, "Q8_0", **kw)
    data = bytearray(path.read_bytes())
    at = data.index(_s(key)) + len(_s(key))
    assert struct.unpack_from("<I", data, at)[0] == 4  # uint32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("value", [1_000_000, 0, 3])
def test_a_gguf_layer_count_must_match_the_file(tmp_path, value):
    path = _patched(tmp_path, "llama.block_count", value, "layers.gguf")
    _refused(path, "`num_hidden_layers`", str(value))


def test_zero_heads_is_an_error_not_a_division_by_zero(tmp_path):
    _refused(_patched(tmp_path, "llama.attention.head_count", 0, "heads.gguf"), "`num_attention_heads`=0")


def test_quantized_shapes_are_checked_against_the_config(tmp_path):
    from test_quantized import FFN
    path = _patched(tmp_path, "llama.feed_forward_length", FFN + 32, "ffn.gguf")
    with pytest.raises(ModelFileError, match=r"ffn\.gguf: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
        torch_load(path)


def test_a_gguf_without_its_mlp_width_is_refused(tmp_path):
    """(fuzzing) no `llama.feed_forward_length`: a TypeError from building the MLP with a width of None"""
    path = tmp_path / "no_ffn.gguf"
    write_quantized_gguf(path, "Q8_0")
    data = path.read_bytes()
    assert data.count(_s("llama.feed_forward_length")) == 1
    path.write_bytes(data.replace(_s("llama.feed_forward_length"), _s("llama.feed_forward_lengtX")))
    _refused(path, "no_ffn.gguf: `intermediate_size` is missing; it must be a positive integer")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_the_bias_of_a_quantized_projection_is_checked(tmp_path, qtype):
    """(fuzzing) a Qwen2 v bias of 64 values for 32 rows was a RuntimeError in the first forward"""
    from test_quantized import HEADS, HIDDEN, KV_HEADS
    path = tmp_path / "bias.gguf"
    write_quantized_gguf(path, qtype, arch="qwen2")
    data = bytearray(path.read_bytes())
    at = data.index(_s("blk.0.attn_v.bias")) + len(_s("blk.0.attn_v.bias"))
    rows = HIDDEN // HEADS * KV_HEADS
    assert struct.unpack_from("<IQ", data, at) == (1, rows)
    struct.pack_into("<Q", data, at + 4, 2 * rows)
    path.write_bytes(bytes(data))
    _refused(path, f"bias.gguf: tensor 'model.layers.0.self_attn.v_proj.bias' has shape ({2 * rows},), but the "
             f"config implies ({rows},)")


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
def test_q_and_k_rows_are_checked_before_they_are_reordered(tmp_path, qtype):
    """a Q projection of 62 rows for 4 heads of 16 was a RuntimeError from the reshape that puts
    llama.cpp's rope rows back in transformers' order"""
    from test_quantized import HIDDEN
    path = tmp_path / "q_rows.gguf"
    write_quantized_gguf(path, qtype)
    data = bytearray(path.read_bytes())
    at = data.index(_s("blk.0.attn_q.weight")) + len(_s("blk.0.attn_q.weight"))
    assert struct.unpack_from("<IQQ", data, at) == (2, HIDDEN, HIDDEN)
    struct.pack_into("<Q", data, at + 12, HIDDEN - 2)  # fewer rows: the tensor still lies inside the file
    path.write_bytes(bytes(data))
    _refused(path, "q_rows.gguf: tensor 'model.layers.0.self_attn.q_proj.weight' has shape (62, 64), but "
             "`num_attention_heads`=4 heads of 16 need 64 rows")


def _gpt2_file(tmp_path: Path, name: str, qtype: str = "F32", **kw) -> Path:
    """A tiny GPT-2 written as llama.cpp's converter writes one (tests/test_gguf_gpt2.py)."""
    from test_gguf_gpt2 import tiny_gpt2, write_gpt2_gguf
    path = tmp_path / name
    write_gpt2_gguf(path, tiny_gpt2(), qtype=qtype, **kw)
    return path


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
def test_a_gpt2_qkv_matrix_must_have_the_shape_the_config_implies(tmp_path, qtype):
    path = _gpt2_file(tmp_path, "qkv.gguf", qtype)
    data = bytearray(path.read_bytes())
    at = data.index(_s("blk.0.attn_qkv.weight")) + len(_s("blk.0.attn_qkv.weight"))
    assert struct.unpack_from("<IQQ", data, at) == (2, 64, 192)  # (in, out): 3 x n_embd rows
    struct.pack_into("<Q", data, at + 12, 160)  # fewer rows: the tensor still lies inside the file
    path.write_bytes(bytes(data))
    _refused(path, "qkv.gguf: tensor 'blk.0.attn_qkv.weight' has shape (160, 64), but the config implies (192, 64)")


def test_a_gpt2_file_without_its_position_table_is_refused(tmp_path):
    path = _gpt2_file(tmp_path, "no_pos.gguf", leave_out=("position_embd.weight",))
    _refused(path, "no_pos.gguf: missing tensors ['position_embd.weight'] for architecture 'gpt2'")


def test_a_gpt2_position_table_must_match_the_context_length(tmp_path):
    path = _gpt2_file(tmp_path, "ctx.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(_s("gpt2.context_length")) + len(_s("gpt2.context_length"))
    assert struct.unpack_from("<II", data, at) == (4, 128)  # uint32
    struct.pack_into("<I", data, at + 4, 1_000_000)  # a table the file does not hold: nothing is allocated
    path.write_bytes(bytes(data))
    _refused(path, "ctx.gguf: tensor 'position_embd.weight' has shape (128, 64), but the config implies "
             "(1000000, 64)")
    renamed = bytes(data).replace(b"gpt2.context_length", b"gpt2.context_lengtX")  # the key left out
    path.write_bytes(renamed)
    _refused(path, "ctx.gguf: metadata 'gpt2.context_length' (the position table's length) is missing")


def test_an_odd_head_size_is_refused(tmp_path):
    """an odd head size was loaded, then every forward failed in rope's split into halves"""
    from safetensors.torch import save_file
    folder = _folder(tmp_path, head_dim=7)
    save_file({k: v.contiguous() for k, v in tiny_llama(head_dim=7).state_dict().items()},
              str(folder / "model.safetensors"))  # weights that match the config
    _refused(folder, "config.json: the head size (7 rotary dimensions) must be even")


def torch_load(path: Path):
    import genkit
    return genkit.load_model(path)


# --- safetensors and config.json ----------------------------------------------------------------

def _folder(tmp_path: Path, name: str = "model", **config) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path / name
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tiny_llama().state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **config}))
    return folder


@pytest.mark.parametrize("field,value", [("num_hidden_layers", -1), ("num_hidden_layers", 1_000_000),
                                         ("num_hidden_layers", 3), ("vocab_size", 10**12),
                                         ("num_attention_heads", 0), ("hidden_size", "64")])
def test_config_json_sizes_are_checked(tmp_path, field, value):
    _refused(_folder(tmp_path, **{field: value}), "config.json", f"`{field}`")


def test_a_llama_config_without_its_mlp_width_is_refused(tmp_path):
    """transformers' default (11008) does not fit the weights either; genkit's MLP got None (TypeError)"""
    _refused(_folder(tmp_path, intermediate_size=None), "config.json: `intermediate_size` is missing")


@pytest.mark.parametrize("field,value,accepted", [
    ("rms_norm_eps", float("nan"), "a finite number >= 0"), ("rms_norm_eps", "x", "a finite number >= 0"),
    ("rope_theta", 0, "a finite number > 0"), ("rope_theta", "abc", "a finite number > 0"),
    ("rope_theta", float("inf"), "a finite number > 0"), ("partial_rotary_factor", 2.0, "a finite number in"),
    ("max_position_embeddings", "x", "an integer >= 0"), ("sliding_window", -5, "an integer >= 0"),
    ("tie_word_embeddings", "no", "true or false"), ("attention_bias", "yes", "true or false"),
    ("model_type", ["llama"], "a string"), ("hidden_act", ["silu"], "a string"),
    ("architectures", "LlamaForCausalLM", "a list of strings"), ("architectures", 5, "a list of strings"),
    ("layer_types", [1, 2], "a list of strings"), ("rope_scaling", [1], "an object"),
    ("rope_scaling", {"rope_type": "linear", "factor": "x"}, "a finite number > 0"),
    ("rope_scaling", {"rope_type": 3}, "a string")])
def test_config_json_fields_are_checked(tmp_path, field, value, accepted):
    """a value of the wrong type or range was a bare ValueError / TypeError, or was loaded: a NaN
    norm epsilon gave NaN logits, `"tie_word_embeddings": "no"` tied the embeddings"""
    import genkit
    folder = _folder(tmp_path, **{field: value})
    with pytest.raises(ModelFileError, match=rf"config\.json: `{field}(\.\w+)?` must be {re.escape(accepted)}"):
        genkit.load_model(folder)


@pytest.mark.parametrize("config,message", [
    ({"layer_types": ["full_attention"] * 3}, "`layer_types` has 3 entries for `num_hidden_layers`=2 layers"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
     "`low_freq_factor` and `high_freq_factor` must differ"),
    ({"get": 5}, "'get' cannot be a config field"), ({"to_dict": 1, "__init__": 0}, "'__init__', 'to_dict' cannot"),
    ({"text_config": {"vocab_size": 128, "get": 5}}, "config.json: 'text_config.get' cannot be a config field"),
    ({"text_config": {"get_text_config": 1, "__class__": 0}},
     "config.json: 'text_config.__class__', 'text_config.get_text_config' cannot be a config field")])
def test_config_json_fields_that_cannot_be_read_are_refused(tmp_path, config, message):
    import genkit
    with pytest.raises(ModelFileError, match=re.escape(message)):
        genkit.load_model(_folder(tmp_path, **config))


def test_a_nested_text_config_cannot_shadow_the_config_methods_either():
    """get_text_config() built a ModelConfig from `text_config` without the check config.json has:
    `{"text_config": {"get": 5}}` replaced `get` of the text config every reader calls."""
    from genkit.errors import ConfigError
    from genkit.models.base import ModelConfig

    config = ModelConfig(vocab_size=8, text_config={"vocab_size": 8, "get": 5})
    with pytest.raises(ConfigError, match=re.escape("'get' cannot be a config field (the name of a ModelConfig "
                                                    "method or attribute)")):
        config.get_text_config()
    with pytest.raises(ConfigError, match=re.escape("'to_dict' cannot be a config field")):
        ModelConfig(to_dict=1)
    assert ModelConfig(text_config={"vocab_size": 8}).get_text_config().get("vocab_size") == 8


def test_real_config_fields_still_load(tmp_path):
    import genkit
    folder = _folder(tmp_path, rope_scaling=None, sliding_window=None, layer_types=["full_attention"] * 2,
                     partial_rotary_factor=1.0, rms_norm_eps=0, max_position_embeddings=10**7,
                     attention_bias=False, hidden_act="silu")
    ids = torch.tensor([[1, 2, 3]])
    expected = tiny_llama(rms_norm_eps=0)(ids).logits
    assert torch.equal(genkit.load_model(folder)(ids).logits, expected)


def test_a_partial_rotary_factor_is_ignored_as_transformers_llama_ignores_it(tmp_path, caplog):
    """(fuzzing config.json) `partial_rotary_factor`=0.5 passed the checks, then every forward failed
    with a RuntimeError (rope tables for half of each head, applied to all of it). transformers'
    Llama family turns every dimension whatever the field says: its logits, and a warning."""
    import genkit
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, partial_rotary_factor=0.5)
    ids = torch.tensor([[1, 2, 3, 4]])
    with caplog.at_level("WARNING", logger="genkit.models"):
        model = genkit.load_model(folder)
    assert "`partial_rotary_factor`=0.5 is ignored, as transformers' LlamaForCausalLM ignores it" in caplog.text
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= logits_bound(reference, ids)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           reference.generate(ids, max_new_tokens=4, do_sample=False))


def test_config_sizes_are_checked_against_the_embedding(tmp_path):
    _refused(_folder(tmp_path, vocab_size=256), "`vocab_size`", "(128, 64)")


def test_a_110_mb_safetensors_header_is_refused(tmp_path):
    folder = _folder(tmp_path)
    n = 110_000_000
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", n))
        fh.truncate(8 + n)  # sparse: the header is never read
    _refused(folder, "model.safetensors", "header length is 110000000", "GENKIT_MAX_SAFETENSORS_HEADER")


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [2], "data_offsets": [0, 2**70]},
                                   {"dtype": "F32", "shape": [-8], "data_offsets": [0, 0]},
                                   {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},
                                   "not an object"])
def test_bad_safetensors_entries_are_refused(tmp_path, entry):
    folder = _folder(tmp_path)
    header = json.dumps({"model.norm.weight": entry}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    _refused(folder, "model.safetensors", "'model.norm.weight'")


def test_an_index_cannot_reach_outside_the_model_folder(tmp_path):
    secret = _folder(tmp_path, "secret")  # weights someone else owns, next to the model
    folder = _folder(tmp_path)
    state = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    for target in ["../secret/model.safetensors", str(secret / "model.safetensors"), "link.safetensors"]:
        (folder / "link.safetensors").unlink(missing_ok=True)
        (folder / "link.safetensors").symlink_to(secret / "model.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": target}}))
        message = _refused(folder, "model.safetensors.index.json", "`weight_map`", "inside the model folder")
        assert state[8:40].decode("latin-1") not in message
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    _refused(folder, "`weight_map` must map tensor names to file names")


def test_limits_can_be_raised_and_bad_values_are_named(tmp_path, monkeypatch):
    import genkit
    from genkit.errors import ConfigError
    folder = _folder(tmp_path, num_hidden_layers=2)
    monkeypatch.setenv("GENKIT_MAX_LAYERS", "1")
    with pytest.raises(ModelFileError, match=r"`num_hidden_layers`=2 is out of range: .* set GENKIT_MAX_LAYERS"):
        genkit.load_model(folder)
    monkeypatch.setenv("GENKIT_MAX_LAYERS", "-5")
    with pytest.raises(ConfigError, match=r"GENKIT_MAX_LAYERS='-5' is not accepted; use a positive integer"):
        genkit.load_model(folder)
    monkeypatch.setenv("GENKIT_MAX_LAYERS", "4")
    model = genkit.load_model(folder)
    assert torch.equal(model(torch.tensor([[1, 2]])).logits, tiny_llama()(torch.tensor([[1, 2]])).logits)


def test_a_model_load_error_is_still_an_os_error_and_a_value_error():
    assert issubclass(ModelFileError, ModelLoadError) and issubclass(ModelFileError, ValueError)
