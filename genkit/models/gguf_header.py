"""GGUF files' headers: read in bounded time and memory, every count, length and offset checked.

:func:`read_gguf_header` walks the header once: every count and length is checked against the bytes
left in the file and the limits of :mod:`genkit.models.limits`; keys and tensor names must be unique
UTF-8, tensor types known, shapes whole blocks, offsets aligned and every tensor's bytes inside the
data section. Anything else is a :class:`~genkit.errors.ModelFileError` (or a
:class:`TruncatedGGUFError` / :class:`UnknownGGUFTypeError`) naming the file, the field and the limit.
It gives the metadata's values and the tensors' places (:class:`GGUFHeader`). ``gguf.GGUFReader``
builds several numpy objects per metadata array element and per tensor (11 s for the demo model's
98,000 tokens and merges; 0.4 s here) and trusts every count, length and offset: genkit reads the
header itself and takes from the ``gguf`` package its type tables and de-quantization only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelFileError
from .limits import limit, over

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 65_535
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    """A tensor's entry: its name, GGUF dimensions (innermost first), GGML type, and where its bytes
    lie in the file (``start``, absolute; ``nbytes``)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    start: int
    nbytes: int


@dataclass
class GGUFHeader:
    """A checked GGUF header: the metadata's values (scalars as Python ints, floats and bools, strings
    as ``str``, arrays as lists) and the tensors in file order."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


class TruncatedGGUFError(ModelFileError):
    """The file ends before the data its header describes."""


class UnknownGGUFTypeError(ModelFileError):
    """A tensor's GGUF type is not one the installed ``gguf`` package knows."""


_U64 = struct.Struct("<Q")


class _Header:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, data: Any, path: str) -> None:
        self.data, self.path, self.pos, self.size = data, path, 0, len(data)
        self.elements = 0  # metadata array elements so far

    def take(self, n: int, field: str) -> int:
        if n > self.size - self.pos:
            raise TruncatedGGUFError(f"{self.path}: the file is truncated: {self.size} bytes, but its header "
                                     f"describes data up to byte {self.pos + n} at least ({field})")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, field: str) -> int:
        return int(struct.unpack_from("<I", self.data, self.take(4, field))[0])

    def u64(self, field: str) -> int:
        return int(struct.unpack_from("<Q", self.data, self.take(8, field))[0])

    def string(self, field: str, max_bytes: int | None = None) -> str:
        n = self.u64(field)
        if max_bytes is not None and n > max_bytes:
            raise ModelFileError(f"{self.path}: {field} is {n} bytes long; the limit is {max_bytes}")
        start = self.take(n, field)
        try:
            return str(self.data[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: {field} is not valid UTF-8") from None

    def count(self, field: str, n: int, min_bytes: int, limit_name: str) -> None:
        """Check a count of items of at least ``min_bytes`` each: within the limit and the file."""
        if n > limit(limit_name):
            raise ModelFileError(f"{self.path}: {field} is {n}; {over(limit_name)}")
        if n * min_bytes > self.size - self.pos:
            raise TruncatedGGUFError(f"{self.path}: the file is truncated: {self.size} bytes, but its header says "
                                     f"{field} is {n}, which needs {n * min_bytes} bytes after byte {self.pos} at least")

    def value(self, key: str, vtype: int, in_array: bool = False) -> Any:
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], f"the value of {key!r}")
            return struct.unpack_from("<" + _SCALAR_FORMATS[vtype], self.data, start)[0]
        if vtype == STRING:
            return self.string(f"the value of {key!r}")
        if vtype != ARRAY or in_array:
            raise ModelFileError(f"{self.path}: metadata {key!r} has value type {vtype}, which is not a GGUF "
                                 "value type" + (" allowed in an array (nested arrays are refused)" if in_array else ""))
        itype, n = self.u32(f"the array type of {key!r}"), self.u64(f"the array length of {key!r}")
        self.elements += n
        if self.elements > limit("gguf_array_elements"):
            raise ModelFileError(f"{self.path}: metadata {key!r}: the arrays hold {self.elements} elements so far; "
                                 f"{over('gguf_array_elements')}")
        if itype in _SCALAR_SIZES:
            start = self.take(n * _SCALAR_SIZES[itype], f"the {n} elements of {key!r}")
            return list(struct.unpack_from(f"<{n}{_SCALAR_FORMATS[itype]}", self.data, start))
        self.count(f"the array length of {key!r}", n, 8, "gguf_array_elements")
        if itype == STRING:
            return self.strings(key, n)
        return [self.value(key, itype, in_array=True) for _ in range(n)]

    def strings(self, key: str, n: int) -> list[str]:
        """An array's ``n`` strings (a tokenizer's 49,000 tokens and as many merges): one loop over the
        bytes; where one does not read, :meth:`string` reads it again to raise its error."""
        data, pos, size, out = self.data, self.pos, self.size, []
        unpack = _U64.unpack_from
        try:
            for _ in range(n):
                if size - pos < 8:
                    break
                length = unpack(data, pos)[0]
                if length > size - pos - 8:
                    break
                out.append(str(data[pos + 8:pos + 8 + length], "utf-8"))
                pos += 8 + length
        except UnicodeDecodeError:
            pass
        self.pos = pos
        while len(out) < n:  # (the slow reads raise: truncated, or not UTF-8)
            out.append(self.string(f"the value of {key!r}"))
        return out


