"""Building a native model from a GGUF file whose quantized tensors stay quantized.

The model is built on the meta device; the linear layers (and the word embedding) whose tensors
are quantized in a format the kernels take (:func:`kernel_types`)
are replaced by :class:`~genkit.models.quant.Int4Linear` (and
:class:`~genkit.models.quant.QuantizedEmbedding`) before any float memory is allocated, so the
float32 weights never exist. A tied LM head runs on the embedding's codes. Other tensors (norms,
and quantized types without a kernel) are de-quantized to ``dtype`` as before.
"""

from __future__ import annotations

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
from .gguf_blocks import GGUF_BLOCK_TYPES, GGUF_INT4_TYPES, int4_parts_from_gguf, q8_0_embedding
from .quant import PACK_CHUNK, Int4Linear, Int4Part, WithBias

logger = logging.getLogger("genkit.models")



def kernel_types() -> frozenset[str]:
    """The GGUF tensor types kept quantized: Q6_K too where the block kernel runs."""
    return frozenset(GGUF_BLOCK_TYPES if block_kernel.available() else GGUF_INT4_TYPES)


def build_quantized_model(config: Any, contents: GGUFContents, dtype: torch.dtype, where: str) -> GenkitModel:
    """The config's architecture with ``contents.quantized`` tensors as int4 layers and the
    float tensors of ``contents.state_dict`` copied in."""
    from .loading import architecture_class, build_model

    quantized = dict(contents.quantized)
    embed = quantized.pop("model.embed_tokens.weight", None)
    tied = bool(config.get("tie_word_embeddings", False))
    if embed is not None and tied and "lm_head.weight" not in quantized:
        quantized["lm_head.weight"] = embed  # the LM head runs on the embedding's codes
    cls = architecture_class(config, os.path.join(where, "config.json"))
    with torch.device("meta"):
        model = cls(config)
    biases = {}
    state = dict(contents.state_dict)
    for name, (_, _, shape) in quantized.items():
        module_name = name.rsplit(".", 1)[0]
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear) or not name.endswith(".weight"):
            raise ModelFileError(f"{where}: quantized tensor {name!r} is not a linear layer's weight")
        if tuple(shape) != (linear.out_features, linear.in_features):
            raise ModelFileError(f"{where}: tensor {name!r} has shape {tuple(shape)}, but the config implies "
                                 f"{(linear.out_features, linear.in_features)}")
        if linear.bias is not None:
            if f"{module_name}.bias" not in state:
                raise ModelFileError(f"{where}: missing tensor {module_name + '.bias'!r}")
            biases[module_name] = state.pop(f"{module_name}.bias")
        _swap(model, module_name, nn.Identity())
    if embed is not None:
        want = (model.model.embed_tokens.num_embeddings, model.model.embed_tokens.embedding_dim)
        if tuple(embed[2]) != want:
            raise ModelFileError(f"{where}: tensor 'model.embed_tokens.weight' has shape {tuple(embed[2])}, but the "
                                 f"config implies {want}")
        _swap(model, "model.embed_tokens", nn.Identity())
    if embed is not None and tied:
        model.tie_weights = lambda: None  # type: ignore[method-assign]  # the head is already quantized
    model = build_model(config, state, dtype, where=where, model=model)
    for name, (type_name, data, shape) in quantized.items():
        module_name = name.rsplit(".", 1)[0]
        out, k = shape
        layer: nn.Module = Int4Linear(k, out, row_chunks=_row_chunks(type_name, data, out, k),
                                      source=f"{type_name} {name}")
        if module_name in biases:
            layer = WithBias(layer, biases[module_name].to(dtype))
        _swap(model, module_name, layer)
    if embed is not None:
        type_name, data, shape = embed
        if type_name != "Q8_0":
            raise ModelFileError(f"{where}: embedding tensor type {type_name} is kept quantized only as Q8_0")
        _swap(model, "model.embed_tokens", q8_0_embedding(data, (shape[0], shape[1]), dtype))
    release_freed_memory()
    model.quantization = "gguf"  # type: ignore[attr-defined]
    model._prepared = None  # type: ignore[attr-defined]
    logger.info("%s: %d tensors kept quantized (%s)", where, len(contents.quantized),
                ", ".join(sorted({t for t, _, _ in contents.quantized.values()})))
    return model


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
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
        if trim is not None:
            trim(0)
    except OSError:  # not glibc
        pass


def _swap(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old  # type: ignore[no-any-return]
