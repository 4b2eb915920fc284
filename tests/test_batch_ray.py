"""``genkit batch --engine ray`` and ``genkit.ray.Generator`` on a local Ray cluster started in the
test (issue 17): 1,000 prompts, 2 actors, output identical to the local engine; an actor killed
mid-job; a job stopped halfway and resumed; Generator in users' own pipelines (JSON, Parquet)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import ray
from test_batch import _model_folder, _read, _write_rows

from genkit.batch import LocalEngine, run_batch
from genkit.ray import RayEngine


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tiny_hf_dir, tmp_path_factory):
    return _model_folder(tiny_hf_dir, tmp_path_factory.mktemp("raymodel") / "model")


def _local(folder, src, dst):
    import genkit

    engine = LocalEngine(genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder)), {"max_new_tokens": 3},
                         batch_size=50)
    run_batch(src, dst, engine, chunk_size=1000)
    return _read(dst)


def test_ray_engine_matches_local_with_two_actors(cluster, folder, tmp_path):
    rows = _write_rows(tmp_path / "in.jsonl", 1000, seed=5, extra=["not json"])
    engine = RayEngine(str(folder), {"max_new_tokens": 3}, batch_size=50, workers=2)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "ray.jsonl", engine, chunk_size=500)
    got = _read(tmp_path / "ray.jsonl")
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # every id exactly once
    assert got == _local(folder, tmp_path / "in.jsonl", tmp_path / "local.jsonl")
    assert (summary.written, summary.bad) == (1000, 1)


def test_actor_killed_mid_job_still_completes(cluster, folder, tmp_path):
    rows = _write_rows(tmp_path / "in.jsonl", 400, seed=6)
    engine = RayEngine(str(folder), {"max_new_tokens": 3}, batch_size=10, workers=2)
    killed = []

    def killer():  # the process of one map actor dies (SIGKILL) while the job runs
        start = time.time()
        deadline = start + 120
        while time.time() < deadline and not killed:
            pids = _map_worker_pids()
            # both actors, or (on a loaded machine, where the second may come up late) the first after 10 s
            if len(pids) == 2 or (pids and time.time() > start + 10):
                time.sleep(0.5)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer)
    thread.start()
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine, chunk_size=400)
    thread.join()
    assert killed
    got = _read(tmp_path / "out.jsonl")
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    assert len({r["id"] for r in got}) == 400
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists(), (tmp_path / "out.jsonl.errors.jsonl").read_text()


def _map_worker_pids() -> list[int]:
    """Processes of live Ray Data map actors (Ray titles them ``ray::MapWorker(...)``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ray::MapWorker" in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def test_generator_in_a_users_pipeline(cluster, folder, tmp_path):
    import genkit.ray

    rows = [{"id": f"u{i}", "prompt": "alpha bravo " * (i % 3 + 1)} for i in range(20)]
    ds = ray.data.from_items(rows).map_batches(
        genkit.ray.Generator, fn_constructor_kwargs={"model": str(folder), "generation_kwargs": {"max_new_tokens": 2}},
        compute=ray.data.ActorPoolStrategy(size=1), batch_size=8)
    out = {r["id"]: r for r in ds.take_all()}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = {r["id"]: r for r in _local_two(folder, tmp_path)}
    assert {k: list(v["token_ids"]) for k, v in out.items()} == {k: v["token_ids"] for k, v in local.items()}


def _local_two(folder, tmp_path):
    import genkit

    engine = LocalEngine(genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder)), {"max_new_tokens": 2})
    run_batch(tmp_path / "in.jsonl", tmp_path / "local.jsonl", engine)
    return _read(tmp_path / "local.jsonl")


def test_generator_in_a_users_parquet_pipeline(cluster, folder, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import genkit.ray

    rows = _write_rows(tmp_path / "in.jsonl", 24, seed=11)
    rows[3]["max_new_tokens"] = 1  # a sparse int column: null elsewhere, floats in a pandas batch
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in ("id", "prompt", "max_new_tokens")}),
                   tmp_path / "in.parquet")
    ds = ray.data.read_parquet(str(tmp_path / "in.parquet")).map_batches(
        genkit.ray.Generator, fn_constructor_kwargs={"model": str(folder), "generation_kwargs": {"max_new_tokens": 2}},
        compute=ray.data.ActorPoolStrategy(size=1), batch_size=8, batch_format="pandas")
    ds.write_parquet(str(tmp_path / "out"))
    got = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    local = {r["id"]: r for r in _local_two(folder, tmp_path)}
    assert sorted(got) == sorted(local) and len(local["r3"]["token_ids"]) == 1
    assert all(got[k]["token_ids"] == v["token_ids"] and got[k]["error"] is None and
               json.loads(got[k]["usage"]) == v["usage"] for k, v in local.items())


