"""One spine, drawn settings (hypothesis, derandomized and bounded): the invariants of
tests/test_spine_settings.py and the parity tests, over settings drawn together rather than one at a
time. A campaign of this file's strategies with thousands of examples per property (session 41)
found the cases now in tests/test_spine_settings.py (a minimum past the length) and
tests/test_beam_parity.py (a ruled-out candidate in the finished set); these bounded runs keep the
invariants in CI:

- ``genkit.generate`` equals transformers' ``generate`` on the same weights, token for token, for
  greedy search, beam search, sampling and beam sampling under one seed (docs/api.md documents
  seeded sampling's draws as transformers'), on left-padded batches, with every processor a config
  switches on;
- the manager (several requests side by side), ``generate_batch`` and
  ``generate(cache_implementation="paged")`` give ``generate``'s tokens for each prompt alone (a
  request's ``seed=s``: the tokens of ``torch.manual_seed(s)`` then ``generate``), and fail where
  ``generate`` fails;
- the paged cache gives ``generate``'s sequences on a left-padded batch (the settings that read
  earlier tokens aside: documented to read each request's own, docs/continuous_batching.md);
- a setting from a ``GenerationConfig`` or the model folder's ``generation_config.json`` acts as
  the same setting given to the call, on every engine;
- ``genkit batch``'s engines and ``genkit serve``'s (both) give each row or request ``generate``'s
  tokens and finish reason.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from contextlib import ExitStack

import pytest
import torch

import genkit
from genkit.models.tiny import tiny_llama
from genkit.strategy.finish import openai_finish_reason

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def bounded(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


VOCAB = 128
NTOK = st.integers(3, VOCAB - 1)


def _maybe(draw, kw: dict, name: str, strategy) -> None:
    if draw(st.integers(0, 3)) == 0:
        kw[name] = draw(strategy)


@st.composite
def processors(draw, emitted: list[int]) -> dict:
    """Processor fields; ``emitted``: tokens the model emits for the prompt, so that bans and biases bite."""
    pick = st.sampled_from(emitted)
    kw: dict = {}
    _maybe(draw, kw, "repetition_penalty", st.sampled_from([0.5, 1.3, 2.0]))
    _maybe(draw, kw, "no_repeat_ngram_size", st.integers(1, 3))
    _maybe(draw, kw, "bad_words_ids", st.lists(st.lists(pick, min_size=1, max_size=2), min_size=1, max_size=2))
    _maybe(draw, kw, "sequence_bias", st.dictionaries(st.lists(pick, min_size=1, max_size=2).map(tuple),
                                                      st.sampled_from([-10.0, 3.0, 8.0]), min_size=1, max_size=2))
    _maybe(draw, kw, "suppress_tokens", st.lists(pick, min_size=1, max_size=2, unique=True))
    _maybe(draw, kw, "begin_suppress_tokens", st.lists(pick, min_size=1, max_size=2, unique=True))
    _maybe(draw, kw, "forced_bos_token_id", NTOK)
    _maybe(draw, kw, "forced_eos_token_id", NTOK)
    _maybe(draw, kw, "exponential_decay_length_penalty", st.tuples(st.integers(0, 4), st.sampled_from([1.1, 2.0])))
    _maybe(draw, kw, "encoder_repetition_penalty", st.sampled_from([0.7, 1.5]))
    _maybe(draw, kw, "renormalize_logits", st.just(True))
    return kw


@st.composite
def sampling(draw) -> dict:
    kw = {"do_sample": True}
    _maybe(draw, kw, "temperature", st.sampled_from([0.5, 1.5]))
    _maybe(draw, kw, "top_k", st.sampled_from([0, 5, 20]))
    _maybe(draw, kw, "top_p", st.sampled_from([0.3, 0.9]))
    _maybe(draw, kw, "min_p", st.sampled_from([0.05, 0.2]))
    _maybe(draw, kw, "typical_p", st.sampled_from([0.5, 0.9]))
    _maybe(draw, kw, "epsilon_cutoff", st.sampled_from([1e-3, 3e-2]))
    _maybe(draw, kw, "eta_cutoff", st.sampled_from([1e-3, 3e-2]))
    return kw


@st.composite
def lengths(draw, width: int, emitted: list[int]) -> dict:
    """The length (new tokens, a max_length counting the prompt, or both), a minimum and the EOS ids."""
    kw: dict = {}
    how = draw(st.sampled_from(["new", "length", "both"]))
    if how != "length":
        kw["max_new_tokens"] = draw(st.integers(1, 10))
    if how != "new":
        kw["max_length"] = width + draw(st.integers(1, 10))
    minimum = draw(st.sampled_from([None, "min_new_tokens", "min_length"]))
    if minimum is not None:
        kw[minimum] = draw(st.integers(0, 8)) + (width if minimum == "min_length" else 0)
    eos = draw(st.sampled_from(["none", "int", "list", "model"]))
    if eos != "model":
        kw["eos_token_id"] = (None if eos == "none" else draw(st.sampled_from(emitted)) if eos == "int"
                              else draw(st.lists(st.sampled_from(emitted), min_size=1, max_size=2)))
    return kw


def _outcome(fn, seed: int | None = None):
    """("ok", value) or ("err", the exception's type): a path fails where the reference fails."""
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - compared with the reference's outcome
        return "err", type(exc).__name__


def _same(tag: str, want, got, case) -> None:
    if want[0] == "err":
        assert got[0] == "err", f"{tag}: {got} where generate failed ({want[1]}); {case}"
    else:
        assert got == want, f"{tag}: {got} != generate's {want}; {case}"


# -- genkit.generate == transformers' generate ------------------------------------------------------
def _padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    return (torch.tensor([[pad] * (width - len(r)) + r for r in rows]),
            torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]))


