"""``genkit batch`` (issue 17, local engine): output equal to ``generate``, committed chunks and
resume, bad rows reported in an errors file, the command line."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

import genkit
from genkit.batch import LocalEngine, run_batch
from genkit.models.tiny import tiny_llama

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango").split()
SPECIALS = ["<unk>", "<s>", "</s>"]  # pad, bos, eos of the tiny model


def _raw_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(SPECIALS)
    return raw


@pytest.fixture
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _write_rows(path, n: int, seed: int = 0, extra: list[str] | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))}
            for i in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra or []:
            f.write(line + "\n")
    return rows


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def _reference(model, tokenizer, prompt: str, new: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = genkit.generate(model, ids, max_new_tokens=new)[0, ids.shape[1]:].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


def test_local_engine_output_equals_generate(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    rows = _write_rows(tmp_path / "in.jsonl", 40)
    engine = LocalEngine(model, tokenizer, {"max_new_tokens": 6}, batch_size=8)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine, chunk_size=16)
    out = _read(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # every id once, in order
    for src, got in zip(rows, out):
        ref = _reference(model, tokenizer, src["prompt"], 6)
        assert got["token_ids"] == ref
        assert got["finish_reason"] == ("stop" if ref and ref[-1] == 2 else "length")
        assert got["text"] == tokenizer.decode(ref, skip_special_tokens=True)
        n_prompt = len(tokenizer(src["prompt"])["input_ids"])
        assert got["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(ref),
                                "total_tokens": n_prompt + len(ref)}
    assert (summary.rows_read, summary.written, summary.skipped, summary.bad) == (40, 40, 0, 0)
    assert summary.new_tokens == sum(len(r["token_ids"]) for r in out)
    assert not (tmp_path / "out.jsonl.parts").exists() and not (tmp_path / "out.jsonl.errors.jsonl").exists()


class _Crash(Exception):
    pass


class _CrashingStream:
    """An engine whose stream dies after ``after`` results (a crash mid-job)."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.after, self.seen = inner, after, []

    def run(self, rows):
        return self.inner.run(rows)

    def stream(self, rows):
        for n, result in enumerate(self.inner.stream(rows)):
            if n == self.after:
                raise _Crash("killed mid-job")
            self.seen.append(result["id"])
            yield result


class _Counting:
    """An engine that records the rows it is given, and can crash after some chunks."""

    def __init__(self, inner, crash_after: int | None = None) -> None:
        self.inner, self.crash_after, self.seen, self.calls = inner, crash_after, [], 0

    def run(self, rows):
        if self.crash_after is not None and self.calls == self.crash_after:
            raise _Crash("killed mid-job")
        self.calls += 1
        self.seen.extend(r.id for r in rows)
        return self.inner.run(rows)


