"""``genkit serve`` and ``genkit batch`` on encoder-decoder (text-to-text) models, as vLLM and TGI
serve T5 and BART: the prompt is the encoder's input, the completion the decoder's text after its
start token. They run on the generate engines (continuous batching refuses such models); the
reference is ``genkit.generate`` on the same model (itself compared with transformers in
tests/test_encoder_decoder.py), decoded with the same tokenizer.

The models are tests/seq2seq_models.py's tiny random T5 (relative positions: no position table)
and BART (64 positions, its decoder starting from its EOS token, ``forced_eos_token_id``), saved
with a word-level tokenizer (``w0`` ... ``w95``, one word per token id) and loaded by
``genkit.load_model`` through the transformers adapter. Servers run in this process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import seq2seq_models as S
import torch
from serve_client import post_json
from test_engine_gate import _free_port, _serving

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.strategy import eos_token_ids

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

PROMPT = "w5 w6 w7 w8 w9 w10 w1"
T5_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _save(name: str, folder: Path, tokenizer_config: dict | None = None) -> str:
    S.save_with_tokenizer(S.build(name), str(folder))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """T5 with a chat template and the tokenizer's ``model_max_length`` (32); BART with neither."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("seq2seq")
    return {"t5": _save("t5", root / "t5", {"model_max_length": 32, "chat_template": T5_TEMPLATE}),
            "bart": _save("bart", root / "bart")}


@pytest.fixture(scope="module")
def loaded(folders):
    return {name: (genkit.load_model(folder), genkit.load_tokenizer(folder)) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def servers(folders):
    """Each folder served as ``genkit serve`` loads it (``build_app`` of the folder: ``load_model``,
    ``load_tokenizer``, ``make_engine``); base URLs by name."""
    from contextlib import ExitStack

    from genkit.serve import build_app

    with ExitStack() as stack:
        yield {name: stack.enter_context(_serving(build_app(folder, model_name=name), engine="GenerateEngine"))
               for name, folder in folders.items()}


def _new_tokens(model, ids: list[int], seed: int | None = None, **kwargs) -> list[list[int]]:
    """``generate``'s decoder tokens after the start token, per returned sequence, through the first EOS."""
    eos = set(eos_token_ids(kwargs.get("eos_token_id", model.generation_config.eos_token_id)))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([ids]), **kwargs)
    rows = []
    for row in out[:, 1:].tolist():
        cut = next((k for k, t in enumerate(row) if t in eos), None)
        rows.append(row if cut is None else row[:cut + 1])
    return rows


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _complete(base: str, name: str, body: dict, path: str = "/v1/completions") -> dict:
    """The response of a completion (``stream``: its events assembled into the same shape)."""
    body = {"model": name, **body}
    if not body.get("stream"):
        status, out = post_json(base, path, body, timeout=120)
        assert status == 200, out
        return out
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        raw = r.read().decode()
    choices: dict[int, dict] = {}
    usage = None
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for c in event["choices"]:
            got = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None})
            got["text"] += c["text"] if "text" in c else c["delta"].get("content", "")
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _texts(out: dict) -> list[str]:
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


# -- /v1/completions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_a_completion_is_the_decoders_text_after_its_start_token(servers, loaded, name, stream, as_ids):
    """Text or token ids: the encoder's input; ``usage`` counts the encoder's tokens and the
    decoder's new ones; BART's forced EOS at ``max_tokens`` ends it with ``stop`` (as generate's
    finish decision), T5 runs to ``length``."""
    model, tok = loaded[name]
    ids = tok.encode(PROMPT)
    want = _new_tokens(model, ids, max_new_tokens=9)[0]
    body = {"prompt": ids if as_ids else PROMPT, "max_tokens": 9, "stream": stream, "temperature": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = _complete(servers[name], name, body)
    assert _texts(out) == [_text(tok, want)]
    assert out["choices"][0]["finish_reason"] == ("stop" if name == "bart" else "length")
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                            "total_tokens": len(ids) + len(want)}
    assert model.generation_config.decoder_start_token_id not in want[:1]  # the start token is not in the text