@st.composite
def parity_case(draw, model):
    rows = draw(st.lists(st.lists(NTOK, min_size=1, max_size=6), min_size=1, max_size=3))
    ids, mask = _padded(rows)
    emitted = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)[:, ids.shape[1]:]
    emitted = emitted.flatten().tolist()
    kw = {**draw(lengths(ids.shape[1], emitted)), **draw(processors(emitted)), "pad_token_id": 0}
    mode = draw(st.sampled_from(["greedy", "sample", "beam", "beam_sample"]))
    seed = draw(st.integers(0, 2**31 - 1)) if "sample" in mode else None
    if "sample" in mode:
        kw.update(draw(sampling()))
    if "beam" in mode:
        kw.update(num_beams=draw(st.integers(2, 4)), length_penalty=draw(st.sampled_from([-1.0, 1.0, 2.0])),
                  early_stopping=draw(st.sampled_from([True, False, "never"])))
    if mode != "greedy":
        kw["num_return_sequences"] = draw(st.integers(1, kw.get("num_beams", 2)))
    return rows, kw, seed


@pytest.mark.filterwarnings("ignore")
@bounded(40)
@given(data=st.data())
def test_generate_matches_transformers(tiny_pair, data):
    hf, ours = tiny_pair
    rows, kw, seed = data.draw(parity_case(ours))
    ids, mask = _padded(rows)
    ref = _outcome(lambda: hf.generate(ids, attention_mask=mask, **{"do_sample": False, **kw}).tolist(), seed)
    if ref[0] == "err":  # transformers fails (exponential_decay_length_penalty without EOS ids, ...): genkit may run
        return
    got = _outcome(lambda: genkit.generate(ours, ids, attention_mask=mask, **kw).tolist(), seed)
    if got[0] == "err" and (kw.get("min_new_tokens", 0) > kw.get("max_new_tokens", 99)
                            or kw.get("min_length", 0) > kw.get("max_length", 999)):
        return  # genkit refuses a minimum past the maximum the call sets (docs/api.md, deliberate differences)
    _same("genkit.generate", ref, got, (rows, kw, seed))


