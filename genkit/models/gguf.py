"""Reading llama.cpp GGUF files: config, dequantized weights under transformers' names, tokenizer.

Needs the ``gguf`` extra (``pip install 'genkit-lm[gguf]'``). Quantized tensors are dequantized
with the ``gguf`` package to float32; the rows of the Q and K projections, which llama.cpp's
converter interleaves for its rope kernel, are put back in the order transformers' checkpoints use.
GPT-2 files (:mod:`genkit.models.gguf_gpt2`) have their Conv1D weights transposed back.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ModelFileError, ModelLoadError, UnsupportedModelError
from . import gguf_gpt2
from .gguf_header import (  # noqa: F401 - the errors re-exported
    GGUFHeader,
    GGUFTensorInfo,
    TruncatedGGUFError,
    UnknownGGUFTypeError,
    read_gguf_header,
)
from .limits import check_config, limit, over

logger = logging.getLogger("genkit.models.gguf")

# GGUF architecture -> (model_type, HF architecture class name, permute Q/K rows)
GGUF_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),  # llama.cpp's converter keeps Qwen2's and Qwen3's rows as they are
    "gpt2": ("gpt2", "GPT2LMHeadModel", False),  # GPT-2 and DistilGPT2 (genkit.models.gguf_gpt2)
}

# metadata key suffix (after "<arch>.") -> config.json key
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# per-layer GGUF tensor name -> transformers name (within model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# per-layer tensors only some architectures have: architecture -> GGUF name -> transformers name
_ARCH_LAYER_TENSORS = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass
class GGUFContents:
    """What a GGUF file holds, in transformers' vocabulary."""

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    #: tensors kept quantized (``read_gguf(..., keep_quantized=...)``): name -> (GGUF type name,
    #: raw blocks, shape (rows, columns) as stored: a linear layer's (out, in), GPT-2's Conv1D
    #: layers too), with the Q/K rows already in transformers' order
    quantized: dict[str, tuple[str, Any, tuple[int, ...]]] = field(default_factory=dict)


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading .gguf files needs the `gguf` package: pip install 'genkit-lm[gguf]'") from exc
    return gguf


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


class GGUFTensor:
    """A tensor of a :class:`GGUFFile`, as ``gguf.ReaderTensor`` gives what genkit reads of it: its name,
    GGUF dimensions (innermost first), GGML type and ``data``, a read-only numpy view of its bytes in the
    file's memory map (elements of a float or integer type, shaped outermost first; raw blocks of a
    quantized type, one row of bytes per row), for ``gguf.quants.dequantize``."""

    __slots__ = ("data", "name", "shape", "tensor_type")

    def __init__(self, info: GGUFTensorInfo, whole: Any, gguf: Any) -> None:
        import numpy as np

        self.name, self.shape = info.name, info.dims
        self.tensor_type = gguf.GGMLQuantizationType(info.ggml_type)
        shape = tuple(reversed(info.dims))
        dtype = _ELEMENT_TYPES.get(self.tensor_type.name)
        if dtype is None:  # quantized: bytes
            dtype, shape = np.uint8, gguf.quants.quant_shape_to_byte_shape(shape, self.tensor_type)
        self.data = whole[info.start:info.start + info.nbytes].view(dtype).reshape(shape)


# GGML types gguf's reader gives as elements (the others as raw bytes)
_ELEMENT_TYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
                  "I32": "int32", "I64": "int64"}


