"""Choosing the server's engine."""

from __future__ import annotations

from typing import Any

from .engine import GenerateEngine


def make_engine(model: Any, tokenizer: Any, *, scheduler: str | None = None,
                max_batch_tokens: int | None = None) -> Any:
    """The engine for ``genkit serve``: requests run one at a time through ``genkit.generate``."""
    if scheduler is not None or max_batch_tokens is not None:
        raise ValueError("--scheduler and --max-batch-tokens need the continuous batching engine, which this "
                         "genkit does not have yet (issue 14)")
    return GenerateEngine(model, tokenizer)
