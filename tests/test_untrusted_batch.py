"""issue 28, batch inputs: oversize and non-UTF-8 lines go to the errors file with their line
number while the job goes on (every good row written exactly once); duplicate ids are reported;
corrupt resume state names the file; the parts folder is never written through a symlink; files
honour the umask; Ctrl-C says how to resume."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from test_batch import _read, _reference, _write_rows, tokenizer  # noqa: F401

from genkit.batch import LocalEngine, run_batch
from genkit.batch.formats import MAX_LINE_BYTES
from genkit.batch.store import CorruptOutputError
from genkit.cli import main as cli
from genkit.errors import ConfigError, GenkitError
from genkit.models.tiny import tiny_llama


@pytest.fixture
def engine(tokenizer):  # noqa: F811
    return LocalEngine(tiny_llama(seed=0), tokenizer, {"max_new_tokens": 3}, batch_size=4)


def _errors(out) -> list[dict]:
    path = out.with_name(out.name + ".errors.jsonl")
    return _read(path) if path.exists() else []


def test_oversize_and_invalid_utf8_lines_are_reported_and_the_job_goes_on(tmp_path, engine, tokenizer):  # noqa: F811
    rows = _write_rows(tmp_path / "good.jsonl", 6)
    lines = [json.dumps(r).encode() for r in rows]
    huge = json.dumps({"id": "huge", "prompt": "alpha " * 2_000_000}).encode()  # 12 MB, one line
    data = [lines[0], huge, lines[1], b'{"id": "bad", "prompt": "caf\xe9"}', lines[2],
            b"\xff\xfe\x00garbage", lines[3], lines[4], lines[5]]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(data) + b"\n")
    out = tmp_path / "out.jsonl"
    summary = run_batch(tmp_path / "in.jsonl", out, engine, chunk_size=2)
    got = _read(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # each good row exactly once
    for src, row in zip(rows, got):
        assert row["token_ids"] == _reference(engine.model, tokenizer, src["prompt"], 3)
    errors = _errors(out)
    assert [(e["line"], e["error"]) for e in errors] == [
        (2, f"the line is over the {MAX_LINE_BYTES}-byte limit (--max-line-bytes); it was not read"),
        (4, "not UTF-8 text (byte 28 of the line)"), (6, "not UTF-8 text (byte 0 of the line)")]
    assert (summary.rows_read, summary.written, summary.bad) == (9, 6, 3)


def test_the_line_limit_is_a_setting(tmp_path, engine):
    rows = _write_rows(tmp_path / "in.jsonl", 3)
    limit = len(json.dumps(rows[0]))  # exactly the first line (its newline not counted)
    out = tmp_path / "out.jsonl"
    run_batch(tmp_path / "in.jsonl", out, engine, max_line_bytes=limit)
    longer = {r["id"] for r in rows if len(json.dumps(r)) > limit}
    assert {r["id"] for r in _read(out)} == {r["id"] for r in rows} - longer
    assert len(_errors(out)) == len(longer)
    with pytest.raises(ConfigError, match=r"`max_line_bytes` must be a positive integer; got 0"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "o2.jsonl", engine, max_line_bytes=0)


def test_duplicate_ids_are_reported_never_silently_dropped(tmp_path, engine):
    rows = _write_rows(tmp_path / "in.jsonl", 4, extra=[json.dumps({"id": "r1", "prompt": "kilo lima"})])
    out = tmp_path / "out.jsonl"
    # an existing output that already holds a different row under id r9 twice
    out.write_text(json.dumps({"id": "r9", "text": "a", "token_ids": [], "finish_reason": "length"}) + "\n"
                   + json.dumps({"id": "r9", "text": "b", "token_ids": [], "finish_reason": "length"}) + "\n")
    run_batch(tmp_path / "in.jsonl", out, engine)
    assert [r["id"] for r in _read(out)] == ["r9"] + [r["id"] for r in rows]
    errors = _errors(out)
    assert {(e["line"], e["id"]) for e in errors} == {(5, "r1"), (2, "r9")}
    assert any("duplicate id 'r1' (first used on line 2)" in e["error"] for e in errors)
    assert any(f"duplicate id 'r9' in {out}" in e["error"] for e in errors)


def test_corrupt_resume_state_names_the_file(tmp_path, engine):
    _write_rows(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    (parts / "part-000000.jsonl").write_text(json.dumps({"id": "r0"}) + "\n{not json\n")
    with pytest.raises(CorruptOutputError, match=r"out\.jsonl\.parts/part-000000\.jsonl:2: the committed output is "
                                                 r"corrupt") as err:
        run_batch(tmp_path / "in.jsonl", out, engine)
    assert isinstance(err.value, GenkitError)
    (parts / "part-000000.jsonl").write_bytes(b'{"id": "r0"}\n\xff\n')
    with pytest.raises(CorruptOutputError, match=r"part-000000\.jsonl:2"):
        run_batch(tmp_path / "in.jsonl", out, engine)
    (parts / "part-000000.jsonl").unlink()
    out.write_text('{"no_id": 1}\n')
    with pytest.raises(CorruptOutputError, match=r"out\.jsonl:1: the committed output is corrupt"):
        run_batch(tmp_path / "in.jsonl", out, engine)


def test_a_symlinked_parts_folder_is_never_written_through(tmp_path, engine):
    _write_rows(tmp_path / "in.jsonl", 4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out.jsonl.parts").symlink_to(elsewhere)
    with pytest.raises(CorruptOutputError, match=r"out\.jsonl\.parts is a symlink"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine, chunk_size=1)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_honour_the_umask(tmp_path, engine, umask):
    _write_rows(tmp_path / "in.jsonl", 2, extra=["not json"])
    old = os.umask(umask)
    try:
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    finally:
        os.umask(old)
    for name in ("out.jsonl", "out.jsonl.errors.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


class _Interrupting:
    def __init__(self, inner, after: int) -> None:
        self.inner, self.after = inner, after

    def run(self, rows):
        if self.after == 0:
            raise KeyboardInterrupt
        self.after -= 1
        return self.inner.run(rows)


def test_ctrl_c_says_how_to_resume(tmp_path, engine, caplog):
    rows = _write_rows(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.WARNING, logger="genkit.batch"), pytest.raises(KeyboardInterrupt):
        run_batch(tmp_path / "in.jsonl", out, _Interrupting(engine, 1), chunk_size=2)
    assert "interrupted: 2 rows are committed under" in caplog.text and "run the same job again" in caplog.text
    run_batch(tmp_path / "in.jsonl", out, engine, chunk_size=2)
    assert [r["id"] for r in _read(out)] == [r["id"] for r in rows]


def test_the_cli_takes_max_line_bytes(capsys):
    import argparse

    from genkit.cli.batch_cmd import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--max-line-bytes", "4096"])
    assert args.max_line_bytes == 4096
    assert parser.parse_args(["batch", "in.jsonl", "out.jsonl"]).max_line_bytes is None  # run_batch's default
    with pytest.raises(SystemExit):
        cli(["batch", "--help"])
    assert f"(default: {MAX_LINE_BYTES}, 1 MiB)" in " ".join(capsys.readouterr().out.split())


def test_a_deeply_nested_line_is_a_bad_row_and_the_job_goes_on(tmp_path, engine):
    deep = '{"id": "deep", "prompt": ' + "[" * 200_000 + "]" * 200_000 + "}"  # 400 kB: under the line limit
    rows = _write_rows(tmp_path / "in.jsonl", 3, extra=[deep, "[" * 300_000])
    out = tmp_path / "out.jsonl"
    summary = run_batch(tmp_path / "in.jsonl", out, engine)
    assert [r["id"] for r in _read(out)] == [r["id"] for r in rows]
    assert [(e["line"], e["error"]) for e in _errors(out)] == [(4, "not a JSON object: nested too deeply"),
                                                               (5, "not a JSON object: nested too deeply")]
    assert (summary.written, summary.bad) == (3, 2)


def test_a_file_that_is_not_parquet_is_a_config_error_naming_it(tmp_path, engine):
    pytest.importorskip("pyarrow")
    for name, data in [("empty.parquet", b""), ("garbage.parquet", b"PAR1 not really PAR1")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"the input '.*{name}' is not a readable Parquet file \(after 0 rows\)"):
            run_batch(tmp_path / name, tmp_path / "out.jsonl", engine)
    assert not (tmp_path / "out.jsonl").exists()


def test_deeply_nested_parquet_messages_are_a_bad_row(tmp_path, engine):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": ["deep", "ok"], "prompt": [None, "alpha bravo"],
                             "messages": ["[" * 100_000, None]}), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    run_batch(tmp_path / "in.parquet", out, engine)
    assert [r["id"] for r in _read(out)] == ["ok"]
    assert [(e["line"], e["id"]) for e in _errors(out)] == [(1, "deep")]
    assert "`messages` must be a non-empty list" in _errors(out)[0]["error"]


@pytest.mark.parametrize(("kind", "value", "why"), [
    ("date32", 2**31 - 1, "days=2147483647; must have magnitude <= 999999999"),
    ("duration", 2**62, "Python int too large to convert to C int")])
def test_a_parquet_value_python_cannot_hold_is_a_bad_row(tmp_path, engine, kind, value, why):
    """(fuzzing Parquet input) a date past year 9999 or a huge duration made the whole job fail with
    a bare OverflowError from pyarrow's to_pylist; it is the row's error, the other rows run"""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    kinds = {"date32": pa.date32(), "duration": pa.duration("s")}
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["alpha", "bravo", "charlie"],
                             "when": pa.array([None, value, None], kinds[kind])}), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    summary = run_batch(tmp_path / "in.parquet", out, engine)
    assert [r["id"] for r in _read(out)] == ["a", "c"] and (summary.written, summary.bad) == (2, 1)
    assert _errors(out) == [{"line": 2, "id": None, "error": f"column 'when' holds a {kinds[kind]} value Python cannot "
                                                            f"represent ({why}); the row was not read"}]