# -- generate == the continuous batching engines ----------------------------------------------------
@pytest.fixture(scope="module")
def cb_model():
    torch.set_num_threads(1)
    return tiny_llama(seed=1)


def _emitted(model, prompt: list[int]) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=8, eos_token_id=None)[0, len(prompt):].tolist()


@st.composite
def request(draw, model):
    """A prompt (any ids, the pad id included), its settings, and a seed when it samples."""
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    emitted = _emitted(model, prompt)
    kw = {**draw(lengths(len(prompt), emitted)), **draw(processors(emitted))}
    _maybe(draw, kw, "presence_penalty", st.sampled_from([-1.0, 1.5]))
    _maybe(draw, kw, "frequency_penalty", st.sampled_from([-1.0, 1.0]))
    seed = None
    if draw(st.booleans()):
        kw.update(draw(sampling()))
        seed = draw(st.integers(0, 2**31 - 1))
    return prompt, kw, seed


def _alone(model, prompt: list[int], kw: dict, seed: int | None):
    """generate on the prompt alone (every token of it read, as a request reads it)."""
    ids = torch.tensor([prompt])
    return _outcome(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(prompt):].tolist(),
                    seed)


def _tokens(out):
    if out.error is not None:
        raise RuntimeError(out.error)
    return out.generated_tokens


@pytest.mark.filterwarnings("ignore")
@bounded(40)
@given(data=st.data())
def test_the_manager_runs_requests_side_by_side_as_generate_runs_each(cb_model, data):
    requests = data.draw(st.lists(request(cb_model), min_size=1, max_size=4))
    wants = [_alone(cb_model, p, kw, seed) for p, kw, seed in requests]
    with cb_model.init_continuous_batching() as manager:
        ids = [manager.add_request(p, **kw, **({} if seed is None else {"seed": seed})) for p, kw, seed in requests]
        got = [_outcome(lambda rid=rid: _tokens(manager.get_result(rid, timeout=120))) for rid in ids]
    for want, one, case in zip(wants, got, requests):
        _same("manager", want, one, case)


@pytest.mark.filterwarnings("ignore")
@bounded(40)
@given(data=st.data())
def test_generate_batch_and_the_paged_cache_give_generates_tokens(cb_model, data):
    prompt, kw, seed = data.draw(request(cb_model))
    want = _alone(cb_model, prompt, kw, seed)
    extra = {} if seed is None else {"seed": seed}
    _same("generate_batch", want, _outcome(lambda: _tokens(cb_model.generate_batch([prompt], **kw, **extra)["req_0"])),
          (prompt, kw, seed))
    if seed is None:
        ids = torch.tensor([prompt])
        paged = _outcome(lambda: cb_model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="paged",
                                                   **kw)[0, len(prompt):].tolist())
        _same("paged", want, paged, (prompt, kw))


@pytest.mark.filterwarnings("ignore")
@bounded(40)
@given(data=st.data())
def test_the_paged_cache_gives_generates_sequences_on_a_padded_batch(cb_model, data):
    rows = data.draw(st.lists(st.lists(NTOK, min_size=1, max_size=6), min_size=1, max_size=4))
    ids, mask = _padded(rows)
    emitted = cb_model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)[:, ids.shape[1]:]
    emitted = emitted.flatten().tolist()
    kw = {**data.draw(lengths(ids.shape[1], emitted)), **data.draw(processors(emitted)), "pad_token_id": 0}
    # the settings that read earlier tokens read each request's own on the paged cache (documented)
    for name in ("encoder_repetition_penalty", "no_repeat_ngram_size", "sequence_bias", "bad_words_ids"):
        kw.pop(name, None)
    extra = {"attention_mask": mask} if data.draw(st.booleans()) else {}
    want = _outcome(lambda: cb_model.generate(ids, **extra, **kw).tolist())
    _same("paged", want, _outcome(lambda: cb_model.generate(ids, cache_implementation="paged", **extra, **kw).tolist()),
          (rows, kw, bool(extra)))


