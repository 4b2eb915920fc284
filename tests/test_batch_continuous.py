"""``genkit batch``'s local engine on continuous batching (issue 17): greedy output token for token
the static engine's (mixed prompt lengths, per-row max_new_tokens and eos_token_id), rows it cannot
run on static batches, engine choice, resume through the streaming path, progress counts and the
bar's rates."""

from __future__ import annotations

import io
import json

import pytest
from test_batch import WORDS, _Crash, _CrashingStream, _model_folder, _raw_tokenizer, _read, _write_rows

from genkit.batch import ContinuousEngine, LocalEngine, make_local_engine, run_batch
from genkit.models.tiny import tiny_llama


@pytest.fixture
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _mixed_rows(path, n: int) -> list[dict]:
    """Prompts of 1 to 30 words; some rows with their own max_new_tokens or eos_token_id."""
    rows = []
    for i in range(n):
        row: dict = {"id": f"m{i}", "prompt": " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i * 3 % 30))}
        if i % 3 == 1:
            row["max_new_tokens"] = 1 + i % 9
        if i % 5 == 2:
            row["eos_token_id"] = [2, 3 + i % 17]  # a word token ends this row too
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_continuous_equals_static_greedy(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    rows = _mixed_rows(tmp_path / "in.jsonl", 60)
    kwargs = {"max_new_tokens": 12}
    engine = make_local_engine(model, tokenizer, kwargs, batch_size=4)  # auto
    assert isinstance(engine, ContinuousEngine)
    # window of 16 requests, committed chunks of 7: rows cross both boundaries
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "cont.jsonl", engine, chunk_size=7)
    run_batch(tmp_path / "in.jsonl", tmp_path / "static.jsonl", LocalEngine(model, tokenizer, kwargs, batch_size=8),
              chunk_size=60)
    cont, static = _read(tmp_path / "cont.jsonl"), _read(tmp_path / "static.jsonl")
    assert [r["id"] for r in cont] == [r["id"] for r in rows]
    assert cont == static
    lengths = {len(r["token_ids"]) for r in cont}
    assert len(lengths) > 3 and max(lengths) == 12  # mixed lengths really happened
    assert any(r["finish_reason"] == "stop" for r in cont) and any(r["finish_reason"] == "length" for r in cont)
    assert (summary.written, summary.bad) == (60, 0)
    assert not engine.manager.is_running()  # the manager's thread ends with the job


def test_rows_continuous_batching_cannot_run_go_to_static_batches(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    lines = [{"id": "a", "prompt": "alpha bravo charlie"},
             {"id": "beam", "prompt": "delta echo", "num_beams": 2},  # beam search: generate
             {"id": "b", "prompt": "golf hotel india juliet"},
             {"id": "beam3", "prompt": "kilo lima", "num_beams": 3, "max_new_tokens": 3},
             {"id": "bad-k", "prompt": "alpha", "top_k": -1}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    kwargs = {"max_new_tokens": 5}
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                        ContinuousEngine(model, tokenizer, kwargs, batch_size=2))
    run_batch(tmp_path / "in.jsonl", tmp_path / "static.jsonl", LocalEngine(model, tokenizer, kwargs))
    out = _read(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == ["a", "beam", "b", "beam3"]
    assert out == _read(tmp_path / "static.jsonl")  # beam rows ran (continuous batching refuses beams)
    assert len(out[3]["token_ids"]) == 3
    (error,) = _read(tmp_path / "out.jsonl.errors.jsonl")
    assert error["id"] == "bad-k" and "top_k" in error["error"] and summary.bad == 1


def test_engine_choice(tokenizer):
    model = tiny_llama(seed=0)
    assert isinstance(make_local_engine(model, tokenizer, {"max_new_tokens": 2}, batching="continuous"),
                      ContinuousEngine)
    static = make_local_engine(model, tokenizer, {"max_new_tokens": 2}, batching="static")
    assert type(static) is LocalEngine
    # auto: what continuous batching cannot run goes to static batches
    assert type(make_local_engine(model, tokenizer, {"num_beams": 2})) is LocalEngine
    assert type(make_local_engine(model, tokenizer, {}, custom_generate="greedy")) is LocalEngine
    with pytest.raises(ValueError, match="`batching='continuous'` cannot run this job: .*num_beams"):
        make_local_engine(model, tokenizer, {"num_beams": 2}, batching="continuous")
    with pytest.raises(ValueError, match="cannot run this job: `custom_generate` is set: a custom generate"):
        make_local_engine(model, tokenizer, {}, custom_generate="greedy", batching="continuous")
    with pytest.raises(ValueError, match=r"`batching` must be one of 'auto', 'continuous', 'static'; got 'paged'"):
        make_local_engine(model, tokenizer, {}, batching="paged")
    for batching in ("auto", "static"):  # every row would fail: refused once, before any row runs
        with pytest.raises(ValueError, match=r"`num_return_sequences` must be 1 in a batch job \(one output row per "
                                             r"input row\); got 2$"):
            make_local_engine(model, tokenizer, {"num_return_sequences": 2, "do_sample": True}, batching=batching)


def test_resume_through_the_streaming_path(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    rows = _write_rows(tmp_path / "in.jsonl", 30, seed=2)
    engine = ContinuousEngine(model, tokenizer, {"max_new_tokens": 4}, batch_size=4)
    with pytest.raises(_Crash):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", _CrashingStream(engine, after=17), chunk_size=8)
    assert not engine.manager.is_running()
    parts = sorted(p.name for p in (tmp_path / "out.jsonl.parts").iterdir())
    assert parts == ["part-000000.jsonl", "part-000001.jsonl"]  # 16 rows committed, the 17th lost
    again = _CrashingStream(engine, after=10**9)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", again, chunk_size=8)
    assert again.seen == [r["id"] for r in rows[16:]]
    assert (summary.skipped, summary.written) == (16, 14)
    run_batch(tmp_path / "in.jsonl", tmp_path / "straight.jsonl", LocalEngine(model, tokenizer, {"max_new_tokens": 4}))
    assert _read(tmp_path / "out.jsonl") == _read(tmp_path / "straight.jsonl")


def test_progress_counts_and_the_bar(tmp_path, tokenizer):
    from genkit.cli.progress import BatchBar

    model = tiny_llama(seed=0)
    _write_rows(tmp_path / "in.jsonl", 25, seed=4, extra=["not json"])
    stream = io.StringIO()
    bar = BatchBar(stream, mininterval=0)
    seen, per_row = [], []

    def progress(summary):
        seen.append((summary.written, summary.bad, summary.new_tokens, summary.rows_per_s, summary.tokens_per_s))
        bar(summary)

    def on_result(summary):
        per_row.append((summary.done, summary.written, summary.done_tokens))
        bar.result(summary)

    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl",
              ContinuousEngine(model, tokenizer, {"max_new_tokens": 3}, batch_size=4), chunk_size=10, progress=progress,
              on_result=on_result)
    bar.close()
    out = _read(tmp_path / "out.jsonl")
    tokens = [len(r["token_ids"]) for r in out]
    assert [s[0] for s in seen] == [10, 20, 25]
    assert [s[2] for s in seen] == [sum(tokens[:10]), sum(tokens[:20]), sum(tokens)]
    assert seen[-1][1] == 1  # the bad line, read before the last chunk
    assert all(s[3] > 0 and s[4] > 0 for s in seen)
    # every row's result moves the count on, before its chunk is committed
    assert len(per_row) == 25 and [d for d, _, _ in per_row] == sorted(d for d, _, _ in per_row)
    assert per_row[0][:2] == (1, 0) and per_row[-1][0] == 26 and per_row[-1][2] == sum(tokens)
    assert [d for d, w, _ in per_row if w == 0] == list(range(1, 11))  # the bad line is read after row 10
    text = stream.getvalue()
    assert "genkit batch: 3row" in text and "genkit batch: 26row" in text
    assert f"{seen[-1][3]:.2f} rows/s" in text and f"{seen[-1][4]:.1f} tokens/s" in text


def test_cli_batching_options(tmp_path, tiny_hf_dir, capsys):
    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    _write_rows(tmp_path / "in.jsonl", 12, seed=8)
    for batching in ("static", "continuous", "auto"):
        assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / f"{batching}.jsonl"), "--model", str(folder),
                     "--max-new-tokens", "5", "--batch-size", "4", "--batching", batching]) == 0
    static = _read(tmp_path / "static.jsonl")
    assert len(static) == 12
    assert _read(tmp_path / "continuous.jsonl") == static == _read(tmp_path / "auto.jsonl")
    capsys.readouterr()
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "x.jsonl"), "--model", str(folder),
                 "--num-beams", "2", "--batching", "continuous"]) == 2
    assert "`batching='continuous'` cannot run this job" in capsys.readouterr().err
    # on Ray too, before any actor starts
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "x.jsonl"), "--model", str(folder),
                 "--engine", "ray", "--custom-generate", "greedy", "--batching", "continuous"]) == 2
    assert "cannot run this job: `custom_generate` is set: a custom generate" in capsys.readouterr().err


