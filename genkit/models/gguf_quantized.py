"""Building a native model from a GGUF file whose quantized tensors stay quantized.

The model is built on the meta device; the linear layers (and the word embedding) whose tensors
are quantized in a format the kernels take (:func:`kernel_types`)
are replaced by :class:`~genkit.models.quant.Int4Linear` (and
:class:`~genkit.models.quant.QuantizedEmbedding`) before any float memory is allocated, so the
float32 weights never exist. A tied LM head runs on the embedding's codes. Other tensors (norms,
and quantized types without a kernel) are de-quantized to ``dtype`` as before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ModelFileError
from . import block_kernel
from .base import GenkitModel
from .gguf import GGUFContents
from .gguf_blocks import GGUF_BLOCK_TYPES, GGUF_INT4_TYPES, block_layer, int4_parts_from_gguf, q8_0_embedding
from .gpt2 import Conv1D
from .quant import PACK_CHUNK, Int4Linear, Int4Part, WithBias, int4_shape_ok

logger = logging.getLogger("genkit.models")



def kernel_types() -> frozenset[str]:
    """The GGUF tensor types kept quantized: Q6_K too where the block kernel runs."""
    return frozenset(GGUF_BLOCK_TYPES if block_kernel.available() else GGUF_INT4_TYPES)


def build_quantized_model(config: Any, contents: GGUFContents, dtype: torch.dtype, where: str) -> GenkitModel:
    """The config's architecture with ``contents.quantized`` tensors as int4 layers and the
    float tensors of ``contents.state_dict`` copied in. A quantized matrix whose rows the kernels
    cannot take (without the block kernel, which pads them: not a multiple of 16, GPT-2's 50,257-token
    head) is de-quantized to ``dtype`` instead, as is an embedding table in another type than Q8_0
    (its tied head stays quantized)."""
    from .loading import architecture_class, build_model

    cls = architecture_class(config, os.path.join(where, "config.json"))
    with torch.device("meta"):
        model = cls(config)
    state = dict(contents.state_dict)
    quantized = dict(contents.quantized)
    embed_name = next(name for name, mod in model.named_modules() if mod is model.input_embeddings())
    embed, head_on_codes = _embedding(model, config, quantized, state, embed_name, where)
    layers, biases = _linear_layers(model, quantized, state, where)
    if embed is not None:
        _swap(model, embed_name, nn.Identity())
    if head_on_codes:
        model.tie_weights = lambda: None  # type: ignore[method-assign]  # the head is already quantized
    model = build_model(config, state, dtype, where=where, model=model)
    for name, (type_name, data, shape) in layers.items():
        module_name = name.rsplit(".", 1)[0]
        out, k = shape
        source = f"{type_name} {name}"
        layer: nn.Module = (block_layer(type_name, data, (out, k), source) if block_kernel.available()
                            else Int4Linear(k, out, row_chunks=_row_chunks(type_name, data, out, k), source=source))
        if module_name in biases:
            layer = WithBias(layer, biases[module_name].to(dtype))
        _swap(model, module_name, layer)
    if embed is not None:
        _swap(model, embed_name, q8_0_embedding(embed[1], (embed[2][0], embed[2][1]), dtype))
    release_freed_memory()
    model.quantization = "gguf"  # type: ignore[attr-defined]
    model._prepared = None  # type: ignore[attr-defined]
    logger.info("%s: %d tensors kept quantized (%s)", where, len(layers) + (embed is not None),
                ", ".join(sorted({t for t, _, _ in layers.values()} | ({embed[0]} if embed else set()))))
    return model


Entry = tuple[str, Any, tuple[int, ...]]  # GGUF type name, raw blocks, (rows, columns)


def _embedding(model: nn.Module, config: Any, quantized: dict[str, Entry], state: dict[str, torch.Tensor],
               embed_name: str, where: str) -> tuple[Entry | None, bool]:
    """The quantized embedding table kept as codes (Q8_0; another type is de-quantized into
    ``state``), and whether the tied LM head runs on its codes (added to ``quantized``; when the
    kernels cannot take its rows, the table is de-quantized and the head shares it)."""
    embed = quantized.pop(f"{embed_name}.weight", None)
    if embed is None:
        return None, False
    module = model.get_submodule(embed_name)
    want = (module.num_embeddings, module.embedding_dim)
    if tuple(embed[2]) != want:
        raise ModelFileError(f"{where}: tensor {embed_name + '.weight'!r} has shape {tuple(embed[2])}, but the "
                             f"config implies {want}")
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in quantized
    head_on_codes = tied and int4_shape_ok(embed[2][0], embed[2][1], padded=block_kernel.available())
    if head_on_codes:
        quantized["lm_head.weight"] = embed  # the LM head runs on the embedding's codes
    if embed[0] != "Q8_0" or (tied and not head_on_codes):
        state[f"{embed_name}.weight"] = _dequantized(embed)
        logger.info("%s: the %s embedding table is de-quantized%s", where, embed[0],
                    "" if head_on_codes else " (the LM head shares it)" if tied else "")
        return None, head_on_codes
    return embed, head_on_codes


def _linear_layers(model: nn.Module, quantized: dict[str, Entry], state: dict[str, torch.Tensor],
                   where: str) -> tuple[dict[str, Entry], dict[str, torch.Tensor]]:
    """The quantized weights that become int4 layers (their modules swapped out of ``model``, so
    that no float memory is allocated for them) and those layers' biases (taken out of ``state``);
    a weight whose rows the kernels cannot take, and a (position) embedding table, go to ``state``
    de-quantized."""
    layers, biases = {}, {}
    for name, entry in quantized.items():
        module_name = name.rsplit(".", 1)[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        if isinstance(module, nn.Embedding) and name.endswith(".weight"):
            state[name] = _dequantized(entry)  # a position table: llama.cpp keeps GPT-2's float, another tool may not
            continue
        if not isinstance(module, (nn.Linear, Conv1D)) or not name.endswith(".weight"):
            raise ModelFileError(f"{where}: quantized tensor {name!r} is not a linear layer's weight")
        # rows (out, in) as stored; transformers' GPT-2 Conv1D keeps its weight (in, out)
        want = tuple(module.weight.shape[::-1]) if isinstance(module, Conv1D) else tuple(module.weight.shape)
        if tuple(entry[2]) != want:
            raise ModelFileError(f"{where}: tensor {name!r} has shape {tuple(entry[2])}, but the config implies {want}")
        if not int4_shape_ok(entry[2][0], entry[2][1], padded=block_kernel.available()):
            logger.info("%s: %s (%s rows) is de-quantized: the int4 kernels take multiples of 16 rows", where,
                        name, entry[2][0])
            state[name] = _dequantized(entry).t() if isinstance(module, Conv1D) else _dequantized(entry)
            continue
        if module.bias is not None:
            if f"{module_name}.bias" not in state:
                raise ModelFileError(f"{where}: missing tensor {module_name + '.bias'!r}")
            bias = biases[module_name] = state.pop(f"{module_name}.bias")
            if tuple(bias.shape) != tuple(module.bias.shape):  # (not checked with the state: taken out of it)
                raise ModelFileError(f"{where}: tensor {module_name + '.bias'!r} has shape {tuple(bias.shape)}, but "
                                     f"the config implies {tuple(module.bias.shape)}")
        _swap(model, module_name, nn.Identity())
        layers[name] = entry
    return layers, biases


def _dequantized(entry: Entry) -> torch.Tensor:
    """The float32 weight of a quantized entry (the ``gguf`` package's de-quantization)."""
    from gguf import GGMLQuantizationType, quants

    type_name, data, shape = entry
    return torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[type_name]).reshape(shape).copy())


def _row_chunks(type_name: str, data: Any, out: int, k: int) -> Iterator[list[Int4Part]]:
    """The int4 parts of ``PACK_CHUNK`` rows at a time; the temporaries of each chunk are handed
    back before the next (glibc would keep them, growing the process by several times the
    model's size while it loads)."""
    for start in range(0, out, PACK_CHUNK):
        yield int4_parts_from_gguf(type_name, data[start:start + PACK_CHUNK], (min(PACK_CHUNK, out - start), k))
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand the block decoders' freed temporaries back to the OS (glibc keeps freed heap memory
    for reuse, which would count in the process's memory for its whole life); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` among the symbols the process has loaded, looked up once (None: not
    glibc). ``ctypes.util.find_library`` ran ``ldconfig`` and a compiler each time: 320 processes, 1-2 s of
    a GGUF model's load."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def _swap(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old  # type: ignore[no-any-return]
