"""One gate for continuous batching (issue 26): serve, batch, ``generate(cache_implementation="paged")``
and the manager ask :mod:`genkit.continuous.gate`; what it refuses runs on ``generate`` (serve,
batch, with the exact tokens ``generate`` gives) or is an error naming the field (the manager, the
paged cache). The tokenizer reaches ``generate`` from the CLI and batch (stop strings, recipes).

The server runs in this process (uvicorn on a thread, 127.0.0.1) on a tiny random Llama; a
word-level tokenizer of 128 words (one per token id) makes the text name each token."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401 - the fixture, requested by name

import genkit
from genkit.batch import ContinuousEngine, make_local_engine, run_batch
from genkit.continuous.gate import refusal_for_kwargs
from genkit.errors import ConfigError, NotSupportedError
from genkit.models.tiny import tiny_llama

PROMPT = [3, 4, 5, 6, 7]  # greedy, contrastive, DoLa and beams all differ from the first tokens on
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 128)]
EOS = 2


def _raw_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(WORDS[:3])
    return raw


SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.fixture(scope="module")
def tokenizer():
    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), SPECIALS)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=0)


def _text(ids: list[int]) -> str:
    return " ".join(WORDS[t] for t in ids)


def _reference(model, prompt: list[int], tokenizer=None, **kwargs) -> list[list[int]]:
    """``generate``'s new tokens per returned sequence, through the first EOS."""
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([prompt]), tokenizer=tokenizer, **kwargs)
    rows = []
    for row in out[:, len(prompt):].tolist():
        rows.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return rows


# -- the gate itself -------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "named"), [
    ({"penalty_alpha": 0.6, "top_k": 4}, "`penalty_alpha`=0.6 selects the strategy 'contrastive_search'"),
    ({"num_beams": 2}, "`num_beams`=2 selects the strategy 'beam_search'"),
    ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
     "`num_beam_groups`=2 selects the strategy 'group_beam_search'"),
    ({"num_beams": 2, "force_words_ids": [[5]]}, "`num_beams`=2 selects the strategy 'constrained_beam_search'"),
    ({"num_beams": 2, "constraints": [[5, 6]]}, "`num_beams`=2 selects the strategy 'constrained_beam_search'"),
    ({"dola_layers": "low"}, "`dola_layers`='low' selects the strategy 'dola_generation'"),
    ({"prompt_lookup_num_tokens": 3}, "`prompt_lookup_num_tokens`=3 selects the strategy 'assisted'"),
    ({"guidance_scale": 1.5}, "`guidance_scale`=1.5: classifier-free guidance"),
    ({"watermarking_config": {"bias": 2.0}}, "`watermarking_config`="),
    ({"do_sample": True, "num_return_sequences": 2}, "`num_return_sequences`=2: continuous batching runs one"),
    ({"custom_generate": "greedy"}, "`custom_generate` is set: a custom generate"),
    ({"top_k": -1}, "`top_k` must be an int >= 0"),  # generate's own error: the generate engine reports it
])
def test_the_gate_names_the_field(kwargs, named):
    why = refusal_for_kwargs(None, kwargs)
    assert why is not None and named in why


@pytest.mark.parametrize("kwargs", [{}, {"do_sample": True, "top_k": 4, "temperature": 0.7}, {"guidance_scale": 1},
                                    {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 3}])
def test_the_gate_lets_greedy_and_sampling_through(kwargs):
    assert refusal_for_kwargs(None, kwargs) is None


# -- the paged cache and the manager refuse, naming the field ---------------------------------------
def test_paged_generate_refuses_what_continuous_batching_cannot_run(model):
    ids = torch.tensor([PROMPT])
    with pytest.raises(NotSupportedError, match=r"cache_implementation=\"paged\" .*cannot run this request: "
                                                r"`num_beams`=2 selects the strategy 'beam_search'"):
        genkit.generate(model, ids, max_new_tokens=4, num_beams=2, cache_implementation="paged")
    with pytest.raises(NotSupportedError, match=r"`penalty_alpha`=0.6 selects the strategy 'contrastive_search'"):
        genkit.generate(model, ids, max_new_tokens=4, penalty_alpha=0.6, top_k=4, cache_implementation="paged")
    with pytest.raises(NotSupportedError, match=r"`dola_layers`='low'"):
        model.generate(ids, max_new_tokens=4, dola_layers="low", cache_implementation="paged")
    out = genkit.generate(model, ids, max_new_tokens=4, cache_implementation="paged", eos_token_id=None)
    assert out[0, len(PROMPT):].tolist() == _reference(model, PROMPT, max_new_tokens=4, eos_token_id=None)[0]