def test_a_request_that_fails_is_a_bad_row_and_the_job_goes_on(tmp_path, tokenizer):
    from genkit.continuous import ContinuousBatchingConfig

    model = tiny_llama(seed=0)
    lines = [{"id": "short", "prompt": "alpha bravo"}, {"id": "long", "prompt": " ".join(WORDS)},
             {"id": "short2", "prompt": "charlie"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    engine = ContinuousEngine(model, tokenizer, {"max_new_tokens": 3}, batch_size=2,
                              continuous_batching_config=ContinuousBatchingConfig(block_size=4, num_blocks=4))
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == ["short", "short2"]
    (error,) = _read(tmp_path / "out.jsonl.errors.jsonl")
    assert error == {"line": 2, "id": "long", "error": error["error"]}
    assert error["error"].startswith("generation failed: ") and "the cache holds 16" in error["error"]
    assert (summary.written, summary.bad) == (2, 1)


def test_a_rows_return_dict_in_generate_leaves_its_finish_reason(tokenizer):
    """A row setting ``return_dict_in_generate: false`` made the static engine's generate return bare
    sequences: a row a stop string ended said ``length``, where the continuous engine says ``stop``."""
    from genkit.batch.rows import parse_record

    model = tiny_llama(seed=1)
    prompt = "alpha bravo charlie"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    full = model.generate(ids, max_new_tokens=16, eos_token_id=None)[0, ids.shape[1]:].tolist()
    k = next(i for i in range(1, len(full)) if 3 <= full[i] < 3 + len(WORDS) and full[i] not in full[:i])
    kwargs = {"max_new_tokens": 16, "eos_token_id": None}
    outs = []
    for batching in ("continuous", "static"):
        engine = make_local_engine(model, tokenizer, kwargs, batching=batching)
        for extra in ({}, {"return_dict_in_generate": False}):
            row = parse_record(1, {"id": "a", "prompt": prompt, "stop_strings": [WORDS[full[k] - 3]], **extra})
            outs.append(engine.run([row])[0])
    assert [(o["token_ids"], o["finish_reason"]) for o in outs] == [(full[:k + 1], "stop")] * 4


def test_a_row_past_the_context_is_generates_error_on_both_engines(tokenizer):
    """A row whose max_new_tokens runs past the model's context: the static engine wrote generate's
    error, the continuous engine capped it silently and wrote fewer tokens ("length")."""
    from genkit.batch.rows import BadRow, parse_record

    model = tiny_llama(seed=1, max_position_embeddings=16)
    row = parse_record(1, {"id": "a", "prompt": "alpha bravo charlie delta echo", "max_new_tokens": 20})
    errors = []
    for batching in ("continuous", "static"):
        out = make_local_engine(model, tokenizer, {"eos_token_id": None}, batching=batching).run([row])[0]
        assert isinstance(out, BadRow), out
        errors.append(out.error)
    assert all("`max_new_tokens` (20) with a prompt of 5 tokens needs 25 positions; the model's context "
               "(`max_position_embeddings`) is 16: ask for at most 11 new tokens" in e for e in errors), errors