def test_resume_after_a_crash_writes_only_the_missing_rows(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    rows = _write_rows(tmp_path / "in.jsonl", 50, seed=1)
    engine = LocalEngine(model, tokenizer, {"max_new_tokens": 4}, batch_size=10)
    crashing = _Counting(engine, crash_after=2)
    with pytest.raises(_Crash):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", crashing, chunk_size=10)
    # two chunks committed, nothing half-written
    parts = sorted((tmp_path / "out.jsonl.parts").glob("*"))
    assert [p.name for p in parts] == ["part-000000.jsonl", "part-000001.jsonl"]
    assert sum(len(_read(p)) for p in parts) == 20
    again = _Counting(engine)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", again, chunk_size=10)
    assert again.seen == [r["id"] for r in rows[20:]]
    assert (summary.skipped, summary.written) == (20, 30)
    resumed = _read(tmp_path / "out.jsonl")
    run_batch(tmp_path / "in.jsonl", tmp_path / "straight.jsonl", engine, chunk_size=50)
    assert resumed == _read(tmp_path / "straight.jsonl")
    # a third run with everything done generates nothing
    idle = _Counting(engine)
    assert run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", idle).skipped == 50 and idle.seen == []


def test_bad_rows_go_to_the_errors_file(tmp_path, tokenizer):
    model = tiny_llama(seed=0)
    extra = ['{"id": "no-prompt"}', "this is not json", '{"id": "bad-k", "prompt": "alpha", "top_k": -1}',
             '{"id": "r0", "prompt": "bravo"}', '{"id": "empty", "prompt": ""}', '[1, 2]',
             '{"id": "own", "prompt": "alpha bravo", "max_new_tokens": 2}']
    rows = _write_rows(tmp_path / "in.jsonl", 5, extra=extra)
    engine = LocalEngine(model, tokenizer, {"max_new_tokens": 5}, batch_size=4)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    out = _read(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [r["id"] for r in rows] + ["own"]
    assert out[-1]["token_ids"] == _reference(model, tokenizer, "alpha bravo", 2)  # a row's own field
    errors = {e["line"]: e for e in _read(tmp_path / "out.jsonl.errors.jsonl")}
    assert sorted(errors) == [6, 7, 8, 9, 10, 11]
    assert errors[6]["id"] == "no-prompt" and "neither `prompt` nor `messages`" in errors[6]["error"]
    assert errors[7]["id"] is None and "not a JSON object" in errors[7]["error"]
    assert errors[8]["id"] == "bad-k" and "top_k" in errors[8]["error"]
    assert "duplicate id 'r0'" in errors[9]["error"]
    assert "non-empty string" in errors[10]["error"]
    assert "not a JSON object" in errors[11]["error"]
    assert (summary.rows_read, summary.written, summary.bad) == (12, 6, 6)



def test_hostile_generation_fields_are_bad_rows_with_their_reason(tmp_path, tokenizer, monkeypatch):
    """The audit's rows: a billion beams (the allocator's RuntimeError for 32 GB), an EOS id no int64
    holds ("Overflow when unpacking long long"), a sampling temperature of 1e-320 (NaN probabilities)
    go to the errors file with the reason, the others run; a length_penalty of 1e308 (an
    OverflowError) runs."""
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", "100000")
    model = tiny_llama(seed=0)
    rows = [{"id": "ok1", "prompt": "alpha bravo"},
            {"id": "beams", "prompt": "alpha", "num_beams": 10**9},
            {"id": "eos", "prompt": "alpha", "eos_token_id": 10**30},
            {"id": "cold", "prompt": "alpha", "do_sample": True, "temperature": 1e-320},
            {"id": "lp", "prompt": "alpha", "num_beams": 2, "length_penalty": 1e308},
            {"id": "ok2", "prompt": "charlie delta"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = LocalEngine(model, tokenizer, {"max_new_tokens": 3}, batch_size=4)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    assert [r["id"] for r in _read(tmp_path / "out.jsonl")] == ["ok1", "lp", "ok2"]
    # a beam of the tiny model: 4 positions (ids, mask, cache; its candidates' and finished ids), its logits and
    # 3 more rows of the vocabulary (genkit.models.memory's beam search terms)
    one = 4 * (16 + 512 + 64) + 4 * 512
    errors = {e["id"]: e["error"] for e in _read(tmp_path / "out.jsonl.errors.jsonl")}
    assert errors == {
        "beams": f"generation failed: `num_beams` (1000000000) with 1 prompt of 1 token and 3 new tokens holds "
                 f"1000000000 sequences of up to 4 positions at once: about {10**9 * one / 1024**4:.1f} TiB for their "
                 "token ids, key/value caches and logits, more than the 97.7 KiB of memory available "
                 f"(GENKIT_MAX_GENERATION_BYTES); at most {100000 // one} fit: set `num_beams` to {100000 // one} or less",
        "eos": "invalid generation field: `eos_token_id` holds token ids [1000000000000000000000000000000] outside the "
               "int64 range; accepted ids are 0..9223372036854775807",
        "cold": "invalid generation field: `temperature` must be >= 1e-05 when do_sample=True; got 1e-320: a smaller "
                "one overflows the scaled logits. For greedy decoding set do_sample=False.",
    }
    assert (summary.written, summary.bad) == (3, 3)


def _model_folder(tiny_hf_dir, folder):
    shutil.copytree(tiny_hf_dir, folder)
    _raw_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>"}))
    return folder


def test_cli_batch(tmp_path, tiny_hf_dir, capsys):
    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    rows = _write_rows(tmp_path / "in.jsonl", 6, extra=["nope"])
    rc = main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(folder),
               "--max-new-tokens", "3", "--batch-size", "4"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (summary["written"], summary["bad"]) == (6, 1)
    model, tok = genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder))
    out = _read(tmp_path / "out.jsonl")
    assert [r["token_ids"] for r in out] == [_reference(model, tok, r["prompt"], 3) for r in rows]
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "o2.jsonl"), "--workers", "0"]) == 2
    assert "--workers must be >= 1; got 0" in capsys.readouterr().err


def test_cli_batch_freezes_the_heap_it_loaded(tmp_path, tiny_hf_dir):
    """A long run's garbage collector passes leave out what start-up loaded (gc.freeze, genkit.cli.heap):
    a full pass over a loaded model's objects is tens of milliseconds."""
    import gc

    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    _write_rows(tmp_path / "in.jsonl", 2)
    gc.unfreeze()
    try:
        assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(folder),
                     "--max-new-tokens", "2"]) == 0
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def test_messages_rows_use_the_chat_template(tmp_path):
    from genkit.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}echo{% endif %}"
    tok = Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "chat_template": template})
    model = tiny_llama(seed=0)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 7, "messages": [{"role": "user", "content": "alpha"}]})
                                       + "\n" + json.dumps({"id": 8, "messages": "alpha"}) + "\n")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", LocalEngine(model, tok, {"max_new_tokens": 3}))
    (row,) = _read(tmp_path / "out.jsonl")
    assert row["id"] == "7" and row["token_ids"] == _reference(model, tok, "alpha echo", 3)
    (error,) = _read(tmp_path / "out.jsonl.errors.jsonl")
    assert error["id"] == "8" and "`messages` must be a non-empty list" in error["error"]
    assert summary.bad == 1


