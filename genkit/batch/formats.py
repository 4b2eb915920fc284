"""File formats of a batch job, chosen by extension: JSONL (``.jsonl``, ``.json``, ``.ndjson``) and
Parquet (``.parquet``, ``.pq``; needs ``pyarrow``, the ``parquet`` extra). Input and output formats
are independent (JSONL in, Parquet out is fine); the errors file is always JSONL.

Parquet output rows have a fixed schema: ``id`` string, ``text`` string, ``token_ids``
list<int64>, ``finish_reason`` string, ``usage`` struct<prompt_tokens, completion_tokens,
total_tokens: int64>.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from .rows import BadRow, BatchRow, parse_record, parse_row

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def file_format(path: str | os.PathLike[str], what: str = "file") -> str:
    """``"jsonl"`` or ``"parquet"`` from ``path``'s extension; ValueError naming the accepted ones."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"the {what} {os.fspath(path)!r} must end in one of {', '.join(FORMATS)} (JSONL or "
                          f"Parquet); got {ext or 'no extension'!r}")
    return FORMATS[ext]


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or an ImportError naming the extra to install."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("Parquet input or output needs pyarrow: pip install 'genkit-lm[parquet]' "
                          "(or 'genkit-lm[ray]')") from exc
    return pq


MAX_LINE_BYTES = 1_048_576
"""Default byte limit of one input row: a JSONL line, or the values of a Parquet row
(``genkit batch --max-line-bytes``)."""