def _quant_sizes() -> dict[int, tuple[int, int]]:
    import gguf

    return {int(t): (int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}


def _tensor_info(h: _Header, i: int, sizes: dict[int, tuple[int, int]], alignment: int) -> GGUFTensorInfo:
    name = h.string(f"the name of tensor #{i}", MAX_NAME_BYTES)
    n_dims = h.u32(f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:  # (no model's tensor is a scalar)
        raise ModelFileError(f"{h.path}: tensor {name!r} has {n_dims} dimensions; accepted: 1 to {MAX_DIMS}")
    dims = tuple(h.u64(f"the dimensions of tensor {name!r}") for _ in range(n_dims))
    ttype = h.u32(f"the type of tensor {name!r}")
    offset = h.u64(f"the offset of tensor {name!r}")
    if ttype not in sizes:
        raise UnknownGGUFTypeError(
            f"{h.path}: tensor {name!r} has GGUF tensor type {ttype}, which the installed gguf package does not know "
            "(a newer quantization format? upgrading `gguf` may help)")
    block, type_size = sizes[ttype]
    if any(d == 0 for d in dims) or (dims and dims[0] % block):
        raise ModelFileError(f"{h.path}: tensor {name!r} has shape {list(dims)}: dimensions must be positive and the "
                             f"first a multiple of its type's block of {block}")
    numel = 1
    for d in dims:
        numel *= d
    if offset % alignment:
        raise ModelFileError(f"{h.path}: tensor {name!r} has offset {offset}, not a multiple of the alignment "
                             f"{alignment}")
    return GGUFTensorInfo(name, dims, ttype, offset, numel // block * type_size)


def read_gguf_header(data: Any, path: str) -> GGUFHeader:
    """The header in ``data`` (bytes or a memory map of the whole file), read and checked: a
    :class:`~genkit.errors.ModelFileError` naming the field at the first count, length or offset that
    does not fit the file or the limits. The tensors' ``start`` are absolute offsets in the file."""
    h = _Header(data, path)
    magic = bytes(data[:4])
    if magic != MAGIC:
        raise ModelFileError(f"{path}: not a readable GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    h.take(4, "magic")
    version = h.u32("the version")
    if version not in VERSIONS:
        raise ModelFileError(f"{path}: not a readable GGUF file (version {version}; supported: 2, 3)")
    n_tensors, n_kv = h.u64("the tensor count"), h.u64("the metadata key count")
    h.count("the tensor count", n_tensors, 24, "gguf_tensors")
    h.count("the metadata key count", n_kv, 13, "gguf_metadata_keys")
    header = GGUFHeader(version)
    alignment = 32
    for i in range(n_kv):
        key = h.string(f"metadata key #{i}", MAX_NAME_BYTES)
        if key in header.metadata:
            raise ModelFileError(f"{path}: metadata key {key!r} appears twice")
        vtype = h.u32(f"the value type of {key!r}")
        header.metadata[key] = value = h.value(key, vtype)
        if key == "general.alignment":
            alignment = value if vtype == 4 else 0
            if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 16:
                raise ModelFileError(f"{path}: `general.alignment` must be a uint32 power of two up to 65536")
    sizes, names = _quant_sizes(), set()
    for i in range(n_tensors):
        info = _tensor_info(h, i, sizes, alignment)
        if info.name in names:
            raise ModelFileError(f"{path}: tensor {info.name!r} appears twice")
        names.add(info.name)
        header.tensors.append(info)
    start = -(-h.pos // alignment) * alignment
    end, name = max(((t.start + t.nbytes, t.name) for t in header.tensors), default=(0, ""))
    if start + end > h.size:
        raise TruncatedGGUFError(f"{path}: the file is truncated: {h.size} bytes, but its tensors need {start + end} "
                                 f"bytes (tensor {name!r}; an interrupted download or copy?)")
    for t in header.tensors:
        t.start += start
    return header


def check_gguf_header(data: Any, path: str) -> None:
    """:func:`read_gguf_header`, for its checks alone."""
    read_gguf_header(data, path)