def test_ray_job_stopped_halfway_resumes_with_the_missing_rows(cluster, folder, tmp_path):
    from test_batch import _Crash, _CrashingStream

    rows = _write_rows(tmp_path / "in.jsonl", 120, seed=12)
    engine = RayEngine(str(folder), {"max_new_tokens": 3}, batch_size=20, workers=2)
    with pytest.raises(_Crash):  # the driver dies after 70 results: 60 rows committed
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", _CrashingStream(engine, after=70), chunk_size=30)
    assert sorted(p.name for p in (tmp_path / "out.jsonl.parts").iterdir()) == ["part-000000.jsonl",
                                                                                 "part-000001.jsonl"]
    again = _CrashingStream(engine, after=10**9)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", again, chunk_size=30)
    assert again.seen == [r["id"] for r in rows[60:]]  # only the missing rows ran
    assert (summary.skipped, summary.written) == (60, 60)
    got = _read(tmp_path / "out.jsonl")
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert got == _local(folder, tmp_path / "in.jsonl", tmp_path / "local.jsonl")


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_ray_engine_runs_an_encoder_decoder_model_as_the_local_engine_does(cluster, tmp_path, name):
    """An encoder-decoder folder through ``--engine ray``: each actor picks the generate engine
    (continuous batching runs decoder-only models), rows with beams, stop strings and their own
    lengths give the local engine's rows (text, decoder tokens after the start token, usage)."""
    import seq2seq_models as S

    import genkit

    folder = tmp_path / name
    S.save_with_tokenizer(S.build(name), str(folder))
    rows = [{"id": "a", "prompt": "w5 w6 w7 w8 w9 w10 w1"},
            {"id": "b", "prompt": "w20 w21 w1", "max_new_tokens": 3},
            {"id": "c", "prompt": "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w1", "num_beams": 3},
            {"id": "d", "prompt": "w40 w41 w42 w1", "stop_strings": ["w50", "w26"]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    engine = RayEngine(str(folder), {"max_new_tokens": 6}, batch_size=2, workers=2)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "ray.jsonl", engine, chunk_size=3)
    local = LocalEngine(genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder)), {"max_new_tokens": 6},
                        batch_size=2)
    run_batch(tmp_path / "in.jsonl", tmp_path / "local.jsonl", local, chunk_size=3)
    got, want = _read(tmp_path / "ray.jsonl"), _read(tmp_path / "local.jsonl")
    assert [r["id"] for r in got] == ["a", "b", "c", "d"] and (summary.written, summary.bad) == (4, 1)
    assert got == want
    assert len(got[1]["token_ids"]) <= 3 and all("error" not in r and r["token_ids"] for r in got)


def test_ray_engine_scores_prompts_as_the_local_engine_does(cluster, folder, tmp_path):
    """``--prompt-logprobs`` on Ray: every row's ``prompt_logprobs`` (through Ray as JSON text) within
    the bound of the model's forward over its prompt, and the rows otherwise the local engine's; a
    JSONL job and a Parquet one."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from test_batch_prompt_logprobs import K, _check_scores, _run_scored

    import genkit
    from genkit.batch import make_local_engine

    rows = _write_rows(tmp_path / "in.jsonl", 40, seed=8)
    model, tokenizer = genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder))
    engine = RayEngine(str(folder), {"max_new_tokens": 3}, batch_size=10, workers=2, prompt_logprobs=K)
    local = make_local_engine(model, tokenizer, {"max_new_tokens": 3}, batch_size=10, prompt_logprobs=K)
    _run_scored(tmp_path, model, tokenizer, rows, engine, local, 20)
    run_batch(tmp_path / "in.jsonl", tmp_path / "ray.parquet", engine, chunk_size=20)
    table = pq.read_table(tmp_path / "ray.parquet")
    assert "prompt_logprobs" in table.schema.names
    _check_scores(model, tokenizer, rows, table.to_pylist())
