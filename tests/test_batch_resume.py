"""``genkit batch`` resumed as a user resumes it: stopped by SIGTERM and run again, resumed with other
settings, pointed at its own input, at a folder it cannot write (docs/batch.md, "Committed chunks,
resume, errors")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import write_tiny_model
from test_batch import _Counting, _Crash, _raw_tokenizer, _read, _write_rows

from genkit.batch import LocalEngine, run_batch
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama


@pytest.fixture
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _engine(tokenizer, new: int = 4) -> LocalEngine:
    return LocalEngine(tiny_llama(seed=0), tokenizer, {"max_new_tokens": new}, batch_size=10)


def _crash_after_two_chunks(tmp_path, tokenizer, settings) -> None:
    with pytest.raises(_Crash):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", _Counting(_engine(tokenizer), crash_after=2),
                  chunk_size=10, settings=settings)


def test_resuming_with_other_settings_is_refused(tmp_path, tokenizer):
    _write_rows(tmp_path / "in.jsonl", 50, seed=1)
    settings = {"model": "tiny", "generation": {"max_new_tokens": 4}}
    _crash_after_two_chunks(tmp_path, tokenizer, settings)
    assert json.loads((tmp_path / "out.jsonl.parts" / "job.json").read_text()) == settings
    other = _Counting(_engine(tokenizer, 2))
    with pytest.raises(ConfigError) as err:
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", other, chunk_size=10,
                  settings={"model": "tiny", "generation": {"max_new_tokens": 2}})
    assert str(err.value) == (
        f"{tmp_path / 'out.jsonl.parts'} holds rows of an interrupted run with other settings (generation: "
        "{'max_new_tokens': 4} then, {'max_new_tokens': 2} now); resume it with the same settings, or write to "
        f"another output (or remove {tmp_path / 'out.jsonl.parts'} to start over)")
    assert other.seen == [] and len(list((tmp_path / "out.jsonl.parts").glob("part-*"))) == 2  # nothing touched
    same = _Counting(_engine(tokenizer))
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", same, chunk_size=10, settings=settings)
    assert (summary.skipped, summary.written) == (20, 30)
    assert not (tmp_path / "out.jsonl.parts").exists()  # the settings go with the parts
    run_batch(tmp_path / "in.jsonl", tmp_path / "straight.jsonl", _engine(tokenizer), chunk_size=50)
    assert _read(tmp_path / "out.jsonl") == _read(tmp_path / "straight.jsonl")


def test_a_corrupt_settings_record_is_reported(tmp_path, tokenizer):
    from genkit.batch.store import CorruptOutputError

    _write_rows(tmp_path / "in.jsonl", 30)
    _crash_after_two_chunks(tmp_path, tokenizer, {"generation": {"max_new_tokens": 4}})
    (tmp_path / "out.jsonl.parts" / "job.json").write_text("{not json")
    with pytest.raises(CorruptOutputError, match=r"job\.json: the job's settings cannot be read \(JSONDecodeError\)"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", _engine(tokenizer),
                  settings={"generation": {"max_new_tokens": 4}})


def test_the_output_cannot_be_the_input(tmp_path, tokenizer):
    _write_rows(tmp_path / "in.jsonl", 5)
    os.symlink(tmp_path / "in.jsonl", tmp_path / "link.jsonl")
    before = (tmp_path / "in.jsonl").read_bytes()
    for output in ("in.jsonl", "link.jsonl"):
        engine = _Counting(_engine(tokenizer))
        with pytest.raises(ConfigError, match=r"the output '.*' is the input file: an existing output is resumed"):
            run_batch(tmp_path / "in.jsonl", tmp_path / output, engine)
        assert engine.seen == []
    assert (tmp_path / "in.jsonl").read_bytes() == before


def test_an_output_folder_that_cannot_be_written_fails_before_any_row_runs(tmp_path, tokenizer):
    _write_rows(tmp_path / "in.jsonl", 30)
    (tmp_path / "file").write_text("a file, not a folder")
    engine = _Counting(_engine(tokenizer))
    with pytest.raises(ConfigError, match=r"the output '.*file/out\.jsonl' cannot be written: its folder '.*file' "
                                          r"is not writable"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "file" / "out.jsonl", engine, chunk_size=10)
    assert engine.seen == []  # before: the first chunk ran, then its commit failed
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "new" / "folder" / "out.jsonl", engine)
    assert summary.written == 30  # a folder that does not exist yet is made


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "genkit", "batch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def test_cli_sigterm_stops_between_commits_and_the_job_resumes(tmp_path):
    model = str(write_tiny_model(tmp_path / "tiny"))
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"id": i, "prompt": f"hello world number {i}"}) + "\n")
    common = ["--model", model, "--threads", "1", "--max-new-tokens", "8", "--chunk-size", "50"]
    job = _cli(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), *common)
    parts = tmp_path / "out.jsonl.parts"
    deadline = time.monotonic() + 240
    while not (parts / "part-000001.jsonl").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err  # before: killed at once (-15), with no word
    assert "interrupted: " in err and "rows are committed under" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
    committed = [row for part in sorted(parts.glob("part-*.jsonl")) for row in _read(part)]
    assert 100 <= len(committed) < 3000 and len(committed) % 50 == 0  # whole chunks only
    assert sorted(p.name for p in parts.iterdir() if not p.name.startswith("part-")) == ["job.json"]  # no temp file

    changed = _cli(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), *common, "--set", "top_k=3")
    _, err = changed.communicate(timeout=240)
    assert changed.returncode == 2 and "holds rows of an interrupted run with other settings (generation: " in err
    resumed = _cli(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), *common)
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    summary = json.loads(err.strip().splitlines()[-1])
    assert (summary["skipped"], summary["written"]) == (len(committed), 3000 - len(committed))
    out = _read(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [str(i) for i in range(3000)]  # every row once, in order
    assert out[: len(committed)] == committed


def _peak_memory(run):
    """What ``run()`` returns, and the most memory Python held while it ran (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        return run(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bad_rows_are_written_as_they_come_not_held_in_memory(tmp_path, tokenizer):
    """A hostile input of short bad lines: each costs an error record of a hundred bytes, which
    goes to disk as it comes (before: every record was held until the end, ~600 bytes of memory
    per 2-byte line)."""
    (tmp_path / "in.jsonl").write_bytes(b"x\n" * 100_000 + b'{"id": "ok", "prompt": "alpha"}\n')
    engine = _Counting(_engine(tokenizer))
    summary, peak = _peak_memory(lambda: run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine))
    assert (summary.bad, summary.written) == (100_000, 1) and engine.seen == ["ok"]
    assert peak < 8 << 20, peak
    errors = _read(tmp_path / "out.jsonl.errors.jsonl")
    assert [e["line"] for e in errors] == list(range(1, 100_001))
    assert errors[0] == {"line": 1, "id": None, "error": "not a JSON object: Expecting value: line 1 column 1 (char 0)"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl", "out.jsonl.errors.jsonl"]


def test_an_interrupted_run_leaves_no_errors_file_and_keeps_the_last_one(tmp_path, tokenizer):
    _write_rows(tmp_path / "in.jsonl", 30, extra=["not json"])
    (tmp_path / "out.jsonl.errors.jsonl").write_text('{"line": 1, "id": null, "error": "an earlier run"}\n')
    _crash_after_two_chunks(tmp_path, tokenizer, None)
    assert _read(tmp_path / "out.jsonl.errors.jsonl") == [{"line": 1, "id": None, "error": "an earlier run"}]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # the run's errors went with it
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", _engine(tokenizer), chunk_size=10)
    (error,) = _read(tmp_path / "out.jsonl.errors.jsonl")
    assert error["line"] == 31 and error["error"].startswith("not a JSON object")


def test_joining_a_large_output_does_not_hold_it_in_memory(tmp_path, tokenizer):
    """The final join keeps a digest per id to find repeats, not each row's text (before: the whole
    output was in memory at the end of the job)."""
    n = 4000
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": "alpha"}) + "\n" for i in range(n)))
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    text = "bravo " * 2000  # 12 kB a row, 48 MB in all
    rows = [{"id": str(i), "text": text, "token_ids": [4], "finish_reason": "length",
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}} for i in range(n)]
    for k in range(4):
        (parts / f"part-{k:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[k * 1000:(k + 1) * 1000]))
    (parts / "part-000004.jsonl").write_text(json.dumps(rows[7]) + "\n")  # a repeat, word for word
    del rows
    engine = _Counting(_engine(tokenizer))
    summary, peak = _peak_memory(lambda: run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine))
    assert (summary.skipped, summary.written, summary.bad) == (n, 0, 0) and engine.seen == []
    assert peak < 16 << 20, peak
    with open(tmp_path / "out.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["id"] for line in f] == [str(i) for i in range(n)]
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()