def test_the_manager_refuses_contrastive_search_naming_the_field(model):
    from genkit.continuous import RequestStatus

    with model.init_continuous_batching() as manager:
        rid = manager.add_request(PROMPT, max_new_tokens=4, penalty_alpha=0.6, top_k=4)
        out = manager.get_result(rid, timeout=30)
    assert out.status == RequestStatus.FAILED
    assert "`penalty_alpha`=0.6 selects the strategy 'contrastive_search'" in out.error


# -- genkit serve ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serving(app, engine: str = "ContinuousEngine", send_buffer: int | None = None, **config):
    """``app`` served by uvicorn on 127.0.0.1 in a thread (``config``: more of uvicorn's settings),
    on the engine of class ``engine``; yields its base URL. ``send_buffer``: its connections' kernel
    send buffer in bytes (SO_SNDBUF, which they take from the listening socket), so that a client
    that does not read fills it with a few kB, not the megabytes Linux grows it to."""
    uvicorn = pytest.importorskip("uvicorn")
    port = _free_port()
    sockets = None
    if send_buffer is not None:
        from genkit.serve.lifecycle import bind

        sockets = [bind("127.0.0.1", port)]
        sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                        **config))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert type(app.state.genkit.engine).__name__ == engine
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)
        app.state.genkit.engine.shutdown(30)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.serve import build_app

    with _serving(build_app(model, tokenizer=tokenizer, model_name="tiny")) as base:
        yield base


