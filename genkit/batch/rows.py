"""Input rows of a batch job: JSONL lines ``{"id": ..., "prompt": ...}`` or ``{"id": ...,
"messages": [...]}`` with optional per-row generation fields. A row that cannot run is reported
(with its line number and id) instead of stopping the job."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ROW_KEYS = ("id", "prompt", "messages")


@dataclass
class BatchRow:
    """One valid input row: its id, its line (1-based), its prompt or chat messages, and its own
    generation settings."""

    id: str
    line: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class BadRow:
    """A row that cannot run: its line, its id when it has one, and why."""

    line: int
    id: str | None
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "error": self.error}


def parse_row(line_no: int, text: str) -> BatchRow | BadRow:
    """A row from one JSONL line. Rows without ``id`` are named by their line number."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        return BadRow(line_no, None, f"not a JSON object: {exc}")
    except RecursionError:
        return BadRow(line_no, None, "not a JSON object: nested too deeply")
    if not isinstance(data, dict):
        return BadRow(line_no, None, f"not a JSON object: {type(data).__name__}")
    return parse_record(line_no, data)


def parse_record(line_no: int, data: dict[str, Any]) -> BatchRow | BadRow:
    """A row from a decoded record (a JSON object, or a row of a Ray dataset)."""
    rid = data.get("id", line_no)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        return BadRow(line_no, None, f"`id` must be a string or an int; got {rid!r}")
    rid = str(rid)
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is None and messages is None:
        return BadRow(line_no, rid, "the row has neither `prompt` nor `messages`")
    if prompt is not None and messages is not None:
        return BadRow(line_no, rid, "give either `prompt` or `messages`, not both")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        return BadRow(line_no, rid, f"`prompt` must be a non-empty string; got {prompt!r}")
    if messages is not None and (not isinstance(messages, list) or not messages
                                 or not all(isinstance(m, dict) and "role" in m and "content" in m
                                            for m in messages)):
        return BadRow(line_no, rid, "`messages` must be a non-empty list of {\"role\", \"content\"} objects")
    settings = {k: v for k, v in data.items() if k not in ROW_KEYS}
    if settings:
        error = check_settings(settings)
        if error:
            return BadRow(line_no, rid, error)
    return BatchRow(rid, line_no, prompt, messages, settings)


def check_settings(settings: dict[str, Any]) -> str | None:
    """None when the row's generation fields are valid, else the error."""
    from genkit.generation.api import merge_config

    try:
        merge_config(None, None, dict(settings))
    except Exception as exc:  # noqa: BLE001 - any invalid value is the row's error
        return f"invalid generation field: {exc}"
    return None


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[BatchRow | BadRow]:
    """Every non-blank line of ``path`` as a row or a bad row; a repeated id is a bad row."""
    from .formats import read_rows

    return read_rows(path, "jsonl")
