"""Output of a batch job, written in committed chunks (JSONL or Parquet, by the output's extension).

Finished rows go to ``<output>.parts/part-NNNNNN.jsonl`` (or ``.parquet``), each part written to a
temporary file and renamed into place (a crash never leaves half a part). When the job ends, the
existing output and the parts are joined into ``<output>`` the same way, and the parts folder is
removed. A re-run with the same output reads the ids already written (in the output and in the
parts) and skips them. The job's settings (what makes its rows: the model, the generation settings)
are kept beside the parts in ``<output>.parts/job.json``; a re-run that would add rows made with
other settings to them is refused. Bad rows go to ``<output>.errors.jsonl`` (JSONL whatever the
output format).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from genkit.errors import ConfigError, GenkitError
from genkit.fileutil import atomic_path, atomic_write_text

from .formats import file_format, output_schema, require_pyarrow, rows_table


class CorruptOutputError(GenkitError, ValueError):
    """A batch job's committed output (the output file or a part) cannot be read back to resume."""


def _ids_in(path: Path, fmt: str) -> list[str]:
    """The ids of a committed output file or part; a :class:`CorruptOutputError` naming the file
    (and the line) when it cannot be read back."""
    hint = "move it away (or repair it) and run the job again"
    if fmt == "parquet":
        pq = require_pyarrow()
        try:
            return [str(i) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()]
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors vary: the file is corrupt either way
            raise CorruptOutputError(f"{path}: the committed output cannot be read to resume ({type(exc).__name__}: "
                                     f"{exc}); {hint}") from exc
    ids = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                ids.append(str(record["id"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptOutputError(f"{path}:{n}: the committed output is corrupt ({type(exc).__name__}: not a "
                                         f"JSON object with an id); {hint}") from None
    return ids


class ErrorLog:
    """The bad rows of a run, appended as they come to a temporary file beside the errors file (a
    hostile input of a million bad lines costs disk, not memory: :func:`genkit.fileutil.atomic_path`,
    held open for the run), which :meth:`commit` renames into place when the job ends;
    :meth:`discard` drops it (an interrupted job)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self._file: Any = None
        self._open = contextlib.ExitStack()  # the temporary file's atomic_path, then the file itself

    def add(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self._open.enter_context(open(self._open.enter_context(atomic_path(self.path)), "w",
                                                       encoding="utf-8"))
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def commit(self) -> None:
        """Put this run's errors file in place; remove an earlier run's when this one had none."""
        if self._file is None:
            if self.path.exists():
                self.path.unlink()
            return
        self._file = None
        self._open.close()  # the file closed, then fsynced and renamed onto the errors file

    def discard(self) -> None:
        """Drop what was written (nothing once committed)."""
        if self._file is not None:
            self._file = None
            dropped = GenkitError("the run stopped: its bad rows are not committed")
            self._open.__exit__(type(dropped), dropped, None)  # atomic_path removes the temporary file


SETTINGS_FILE = "job.json"
"""The job's settings, kept in the parts folder beside the committed parts."""


class ChunkedOutput:
    """Committed chunks of output rows, the ids already done, and the errors file. ``settings``
    (JSON values) describe what makes the rows; a parts folder left by a run with other settings is
    refused (:class:`~genkit.errors.ConfigError`) rather than resumed. ``read_state=False`` makes
    only the checks (the folders, the settings), without reading back the ids already written."""

    def __init__(self, output: str | os.PathLike[str], settings: Mapping[str, Any] | None = None, *,
                 read_state: bool = True) -> None:
        self.path = Path(output)
        self.settings = None if settings is None else json.loads(json.dumps(settings, default=str))
        self.format = file_format(self.path, "output")
        if self.format == "parquet":
            require_pyarrow()
        self.ext = "parquet" if self.format == "parquet" else "jsonl"
        self.parts = self.path.with_name(self.path.name + ".parts")
        self.errors_path = self.path.with_name(self.path.name + ".errors.jsonl")
        self.errors = ErrorLog(self.errors_path)
        self._next = 0
        self.done: set[str] = set()
        self._check_parts_folder()
        self._check_settings()
        self._check_writable()
        if not read_state:
            return
        if self.path.exists():
            self.done.update(_ids_in(self.path, self.format))
        for part in self._part_files():
            self.done.update(_ids_in(part, self.format))
            self._next = max(self._next, int(part.stem.split("-")[1]) + 1)

    def _check_parts_folder(self) -> None:
        """The parts folder must be a real folder: never written through a symlink."""
        if self.parts.is_symlink() or (self.parts.exists() and not self.parts.is_dir()):
            raise CorruptOutputError(f"{self.parts} is a symlink or not a folder; genkit writes the job's parts "
                                     "only into a folder of its own: remove it and run the job again")

    def _check_settings(self) -> None:
        """Refuse to add rows made with other settings to the parts of an interrupted run."""
        record = self.parts / SETTINGS_FILE
        if self.settings is None or not record.is_file():
            return
        try:
            before = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise CorruptOutputError(f"{record}: the job's settings cannot be read ({type(exc).__name__}); move "
                                     f"{self.parts} away (or repair it) and run the job again") from None
        if not isinstance(before, dict):
            raise CorruptOutputError(f"{record}: the job's settings are not a JSON object; move {self.parts} away "
                                     "and run the job again")
        changed = [f"{key}: {before.get(key)!r} then, {self.settings.get(key)!r} now"
                   for key in sorted(set(before) | set(self.settings)) if before.get(key) != self.settings.get(key)]
        if changed:
            raise ConfigError(f"{self.parts} holds rows of an interrupted run with other settings ({'; '.join(changed)}"
                              f"); resume it with the same settings, or write to another output (or remove "
                              f"{self.parts} to start over)")

    def _check_writable(self) -> None:
        """Fail now, not after the first chunk's work, when the output's folder cannot be written."""
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".tmp-genkit-write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"the output {os.fspath(self.path)!r} cannot be written: its folder {os.fspath(folder)!r}"
                              f" is not writable ({exc.strerror or exc})") from None

    def _part_files(self) -> list[Path]:
        return sorted(self.parts.glob(f"part-*.{self.ext}")) if self.parts.is_dir() else []

    def commit(self, rows: list[dict[str, Any]]) -> None:
        """Write one chunk of finished rows for good."""
        if not rows:
            return
        self._check_parts_folder()
        if self.settings is not None and not (self.parts / SETTINGS_FILE).exists():
            atomic_write_text(self.parts / SETTINGS_FILE, json.dumps(self.settings, sort_keys=True) + "\n")
        part = self.parts / f"part-{self._next:06d}.{self.ext}"
        if self.format == "parquet":
            pq = require_pyarrow()
            with atomic_path(part) as tmp:
                pq.write_table(rows_table(rows), tmp)
        else:
            atomic_write_text(part, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._next += 1
        self.done.update(str(r["id"]) for r in rows)

    def finalize(self) -> None:
        """Join the output and the parts into the output file; put the errors file in place."""
        parts = self._part_files()
        if parts or not self.path.exists():
            sources = ([self.path] if self.path.exists() else []) + parts
            with atomic_path(self.path) as tmp:
                if self.format == "parquet":
                    _join_parquet(sources, tmp)
                else:
                    for error in _join_jsonl(sources, tmp):
                        self.errors.add(error)
        if self.parts.is_dir():
            shutil.rmtree(self.parts)
        self.errors.commit()


def _join_jsonl(sources: list[Path], target: str) -> list[dict[str, Any]]:
    """Join the JSONL ``sources`` into ``target``, each id once. A repeat of a row already written
    (a crash between the join's rename and the parts' removal leaves both) is dropped; a different
    row under an id already written is kept out too, and reported (the returned error records)."""
    seen: dict[str, bytes] = {}  # id -> its row's digest: the output is never held in memory
    repeats = []
    with open(target, "w", encoding="utf-8") as out:
        for source in sources:
            with open(source, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    rid = str(json.loads(line)["id"])
                    digest = hashlib.blake2b(line.rstrip("\n").encode("utf-8"), digest_size=16).digest()
                    if rid not in seen:
                        seen[rid] = digest
                        out.write(line if line.endswith("\n") else line + "\n")
                    elif seen[rid] != digest:
                        repeats.append({"line": n, "id": rid, "error": f"duplicate id {rid!r} in {source}: another "
                                        "row with this id is already in the output; this one was not written"})
    return repeats


def _join_parquet(sources: list[Path], target: str) -> None:
    import pyarrow as pa

    pq = require_pyarrow()
    # the job's schema: its parts all have the scored prompts' column, or none does
    schema = output_schema(any("prompt_logprobs" in pq.read_schema(source).names for source in sources))
    seen: set[str] = set()
    with pq.ParquetWriter(target, schema) as writer:
        for source in sources:
            for batch in pq.ParquetFile(source).iter_batches(batch_size=4096):
                keep = []
                for rid in batch.column("id").to_pylist():
                    keep.append(str(rid) not in seen)
                    seen.add(str(rid))
                if not all(keep):
                    batch = batch.filter(pa.array(keep))
                writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