def test_an_eos_and_a_stop_string_end_a_choice_with_stop(servers, loaded):
    model, tok = loaded["t5"]
    ids = tok.encode(PROMPT)
    greedy = _new_tokens(model, ids, max_new_tokens=9)[0]
    eos = greedy[3]  # a token of the decoder's text as its EOS: the choice ends there
    want = _new_tokens(model, ids, max_new_tokens=9, eos_token_id=eos)[0]
    assert want == greedy[:4]
    for stream in (False, True):
        out = _complete(servers["t5"], "t5", {"prompt": PROMPT, "max_tokens": 9, "eos_token_id": eos,
                                              "stream": stream})
        assert out["choices"][0] == {**out["choices"][0], "text": _text(tok, want), "finish_reason": "stop"}
        stop = f"w{greedy[2]}"
        out = _complete(servers["t5"], "t5", {"prompt": PROMPT, "max_tokens": 9, "stop": [stop], "stream": stream})
        full = _text(tok, greedy)
        assert out["choices"][0]["text"] == full[:full.index(stop)]
        assert out["choices"][0]["finish_reason"] == "stop"


def _sampled(model, ids: list[int], seed: int, new: int = 8) -> list[int]:
    return _new_tokens(model, ids, seed=seed, max_new_tokens=new, do_sample=True, temperature=1.0)[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_choice_i_of_a_seeded_request_draws_what_seed_plus_i_draws(servers, loaded, stream):
    """The rule on main (vLLM's): choice ``i`` of a request seeded ``s`` is ``generate`` after
    ``torch.manual_seed(s + i)``."""
    model, tok = loaded["bart"]
    ids = tok.encode(PROMPT)
    want = [_text(tok, _sampled(model, ids, 5 + i)) for i in range(3)]
    assert len(set(want)) == 3
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "stream": stream}
    assert _texts(_complete(servers["bart"], "bart", {**body, "n": 3, "seed": 5})) == want
    assert _texts(_complete(servers["bart"], "bart", {**body, "seed": 6})) == want[1:2]


def test_logprobs_are_the_decoders_and_best_of_returns_the_most_likely(servers, loaded):
    """``logprobs``: each decoder token's log-probability under the scores ``generate`` chose it
    from (``output_scores``), and that many alternatives; ``best_of`` 3 returns the choice (of the
    seeds ``s``, ``s + 1``, ``s + 2``) with the highest mean log-probability per token."""
    model, tok = loaded["t5"]
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([ids]), max_new_tokens=6, output_scores=True,
                              return_dict_in_generate=True)
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    tokens = out.sequences[0, 1:].tolist()
    got = _complete(servers["t5"], "t5", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2})["choices"][0]["logprobs"]
    assert got["tokens"] == [tok.decode([t]) for t in tokens]
    assert got["token_logprobs"] == pytest.approx([float(lp[t]) for lp, t in zip(logprobs, tokens)], abs=1e-4)
    assert [list(top) for top in got["top_logprobs"]] == [[tok.decode([t]) for t in lp.topk(2).indices.tolist()]
                                                           for lp in logprobs]
    model, tok = loaded["bart"]  # (T5's tiny model samples alike under most seeds)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0}
    means = {}
    for i in range(3):
        choice = _complete(servers["bart"], "bart", {**body, "seed": 11 + i, "logprobs": 0})["choices"][0]
        assert choice["text"] == _text(tok, _sampled(model, tok.encode(PROMPT), 11 + i, 6))
        means[choice["text"]] = sum(choice["logprobs"]["token_logprobs"]) / len(choice["logprobs"]["token_logprobs"])
    assert len(means) == 3
    best = _complete(servers["bart"], "bart", {**body, "seed": 11, "best_of": 3})
    assert _texts(best) == [max(means, key=means.__getitem__)]


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_beam_search_returns_generates_n_best_hypotheses(servers, loaded, name):
    """``num_beams`` with ``n``, and vLLM's ``use_beam_search`` (``n`` beams), streamed or not:
    the decoder's text of each hypothesis, not cut at the encoder prompt's length."""
    model, tok = loaded[name]
    ids = tok.encode(PROMPT)
    want = [_text(tok, t) for t in _new_tokens(model, ids, max_new_tokens=8, num_beams=3, num_return_sequences=2)]
    two = [_text(tok, t) for t in _new_tokens(model, ids, max_new_tokens=8, num_beams=2, num_return_sequences=2)]
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 8, "n": 2, "stream": stream}
        assert _texts(_complete(servers[name], name, {**body, "num_beams": 3})) == want
        assert _texts(_complete(servers[name], name, {**body, "use_beam_search": True})) == two


