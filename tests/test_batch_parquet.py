"""``genkit batch`` with Parquet input and output (issue 17): the same rows as JSONL, mixed formats,
bad rows by row number, committed Parquet parts and resume, the error without pyarrow."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_batch import _Crash, _CrashingStream, _model_folder, _raw_tokenizer, _read, _write_rows

from genkit.batch import ContinuousEngine, LocalEngine, run_batch
from genkit.models.tiny import tiny_llama


@pytest.fixture
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _to_parquet(rows: list[dict], path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, null where a row has none
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), path)


def _engine(tokenizer, new=4):
    return ContinuousEngine(tiny_llama(seed=0), tokenizer, {"max_new_tokens": new}, batch_size=4)


def test_parquet_in_and_out_equal_jsonl(tmp_path, tokenizer):
    rows = _write_rows(tmp_path / "in.jsonl", 30, seed=3)
    rows[4]["max_new_tokens"] = 2  # a per-row field: a column, null in the other rows
    _to_parquet(rows, tmp_path / "in.parquet")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = _engine(tokenizer)
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine, chunk_size=8)
    summary = run_batch(tmp_path / "in.parquet", tmp_path / "out.parquet", engine, chunk_size=8)
    assert (summary.written, summary.bad) == (30, 0)
    expected = _read(tmp_path / "out.jsonl")
    assert len(expected[4]["token_ids"]) == 2
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("token_ids").type == pa.list_(pa.int64())
    assert table.schema.field("usage").type == pa.struct([("prompt_tokens", pa.int64()),
                                                          ("completion_tokens", pa.int64()),
                                                          ("total_tokens", pa.int64())])
    assert table.to_pylist() == expected
    assert not (tmp_path / "out.parquet.parts").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []
    # mixed: JSONL in, Parquet out; Parquet in, JSONL out
    run_batch(tmp_path / "in.jsonl", tmp_path / "mixed.parquet", engine, chunk_size=8)
    assert pq.read_table(tmp_path / "mixed.parquet").to_pylist() == expected
    run_batch(tmp_path / "in.parquet", tmp_path / "mixed.jsonl", engine, chunk_size=8)
    assert _read(tmp_path / "mixed.jsonl") == expected


def test_bad_parquet_rows_are_reported_by_row_number(tmp_path, tokenizer):
    rows = [{"id": "ok", "prompt": "alpha bravo", "top_k": None, "messages": None},
            {"id": "no-prompt", "prompt": None, "top_k": None, "messages": None},
            {"id": "bad-k", "prompt": "alpha", "top_k": -3, "messages": None},
            {"id": "ok", "prompt": "charlie", "top_k": None, "messages": None},
            {"id": "chat", "prompt": None, "top_k": None, "messages": [{"role": "user", "content": "delta"}]},
            {"id": "empty", "prompt": "", "top_k": None, "messages": None}]
    _to_parquet(rows, tmp_path / "in.parquet")
    from genkit.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}echo{% endif %}"
    tok = Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "chat_template": template})
    model = tiny_llama(seed=0)
    summary = run_batch(tmp_path / "in.parquet", tmp_path / "out.parquet",
                        ContinuousEngine(model, tok, {"max_new_tokens": 3}))
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["id"] for r in out] == ["ok", "chat"]
    (tmp_path / "ref.jsonl").write_text(json.dumps({"id": "chat", "prompt": "delta echo"}) + "\n")
    run_batch(tmp_path / "ref.jsonl", tmp_path / "ref.jsonl.out.jsonl", LocalEngine(model, tok, {"max_new_tokens": 3}))
    assert out[1]["token_ids"] == _read(tmp_path / "ref.jsonl.out.jsonl")[0]["token_ids"]  # list<struct> messages
    errors = {e["line"]: e for e in _read(tmp_path / "out.parquet.errors.jsonl")}
    assert sorted(errors) == [2, 3, 4, 6]
    assert errors[2]["id"] == "no-prompt" and "neither `prompt` nor `messages`" in errors[2]["error"]
    assert errors[3]["id"] == "bad-k" and "top_k" in errors[3]["error"]
    assert "duplicate id 'ok'" in errors[4]["error"]
    assert errors[6]["id"] == "empty" and "non-empty string" in errors[6]["error"]
    assert (summary.rows_read, summary.written, summary.bad) == (6, 2, 4)


def test_parquet_resume_writes_only_the_missing_rows(tmp_path, tokenizer):
    rows = _write_rows(tmp_path / "in.jsonl", 25, seed=9)
    _to_parquet(rows, tmp_path / "in.parquet")
    engine = _engine(tokenizer)
    with pytest.raises(_Crash):
        run_batch(tmp_path / "in.parquet", tmp_path / "out.parquet", _CrashingStream(engine, 13), chunk_size=6)
    parts = sorted((tmp_path / "out.parquet.parts").iterdir())
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]  # no temporary file left
    assert [len(pq.read_table(p)) for p in parts] == [6, 6]
    again = _CrashingStream(engine, 10**9)
    summary = run_batch(tmp_path / "in.parquet", tmp_path / "out.parquet", again, chunk_size=6)
    assert again.seen == [r["id"] for r in rows[12:]] and (summary.skipped, summary.written) == (12, 13)
    run_batch(tmp_path / "in.parquet", tmp_path / "straight.parquet", engine)
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == pq.read_table(tmp_path / "straight.parquet").to_pylist()
    # an output already complete: nothing runs; its rows stay
    idle = _CrashingStream(engine, 10**9)
    assert run_batch(tmp_path / "in.parquet", tmp_path / "out.parquet", idle).skipped == 25 and idle.seen == []
    assert len(pq.read_table(tmp_path / "out.parquet")) == 25


def test_formats_and_missing_pyarrow(tmp_path, tokenizer, monkeypatch):
    _write_rows(tmp_path / "in.jsonl", 2)
    engine = _engine(tokenizer)
    with pytest.raises(ValueError, match=r"output .*out\.csv.* must end in one of .jsonl, .json, .ndjson, .parquet"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.csv", engine)
    with pytest.raises(ValueError, match=r"the input .*in\.txt.* must end in one of"):
        run_batch(tmp_path / "in.txt", tmp_path / "out.jsonl", engine)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"Parquet input or output needs pyarrow: pip install 'genkit-lm\[parquet\]'"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.parquet", engine)
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)  # JSONL needs no pyarrow
    assert len(_read(tmp_path / "out.jsonl")) == 2


def test_cli_parquet(tmp_path, tiny_hf_dir, capsys):
    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    rows = _write_rows(tmp_path / "in.jsonl", 9, seed=1)
    _to_parquet(rows, tmp_path / "in.parquet")
    for src, dst in (("in.jsonl", "out.jsonl"), ("in.parquet", "out.parquet")):
        assert main(["batch", str(tmp_path / src), str(tmp_path / dst), "--model", str(folder),
                     "--max-new-tokens", "3", "--chunk-size", "4"]) == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (summary["written"], summary["bad"]) == (9, 0)
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == _read(tmp_path / "out.jsonl")


# -- untrusted Parquet input: the per-row budget of a JSONL line, checked before a row is decoded ----
def _shared_prompt_file(path, rows: int, prompt: str, good: list[dict]) -> None:
    """``rows`` rows that share one dictionary-encoded ``prompt`` (stored once, small on disk), then
    the ``good`` rows."""
    n = rows + len(good)
    prompts = pa.DictionaryArray.from_arrays(pa.array([0] * rows + list(range(1, len(good) + 1)), pa.int32()),
                                             pa.array([prompt] + [r["prompt"] for r in good]))
    ids = pa.array([f"big{i}" for i in range(rows)] + [r["id"] for r in good])
    assert len(ids) == n
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path, compression="zstd")


def test_a_parquet_row_over_the_line_limit_is_a_bad_row_and_the_job_goes_on(tmp_path, tokenizer):
    """A row whose values hold more than ``--max-line-bytes`` (here a prompt that many rows share
    through the file's dictionary) goes to the errors file as an over-long JSONL line does; the other
    rows run. Before, every row was decoded to Python, with no limit."""
    good = [{"id": "g1", "prompt": "alpha bravo"}, {"id": "g2", "prompt": "charlie"}]
    _shared_prompt_file(tmp_path / "in.parquet", 3, "alpha " * 1000, good)
    engine = LocalEngine(tiny_llama(seed=0), tokenizer, {"max_new_tokens": 2}, batch_size=2)
    summary = run_batch(tmp_path / "in.parquet", tmp_path / "out.jsonl", engine, max_line_bytes=1024)
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == ["g1", "g2"]
    # a row's size: its strings' bytes, 8 more for each value (as Arrow holds it)
    size = len("big0") + 8 + 6000 + 8
    assert _read(tmp_path / "out.jsonl.errors.jsonl") == [
        {"line": i, "id": None, "error": f"the row is over the 1024-byte limit (--max-line-bytes): its values hold "
                                         f"{size} bytes; it was not read"} for i in (1, 2, 3)]
    assert (summary.rows_read, summary.written, summary.bad) == (5, 2, 3)


def test_a_row_is_sized_from_all_its_columns_nested_ones_too(tmp_path):
    """``messages`` (list<struct<role, content>>) and list fields count with their values; a row at
    the limit is read, one byte more is not."""
    from genkit.batch.formats import read_rows
    from genkit.batch.rows import BadRow

    messages = [[{"role": "user", "content": "x" * 40}], [{"role": "user", "content": "x" * 41}]]
    table = pa.table({"id": ["a", "b"], "messages": messages, "eos_token_id": [[2, 3], [2, 3]]})
    pq.write_table(table, tmp_path / "in.parquet")
    # id: 1 + 8; messages: the list 8 + role 4 + 8 + content 40 + 8; eos_token_id: the list 8 + 2 x 8
    limit = 9 + 8 + 12 + 48 + 8 + 16
    rows = list(read_rows(tmp_path / "in.parquet", max_line_bytes=limit))
    assert rows[0].messages == messages[0] and rows[0].settings == {"eos_token_id": [2, 3]}
    assert rows[1] == BadRow(2, None, f"the row is over the {limit}-byte limit (--max-line-bytes): its values hold "
                                      f"{limit + 1} bytes; it was not read")


def test_a_dictionary_bomb_is_read_in_bounded_memory(tmp_path):
    """The audit's file: 2,000 rows that share one 6 MB prompt through the dictionary (a few kB on
    disk, 12 GB as Python strings). Read under a 3 GB address-space limit: every row is a bad row
    (before: a MemoryError, decoding whole batches of 4,096 rows first)."""
    import subprocess

    big = "alpha " * 1_000_000
    prompts = pa.DictionaryArray.from_arrays(pa.array([0] * 2000, pa.int32()), pa.array([big]))
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(2000)], "prompt": prompts}), tmp_path / "bomb.parquet",
                   compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 100_000
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000)); "
              "from genkit.batch.formats import read_rows; "
              "rows = list(read_rows(sys.argv[1])); "
              "print(len(rows), sum('over the 1048576-byte limit' in r.error for r in rows))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bomb.parquet")], capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.split() == ["2000", "2000"], done.stderr[-2000:]


def test_a_row_group_that_would_decode_past_its_limit_is_refused(tmp_path):
    """A compressed page of repeated data is small on disk and large once decoded: a row group whose
    metadata says it decodes to more than 512 x --max-line-bytes is refused before it is read,
    naming the file and the limit (before: decoded whole)."""
    from genkit.batch.formats import read_rows
    from genkit.errors import ConfigError

    path = tmp_path / "in.parquet"
    rows = [{"id": "a", "prompt": "alpha"}, {"id": "b", "prompt": "bravo " * 100_000}]
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "prompt": [r["prompt"] for r in rows]}), path,
                   compression="zstd", use_dictionary=False, row_group_size=1)
    assert path.stat().st_size < 20_000
    meta = pq.ParquetFile(path).metadata.row_group(1)
    pages = sum(meta.column(c).total_uncompressed_size for c in range(2))
    with pytest.raises(ConfigError) as exc:
        list(read_rows(path, max_line_bytes=1024))
    assert str(exc.value) == (
        f"the input {str(path)!r}: row group 1 (rows 2 to 2) decodes to about {pages + 16} bytes ({pages} bytes of "
        f"uncompressed pages and 2 values), over the 524288-byte limit on one row group (512 x --max-line-bytes); "
        "write the file with smaller row groups (pyarrow: pq.write_table(table, path, row_group_size=...)) or raise "
        "--max-line-bytes")
    assert [r.id for r in read_rows(path, max_line_bytes=2048)] == ["a", None]  # the row is then a bad row