@pytest.fixture(scope="module")
def generate_server(model, tokenizer):
    """The same model served by the generate engine alone (as a model without a paged cache is)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.serve import build_app
    from genkit.serve.engine import GenerateEngine

    app = build_app(model, tokenizer=tokenizer, model_name="tiny", engine=GenerateEngine(model, tokenizer))
    with _serving(app, engine="GenerateEngine") as base:
        yield base


def _post(base: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _complete(base: str, body: dict) -> list[str]:
    """Each choice's text: from one JSON response, or assembled from the stream's events."""
    status, raw = _post(base, {"model": "tiny", "prompt": PROMPT, **body})
    assert status == 200, raw.decode()
    if not body.get("stream"):
        return [c["text"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])]
    texts: dict[int, str] = {}
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return [texts[i] for i in sorted(texts)]


def _words(ids: list[int]) -> str:
    """The text the server sends for ``ids`` (special tokens skipped)."""
    return _text([t for t in ids if t >= len(SPECIALS)])


# settings continuous batching cannot run: the server runs them on generate, with generate's tokens
OTHER_STRATEGIES = [
    {"penalty_alpha": 0.6, "top_k": 4},
    {"dola_layers": "low"},
    {"num_beams": 2},
    {"guidance_scale": 1.5},
    {"watermarking_config": {"bias": 4.0}},
]


@pytest.mark.parametrize("settings", OTHER_STRATEGIES, ids=lambda s: next(iter(s)))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_serve_runs_other_strategies_on_generate(server, model, settings, stream):
    want = _reference(model, PROMPT, max_new_tokens=8, **settings)[0]
    assert want != _reference(model, PROMPT, max_new_tokens=8)[0]  # continuous batching's greedy would differ
    got = _complete(server, {"max_tokens": 8, "temperature": 0, "stream": stream, **settings})
    assert got == [_words(want)]


def test_serve_beams_with_n_choices(server, model):
    """``n`` is the best ``n`` hypotheses of one beam search, with or without a seed."""
    want = _reference(model, PROMPT, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    for stream in (False, True):
        for seed in ({}, {"seed": 3}):
            got = _complete(server, {"max_tokens": 8, "temperature": 0, "n": 2, "num_beams": 3, "stream": stream,
                                     **seed})
            assert got == [_words(w) for w in want]


def _seeded(model, seed: int, **settings) -> str:
    """The text of ``torch.manual_seed(seed)`` then ``generate`` sampling 8 tokens of PROMPT (one row)."""
    torch.manual_seed(seed)
    return _words(_reference(model, PROMPT, max_new_tokens=8, do_sample=True, temperature=1.0, **settings)[0])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_choice_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i_on_either_engine(
        server, generate_server, model, stream):
    """vLLM's rule on both engines: choice ``i`` of a request with ``seed`` s draws what the one-choice
    request with seed ``s + i`` draws (``generate`` after ``torch.manual_seed(s + i)``). The generate
    engine sampled the n choices as n rows after ``torch.manual_seed(s)``: other choices than continuous
    batching's, and a choice 0 other than the one-choice request's."""
    want = [_seeded(model, 5 + i) for i in range(3)]
    assert len(set(want)) == 3
    body = {"max_tokens": 8, "temperature": 1.0, "stream": stream}
    for base in (server, generate_server):
        assert _complete(base, {**body, "n": 3, "seed": 5}) == want, base
        assert [_complete(base, {**body, "seed": 5 + i})[0] for i in range(3)] == want, base
        unseeded = _complete(base, {**body, "n": 3})
        assert len(set(unseeded)) == 3, unseeded  # without a seed the choices still differ


def test_a_seeded_request_leaves_the_global_generator_as_it_was(generate_server):
    """A seeded request draws from its own seed and puts torch's global generator back: the draws
    after it are those the process would have made without it (it had left the generator seeded,
    so every unseeded request after it drew predictable tokens)."""
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    _complete(generate_server, {"max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 5})
    _complete(generate_server, {"max_tokens": 4, "temperature": 1.0, "seed": 7})
    assert torch.equal(torch.rand(4), want)


def test_a_seeded_choice_has_the_log_probabilities_of_the_request_seeded_seed_plus_i(server, generate_server):
    def logprobs(base: str, **fields) -> list[dict]:
        status, raw = _post(base, {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
                                   "logprobs": 2, **fields})
        assert status == 200, raw.decode()
        return [c["logprobs"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])]

    want = [logprobs(server, seed=5 + i)[0] for i in range(3)]
    for base in (server, generate_server):
        got = logprobs(base, n=3, seed=5)
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want], base
        for g, w in zip(got, want):
            assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-5)
            assert [list(t) for t in g["top_logprobs"]] == [list(t) for t in w["top_logprobs"]]


@pytest.mark.parametrize("settings", [{"watermarking_config": {"bias": 4.0}}, {"custom_generate": "sample"}],
                         ids=lambda s: next(iter(s)))
def test_a_seeded_sampling_strategy_continuous_batching_hands_to_generate_follows_the_rule(server, model, settings):
    """A sampled request continuous batching refuses runs on the generate engine beside it, with the
    same rule: choice ``i`` is the one-choice request seeded ``seed + i``."""
    want = [_seeded(model, 9 + i, **{k: v for k, v in settings.items() if k != "custom_generate"})
            for i in range(3)]
    assert len(set(want)) == 3
    assert _complete(server, {"max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 9, **settings}) == want


def test_serve_and_batch_run_a_recipe_with_the_tokenizer(model, tokenizer, tmp_path, hub_server):  # noqa: F811
    """The recipe, published on the (test) Hub and allowed by the operator, reads the tokenizer
    through serve; batch runs the same recipe from its folder."""
    pytest.importorskip("starlette")
    from hub_server import write_recipe

    from genkit.serve import build_app

    full = _reference(model, PROMPT, max_new_tokens=8, eos_token_id=None)[0]
    want = _reference(model, PROMPT, max_new_tokens=8, eos_token_id=full[3])[0]
    assert len(want) == 4
    # the server takes no recipe options in the body: the recipe's default names the word
    source = RECIPE.replace('stop_word="w3"', f'stop_word="{WORDS[full[3]]}"')
    recipe = write_recipe(tmp_path / "recipe", {"custom_generate/generate.py": source})
    hub_server.state.create_repo("org/stopword")
    hub_server.state.commit("org/stopword", {str(p.relative_to(recipe)): p.read_bytes()
                                             for p in recipe.rglob("*") if p.is_file()})
    app = build_app(model, tokenizer=tokenizer, model_name="tiny", trust_remote_code=True,
                    allowed_recipes=["org/stopword"])
    with _serving(app) as base:
        for stream in (False, True):
            got = _complete(base, {"max_tokens": 8, "temperature": 0, "stream": stream,
                                   "custom_generate": "org/stopword"})
            assert got == [_words(want)]
        # a folder named by a client is never run, even with the same recipe in it
        status, raw = _post(base, {"model": "tiny", "prompt": _text(PROMPT), "max_tokens": 8,
                                   "custom_generate": str(recipe)})
        assert status == 403 and b"custom_generate" in raw
    _rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": _text(PROMPT)}])
    engine = make_local_engine(model, tokenizer, {"max_new_tokens": 8}, custom_generate=str(recipe))
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    assert _read(tmp_path / "out.jsonl")[0]["token_ids"] == want


@pytest.mark.parametrize("settings", [{"penalty_alpha": 0.6, "top_k": 4}, {"dola_layers": "low"},
                                      {"custom_generate": "greedy"}], ids=lambda s: next(iter(s)))
def test_serve_n_choices_of_a_deterministic_strategy_on_generate(server, model, settings):
    """``n`` greedy choices are n equal texts on either engine; on generate a deterministic strategy
    refused ``num_return_sequences`` once the request ran (a 400 after the queue, an error event in a
    200 stream)."""
    want = _reference(model, PROMPT, max_new_tokens=8, **{k: v for k, v in settings.items() if k != "custom_generate"})
    for stream in (False, True):
        got = _complete(server, {"max_tokens": 8, "temperature": 0, "n": 2, "stream": stream, **settings})
        assert got == [_words(want[0])] * 2


@pytest.mark.parametrize(("fields", "param"), [({"logprobs": 2}, "logprobs"), ({"n": 1, "best_of": 2}, "best_of"),
                                               ({"logprobs": 2, "stream": True}, "logprobs")])
def test_serve_refuses_logprobs_with_beams(server, fields, param):
    """Before anything is queued, naming the field (it was a failed generation, param null, or an
    error event in a 200 stream)."""
    status, raw = _post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "num_beams": 2, **fields})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, raw
    assert "cannot be reported with beam search" in error["message"] or "beam search (num_beams > 1) does not report" \
        in error["message"]


def test_serve_greedy_and_sampling_still_batch_continuously(server, model):
    assert _complete(server, {"max_tokens": 8, "temperature": 0}) == \
        [_words(_reference(model, PROMPT, max_new_tokens=8)[0])]


# -- genkit batch ----------------------------------------------------------------------------------
def _rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_batch_rows_of_other_strategies_and_stop_strings_run_on_generate(tmp_path, model, tokenizer):
    stop_word = _text([_reference(model, PROMPT, max_new_tokens=8)[0][2]])
    settings = [{}, *OTHER_STRATEGIES, {"stop_strings": [stop_word]}, {"do_sample": True, "top_k": 1}]
    rows = [{"id": f"r{i}", "prompt": _text(PROMPT), **s} for i, s in enumerate(settings)]
    _rows(tmp_path / "in.jsonl", rows)
    engine = make_local_engine(model, tokenizer, {"max_new_tokens": 8}, batch_size=2)  # auto
    assert isinstance(engine, ContinuousEngine)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    assert summary.bad == 0, (tmp_path / "out.jsonl.errors.jsonl").read_text()
    out = _read(tmp_path / "out.jsonl")
    for row, s in zip(out, settings):
        assert row["token_ids"] == _reference(model, PROMPT, tokenizer, max_new_tokens=8, **s)[0], s
    assert out[-2]["text"].endswith(stop_word) and len(out[-2]["token_ids"]) == 3  # the stop string ended it


def test_batch_rows_sharing_stop_strings_end_at_them(tmp_path, model, tokenizer):
    """Rows with the same settings share a left-padded batch; one a stop string ends early has no
    padding after its tokens."""
    prompts = [PROMPT, [10, 20, 30, 40], [5, 6, 7]]
    stop_word = _text([_reference(model, PROMPT, max_new_tokens=8)[0][1]])
    _rows(tmp_path / "in.jsonl", [{"id": str(i), "prompt": _text(p)} for i, p in enumerate(prompts)])
    engine = make_local_engine(model, tokenizer, {"max_new_tokens": 8, "stop_strings": [stop_word]}, batch_size=4)
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine)
    out = _read(tmp_path / "out.jsonl")
    for row, p in zip(out, prompts):
        assert row["token_ids"] == _reference(model, p, tokenizer, max_new_tokens=8, stop_strings=[stop_word])[0]
    assert len(out[0]["token_ids"]) == 2


def test_batch_continuous_refuses_naming_the_field(tmp_path, model, tokenizer, tiny_hf_dir, capsys):
    with pytest.raises(ConfigError, match=r"`batching='continuous'` cannot run this job: `penalty_alpha`=0.6 "
                                          r"selects the strategy 'contrastive_search'"):
        make_local_engine(model, tokenizer, {"penalty_alpha": 0.6, "top_k": 4}, batching="continuous")
    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    _rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "w3 w4"}])
    rc = main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", str(folder),
               "--batching", "continuous", "--num-beams", "2"])
    assert rc == 2
    assert "cannot run this job: `num_beams`=2 selects the strategy 'beam_search'" in capsys.readouterr().err


# -- the CLI passes its tokenizer ------------------------------------------------------------------
def _model_folder(tiny_hf_dir, folder: Path) -> Path:
    shutil.copytree(tiny_hf_dir, folder)
    _raw_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(SPECIALS))
    return folder


def test_cli_generate_stops_at_a_stop_string_without_stream(tmp_path, tiny_hf_dir):
    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    ours, tok = genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder))
    prompt = tok("w3 w4 w5")["input_ids"]
    full = _reference(ours, prompt, max_new_tokens=10, eos_token_id=None)[0]
    stop = WORDS[full[3]]
    want = _reference(ours, prompt, tok, max_new_tokens=10, stop_strings=[stop])[0]
    assert want == full[:full.index(full[3]) + 1]  # generate stops at the first occurrence
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "genkit", "generate", "--model", str(folder), "--prompt",
                           "w3 w4 w5", "--max-new-tokens", "10", "--set", f"stop_strings={json.dumps([stop])}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tok.decode(want, skip_special_tokens=True)


RECIPE = '''
import genkit


def generate(model, inputs=None, *, stop_word="w3", tokenizer=None, **kwargs):
    if tokenizer is None:
        raise ValueError("this recipe needs `tokenizer`")
    (word_id,) = tokenizer(stop_word)["input_ids"]
    return genkit.generate(model, inputs, eos_token_id=word_id, **kwargs)
'''


def test_cli_hands_a_recipe_the_tokenizer(tmp_path, tiny_hf_dir, capsys):
    from hub_server import write_recipe

    from genkit.cli import main

    folder = _model_folder(tiny_hf_dir, tmp_path / "model")
    recipe = write_recipe(tmp_path / "recipe", {"custom_generate/generate.py": RECIPE})
    ours, tok = genkit.load_model(str(folder)), genkit.load_tokenizer(str(folder))
    prompt = tok("w3 w4 w5")["input_ids"]
    full = _reference(ours, prompt, max_new_tokens=10, eos_token_id=None)[0]
    word = WORDS[full[4]]
    want = _reference(ours, prompt, max_new_tokens=10, eos_token_id=full[4])[0]
    assert len(want) <= 5
    rc = main(["generate", "--model", str(folder), "--prompt", "w3 w4 w5", "--max-new-tokens", "10",
               "--custom-generate", str(recipe), "--set", f"stop_word={word}"])
    assert rc == 0
    assert capsys.readouterr().out.strip() == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize(("name", "sample"), [("greedy", True), ("sample", False)])
def test_a_named_strategy_against_do_sample_is_refused(model, server, name, sample):
    """``custom_generate`` names a strategy that runs whatever the settings say: greedy search with
    do_sample=True (or serve's temperature > 0) ran greedy, the sampling ignored; now refused, in generate
    and as a 400 before anything is queued."""
    with pytest.raises(genkit.errors.ConfigError, match=rf"`custom_generate`='{name}' does not run with `do_sample`="
                                                         rf"{sample}: it (does not sample|samples)"):
        genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=2, custom_generate=name, do_sample=sample)
    status, raw = _post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "custom_generate": name,
                                 "temperature": 0.7 if sample else 0})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "custom_generate" and "does not run with `do_sample`" in error["message"]
    out = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=2, custom_generate=name, eos_token_id=None)
    assert out.shape == (1, 2 + len(PROMPT))


def test_a_prompt_holding_the_pad_id_reads_it_on_either_engine(server, generate_server, model):
    """Every token of a served prompt counts, the model's pad id (0 here) among them, as on continuous
    batching and in vLLM: the generate engine passed no mask, and generate masked the pad id (its rule
    for a left-padded batch given without one), so the same request got other tokens there."""
    prompt = [3, 4, 0, 5, 6]
    kw = {"max_new_tokens": 6, "eos_token_id": None}
    want = _reference(model, prompt, attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)[0]
    assert want != _reference(model, prompt, **kw)[0]  # generate without a mask reads another prompt
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False}
    for base in (server, generate_server):
        status, raw = _post(base, body)
        assert status == 200, raw.decode()
        assert json.loads(raw)["choices"][0]["text"].split() == [WORDS[t] for t in want], base
