"""A streamer that writes one JSON object per line for every generation event.

Events (each line is a JSON object with an ``"event"`` key; times are seconds):

- ``{"event": "prompt", "batch": B, "length": L, "t": 0.0}`` — the prompt, once;
- ``{"event": "token", "row": r, "index": i, "token_id": id, "t": ..., "dt": ..., ["text": ...]}`` —
  every generated token; ``index`` counts the row's tokens from 0, ``t`` is the time since the
  prompt event and ``dt`` the time since the row's previous token (for the first token: the time to
  first token);
- ``{"event": "end", "tokens": n, "elapsed": s, "tokens_per_s": r, "ttft": s}`` — once, from ``end()``.

This module does not import torch: token ids are read with ``.tolist()``.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["JsonlStreamer", "make_jsonl_streamer"]


class JsonlStreamer:
    """Writes token events as JSON lines to ``file`` (a path, opened for appending, or a text stream;
    default standard output). With a ``tokenizer`` each token event carries its ``text``."""

    def __init__(self, file: str | os.PathLike[str] | TextIO | None = None, tokenizer: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._owns = False
        if file is None:
            self.stream: TextIO = sys.stdout
        elif isinstance(file, (str, os.PathLike)):
            self.stream = open(file, "a", encoding="utf-8")  # noqa: SIM115 - closed in end()
            self._owns = True
        elif isinstance(file, io.IOBase) or hasattr(file, "write"):
            self.stream = file
        else:
            raise ValueError(f"`file` must be a path, a text stream or None; got {type(file).__name__}")
        self.tokenizer = tokenizer
        self.clock = clock
        self._start: float | None = None
        self._last: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._ttft: float | None = None
        self._ended = False

    def _emit(self, event: dict[str, Any]) -> None:
        self.stream.write(json.dumps(event, ensure_ascii=False) + "\n")

    def _text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        try:
            return self.tokenizer.decode([token_id])
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode a lone id: leave the text out
            return None

    def put(self, value: Any) -> None:
        """Receive the prompt (first call, 2-D) or new tokens (1-D ``(batch,)`` or 2-D ``(1, n)``)."""
        ids = value.tolist() if hasattr(value, "tolist") else value
        now = self.clock()
        if self._start is None:
            self._start = now
            rows = ids if ids and isinstance(ids[0], list) else [ids]
            self._emit({"event": "prompt", "batch": len(rows), "length": len(rows[0]) if rows else 0, "t": 0.0})
            return
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], list):  # (1, n): several tokens of one row
            if len(ids) != 1:
                raise ValueError("JsonlStreamer.put takes new tokens as (batch,) or (1, n)")
            per_row = [(0, t) for t in ids[0]]
        else:
            per_row = list(enumerate(ids))
        t = now - self._start
        if self._ttft is None:
            self._ttft = t
        for row, token in per_row:
            index = self._count.get(row, 0)
            event: dict[str, Any] = {"event": "token", "row": row, "index": index, "token_id": int(token),
                                     "t": round(t, 6), "dt": round(now - self._last.get(row, self._start), 6)}
            text = self._text(int(token))
            if text is not None:
                event["text"] = text
            self._emit(event)
            self._count[row] = index + 1
            self._last[row] = now

    def end(self) -> None:
        """Write the summary event and flush (closing a file this streamer opened). Idempotent."""
        if self._ended:
            return
        self._ended = True
        elapsed = (self.clock() - self._start) if self._start is not None else 0.0
        total = sum(self._count.values())
        self._emit({"event": "end", "tokens": total, "elapsed": round(elapsed, 6),
                    "tokens_per_s": round(total / elapsed, 3) if elapsed > 0 else None,
                    "ttft": None if self._ttft is None else round(self._ttft, 6)})
        self.stream.flush()
        if self._owns:
            self.stream.close()


def make_jsonl_streamer(tokenizer: Any = None, **kwargs: Any) -> JsonlStreamer:
    """Factory used for ``streamer="jsonl"``: writes to ``file=`` if given, else to the path in
    ``$GENKIT_JSONL_PATH`` (appending), else to standard output."""
    unknown = set(kwargs) - {"file", "clock"}
    if unknown:
        raise ValueError(f"unknown argument(s) for the jsonl streamer: {sorted(unknown)}; accepted: file, clock")
    file = kwargs.get("file") or os.environ.get("GENKIT_JSONL_PATH") or None
    if "clock" in kwargs:
        return JsonlStreamer(file=file, tokenizer=tokenizer, clock=kwargs["clock"])
    return JsonlStreamer(file=file, tokenizer=tokenizer)
