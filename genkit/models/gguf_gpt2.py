"""GPT-2 in GGUF (``general.architecture`` "gpt2"): llama.cpp's layout of transformers' GPT-2.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``GPT2Model``) writes GPT-2 and DistilGPT2 under
its own tensor names, with transformers' ``Conv1D`` weights (stored ``(in, out)``) transposed to
``(out, in)`` rows like every GGUF matrix; biases and LayerNorm weights as they are; no
``output.weight`` (the LM head is the token embedding; older converters wrote a copy of it). The
metadata keys are ``gpt2.*`` (``context_length`` is the position table's length). Every tensor's
shape is checked against the config here, before any is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ModelFileError

# metadata key suffix (after "gpt2.") -> GPT2Config key
CONFIG_KEYS = {
    "context_length": "n_positions",
    "block_count": "n_layer",
    "feed_forward_length": "n_inner",
    "embedding_length": "n_embd",
    "attention.head_count": "n_head",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "vocab_size": "vocab_size",
}
# per-layer GGUF tensor name -> transformers name (within transformer.h.N.)
LAYER_TENSORS = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
GLOBAL_TENSORS = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
# the layers transformers keeps as Conv1D: their GGUF weights are the transposes of transformers'
_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def hf_name(layer: str | None, base: str, kind: str) -> str | None:
    """transformers' name of GGUF tensor ``blk.<layer>.<base>.<kind>`` (``layer`` None: a global
    tensor ``<base>.<kind>``), or None for a name GPT-2 does not have."""
    if layer is None:
        target = GLOBAL_TENSORS.get(base)
        return None if target is None else f"{target}.{kind}"
    inner = LAYER_TENSORS.get(base)
    return None if inner is None else f"transformer.h.{layer}.{inner}.{kind}"


def is_transposed(gguf_name: str) -> bool:
    """Whether the GGUF tensor is the transpose of transformers' (a Conv1D weight)."""
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _CONV1D and parts[3] == "weight"


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a GPT-2 GGUF file must hold, with its shape (rows, columns) for ``config``;
    ``output.weight`` is optional (see :func:`check_tensors`)."""
    n, vocab, positions = config["n_embd"], config["vocab_size"], config["n_positions"]
    inner = config.get("n_inner") or 4 * n
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, n), "position_embd.weight": (positions, n),
                                        "output_norm.weight": (n,), "output_norm.bias": (n,)}
    for i in range(config["n_layer"]):
        for base, rows, cols in (("attn_norm", n, 0), ("attn_qkv", 3 * n, n), ("attn_output", n, n),
                                 ("ffn_norm", n, 0), ("ffn_up", inner, n), ("ffn_down", n, inner)):
            want[f"blk.{i}.{base}.weight"] = (rows, cols) if cols else (rows,)
            want[f"blk.{i}.{base}.bias"] = (rows,)
    return want


def check_tensors(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], path: str) -> None:
    """The file's tensors (GGUF names -> shapes, rows first) against what ``config`` implies: each
    one present (``output.weight`` may be left out: the head is then the embedding) with its shape;
    a :class:`~genkit.errors.ModelFileError` naming the first that is not."""
    if config.get("n_positions") is None:
        raise ModelFileError(f"{path}: metadata 'gpt2.context_length' (the position table's length) is missing")
    want = expected_shapes(config)
    missing = [name for name in want if name not in shapes]
    if missing:
        raise ModelFileError(f"{path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} for "
                             "architecture 'gpt2'")
    want["output.weight"] = want["token_embd.weight"]
    for name, shape in shapes.items():
        expected = want.get(name)
        if expected is None:  # a layer index spelled another way ("blk.01."), or a layer twice
            raise ModelFileError(f"{path}: unexpected tensor {name!r} for architecture 'gpt2'")
        if tuple(shape) != expected:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {tuple(shape)}, but the config implies "
                                 f"{expected}")