def read_rows(path: str | os.PathLike[str], fmt: str | None = None,
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[BatchRow | BadRow]:
    """Every row of a JSONL or Parquet file (``fmt``, default: by extension) as a row or a bad row
    (a repeated id is a bad row, reported with the line of its first use). A bad row's ``line``
    is its line in a JSONL file, its row number (1-based) in a Parquet file. A JSONL line over
    ``max_line_bytes`` bytes, or not UTF-8, is a bad row (it is never held whole in memory); so is
    a Parquet row whose values hold more (it is never made into Python objects), and a Parquet row
    group that would decode to more than :data:`ROW_GROUP_LINES` times it is a ConfigError."""
    if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise ConfigError(f"`max_line_bytes` must be a positive integer; got {max_line_bytes!r}")
    fmt = fmt or file_format(path, "input")
    rows = _read_parquet(path, max_line_bytes) if fmt == "parquet" else _read_jsonl(path, max_line_bytes)
    seen: dict[str, int] = {}
    for row in rows:
        if isinstance(row, BatchRow):
            if row.id in seen:
                yield BadRow(row.line, row.id, f"duplicate id {row.id!r} (first used on line {seen[row.id]}); "
                                               "this row was not run")
                continue
            seen[row.id] = row.line
        yield row


def _read_jsonl(path: str | os.PathLike[str], max_line_bytes: int) -> Iterator[BatchRow | BadRow]:
    with open(path, "rb") as f:
        for n, raw in enumerate(_lines(f, max_line_bytes), 1):
            if raw is None:
                yield BadRow(n, None, f"the line is over the {max_line_bytes}-byte limit (--max-line-bytes); "
                                      "it was not read")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield BadRow(n, None, f"not UTF-8 text (byte {exc.start} of the line)")
                continue
            if text.strip():
                yield parse_row(n, text.removeprefix("\ufeff") if n == 1 else text)


def _lines(f: Any, limit: int) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with at most ``limit + 1`` bytes in memory; ``None``
    for a line over ``limit`` bytes (its rest is skipped in bounded reads)."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or (len(line) == limit + 1 and line.endswith(b"\n")):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # skip the rest of the long line
            line = f.readline(1 << 20)
        yield None


ROW_GROUP_LINES = 512
"""A Parquet row group may decode to at most this many times ``max_line_bytes`` (512 MiB by
default): it is read as a unit (:func:`_read_parquet`)."""

# rows turned into Python objects at once, at most (and at most this many bytes of values)
_ROWS_AT_ONCE, _BYTES_AT_ONCE = 1024, 16 << 20
# what one decoded value costs besides its bytes (an offset or a dictionary index, validity)
_VALUE_OVERHEAD = 8


def _read_parquet(path: str | os.PathLike[str], max_line_bytes: int) -> Iterator[BatchRow | BadRow]:
    """The rows of a Parquet file under the same per-row budget as a JSONL line. Each row group is
    checked from the file's metadata before it is read (:func:`_check_row_group`: its pages and
    values bound what decoding it takes), then read with its string and binary columns as
    dictionary arrays, so a value that many rows share is decoded once; each row's size is computed
    from Arrow's lengths (:func:`_value_bytes`) and only rows within ``max_line_bytes`` become
    Python objects, a few at a time. A row over it is a bad row, as an over-long JSONL line is."""
    pq = require_pyarrow()
    import pyarrow as pa

    n = 0
    try:
        plain = pq.ParquetFile(path)
        dictionary = _dictionary_columns(plain)
        parquet = pq.ParquetFile(path, read_dictionary=dictionary) if dictionary else plain
        limit = ROW_GROUP_LINES * max_line_bytes
        for group in range(parquet.metadata.num_row_groups):
            _check_row_group(path, parquet.metadata.row_group(group), group, limit, n)
            for batch in parquet.read_row_group(group).to_batches():
                for item in _batch_records(batch, max_line_bytes):
                    n += 1
                    if isinstance(item, int):
                        yield BadRow(n, None, f"the row is over the {max_line_bytes}-byte limit (--max-line-bytes): "
                                              f"its values hold {item} bytes; it was not read")
                    elif isinstance(item, str):
                        yield BadRow(n, None, f"{item}; the row was not read")
                    else:
                        yield parse_record(n, _parquet_record(item))
    except (pa.ArrowException, OSError) as exc:  # not Parquet, truncated, or corrupt past row n
        raise ConfigError(f"the input {os.fspath(path)!r} is not a readable Parquet file (after {n} rows): "
                          f"{exc}") from None


def _dictionary_columns(parquet: Any) -> list[str]:
    """The paths of the string and binary leaf columns that are dictionary-encoded in some row
    group: read as dictionary arrays, their values are decoded once, however many rows share them."""
    meta, schema = parquet.metadata, parquet.schema
    coded = {c for g in range(meta.num_row_groups) for c in range(meta.num_columns)
             if meta.row_group(g).column(c).has_dictionary_page}
    return [schema.column(c).path for c in sorted(coded)
            if schema.column(c).physical_type == "BYTE_ARRAY"
            and str(schema.column(c).logical_type).split("(")[0] in ("None", "String", "JSON", "Enum", "BSON")]


def _check_row_group(path: str | os.PathLike[str], group: Any, index: int, limit: int, before: int) -> None:
    """A row group is read as a unit: the bytes of its uncompressed pages (a compressed page of
    repeated data is small on disk and large decoded) and its values (run-length encoded levels and
    dictionary indices decode to many values from few bytes), as the file's metadata gives them,
    must stay within ``limit`` bytes, else a ConfigError naming the file and the limit."""
    chunks = [group.column(c) for c in range(group.num_columns)]
    pages = sum(max(int(c.total_uncompressed_size), 0) for c in chunks)
    values = sum(max(int(c.num_values), 0) for c in chunks)
    if pages + _VALUE_OVERHEAD * values > limit:
        raise ConfigError(
            f"the input {os.fspath(path)!r}: row group {index} (rows {before + 1} to {before + group.num_rows}) decodes "
            f"to about {pages + _VALUE_OVERHEAD * values} bytes ({pages} bytes of uncompressed pages and {values} "
            f"values), over the {limit}-byte limit on one row group ({ROW_GROUP_LINES} x --max-line-bytes); write the "
            "file with smaller row groups (pyarrow: pq.write_table(table, path, row_group_size=...)) or raise "
            "--max-line-bytes")


def _batch_records(batch: Any, max_line_bytes: int) -> Iterator[dict[str, Any] | int | str]:
    """The rows of a record batch in order: each row within ``max_line_bytes`` bytes as a dict, each
    row over it as its size (never made into Python objects), each row holding a value Python cannot
    represent as why (:func:`_row_or_error`)."""
    import pyarrow as pa

    sizes: Any = 0
    for column in batch.columns:
        sizes = _add(sizes, _value_bytes(column))
    per_row = sizes.to_pylist() if isinstance(sizes, pa.Array) else [sizes] * batch.num_rows
    start = 0
    while start < batch.num_rows:
        if per_row[start] > max_line_bytes:
            yield per_row[start]
            start += 1
            continue
        stop, held = start, 0
        while (stop < batch.num_rows and per_row[stop] <= max_line_bytes and stop - start < _ROWS_AT_ONCE
               and (held == 0 or held + per_row[stop] <= _BYTES_AT_ONCE)):
            held += per_row[stop]
            stop += 1
        try:
            rows = batch.slice(start, stop - start).to_pylist()
        except (OverflowError, ValueError):  # a value Python cannot hold (a date past year 9999): which rows
            rows = [_row_or_error(batch, i) for i in range(start, stop)]
        yield from rows
        start = stop


def _row_or_error(batch: Any, i: int) -> dict[str, Any] | str:
    """Row ``i`` of ``batch`` as a dict, or why a value of it cannot become a Python value."""
    try:
        return dict(batch.slice(i, 1).to_pylist()[0])
    except (OverflowError, ValueError):
        pass
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            column[i].as_py()
        except (OverflowError, ValueError) as exc:
            return f"column {name!r} holds a {column.type} value Python cannot represent ({exc})"
    return "a value cannot be read"


def _add(a: Any, b: Any) -> Any:
    """The sum of two sizes, each an int (the same for every row) or an int64 array (one per row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(a, pa.Array) or isinstance(b, pa.Array):
        return pc.add(a, b)
    return a + b


def _value_bytes(array: Any) -> Any:
    """The bytes each value of an Arrow ``array`` holds once decoded (string and binary bytes,
    fixed-width sizes, the sum of a list's or a struct's values, a dictionary's value taken by its
    index): an int64 array with one entry per value, or an int when every value has the same size.
    Computed from lengths and offsets: no value is decoded."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        sizes = _value_bytes(array.dictionary)  # (its overhead stands for the index's)
        return pc.take(sizes, array.indices).fill_null(0) if isinstance(sizes, pa.Array) else sizes
    if pa.types.is_null(kind):
        return 0
    if (pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind)
            or pa.types.is_large_binary(kind)):
        return pc.add(pc.binary_length(array).cast(pa.int64()).fill_null(0), _VALUE_OVERHEAD)
    if pa.types.is_struct(kind):
        total: Any = 0
        for child in array.flatten():
            total = _add(total, _value_bytes(child))
        return total
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        return _per_list(_value_bytes(array.values), array.offsets.cast(pa.int64()))
    if pa.types.is_fixed_size_list(kind):
        k = kind.list_size
        offsets = pa.array(range(array.offset * k, (array.offset + len(array)) * k + 1, k), pa.int64())
        return _per_list(_value_bytes(array.values), offsets)
    width = getattr(kind, "bit_width", 0)
    if width:
        return max(width // 8, 1)
    return -(-array.nbytes // max(len(array), 1))  # another type: its buffers shared out


def _per_list(child: Any, offsets: Any) -> Any:
    """The sizes of lists from the sizes of their values (``child``: one per value, or an int for
    all) and their ``offsets`` into those values (one more than the lists)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    starts, ends = offsets.slice(0, len(offsets) - 1), offsets.slice(1)
    if not isinstance(child, pa.Array):
        return pc.add(pc.multiply(pc.subtract(ends, starts), child), _VALUE_OVERHEAD)
    running = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(child.cast(pa.int64()))])
    return pc.add(pc.subtract(pc.take(running, ends), pc.take(running, starts)), _VALUE_OVERHEAD)


def _parquet_record(record: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as a JSONL row would be: null columns left out, ``messages`` stored as a JSON
    string decoded (left as the string, which the row check refuses, when it is not JSON)."""
    # a column some rows leave empty is null in the others: not a setting of theirs
    record = {k: v for k, v in record.items() if v is not None}
    if isinstance(record.get("messages"), str):  # messages stored as a JSON string
        try:
            record["messages"] = json.loads(record["messages"])
        except (ValueError, RecursionError):
            pass
    return record


def output_schema(prompt_logprobs: bool = False) -> Any:
    """The output rows' Parquet schema; a job that scores its prompts adds ``prompt_logprobs``
    (list<struct<token, logprob, rank, top: list<struct<token, logprob>>>>, its first item null)."""
    import pyarrow as pa

    fields = [("id", pa.string()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
              ("finish_reason", pa.string()), ("usage", pa.struct([(k, pa.int64()) for k in USAGE_KEYS]))]
    if prompt_logprobs:
        top = pa.list_(pa.struct([("token", pa.int64()), ("logprob", pa.float64())]))
        fields.append(("prompt_logprobs", pa.list_(pa.struct([("token", pa.int64()), ("logprob", pa.float64()),
                                                              ("rank", pa.int64()), ("top", top)]))))
    return pa.schema(fields)


def rows_table(rows: list[dict[str, Any]]) -> Any:
    """Output rows as a pyarrow Table of :func:`output_schema` (with ``prompt_logprobs`` where the
    rows have them: a job's rows all have them, or none)."""
    require_pyarrow()
    import pyarrow as pa

    schema = output_schema(any("prompt_logprobs" in r for r in rows))
    return pa.Table.from_pylist([{name: r.get(name) for name in schema.names} for r in rows], schema=schema)
