"""Output of a batch job, written in committed chunks.

Finished rows go to ``<output>.parts/part-NNNNNN.jsonl``, each part written to a temporary file and
renamed into place (a crash never leaves half a part). When the job ends, the existing output and
the parts are joined into ``<output>`` the same way, and the parts folder is removed. A re-run with
the same output reads the ids already written (in the output and in the parts) and skips them.
Bad rows go to ``<output>.errors.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def _atomic_write(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _ids_in(path: Path) -> list[str]:
    ids = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            if text.strip():
                ids.append(str(json.loads(text)["id"]))
    return ids


class ChunkedOutput:
    """Committed chunks of output rows, the ids already done, and the errors file."""

    def __init__(self, output: str | os.PathLike[str]) -> None:
        self.path = Path(output)
        self.parts = self.path.with_name(self.path.name + ".parts")
        self.errors_path = self.path.with_name(self.path.name + ".errors.jsonl")
        self._next = 0
        self.done: set[str] = set()
        if self.path.exists():
            self.done.update(_ids_in(self.path))
        if self.parts.is_dir():
            for part in sorted(self.parts.glob("part-*.jsonl")):
                self.done.update(_ids_in(part))
                self._next = max(self._next, int(part.stem.split("-")[1]) + 1)

    def commit(self, rows: list[dict[str, Any]]) -> None:
        """Write one chunk of finished rows for good."""
        if not rows:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.parts / f"part-{self._next:06d}.jsonl",
                      [json.dumps(r, ensure_ascii=False) + "\n" for r in rows])
        self._next += 1
        self.done.update(str(r["id"]) for r in rows)

    def finalize(self, errors: list[dict[str, Any]]) -> None:
        """Join the output and the parts into the output file; write the errors file."""
        if self.parts.is_dir():
            lines: list[str] = []
            if self.path.exists():
                with open(self.path, encoding="utf-8") as f:
                    lines.extend(line if line.endswith("\n") else line + "\n" for line in f if line.strip())
            for part in sorted(self.parts.glob("part-*.jsonl")):
                with open(part, encoding="utf-8") as f:
                    lines.extend(f.readlines())
            _atomic_write(self.path, lines)
            shutil.rmtree(self.parts)
        elif not self.path.exists():
            _atomic_write(self.path, [])
        if errors:
            _atomic_write(self.errors_path, [json.dumps(e, ensure_ascii=False) + "\n" for e in errors])
        elif self.errors_path.exists():
            self.errors_path.unlink()
