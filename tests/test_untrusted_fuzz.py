"""issue 28: fuzzing the GGUF and safetensors header parsers (hypothesis, a bounded number of
examples so it runs in seconds in CI). Whatever the bytes, the only exception is ModelLoadError."""

from __future__ import annotations

import json
import struct

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("gguf")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from genkit.errors import ModelLoadError  # noqa: E402
from genkit.models.gguf import read_gguf_config  # noqa: E402
from genkit.models.loading import safetensors_header  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _valid_gguf() -> bytes:
    kvs = [_s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
           _s("llama.block_count") + struct.pack("<II", 4, 1),
           _s("llama.embedding_length") + struct.pack("<II", 4, 32),
           _s("llama.attention.head_count") + struct.pack("<II", 4, 2),
           _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + _s("a") + _s("b") + _s("c"),
           _s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0, 1, 2)]
    tensors = [_s("output_norm.weight") + struct.pack("<IQIQ", 1, 32, 0, 0),
               _s("blk.0.attn_norm.weight") + struct.pack("<IQIQ", 1, 32, 0, 128)]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % 32) + bytes(256)


BASE = _valid_gguf()


def _only_model_load_errors(fn, *args):
    try:
        fn(*args)
    except ModelLoadError:
        pass


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, len(BASE)), tail=st.binary(max_size=16))
def test_gguf_headers_never_raise_anything_but_model_load_error(tmp_path_factory, edits, cut, tail):
    data = bytearray(BASE)
    for at, byte in edits:
        data[at] = byte
    path = tmp_path_factory.mktemp("g") / "f.gguf"
    path.write_bytes(bytes(data[:cut] if cut < len(BASE) // 2 else data) + (tail if cut % 3 == 0 else b""))
    _only_model_load_errors(read_gguf_config, path)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_random_bytes_after_a_gguf_magic(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("g") / "r.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + raw)
    _only_model_load_errors(read_gguf_config, path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
ENTRY = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "I8", "X", 3]) | JSON,
                               "shape": st.lists(st.integers(-3, 2**40), max_size=3) | JSON,
                               "data_offsets": st.lists(st.integers(-8, 2**66), min_size=0, max_size=3) | JSON})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=8), ENTRY | JSON, max_size=4), body=st.binary(max_size=64),
       length_delta=st.integers(-4, 4), garble=st.booleans())
def test_safetensors_headers_never_raise_anything_but_model_load_error(tmp_path_factory, header, body,
                                                                      length_delta, garble):
    raw = json.dumps(header).encode()
    if garble:
        raw = raw[: len(raw) // 2] + b"\xff" + raw[len(raw) // 2:]
    path = tmp_path_factory.mktemp("s") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + body)
    _only_model_load_errors(safetensors_header, str(path))
