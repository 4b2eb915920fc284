"""A bounded pre-check of a GGUF file's header, before the ``gguf`` package parses it.

``gguf.GGUFReader`` builds several numpy objects per metadata array element and per tensor, and
trusts every count, length and offset: a small file that claims millions of elements takes
minutes and gigabytes, and an offset near 2**64 wraps below the data section. :func:`check_gguf_header`
walks the header first, in bounded time and memory: every count and length is checked against
the bytes left in the file and the limits of :mod:`genkit.models.limits`; keys and tensor names
must be unique UTF-8, tensor types known, shapes whole blocks, offsets aligned and every tensor's
bytes inside the data section. Anything else is a :class:`~genkit.errors.ModelFileError` (or a
:class:`TruncatedGGUFError` / :class:`UnknownGGUFTypeError`) naming the file, the field and the limit.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import ModelFileError
from .limits import limit, over

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 65_535
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


class TruncatedGGUFError(ModelFileError):
    """The file ends before the data its header describes."""


class UnknownGGUFTypeError(ModelFileError):
    """A tensor's GGUF type is not one the installed ``gguf`` package knows."""


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

    def string(self, field: str, max_bytes: int | None = None) -> bytes:
        n = self.u64(field)
        if max_bytes is not None and n > max_bytes:
            raise ModelFileError(f"{self.path}: {field} is {n} bytes long; the limit is {max_bytes}")
        start = self.take(n, field)
        raw = bytes(self.data[start:start + n])
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: {field} is not valid UTF-8") from None
        return raw

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
            return self.data[start:start + _SCALAR_SIZES[vtype]]
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
            self.take(n * _SCALAR_SIZES[itype], f"the {n} elements of {key!r}")
            return None
        self.count(f"the array length of {key!r}", n, 8, "gguf_array_elements")
        for _ in range(n):
            self.value(key, itype, in_array=True)
        return None


def _quant_sizes() -> dict[int, tuple[int, int]]:
    import gguf

    return {int(t): (int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}


def _tensor_info(h: _Header, i: int, sizes: dict[int, tuple[int, int]], alignment: int) -> tuple[str, int, int]:
    name = h.string(f"the name of tensor #{i}", MAX_NAME_BYTES).decode("utf-8")
    n_dims = h.u32(f"the dimension count of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise ModelFileError(f"{h.path}: tensor {name!r} has {n_dims} dimensions; the limit is {MAX_DIMS}")
    dims = [h.u64(f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
    ttype = h.u32(f"the type of tensor {name!r}")
    offset = h.u64(f"the offset of tensor {name!r}")
    if ttype not in sizes:
        raise UnknownGGUFTypeError(
            f"{h.path}: tensor {name!r} has GGUF tensor type {ttype}, which the installed gguf package does not know "
            "(a newer quantization format? upgrading `gguf` may help)")
    block, type_size = sizes[ttype]
    if any(d == 0 for d in dims) or (dims and dims[0] % block):
        raise ModelFileError(f"{h.path}: tensor {name!r} has shape {dims}: dimensions must be positive and the first "
                             f"a multiple of its type's block of {block}")
    numel = 1
    for d in dims:
        numel *= d
    if offset % alignment:
        raise ModelFileError(f"{h.path}: tensor {name!r} has offset {offset}, not a multiple of the alignment "
                             f"{alignment}")
    return name, offset, numel // block * type_size


def check_gguf_header(data: Any, path: str) -> None:
    """Walk the GGUF header in ``data`` (bytes or a memory map of the whole file); raise a
    :class:`~genkit.errors.ModelFileError` naming the field at the first count, length or offset
    that does not fit the file or the limits."""
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
    alignment, keys = 32, set()
    for i in range(n_kv):
        key = h.string(f"metadata key #{i}", MAX_NAME_BYTES).decode("utf-8")
        if key in keys:
            raise ModelFileError(f"{path}: metadata key {key!r} appears twice")
        keys.add(key)
        vtype = h.u32(f"the value type of {key!r}")
        value = h.value(key, vtype)
        if key == "general.alignment":
            alignment = int.from_bytes(value, "little") if vtype == 4 else 0
            if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 16:
                raise ModelFileError(f"{path}: `general.alignment` must be a uint32 power of two up to 65536")
    sizes, names, spans = _quant_sizes(), set(), []
    for i in range(n_tensors):
        name, offset, nbytes = _tensor_info(h, i, sizes, alignment)
        if name in names:
            raise ModelFileError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        spans.append((offset + nbytes, name))
    start = -(-h.pos // alignment) * alignment
    end, name = max(spans, default=(0, ""))
    if start + end > h.size:
        raise TruncatedGGUFError(f"{path}: the file is truncated: {h.size} bytes, but its tensors need {start + end} "
                                 f"bytes (tensor {name!r}; an interrupted download or copy?)")
