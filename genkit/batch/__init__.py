"""Batch generation over files of prompts (``genkit batch``): JSONL rows in, JSONL rows out, in
committed chunks that a re-run resumes from; bad rows go to an errors file. See docs/batch.md."""

from __future__ import annotations

from .engine import BatchEngine, LocalEngine
from .job import BatchSummary, run_batch
from .rows import BadRow, BatchRow, read_jsonl
from .store import ChunkedOutput

__all__ = ["BadRow", "BatchEngine", "BatchRow", "BatchSummary", "ChunkedOutput", "LocalEngine", "read_jsonl",
           "run_batch"]
