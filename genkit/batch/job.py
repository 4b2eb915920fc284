"""A batch job: read rows, skip those already written, generate in chunks, commit each chunk,
report bad rows, and count everything."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError
from .engine import BatchEngine
from .formats import MAX_LINE_BYTES, file_format, read_rows
from .rows import BadRow, BatchRow
from .store import ChunkedOutput

logger = logging.getLogger("genkit.batch")


@dataclass
class BatchSummary:
    """What a job did: rows read, written now, skipped (already in the output), bad (in the
    errors file), tokens generated, seconds, and the rates. While the job runs, ``done`` and
    ``done_tokens`` also count the results not yet committed (they are not in :meth:`to_dict`)."""

    rows_read: int = 0
    written: int = 0
    skipped: int = 0
    bad: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    done: int = field(default=0, repr=False)
    done_tokens: int = field(default=0, repr=False)

    @property
    def rows_per_s(self) -> float:
        return self.written / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        counts = {k: v for k, v in asdict(self).items() if k not in ("done", "done_tokens")}
        return {**counts, "rows_per_s": round(self.rows_per_s, 2), "tokens_per_s": round(self.tokens_per_s, 2)}


def run_batch(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str], engine: BatchEngine,
              chunk_size: int = 256, progress: Callable[[BatchSummary], None] | None = None,
              on_result: Callable[[BatchSummary], None] | None = None,
              max_line_bytes: int = MAX_LINE_BYTES, settings: Mapping[str, Any] | None = None) -> BatchSummary:
    """Run ``engine`` over the rows of ``input_path`` into ``output_path`` (JSONL or Parquet, each by
    its extension; see :mod:`genkit.batch.store` for how the output is committed and resumed); bad
    rows go to ``<output>.errors.jsonl``. ``progress`` is called with the summary after every
    committed chunk, ``on_result`` after every row's result (committed or not: see
    :attr:`BatchSummary.done`).

    An engine with a ``stream(rows)`` method (results in input order, as they come) gets every
    pending row of the job at once (one pipeline, no drain between chunks); otherwise ``run`` is
    called on each chunk of ``chunk_size`` rows. Either way every ``chunk_size`` results are
    committed as one chunk.

    A JSONL input line over ``max_line_bytes`` bytes (default 1 MiB), or not UTF-8, is a bad row.
    ``settings`` (JSON values: the model, the generation settings, ...) are recorded beside the
    committed chunks; resuming them with other settings is a :class:`~genkit.errors.ConfigError`
    (the rows would mix). The output must not be the input. On Ctrl-C the chunks committed so far stay, and a warning says how to resume (run the same
    job again)."""
    if chunk_size < 1:
        raise ConfigError(f"`chunk_size` must be >= 1; got {chunk_size}")
    file_format(input_path, "input")
    _check_paths(input_path, output_path)
    job = _Job(ChunkedOutput(output_path, settings), progress, on_result)
    try:
        try:
            for result in _results(engine, job.pending(input_path, max_line_bytes), chunk_size):
                job.take(result)
                if job.taken >= chunk_size:
                    job.commit()
            if job.taken:
                job.commit()
        except KeyboardInterrupt:
            logger.warning("interrupted: %d rows are committed under %s; run the same job again (same input and "
                           "output) to resume where it stopped", len(job.out.done), job.out.parts)
            raise
        job.out.finalize()
    finally:
        job.out.errors.discard()  # an interrupted run's errors (its bad rows are found again when it resumes)
    job.summary.seconds = time.perf_counter() - job.start
    logger.info("batch job: %s", job.summary.to_dict())
    return job.summary


def check_job(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str],
              settings: Mapping[str, Any] | None = None) -> None:
    """The checks :func:`run_batch` makes before any row runs (the formats, the input readable, the
    output another file in a writable folder, an interrupted run's settings the same), for a caller
    to make before it loads a model."""
    file_format(input_path, "input")
    with open(input_path, "rb"):
        pass
    _check_paths(input_path, output_path)
    ChunkedOutput(output_path, settings, read_state=False)


def _check_paths(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str]) -> None:
    """The output must be another file than the input: an existing output is resumed, so the
    input's rows would be taken for rows already written."""
    same = os.path.realpath(input_path) == os.path.realpath(output_path)
    if not same and os.path.exists(input_path) and os.path.exists(output_path):
        same = os.path.samefile(input_path, output_path)
    if same:
        raise ConfigError(f"the output {os.fspath(output_path)!r} is the input file: an existing output is resumed "
                          "(its rows are taken as done), so write to another file")


class _Job:
    """One run of :func:`run_batch`: the output, the summary, the bad rows, and the chunk of
    results not committed yet."""

    def __init__(self, out: ChunkedOutput, progress: Callable[[BatchSummary], None] | None,
                 on_result: Callable[[BatchSummary], None] | None) -> None:
        self.out, self.progress, self.on_result = out, progress, on_result
        self.summary = BatchSummary()
        self.start = time.perf_counter()
        self.good: list[dict[str, Any]] = []
        self.chunk_ids: set[str] = set()
        self.taken = 0

    def pending(self, input_path: str | os.PathLike[str], max_line_bytes: int) -> Iterator[BatchRow]:
        """The rows still to run: bad rows are recorded, rows already in the output skipped."""
        summary = self.summary
        for row in read_rows(input_path, max_line_bytes=max_line_bytes):
            summary.rows_read += 1
            if isinstance(row, BadRow):
                self.out.errors.add(row.to_json())
                summary.bad += 1
            elif row.id in self.out.done:
                summary.skipped += 1
            else:
                yield row

    def take(self, result: dict[str, Any] | BadRow) -> None:
        """One result of the engine into the current chunk (or the bad rows)."""
        summary = self.summary
        self.taken += 1
        if isinstance(result, BadRow):
            self.out.errors.add(result.to_json())
            summary.bad += 1
        elif str(result["id"]) not in self.out.done and str(result["id"]) not in self.chunk_ids:
            self.good.append(result)  # (an engine that ran a row twice, e.g. on a retry, writes it once)
            self.chunk_ids.add(str(result["id"]))
            summary.done_tokens += result["usage"]["completion_tokens"]
        summary.done = summary.written + len(self.good) + summary.bad
        if self.on_result is not None:
            summary.seconds = time.perf_counter() - self.start
            self.on_result(summary)

    def commit(self) -> None:
        """Commit the current chunk and report progress."""
        summary = self.summary
        self.out.commit(self.good)
        summary.written += len(self.good)
        summary.new_tokens += sum(r["usage"]["completion_tokens"] for r in self.good)
        summary.seconds = time.perf_counter() - self.start
        summary.done = summary.written + summary.bad
        self.good.clear()
        self.chunk_ids.clear()
        self.taken = 0
        if self.progress is not None:
            self.progress(summary)


def _results(engine: BatchEngine, rows: Iterator[BatchRow], chunk_size: int) -> Iterator[dict[str, Any] | BadRow]:
    stream = getattr(engine, "stream", None)
    if stream is not None:
        yield from stream(rows)
        return
    while True:
        chunk = list(itertools.islice(rows, chunk_size))
        if not chunk:
            return
        yield from engine.run(chunk)
