"""Writing a native model's files: ``config.json`` and safetensors weights (no numpy needed)."""

from __future__ import annotations

import ctypes
import json
from typing import Any

import torch

from ..errors import NotSupportedError
from ..fileutil import atomic_path

_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def config_json(model: Any) -> str:
    """``config.json`` for ``model``: its config's fields, ``architectures`` and ``model_type``
    filled in when absent, and ``dtype`` set to the weights' dtype (transformers' key)."""
    from .loading import MODEL_TYPES

    data = model.config.json_fields()
    if not data.get("architectures"):
        data["architectures"] = [MODEL_TYPES.get(data.get("model_type") or "", type(model).__name__)]
    if not data.get("model_type"):
        data["model_type"] = {v: k for k, v in MODEL_TYPES.items()}.get(data["architectures"][0])
    data.pop("torch_dtype", None)
    data["dtype"] = str(model.dtype).removeprefix("torch.")
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file (atomically): an 8-byte header length, the JSON
    header (names, dtypes, shapes, byte offsets; ``{"format": "pt"}`` metadata, which transformers
    expects), padded to 8 bytes, then the raw little-endian data of each tensor in turn."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    data = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _ST_NAMES:
            raise NotSupportedError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold here; "
                                    f"accepted: {', '.join(str(d) for d in _ST_NAMES)}")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        data.append((t, size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t, size in data:
            if size:
                fh.write(ctypes.string_at(t.data_ptr(), size))