def test_a_transformers_model_object_is_served_as_its_folder(loaded):
    """``build_app`` of a transformers T5 object (not loaded by genkit): the same engine, limits and
    text as the folder's (it is run through genkit's adapter, as ``generate`` runs it)."""
    from genkit.serve import build_app

    model, tok = loaded["t5"]
    app = build_app(model.hf_model, tokenizer=tok, model_name="t5")
    want = [_text(tok, t) for t in _new_tokens(model, tok.encode(PROMPT), max_new_tokens=8, num_beams=3,
                                               num_return_sequences=2)]
    with _serving(app, engine="GenerateEngine") as base:
        assert _get(base + "/v1/models")["data"][0]["max_model_len"] == 32
        assert _texts(_complete(base, "t5", {"prompt": PROMPT, "max_tokens": 8, "n": 2, "num_beams": 3})) == want


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"echo": True}, "echo", "`echo` is not supported for an encoder-decoder model: the prompt is the encoder's input"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature",
     "`use_beam_search` runs beam search, which does not sample"),
    ({"use_beam_search": True, "num_beams": 4}, "use_beam_search", "`use_beam_search` sets `num_beams` (to `n`)"),
    ({"use_beam_search": True, "best_of": 2}, "best_of", "`best_of` must be `n`"),
    # checked before the request is queued: a stream answered 200, then an error event naming no field
    ({"dola_layers": "low", "stream": True}, "dola_layers", "`dola_layers` (DoLa) is supported for decoder-only "
     "models only"),
    ({"guidance_scale": 2.0, "stream": True}, "guidance_scale", "`guidance_scale` (classifier-free guidance) is "
     "supported for decoder-only models only"),
])
def test_settings_an_encoder_decoder_request_cannot_take_are_a_400_naming_them(servers, body, param, message):
    status, out = post_json(servers["t5"], "/v1/completions", {"model": "t5", "prompt": PROMPT, **body}, timeout=60)
    assert status == 400 and out["error"]["param"] == param and message in out["error"]["message"], out


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_renders_the_template_into_the_encoders_input(servers, loaded):
    model, tok = loaded["t5"]
    messages = [{"role": "user", "content": "w5 w6 w7"}, {"role": "user", "content": "w8 w9"}]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert ids == tok.encode("w5 w6 w7 w8 w9")
    want = _new_tokens(model, ids, max_new_tokens=7)[0]
    for stream in (False, True):
        out = _complete(servers["t5"], "t5", {"messages": messages, "max_tokens": 7, "stream": stream},
                        path="/v1/chat/completions")
        text = out["choices"][0]["message"]["content"] if not stream else out["choices"][0]["text"]
        assert text == _text(tok, want)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_without_a_chat_template_says_so(servers, path):
    status, out = post_json(servers["bart"], path, {"model": "bart", "messages": [{"role": "user", "content": "w5"}]},
                            timeout=60)
    assert status == 400 and out["error"]["param"] == "messages"
    assert out["error"]["message"] == (
        "this model's tokenizer has no chat template, so chat messages cannot be rendered: send the text to "
        "/v1/completions, or start the server with `genkit serve --chat-template TEMPLATE`")


# -- max_model_len, /tokenize, /detokenize, /v1/models -----------------------------------------------------
def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_max_model_len_is_the_position_table_else_the_tokenizers_length(servers, loaded):
    """BART: its 64 positions; T5 (relative positions): the tokenizer's ``model_max_length``."""
    for name, length in (("t5", 32), ("bart", 64)):
        assert _get(servers[name] + "/v1/models")["data"][0]["max_model_len"] == length
        status, out = post_json(servers[name], "/tokenize", {"model": name, "prompt": "w5 w6 w7"}, timeout=60)
        assert (status, out) == (200, {"count": 3, "max_model_len": length, "tokens": [5, 6, 7]})
        status, out = post_json(servers[name], "/detokenize", {"model": name, "tokens": [5, 6, 7]}, timeout=60)
        assert (status, out) == (200, {"prompt": "w5 w6 w7"})