@pytest.fixture(scope="module")
def folder(cb_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gc")
    cb_model.save_pretrained(path)
    return path


@pytest.mark.filterwarnings("ignore")
@bounded(15)
@given(data=st.data())
def test_a_setting_acts_the_same_from_a_config_or_the_model_folder(cb_model, folder, data):
    prompt = data.draw(st.lists(NTOK, min_size=1, max_size=6))
    emitted = _emitted(cb_model, prompt)
    # a generation_config.json holds the model's special tokens (one without eos_token_id has no EOS,
    # in transformers as in genkit); no None: a config's None is "unset" (the model's value, the
    # default), a call's None is "off" (eos_token_id, top_k), in transformers as in genkit
    file = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **data.draw(lengths(len(prompt), emitted)),
            **data.draw(processors(emitted))}
    file = {k: v for k, v in file.items() if v is not None}
    file.setdefault("eos_token_id", 2)
    want = _alone(cb_model, prompt, file, None)
    config = _outcome(lambda: genkit.GenerationConfig(**file))
    if config[0] == "err":
        assert want[0] == "err", f"GenerationConfig refused what generate ran: {file}"
        return
    config[1].save_pretrained(folder)
    loaded = genkit.load_model(folder)
    ids = torch.tensor([prompt])
    by_config = _outcome(lambda: cb_model.generate(ids, attention_mask=torch.ones_like(ids),
                                                   generation_config=config[1])[0, len(prompt):].tolist())
    _same("GenerationConfig", want, by_config, file)
    _same("folder", want, _alone(loaded, prompt, {}, None), file)
    _same("folder generate_batch", want, _outcome(lambda: _tokens(loaded.generate_batch([prompt])["req_0"])), file)
    _same("generate_batch(GenerationConfig)", want,
          _outcome(lambda: _tokens(cb_model.generate_batch([prompt], generation_config=config[1])["req_0"])), file)


# -- genkit batch and genkit serve ------------------------------------------------------------------
def _through_eos(model, prompt: list[int], kw: dict, seed: int | None = None):
    """generate's new tokens through the first EOS id and its finish reason in OpenAI's words."""
    def run():
        out = genkit.generate(model, torch.tensor([prompt]), return_dict_in_generate=True, **kw)
        new = out.sequences[0, len(prompt):].tolist()
        eos = kw.get("eos_token_id", model.generation_config.eos_token_id)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        cut = next((i for i, t in enumerate(new) if t in eos), None)
        reason = (getattr(out, "finish_reasons", None) or [None])[0] or ("eos" if cut is not None else "length")
        return (new if cut is None else new[:cut + 1]), openai_finish_reason(reason)
    return _outcome(run, seed)


@pytest.fixture(scope="module")
def words():
    from test_engine_gate import SPECIALS, WORDS, _raw_tokenizer

    from genkit.tokenizer import Tokenizer

    return Tokenizer(_raw_tokenizer(), SPECIALS), WORDS


@pytest.mark.filterwarnings("ignore")
@bounded(15)
@given(data=st.data())
def test_genkit_batch_engines_give_each_row_generates_tokens(words, data):
    from genkit.batch import make_local_engine
    from genkit.batch.rows import BatchRow

    tok, names = words
    model = tiny_llama(seed=0)
    rows, wants = [], []
    for i in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(st.lists(NTOK, min_size=1, max_size=6))
        emitted = _emitted(model, prompt)
        kw = {**data.draw(lengths(len(prompt), emitted)), **data.draw(processors(emitted))}
        if "sequence_bias" in kw:  # as a JSON row holds it
            kw["sequence_bias"] = [[list(k), v] for k, v in kw["sequence_bias"].items()]
        if data.draw(st.integers(0, 4)) == 0:
            kw["num_beams"] = 2  # a row continuous batching does not run: static batches beside it
        rows.append(BatchRow(f"r{i}", i + 1, prompt=" ".join(names[t] for t in prompt), settings=kw))
        wants.append(_through_eos(model, prompt, kw))
    for batching in ("static", "auto"):
        outs = make_local_engine(model, tok, batch_size=2, batching=batching).run(rows)
        for row, want, out in zip(rows, wants, outs):
            got = ("ok", (out["token_ids"], out["finish_reason"])) if isinstance(out, dict) else ("err", out)
            _same(f"genkit batch ({batching})", want, got, row)


