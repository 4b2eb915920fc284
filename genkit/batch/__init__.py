"""Batch generation over files of prompts (``genkit batch``): JSONL or Parquet rows in, JSONL or
Parquet rows out, in committed chunks that a re-run resumes from; bad rows go to an errors file.
The local engine runs continuous batching where it can, static left-padded batches otherwise.
See docs/batch.md."""

from __future__ import annotations

from .continuous import ContinuousEngine, make_local_engine
from .engine import BatchEngine, LocalEngine
from .formats import read_rows
from .job import BatchSummary, run_batch
from .rows import BadRow, BatchRow, read_jsonl
from .store import ChunkedOutput

__all__ = ["BadRow", "BatchEngine", "BatchRow", "BatchSummary", "ChunkedOutput", "ContinuousEngine", "LocalEngine",
           "make_local_engine", "read_jsonl", "read_rows", "run_batch"]
