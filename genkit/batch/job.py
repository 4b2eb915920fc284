"""A batch job: read rows, skip those already written, generate in chunks, commit each chunk,
report bad rows, and count everything."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .engine import BatchEngine
from .rows import BadRow, BatchRow, read_jsonl
from .store import ChunkedOutput

logger = logging.getLogger("genkit.batch")


@dataclass
class BatchSummary:
    """What a job did: rows read, written now, skipped (already in the output), bad (in the
    errors file), tokens generated, seconds, and the rates."""

    rows_read: int = 0
    written: int = 0
    skipped: int = 0
    bad: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.written / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows_per_s": round(self.rows_per_s, 2), "tokens_per_s": round(self.tokens_per_s, 2)}


def run_batch(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], engine: BatchEngine,
              chunk_size: int = 256, progress: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Run ``engine`` over the JSONL rows of ``input_path`` into ``output_path`` (see
    :mod:`genkit.batch.store` for how the output is committed and resumed); bad rows go to
    ``<output>.errors.jsonl``. ``progress`` is called after every chunk."""
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be >= 1; got {chunk_size}")
    out = ChunkedOutput(output_path)
    summary = BatchSummary()
    errors: list[dict[str, Any]] = []
    pending: list[BatchRow] = []
    start = time.perf_counter()

    def flush() -> None:
        results = engine.run(pending)
        good = [r for r in results if not isinstance(r, BadRow)]
        for r in results:
            if isinstance(r, BadRow):
                errors.append(r.to_json())
        out.commit(good)
        summary.written += len(good)
        summary.bad += len(results) - len(good)
        summary.new_tokens += sum(r["usage"]["completion_tokens"] for r in good)
        summary.seconds = time.perf_counter() - start
        pending.clear()
        if progress is not None:
            progress(summary)

    for row in read_jsonl(input_path):
        summary.rows_read += 1
        if isinstance(row, BadRow):
            errors.append(row.to_json())
            summary.bad += 1
        elif row.id in out.done:
            summary.skipped += 1
        else:
            pending.append(row)
            if len(pending) >= chunk_size:
                flush()
    if pending:
        flush()
    out.finalize(errors)
    summary.seconds = time.perf_counter() - start
    logger.info("batch job: %s", summary.to_dict())
    return summary