def test_the_prompt_and_the_decoder_each_fit_max_model_len(servers, loaded):
    """An encoder-decoder model's prompt and its decoder's tokens do not share a context: the
    prompt may have max_model_len tokens, and the decoder its start token + max_model_len - 1."""
    model, tok = loaded["t5"]
    full = [5 + i % 80 for i in range(32)]
    out = _complete(servers["t5"], "t5", {"prompt": full, "max_tokens": 31})
    assert _texts(out) == [_text(tok, _new_tokens(model, full, max_new_tokens=31)[0])]
    for body, param, message in [
        ({"prompt": [*full, 5]}, "prompt", "the prompt has 33 tokens; this model's encoder takes 32 tokens"),
        ({"prompt": full, "max_tokens": 32}, "max_tokens",
         "`max_tokens` is 32, but this model's decoder takes 32 tokens, its start token among them: at most 31"),
    ]:
        status, err = post_json(servers["t5"], "/v1/completions", {"model": "t5", **body}, timeout=60)
        assert status == 400 and err["error"]["param"] == param and err["error"]["message"] == message
        assert err["error"]["code"] == "context_length_exceeded"


def test_the_default_max_model_len_of_a_model_without_positions(loaded):
    """No position table and no tokenizer limit (transformers writes int(1e30) for none): vLLM's
    fallback, 2048; a decoder-only model keeps its ``max_position_embeddings`` (or none)."""
    from types import SimpleNamespace

    from genkit.serve.limits import SEQ2SEQ_FALLBACK_LEN, default_max_model_len, position_limit

    t5 = loaded["t5"][0]
    assert position_limit(t5) is None and position_limit(loaded["bart"][0]) == 64
    for length in (None, int(1e30)):
        assert default_max_model_len(t5, SimpleNamespace(model_max_length=length)) == SEQ2SEQ_FALLBACK_LEN == 2048
    assert default_max_model_len(t5, SimpleNamespace(model_max_length=512)) == 512
    decoder_only = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=None))
    assert default_max_model_len(decoder_only, SimpleNamespace(model_max_length=512)) is None


# -- the engines --------------------------------------------------------------------------------------------
def test_the_engines_pick_generate_and_continuous_batching_still_refuses(loaded):
    from genkit.batch import LocalEngine, make_local_engine
    from genkit.serve.engine import GenerateEngine
    from genkit.serve.engines import make_engine

    model, tok = loaded["t5"]
    engine = make_engine(model, tok)
    try:
        assert type(engine) is GenerateEngine
    finally:
        engine.shutdown(10)
    with pytest.raises(ConfigError, match=r"--scheduler and --max-batch-tokens need continuous batching: "
                                          r"T5ForConditionalGeneration is an encoder-decoder model"):
        make_engine(model, tok, scheduler="fifo")
    assert type(make_local_engine(model, tok, {"max_new_tokens": 4})) is LocalEngine
    with pytest.raises(ConfigError, match=r"`batching='continuous'` cannot run this job: T5ForConditionalGeneration "
                                          r"is an encoder-decoder model: continuous batching runs decoder-only"):
        make_local_engine(model, tok, {"max_new_tokens": 4}, batching="continuous")
    with pytest.raises(NotSupportedError, match="continuous batching cannot run this model: T5ForConditional"):
        genkit.generate_batch(model, [[5, 6, 7]], max_new_tokens=2)