def _complete(base: str, body: dict):
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", **body}).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return "err", e.code
    choice = out["choices"][0]
    return "ok", (choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"])


@st.composite
def serve_request(draw, model):
    """An OpenAI/vLLM request body and the generate settings it stands for (docs/serve.md)."""
    prompt = draw(st.lists(NTOK, min_size=1, max_size=6))
    pick = st.sampled_from(_emitted(model, prompt))
    body: dict = {"prompt": prompt, "max_tokens": draw(st.integers(1, 8)), "temperature": 0}
    gen: dict = {"max_new_tokens": body["max_tokens"], "do_sample": False}
    seed = None
    if draw(st.booleans()):
        seed = body["seed"] = draw(st.integers(0, 2**31 - 1))
        body["temperature"] = draw(st.sampled_from([0.5, 1.0]))
        gen.update(do_sample=True, temperature=body["temperature"])
        if draw(st.booleans()):
            body["top_k"] = draw(st.sampled_from([-1, 5]))
            gen["top_k"] = max(body["top_k"], 0)
    for name, strategy in (("presence_penalty", st.sampled_from([-1.0, 2.0])), ("repetition_penalty", st.just(1.5)),
                           ("suppress_tokens", st.lists(pick, min_size=1, max_size=2, unique=True))):
        if draw(st.integers(0, 2)) == 0:
            body[name] = gen[name] = draw(strategy)
    if draw(st.integers(0, 2)) == 0:
        body["logit_bias"] = {str(t): 100 for t in draw(st.lists(pick, min_size=1, max_size=1))}
        gen["sequence_bias"] = {(int(t),): 100.0 for t in body["logit_bias"]}
    eos = [2]
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(pick, min_size=1, max_size=2))
        if draw(st.booleans()):
            body["ignore_eos"] = True
            eos = []
        eos = eos + body["stop_token_ids"]
    gen["eos_token_id"] = eos or None
    if draw(st.booleans()):
        body["min_tokens"] = gen["min_new_tokens"] = draw(st.integers(0, body["max_tokens"]))
    return body, gen, seed


@pytest.mark.filterwarnings("ignore")
@bounded(25)
@given(data=st.data())
def test_genkit_serve_gives_generates_tokens_on_both_engines(words, served, data):
    tok, names = words
    model, bases = served
    body, gen, seed = data.draw(serve_request(model))
    want = _through_eos(model, body["prompt"], gen, seed)
    if want[0] == "ok":
        tokens, reason = want[1]
        want = ("ok", (" ".join(names[t] for t in tokens if t > 2), reason, len(tokens)))
    for engine, base in bases.items():
        _same(f"serve ({engine})", want, _complete(base, body), body)


@pytest.fixture(scope="module")
def served(words):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from test_engine_gate import _serving

    from genkit.serve import build_app
    from genkit.serve.engine import GenerateEngine

    quiet = logging.getLogger("genkit")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # (restored below: a level left at ERROR silenced other tests' warnings)
    tok, _ = words
    model = tiny_llama(seed=0)
    with ExitStack() as stack:
        bases = {"continuous": stack.enter_context(_serving(build_app(model, tokenizer=tok, model_name="tiny"))),
                 "generate": stack.enter_context(_serving(build_app(model, tokenizer=tok, model_name="tiny",
                                                                    engine=GenerateEngine(model, tok)),
                                                          engine="GenerateEngine"))}
        try:
            yield model, bases
        finally:
            quiet.setLevel(level)
