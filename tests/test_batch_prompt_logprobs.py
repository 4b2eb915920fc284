"""``genkit batch --prompt-logprobs K``: every row's prompt scored too (each token's log-probability
given the tokens before it, its rank and K alternatives: ``genkit.score_prompt``'s), on continuous
batching (the steps that compute the prompt) and on static batches (a forward over each prompt), in
JSONL and Parquet, resumed like any job; refused where it cannot act (an encoder-decoder model, a K
out of range). The Ray engine's are in tests/test_batch_ray.py."""

from __future__ import annotations

import json

import pytest
import torch
from hub_server import hub_server  # noqa: F401 - the fixture, requested by name
from test_batch import _model_folder, _raw_tokenizer, _read, _write_rows
from tolerance import logits_bound, unit_roundoff

from genkit.batch import ContinuousEngine, LocalEngine, make_local_engine, run_batch
from genkit.errors import ConfigError, NotSupportedError
from genkit.models.tiny import tiny_llama

K = 2


@pytest.fixture
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _check_scores(model, tokenizer, rows: list[dict], out: list[dict]) -> None:
    """Each output row's prompt_logprobs against the model's forward over its prompt, within twice the
    bound of two evaluations' logits (plus a float32 rounding of a log-probability up to 30)."""
    assert [r["id"] for r in out] == [str(r["id"]) for r in rows]
    for row, got in zip(rows, out):
        prompt = tokenizer(row["prompt"])["input_ids"]
        entries = got["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        if len(prompt) < 2:
            continue
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        tol = 2 * logits_bound(model, torch.tensor([prompt])) + 30 * unit_roundoff(torch.float32)
        for i, e in enumerate(entries[1:]):
            token = prompt[i + 1]
            assert e["token"] == token and abs(e["logprob"] - ref[i, token].item()) <= tol
            assert int((ref[i] > ref[i, token] + 2 * tol).sum()) + 1 <= e["rank"] \
                <= int((ref[i] > ref[i, token] - 2 * tol).sum()) + 1
            assert len(e["top"]) == K
            assert all(abs(t["logprob"] - ref[i, t["token"]].item()) <= tol for t in e["top"])
            assert abs(e["top"][0]["logprob"] - ref[i].max().item()) <= tol


def _unscored(rows: list[dict]) -> list[dict]:
    """Output rows without their ``prompt_logprobs``."""
    return [{k: v for k, v in r.items() if k != "prompt_logprobs"} for r in rows]


def _run_scored(tmp_path, model, tokenizer, rows: list[dict], engine, reference, chunk_size: int) -> list[dict]:
    """``engine``'s scored job over ``in.jsonl``: every row written, its scores checked against the
    model (:func:`_check_scores`), and the rows otherwise ``reference``'s (another engine's job over
    the same rows, in ``reference.jsonl``)."""
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine, chunk_size=chunk_size)
    assert (summary.written, summary.bad) == (len(rows), 0)
    out = _read(tmp_path / "out.jsonl")
    _check_scores(model, tokenizer, rows, out)
    run_batch(tmp_path / "in.jsonl", tmp_path / "reference.jsonl", reference, chunk_size=chunk_size)
    assert _unscored(out) == _unscored(_read(tmp_path / "reference.jsonl"))
    return out


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_rows_carry_their_prompts_scores(tmp_path, tokenizer, batching):
    model = tiny_llama(seed=0)
    rows = _write_rows(tmp_path / "in.jsonl", 9)
    engine = make_local_engine(model, tokenizer, {"max_new_tokens": 3}, batch_size=4, batching=batching,
                               prompt_logprobs=K)
    assert type(engine) is (ContinuousEngine if batching == "continuous" else LocalEngine)
    plain = make_local_engine(model, tokenizer, {"max_new_tokens": 3}, batch_size=4, batching=batching)
    # the generations are those of the job without scores, which has no such column
    _run_scored(tmp_path, model, tokenizer, rows, engine, plain, 4)
    assert all("prompt_logprobs" not in r for r in _read(tmp_path / "reference.jsonl"))


def test_parquet_output_and_resume(tmp_path, tokenizer):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    model = tiny_llama(seed=0)
    _write_rows(tmp_path / "in.jsonl", 7)
    engine = make_local_engine(model, tokenizer, {"max_new_tokens": 2}, batch_size=4, prompt_logprobs=K)
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.parquet", engine, chunk_size=3)
    assert "prompt_logprobs" in pq.read_table(tmp_path / "out.parquet").schema.names
    rows = _write_rows(tmp_path / "in.jsonl", 10)  # the same 7 rows and 3 more: the job resumes
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.parquet", engine, chunk_size=3)
    assert summary.written == 3
    _check_scores(model, tokenizer, rows, pq.read_table(tmp_path / "out.parquet").to_pylist())


def test_cli_option_is_checked_and_recorded(tmp_path, tiny_hf_dir, capsys):
    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    _write_rows(tmp_path / "in.jsonl", 3)
    args = ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(folder),
            "--max-new-tokens", "2"]
    assert main([*args, "--prompt-logprobs", "21"]) == 2
    assert "`prompt_logprobs` must be an int from 0 to 20; got 21" in capsys.readouterr().err
    assert main([*args, "--prompt-logprobs", "1"]) == 0
    out = _read(tmp_path / "out.jsonl")
    assert all(len(r["prompt_logprobs"][1]["top"]) == 1 for r in out)
    settings = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert settings["written"] == 3


def test_encoder_decoder_model_is_refused(tokenizer):
    from seq2seq_models import build

    with pytest.raises(NotSupportedError, match="needs a causal LM"):
        make_local_engine(build("t5"), tokenizer, {"max_new_tokens": 2}, prompt_logprobs=1)
    with pytest.raises(ConfigError, match="from 0 to 20; got -1"):
        make_local_engine(tiny_llama(seed=0), tokenizer, {"max_new_tokens": 2}, prompt_logprobs=-1)


def test_ray_job_on_an_encoder_decoder_folder_is_refused_before_ray_starts(tmp_path, capsys):
    pytest.importorskip("ray")
    import seq2seq_models as S

    from genkit.cli import main

    S.save_with_tokenizer(S.build("t5"), str(tmp_path / "t5"))
    _write_rows(tmp_path / "in.jsonl", 2)
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "t5"),
                 "--engine", "ray", "--prompt-logprobs", "1", "--max-new-tokens", "2"]) == 2
    assert "`prompt_logprobs` needs a causal LM" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_ray_job_on_an_encoder_decoder_hub_model_fetches_only_its_config(tmp_path, capsys, hub_server):  # noqa: F811
    pytest.importorskip("ray")
    import seq2seq_models as S

    from genkit.cli import main

    S.save_with_tokenizer(S.build("t5"), str(tmp_path / "t5"))
    hub_server.state.commit("org/t5", {name: (tmp_path / "t5" / name).read_bytes()
                                       for name in ("config.json", "model.safetensors")})
    _write_rows(tmp_path / "in.jsonl", 2)
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", "org/t5",
                 "--engine", "ray", "--prompt-logprobs", "1", "--max-new-tokens", "2"]) == 2
    assert "`prompt_logprobs` needs a causal LM" in capsys.readouterr().err
    fetched = [path for _, path in hub_server.state.file_requests()]
    assert any(p.endswith("/config.json") for p in fetched) and not any("safetensors" in p for p in fetched)