def test_docs_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "batch.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/batch.md", "exec"), {"__name__": "__docs__"})


# -- padding: a static batch gives each row what generate gives it alone ---------------------------------------
EOS = 92  # an id the tiny model (seed 0) emits; the model has no pad id, so the static engine pads with it
ALPHA = 3  # "alpha", the one-token prompt


def _pad_is_eos_model():
    model = tiny_llama(seed=0)
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = EOS
    return model


def _alone(model, ids: list[int], settings: dict) -> list[int]:
    out = genkit.generate(model, torch.tensor([ids]), **settings)[0, len(ids):].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("settings", [
    {"min_length": 12},  # counts the padded width
    {"no_repeat_ngram_size": 1},  # bans the pad id, here the EOS
    {"encoder_repetition_penalty": 3.0},  # favours the pad id
    {"encoder_no_repeat_ngram_size": 1},
    {"forced_bos_token_id": 7},  # forced where the whole sequence is one token
    {"sequence_bias": [[[EOS, EOS, ALPHA, 7], 30.0]]},  # matched on the padding before a short prompt
    {"bad_words_ids": [[EOS, EOS, ALPHA, EOS]]},  # "alpha" alone ends at once
    {"watermarking_config": {"seeding_scheme": "selfhash", "context_width": 4, "bias": 30.0}},
    {"prefix_allowed_tokens_fn": lambda batch_id, row: [int(row[0]) % 100, 50, 60]},  # reads the row's first token
], ids=lambda s: next(iter(s)))
def test_static_batches_give_a_row_its_tokens_alone_whatever_it_is_batched_with(tokenizer, settings):
    """A setting that counts the row's length or reads its earlier tokens would count or read the
    left padding of a shared batch as the row's (as generate does on a caller's padded batch): rows
    with it share a batch only with prompts the padding cannot reach."""
    from genkit.batch import make_local_engine
    from genkit.batch.rows import BatchRow

    model = _pad_is_eos_model()
    prompts = ["alpha bravo charlie delta echo foxtrot golf hotel", "alpha", "bravo charlie", "alpha charlie delta",
               "alpha bravo charlie delta echo"]
    job = {"max_new_tokens": 14, **settings}
    row_settings = {k: v for k, v in job.items() if k != "prefix_allowed_tokens_fn"}
    rows = [BatchRow(f"r{i}", i + 1, prompt=p, settings=row_settings) for i, p in enumerate(prompts)]
    engine = make_local_engine(model, tokenizer, {"prefix_allowed_tokens_fn": settings.get("prefix_allowed_tokens_fn")}
                               if "prefix_allowed_tokens_fn" in settings else None, batching="static")
    assert engine.pad == EOS
    want = [_alone(model, tokenizer(p)["input_ids"], job) for p in prompts]
    assert [out["token_ids"] for out in engine.run(rows)] == want


def test_an_encoder_decoder_models_rows_read_no_padding_of_the_encoders_input(tokenizer):
    """An encoder-decoder model's rows are padded on the right; the settings that read the encoder's
    input would read that padding (T5's pad id, favoured by ``encoder_repetition_penalty``)."""
    import seq2seq_models as S

    from genkit.batch import make_local_engine
    from genkit.batch.rows import BatchRow

    model = S.build("t5")
    prompts = ["alpha bravo charlie delta echo foxtrot golf hotel", "alpha", "bravo charlie"]
    job = {"max_new_tokens": 8, "encoder_repetition_penalty": 3.0}
    engine = make_local_engine(model, tokenizer, batching="static")
    want = []
    for p in prompts:
        out = genkit.generate(model, torch.tensor([tokenizer(p)["input_ids"]]), **job)[0, 1:].tolist()  # after the start
        want.append(out[: out.index(1) + 1] if 1 in out else out)  # through T5's EOS
    rows = [BatchRow(f"r{i}", i + 1, prompt=p, settings=job) for i, p in enumerate(prompts)]
    assert [out["token_ids"] for out in engine.run(rows)] == want


def test_rows_out_of_the_paddings_reach_still_share_a_batch():
    """A setting that looks back a few tokens keeps apart only the rows shorter than that; one that
    counts or reads the whole row keeps every prompt length apart; the others keep nothing apart."""
    from genkit.generation.api import merge_config
    from genkit.generation.padding import padding_group, padding_readers

    model = _pad_is_eos_model()

    def groups(lengths, **settings):
        readers = padding_readers(merge_config(model, None, {"max_new_tokens": 4, **settings})[0])
        return [padding_group(readers, n) for n in lengths]

    assert groups([1, 2, 3, 8], sequence_bias={(5, 6, 7, 8): 1.0}) == [1, 2, 3, 3]
    assert groups([1, 2, 3, 8], bad_words_ids=[[5, 6]], forced_bos_token_id=4) == [1, 2, 2, 2]
    assert groups([1, 3, 8], no_repeat_ngram_size=3, bad_words_ids=[[5, 6]]) == [1, 3, 8]
    assert groups([1, 3, 8], repetition_penalty=1.3, bad_words_ids=[[5]], min_new_tokens=3) == [None] * 3