class GGUFFile:
    """A GGUF file read by genkit (:func:`open_gguf`): its checked header's metadata (scalars as ints,
    floats and bools, strings as ``str``, arrays as lists) and tensors (:class:`GGUFTensor`)."""

    def __init__(self, path: str, header: GGUFHeader, gguf: Any) -> None:
        import numpy as np

        self.path, self.metadata = path, header.metadata
        whole = np.memmap(path, mode="r") if header.tensors else None
        self.tensors = [GGUFTensor(info, whole, gguf) for info in header.tensors]


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of Q/K projection rows (``(out, in)`` or a bias ``(out,)``).

    llama.cpp stores, per head, the rows in interleaved pairs (0, half, 1, half+1, ...); transformers
    keeps the two halves as blocks.
    """
    out = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """``path`` read as a :class:`GGUFFile`: its header read and checked by
    :func:`~genkit.models.gguf_header.read_gguf_header` (bounded time and memory), its tensors
    memory-mapped. Every refusal is a :class:`~genkit.errors.ModelFileError` naming the file and the
    field: :class:`TruncatedGGUFError` (expected vs actual size) when the file is cut short."""
    gguf = _require_gguf()
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < 1 << 16:
                header = read_gguf_header(fh.read(), path)
            else:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    header = read_gguf_header(data, path)
        return GGUFFile(path, header, gguf)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def read_gguf_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], GGUFFile]:
    """The ``config.json`` dict a GGUF describes, and the open file. The sizes are checked
    (:func:`~genkit.models.limits.check_config`) against the limits and the file's tensors."""
    path = os.fspath(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    model_type, hf_arch, _ = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {"model_type": model_type, "architectures": [hf_arch]}
    for suffix, key in (gguf_gpt2.CONFIG_KEYS if arch == "gpt2" else _CONFIG_KEYS).items():
        value = _field(reader, f"{arch}.{suffix}")
        if value is not None:
            config[key] = value
    if "vocab_size" not in config:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            config["vocab_size"] = len(tokens)
    shapes = _hf_shapes(reader, path, arch)
    if arch == "gpt2":
        check_config(config, path, shapes)
        gguf_gpt2.check_tensors(config, {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors},
                                path)
    else:
        _llama_family_config(reader, arch, config, shapes, path)
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        value = _field(reader, f"tokenizer.ggml.{meta}")
        if isinstance(value, int):
            config[key] = value
        elif value is not None:
            raise ModelFileError(f"{path}: metadata 'tokenizer.ggml.{meta}' must be an integer; got {value!r}")
    config["torch_dtype"] = "float32"
    return config, reader


def _llama_family_config(reader: GGUFFile, arch: str, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                         path: str) -> None:
    """The Llama family's config fields beyond the sizes (KV heads, head size, rope scaling, Qwen3's
    attention bias), checked with the sizes against the file's tensors."""
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    check_config(config, path, shapes)
    rope_dim = _field(reader, f"{arch}.rope.dimension_count")
    if arch == "qwen3":  # always explicit: Qwen3Config's default (128) is not llama.cpp's (hidden / heads)
        key_length = _field(reader, f"{arch}.attention.key_length")
        config["head_dim"] = key_length or rope_dim or config["hidden_size"] // config["num_attention_heads"]
        check_config(config, path)
    elif rope_dim is not None and rope_dim != config["hidden_size"] // config["num_attention_heads"]:
        config["head_dim"] = rope_dim
        check_config(config, path)
    _check_qk_rows(config, shapes, path)
    _rope_scaling(reader, arch, config, path)
    if arch == "qwen3":  # Qwen3's attention_bias (off by default) gives q, k, v and o their biases
        config["attention_bias"] = "blk.0.attn_q.bias" in {t.name for t in reader.tensors}
    # Qwen2's q/k/v biases follow from model_type (as in transformers' Qwen2 config);
    # attention_bias would also ask for an o_proj bias, which Qwen2 files do not have


def _rope_scaling(reader: GGUFFile, arch: str, config: dict[str, Any], path: str) -> None:
    """``rope_scaling`` from ``<arch>.rope.scaling.type``/``factor``: none, or linear (llama.cpp's
    position scale ``1 / factor``, transformers' ``linear``); another kind (YaRN, LongRoPE) is refused
    by name rather than run with plain rotary tables."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind != "linear":
        raise UnsupportedModelError(f"{path}: metadata '{arch}.rope.scaling.type' is {kind!r}; accepted: 'none', "
                                    "'linear'")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ModelFileError(f"{path}: metadata '{arch}.rope.scaling.factor' must be a number > 0; got {factor!r}")
    config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    check_config(config, path)


def _check_qk_rows(config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str) -> None:
    """The Q and K projections have one row per head dimension of each (key/value) head: checked
    before their rows are put back in transformers' order, which splits them per head."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for name, shape in shapes.items():
        for proj, heads_key in (("q_proj", "num_attention_heads"), ("k_proj", "num_key_value_heads")):
            rows = config[heads_key] * head_dim
            if f".self_attn.{proj}." in name and shape[0] != rows:
                raise ModelFileError(f"{path}: tensor {name!r} has shape {shape}, but `{heads_key}`="
                                     f"{config[heads_key]} heads of {head_dim} need {rows} rows")


def _hf_shapes(reader: GGUFFile, path: str, arch: str) -> dict[str, tuple[int, ...]]:
    """The file's tensors under transformers' names, with their torch shapes."""
    shapes = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            raise ModelFileError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
        shapes[name] = tuple(int(d) for d in reversed(t.shape))
    return shapes


def read_gguf(path: str | os.PathLike[str], *, tensors: bool = True,
              on_tensor: Callable[[int, int], None] | None = None,
              keep_quantized: frozenset[str] = frozenset()) -> GGUFContents:
    """Config, float32 state dict (transformers' names) and tokenizer metadata of a GGUF file.

    Tensors whose GGUF type is in ``keep_quantized`` (e.g. ``{"Q4_1", "Q8_0"}``) are not
    de-quantized: their raw blocks go to ``contents.quantized``. ``on_tensor(done, total)`` is
    called after each tensor is read (progress reporting)."""
    gguf = _require_gguf()
    path = os.fspath(path)
    config, reader = read_gguf_config(path)
    arch = _field(reader, "general.architecture")
    permute = GGUF_ARCHITECTURES[arch][2]
    state: dict[str, torch.Tensor] = {}
    contents_quantized: dict[str, tuple[str, Any, tuple[int, ...]]] = {}
    if tensors:
        for t in reader.tensors:
            name = _hf_name(t.name, arch)
            assert name is not None  # read_gguf_config checked every name
            shape = tuple(int(d) for d in reversed(t.shape))
            if t.tensor_type.name in keep_quantized and len(shape) == 2:
                contents_quantized[name] = (t.tensor_type.name, _rows_in_hf_order(t.data, name, config, permute),
                                            shape)
                if on_tensor is not None:
                    on_tensor(len(state) + len(contents_quantized), len(reader.tensors))
                continue
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as exc:
                raise UnsupportedModelError(f"{path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                                            "which the installed gguf package cannot dequantize") from exc
            tensor = torch.from_numpy(array.reshape(shape).astype("float32", copy=False).copy())
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                tensor = unpermute_qk(tensor, config["num_attention_heads"])
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                tensor = unpermute_qk(tensor, config["num_key_value_heads"])
            elif arch == "gpt2" and gguf_gpt2.is_transposed(t.name):  # transformers' Conv1D: (in, out)
                tensor = tensor.t()
            state[name] = tensor
            if on_tensor is not None:
                on_tensor(len(state) + len(contents_quantized), len(reader.tensors))
    return GGUFContents(config=config, state_dict=state, tokenizer=read_gguf_tokenizer(reader, path),
                        quantized=contents_quantized)


def _rows_in_hf_order(data: Any, name: str, config: dict[str, Any], permute: bool) -> Any:
    """The raw blocks of a quantized 2-D tensor (one row of blocks per output row), with the Q/K
    projection rows put back in transformers' order (a row permutation: blocks stay intact)."""
    import numpy as np

    rows = np.asarray(data)
    if permute and name.endswith("q_proj.weight"):
        return unpermute_qk(torch.from_numpy(np.array(rows)), config["num_attention_heads"]).numpy()
    if permute and name.endswith("k_proj.weight"):
        return unpermute_qk(torch.from_numpy(np.array(rows)), config["num_key_value_heads"]).numpy()
    return rows


def _hf_name(name: str, arch: str) -> str | None:
    m = _LAYER_RE.match(name)
    if arch == "gpt2":
        if m:
            return gguf_gpt2.hf_name(m.group(1), m.group(2), m.group(3))
        base, _, kind = name.rpartition(".")
        return gguf_gpt2.hf_name(None, base, kind) if kind in ("weight", "bias") else None
    if m:
        inner = _LAYER_TENSORS.get(m.group(2)) or _ARCH_LAYER_TENSORS.get(arch, {}).get(m.group(2))
        return None if inner is None else f"model.layers.{m.group(1)}.{inner}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    target = _GLOBAL_TENSORS.get(base)
    return None if target is None else f"{target}.{kind}"


def read_gguf_tokenizer(reader: GGUFFile, path: str | os.PathLike[str] = "the GGUF file") -> dict[str, Any]:
    """The tokenizer metadata (llama.cpp key names without the ``tokenizer.ggml.`` prefix). A 'llama'
    vocabulary without merges (they are derived from its scores) is checked against the
    ``tokenizer_merge_work`` limit before that work."""
    out: dict[str, Any] = {}
    for key in ("model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
                "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token", "add_space_prefix"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            out[key] = value
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    if out.get("model") == "llama" and not out.get("merges") and isinstance(out.get("tokens"), list):
        from ..tokenizer import sentencepiece_merge_work

        work = sentencepiece_merge_work([str(t) for t in out["tokens"]])
        if work > limit("tokenizer_merge_work"):
            raise ModelFileError(f"{os.fspath(path)}: metadata 'tokenizer.ggml.tokens' ({len(out['tokens'])} pieces, "
                                 f"no merges) would take {work} steps to derive its merges from the scores; "
                                 f"{over('tokenizer_merge_work')}")
    return out
