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
"""Default byte limit of one JSONL input line (``genkit batch --max-line-bytes``)."""


def read_rows(path: str | os.PathLike[str], fmt: str | None = None,
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[BatchRow | BadRow]:
    """Every row of a JSONL or Parquet file (``fmt``, default: by extension) as a row or a bad row
    (a repeated id is a bad row, reported with the line of its first use). A bad row's ``line``
    is its line in a JSONL file, its row number (1-based) in a Parquet file. A JSONL line over
    ``max_line_bytes`` bytes, or not UTF-8, is a bad row (it is never held whole in memory)."""
    if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise ConfigError(f"`max_line_bytes` must be a positive integer; got {max_line_bytes!r}")
    fmt = fmt or file_format(path, "input")
    rows = _read_parquet(path) if fmt == "parquet" else _read_jsonl(path, max_line_bytes)
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


def _read_parquet(path: str | os.PathLike[str]) -> Iterator[BatchRow | BadRow]:
    pq = require_pyarrow()
    import pyarrow as pa

    n = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
        for batch in batches:
            for record in batch.to_pylist():
                n += 1
                yield parse_record(n, _parquet_record(record))
    except (pa.ArrowException, OSError) as exc:  # not Parquet, truncated, or corrupt past row n
        raise ConfigError(f"the input {os.fspath(path)!r} is not a readable Parquet file (after {n} rows): "
                          f"{exc}") from None


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