@pytest.mark.parametrize(("name", "input_name"), [("whisper", "input_features"), ("vision", "pixel_values")])
def test_audio_and_image_encoders_are_refused_naming_their_input(name, input_name):
    from genkit.batch import make_local_engine
    from genkit.models.seq2seq import TransformersSeq2SeqAdapter
    from genkit.serve.engines import make_engine

    raw = S.build(name)
    cls = type(raw).__name__
    for what, make in (("genkit serve", make_engine), ("genkit batch", make_local_engine)):
        for model in (raw, TransformersSeq2SeqAdapter(raw)):  # a transformers model, or genkit's adapter of it
            with pytest.raises(NotSupportedError) as info:
                make(model, None)
            assert str(info.value) == (f"{what} reads text prompts, but {cls}'s encoder reads `{input_name}` (audio "
                                       f"or images): run it from Python with genkit.generate(model, {input_name}=...) "
                                       "(docs/encoder_decoder.md)")


# -- genkit batch -------------------------------------------------------------------------------------------
ROWS = [
    {"id": "a", "prompt": PROMPT},
    {"id": "b", "prompt": "w20 w21 w1"},  # shorter: padded on the right beside a
    {"id": "c", "prompt": "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w1"},
    {"id": "d", "prompt": PROMPT, "num_beams": 3},
    {"id": "e", "prompt": "w40 w41 w42 w1", "stop_strings": ["w50", "w26"]},  # T5's 2nd token, BART's 4th
]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_batch_rows_are_the_servers_completions(tmp_path, folders, servers, loaded, name):
    """``genkit batch`` on the model's folder: each row's text, tokens, finish reason and usage are
    what the server answers for it, and ``generate``'s tokens (a row's ``stop_strings`` end it as
    ``generate``'s do, the stop string kept, where the server's OpenAI ``stop`` cuts the text before it)."""
    from genkit.cli import main

    model, tok = loaded[name]
    _write(tmp_path / "in.jsonl", ROWS)
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", folders[name],
                 "--max-new-tokens", "7", "--batch-size", "4"]) == 0
    got = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert list(got) == [r["id"] for r in ROWS]
    for row in ROWS:
        settings = {k: v for k, v in row.items() if k not in ("id", "prompt")}
        fields = {"num_beams": settings["num_beams"]} if "num_beams" in settings else {}
        if "stop_strings" in settings:
            fields["stop"] = settings["stop_strings"]
        served = _complete(servers[name], name, {"prompt": row["prompt"], "max_tokens": 7, "temperature": 0,
                                                 **fields})
        ids = tok.encode(row["prompt"])
        want = _new_tokens(model, ids, max_new_tokens=7, tokenizer=tok, **settings)[0]
        assert got[row["id"]]["token_ids"] == want, row
        text = _text(tok, want)
        assert got[row["id"]]["text"] == text, row
        stop = next((s for s in settings.get("stop_strings", []) if s in text), None)
        assert _texts(served)[0] == (text if stop is None else text[:text.index(stop)]), row
        if "stop_strings" in settings:  # the stop string ended the row
            assert stop is not None and len(want) < 7 and served["choices"][0]["finish_reason"] == "stop", want
        assert got[row["id"]]["finish_reason"] == served["choices"][0]["finish_reason"], row
        assert got[row["id"]]["usage"] == served["usage"], row


def test_genkit_batch_continuous_says_why_it_cannot(tmp_path, folders, capsys):
    from genkit.cli import main

    _write(tmp_path / "in.jsonl", ROWS[:1])
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--model", folders["t5"],
                 "--batching", "continuous"]) == 2
    assert ("`batching='continuous'` cannot run this job: T5ForConditionalGeneration is an encoder-decoder model: "
            "continuous batching runs decoder-only models" in capsys.readouterr().err)


# -- the command ---------------------------------------------------------------------------------------------
def test_genkit_serve_serves_a_t5_folder(folders, loaded):
    """``python -m genkit serve --model <T5 folder>``: the generate engine, and generate's text."""
    model, tok = loaded["t5"]
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "genkit", "serve", "--model", folders["t5"], "--port", str(port),
                             "--served-model-name", "t5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _get(base + "/health")["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        want = _new_tokens(model, tok.encode(PROMPT), max_new_tokens=5)[0]
        assert _texts(_complete(base, "t5", {"prompt": PROMPT, "max_tokens": 5})) == [_text(tok, want)]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"genkit serve: t5 on http://127.0.0.1:{port}/v1 (generate engine)" in out
