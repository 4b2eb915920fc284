"""A prompt's own tokens scored: :func:`genkit.generation.scoring.score_prompt`, and ``genkit serve``'s
OpenAI ``echo`` + ``logprobs`` (what lm-evaluation-harness's ``local-completions`` model sends for its
loglikelihood tasks) and vLLM's ``prompt_logprobs``. Before, ``echo`` with ``logprobs`` was a 400
("the prompt's log-probabilities are not computed") and ``prompt_logprobs`` an unknown field.

The references: the model's own forward over the prompt (log_softmax of its logits), transformers'
forward on the same weights, and ``generate``'s greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest
import torch
from test_engine_gate import WORDS, _free_port, _raw_tokenizer, _serving, tokenizer  # noqa: F401
from tolerance import logits_bound, unit_roundoff

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.generation.scoring import score_prompt
from genkit.models.tiny import tiny_llama

PROMPTS = [[1, 3, 4, 5, 6, 7, 40, 41], [1, 9, 8, 7, 60, 61, 62, 63, 64, 65, 3]]
TOP = 3


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over ``prompt`` but its last token: row i scores token i + 1."""
    ids = torch.tensor([prompt[:-1]])
    with torch.no_grad():
        logits = model(ids, past_key_values=model.new_cache(len(prompt)), use_cache=True).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _agrees(logprob: float, rank: int, top_ids: list[int], ref: torch.Tensor, token: int, tol: float) -> None:
    """A token's score (its log-probability, rank and best alternatives) against ``ref``, the
    log-probabilities of its position from another evaluation of the model, that differ from the
    score's own by at most ``tol`` each: the rank between the counts of tokens more likely by more
    than ``tol`` either way, each alternative's reference value within ``tol`` of the reference's
    sorted values (a near-tie may order two alternatives either way)."""
    assert abs(logprob - ref[token].item()) <= tol
    assert int((ref > ref[token] + 2 * tol).sum()) + 1 <= rank <= int((ref > ref[token] - 2 * tol).sum()) + 1
    best = ref.topk(len(top_ids)).values
    assert all(abs(ref[t].item() - v.item()) <= 2 * tol for t, v in zip(top_ids, best))


def _bound(model, prompt: list[int]) -> float:
    """Twice the bound on two evaluations' logits (a log_softmax moves each value by at most the largest
    logit difference, twice), plus one float32 rounding of a log-probability up to 30."""
    return 2 * logits_bound(model, torch.tensor([prompt])) + 30 * unit_roundoff(torch.float32)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=0)


# -- the library ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS)
def test_scores_are_the_forwards_log_softmax(model, prompt):
    """Each token i + 1 is scored at position i: its log-probability, its rank (1 + the tokens strictly
    more likely) and the best TOP there, best first, exactly as one forward over the prompt gives them."""
    scored = score_prompt(model, prompt, top_n=TOP)
    ref = _reference(model, prompt)
    assert [s.token for s in scored.tokens] == prompt[1:]
    for i, s in enumerate(scored.tokens):
        assert s.logprob == ref[i, prompt[i + 1]].item()
        assert s.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
        best = ref[i].topk(TOP)
        assert [t for t, _ in s.top] == best.indices.tolist()
        assert [v for _, v in s.top] == best.values.tolist()
    assert scored.total == pytest.approx(sum(ref[i, t].item() for i, t in enumerate(prompt[1:])), abs=1e-5)
    assert {s.rank for s in scored.tokens} != {1}  # a random model: not every token is its position's best


def test_chunks_give_one_forwards_scores():
    """A logits budget of 3 positions runs the prompt in chunks through the cache: the same scores.
    In float64 the two forwards differ by accumulation order only (~1e-15 relative); the
    log-probabilities are computed in float32 from the logits rounded to float32 (one unit roundoff
    of the largest logit, moving a log_softmax value by at most twice that) and rounded once more:
    4 unit roundoffs of the largest logit plus the value."""
    model = tiny_llama(seed=0).double()
    prompt = PROMPTS[1]
    whole = score_prompt(model, prompt, top_n=TOP)
    chunked = score_prompt(model, prompt, top_n=TOP, logits_budget=3 * 8 * model.config.vocab_size)
    with torch.no_grad():
        largest = model(torch.tensor([prompt])).logits.abs().max().item()
    u = unit_roundoff(torch.float32)
    for a, b in zip(whole.tokens, chunked.tokens):
        assert (a.token, a.rank, [t for t, _ in a.top]) == (b.token, b.rank, [t for t, _ in b.top])
        assert abs(a.logprob - b.logprob) <= 4 * u * (largest + abs(a.logprob))


def test_kept_cache_continues_generate(model):
    """The cache the scoring forward leaves (the prompt but its last token) handed to generate: the
    same greedy tokens as generate from nothing."""
    prompt = PROMPTS[0]
    scored = score_prompt(model, prompt, keep_cache=True, cache_length=len(prompt) + 12)
    assert scored.cache.get_seq_length() == len(prompt) - 1
    ids = torch.tensor([prompt])
    with torch.no_grad():
        plain = genkit.generate(model, ids, max_new_tokens=12, do_sample=False)
        reused = genkit.generate(model, ids, past_key_values=scored.cache, max_new_tokens=12, do_sample=False)
    assert reused.tolist() == plain.tolist()


def test_one_token_prompt_has_nothing_to_score(model):
    assert score_prompt(model, [5]).tokens == []
    assert score_prompt(model, torch.tensor([[5, 6]])).tokens[0].token == 6


@pytest.mark.parametrize("kwargs, message", [
    ({"input_ids": []}, "`input_ids` is empty"),
    ({"input_ids": [1, 2, 128]}, "token ids from 0 to 127; got 128"),
    ({"input_ids": [1, -2]}, "got -2"),
    ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, "one prompt of token ids"),
    ({"input_ids": [1, 2], "top_n": -1}, "`top_n` must be an int from 0 to the vocabulary's size (128)"),
    ({"input_ids": [1, 2], "logits_budget": 0}, "`logits_budget` must be a positive number"),
])
def test_bad_input_is_named(model, kwargs, message):
    with pytest.raises(ConfigError) as err:
        score_prompt(model, **kwargs)
    assert message in str(err.value)


def test_encoder_decoder_model_is_refused():
    from seq2seq_models import build

    with pytest.raises(NotSupportedError, match="needs a causal LM"):
        score_prompt(build("t5"), [1, 2, 3])


def test_transformers_model_on_the_same_weights(tmp_path):
    """score_prompt on a transformers Llama (through genkit's adapter) gives its own forward's
    log-probabilities; on genkit's own model loaded from its save_pretrained, they agree with those
    within twice the two forwards' logits bound (a log_softmax moves each value by at most the
    largest logit difference, twice) plus their float32 rounding, and so do the ranks and
    alternatives (up to near-ties within that bound)."""
    pytest.importorskip("transformers")
    from test_models_parity import CONFIGS, _hf_model  # the parity tests' tiny Llama (GQA, untied head)

    torch.manual_seed(1234)
    hf = _hf_model(CONFIGS["llama_gqa_untied"]())
    hf.save_pretrained(tmp_path)
    ours = genkit.load_model(tmp_path)
    prompt = [1, 17, 33, 99, 150, 3, 64, 12, 5]
    theirs, mine = score_prompt(hf, prompt, top_n=TOP), score_prompt(ours, prompt, top_n=TOP)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    bound = _bound(ours, prompt)
    for i, (a, b) in enumerate(zip(theirs.tokens, mine.tokens)):
        assert abs(a.logprob - ref[i, prompt[i + 1]].item()) <= bound  # two evaluations of the same forward
        _agrees(b.logprob, b.rank, [t for t, _ in b.top], ref[i], prompt[i + 1], bound)


# -- continuous batching ---------------------------------------------------------------------------------------

def _results(manager, requests: list[dict]) -> list:
    """Each request (``add_request``'s arguments) added to the running ``manager``, then its output."""
    ids = [manager.add_request(**r) for r in requests]
    outs: dict = {}
    while len(outs) < len(ids):
        out = manager.get_result(timeout=60)
        assert out is not None, "the manager gave no result within 60 s"
        outs[out.request_id] = out
    return [outs[i] for i in ids]


@pytest.mark.parametrize("cb", [{}, {"max_batch_tokens": 16}], ids=["one-step", "chunks-of-16"])
def test_continuous_batching_scores_the_prompt_as_it_computes_it(model, cb):
    """``add_request(prompt_logprobs=k)``: the prompt's scores come from the steps that compute it (in
    chunks of 16 tokens too, beside other requests), as one forward gives them within the bound of
    two evaluations; the generated tokens are generate's."""
    from genkit.continuous import ContinuousBatchingConfig

    prompts = [*PROMPTS, list(range(1, 60))]
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**cb))
    manager.start()
    try:
        outs = _results(manager, [{"input_ids": p, "max_new_tokens": 4, "prompt_logprobs": TOP, "do_sample": False}
                                  for p in prompts] + [{"input_ids": PROMPTS[0], "max_new_tokens": 4}])
    finally:
        manager.stop(block=True)
    for prompt, out in zip(prompts, outs):
        ref, tol = _reference(model, prompt), _bound(model, prompt)
        assert [s.token for s in out.prompt_logprobs] == prompt[1:]
        for i, s in enumerate(out.prompt_logprobs):
            _agrees(s.logprob, s.rank, [t for t, _ in s.top], ref[i], prompt[i + 1], tol)
        assert out.generated_tokens == _greedy(model, prompt, 4)[0][:len(out.generated_tokens)]
    assert outs[-1].prompt_logprobs is None  # not asked for


def test_a_scored_prompt_reuses_only_a_scored_prefix(model):
    """A scored prompt takes from the prompt cache only a prefix whose tokens' scores an earlier
    scored prompt published (with as many alternatives), less its last token: an unscored prompt's
    blocks are not taken, the choices of a shared context are (their scores the published ones, cut
    to the request's alternatives, and within the bound of their own forward); more alternatives
    than published computes the prompt whole. A bad ``prompt_logprobs`` is a failed output naming it."""
    manager = model.init_continuous_batching()
    manager.start()
    context = [1, 9, 8, 7, 60, 61, 62, 63, 64, 65, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]  # 21 tokens
    try:
        _results(manager, [{"input_ids": context + [80], "max_new_tokens": 2}])
        before = manager.reused_prompt_tokens
        first, = _results(manager, [{"input_ids": context + [70], "max_new_tokens": 2, "prompt_logprobs": 2}])
        assert manager.reused_prompt_tokens == before  # the unscored prompt published no scores
        second, = _results(manager, [{"input_ids": context + [71, 72], "max_new_tokens": 2, "prompt_logprobs": 1,
                                      "do_sample": False}])
        assert manager.reused_prompt_tokens == before + len(context) - 1  # the context but its last token
        assert second.prompt_logprobs[:len(context) - 1] == [
            dataclasses.replace(s, top=s.top[:1]) for s in first.prompt_logprobs[:len(context) - 1]]
        prompt, tol = context + [71, 72], _bound(model, context + [71, 72])
        ref = _reference(model, prompt)
        for i, s in enumerate(second.prompt_logprobs):
            assert s.token == prompt[i + 1] and len(s.top) == 1
            _agrees(s.logprob, s.rank, [t for t, _ in s.top], ref[i], prompt[i + 1], tol)
        assert second.generated_tokens == _greedy(model, prompt, 2)[0][:len(second.generated_tokens)]
        more, = _results(manager, [{"input_ids": context + [73], "max_new_tokens": 2, "prompt_logprobs": 3}])
        assert manager.reused_prompt_tokens == before + len(context) - 1 and len(more.prompt_logprobs) == len(context)
        bad, = _results(manager, [{"input_ids": context, "max_new_tokens": 2, "prompt_logprobs": -1}])
        assert bad.error is not None and "`prompt_logprobs` must be an int from 0 to the vocabulary's size (128)" \
            in bad.error
    finally:
        manager.stop(block=True)


def test_quantized_steps_score_each_row_as_its_last_row(tmp_path):
    """On a Q4_1 model (the block kernel's paged step): position k's best alternative, read from the
    scored request's rows, is what a request whose prompt ends at k reads from its last row, up to a
    few float32 roundings (the rows' integer products are exact)."""
    from test_quantized import write_quantized_gguf

    write_quantized_gguf(tmp_path / "q.gguf", "Q4_1")
    model = genkit.load_model(tmp_path / "q.gguf")
    prompt = [1, 5, 9, 13, 17, 3, 8, 2, 40, 41, 7, 7, 19, 20]
    manager = model.init_continuous_batching()
    manager.start()
    try:
        outs = _results(manager, [{"input_ids": prompt, "max_new_tokens": 2, "prompt_logprobs": 1, "do_sample": False}]
                        + [{"input_ids": prompt[:k + 1], "max_new_tokens": 1, "top_logprobs": 1, "do_sample": False}
                           for k in range(1, len(prompt) - 1)])
    finally:
        manager.stop(block=True)
    scores, u = outs[0].prompt_logprobs, unit_roundoff(torch.float32)
    for k, out in enumerate(outs[1:], start=1):
        (token, value), = out.top_logprobs[0]
        assert scores[k].top[0][0] == token and abs(scores[k].top[0][1] - value) <= 8 * u * abs(value)


# -- genkit serve -----------------------------------------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module", params=["ContinuousEngine", "GenerateEngine"])
def base(request, model, tokenizer):  # noqa: F811
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.serve import build_app
    from genkit.serve.engine import GenerateEngine

    engine = GenerateEngine(model, tokenizer) if request.param == "GenerateEngine" else None
    app = build_app(model, tokenizer=tokenizer, model_name="tiny", engine=engine, chat_template=CHAT_TEMPLATE)
    with _serving(app, engine=request.param) as url:
        yield url


def _post(base: str, body: dict, route: str = "/v1/completions") -> tuple[int, dict]:
    req = urllib.request.Request(base + route, headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", **body}).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """generate's greedy tokens and their log-probabilities."""
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]


def test_lm_eval_loglikelihood_request(base, model, tokenizer):  # noqa: F811
    """lm-evaluation-harness's local-completions loglikelihood payload, answered as it parses it:
    per prompt, the tokens' log-probabilities from position 1 on (position 0: null), the best one's
    at each position (its is_greedy check), then the generated token's."""
    status, out = _post(base, {"prompt": PROMPTS, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                               "seed": 1234, "echo": True})
    assert status == 200, out
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for prompt, choice in zip(PROMPTS, choices):
        lp = choice["logprobs"]
        ref, tol = _reference(model, prompt), _bound(model, prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"] == [tokenizer.decode([t]) for t in prompt] + lp["tokens"][len(prompt):]
        for i, (value, top) in enumerate(zip(lp["token_logprobs"][1:len(prompt)], lp["top_logprobs"][1:len(prompt)])):
            (best, best_lp), = top.items()
            assert abs(value - ref[i, prompt[i + 1]].item()) <= tol
            assert abs(best_lp - ref[i].max().item()) <= tol  # the best token's (lm-eval's is_greedy check)
            assert abs(ref[i, WORDS.index(best)].item() - ref[i].max().item()) <= 2 * tol
        (token,), (logprob,) = _greedy(model, prompt, 1)
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["tokens"][-1] == tokenizer.decode([token])
        assert lp["token_logprobs"][-1] == pytest.approx(logprob, abs=2 * logits_bound(model, torch.tensor([prompt])))
        assert choice["text"] == tokenizer.decode(prompt) + tokenizer.decode([token])
        assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert out["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "completion_tokens": 2,
                            "total_tokens": sum(map(len, PROMPTS)) + 2}


def test_max_tokens_zero_scores_the_prompt_only(base, model):
    status, out = _post(base, {"prompt": PROMPTS[0], "max_tokens": 0, "logprobs": 2, "echo": True})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    ref, tol = _reference(model, PROMPTS[0]), _bound(model, PROMPTS[0])
    got = choice["logprobs"]["token_logprobs"][1:]
    assert len(got) == len(PROMPTS[0]) - 1
    assert all(abs(v - ref[i, t].item()) <= tol for i, (v, t) in enumerate(zip(got, PROMPTS[0][1:])))
    assert [len(t) for t in choice["logprobs"]["top_logprobs"][1:]] == [2] * (len(PROMPTS[0]) - 1)
    assert out["usage"]["completion_tokens"] == 0
    status, out = _post(base, {"prompt": PROMPTS[0], "max_tokens": 0})
    assert status == 400 and out["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("prompt_cache", [True, False], ids=["prompt-cache", "no-prompt-cache"])
def test_continuous_engine_scores_several_choices_and_max_tokens_zero_itself(prompt_cache):
    """On continuous batching, a prompt only scored (max_tokens 0) and one scored for three choices
    (n 3, echo + logprobs, and vLLM's prompt_logprobs) run on the manager (the generate engine beside
    it computes nothing). With a 2^18-token vocabulary the first choice's prompt is scored in chunks
    of 64 positions (the logits budget). With the prompt cache the other two choices wait for it and
    take it from the cache (the scored-only prompt too, but its last two tokens); without, they compute
    theirs in the first step and choose tokens, which are held until the prompt's scores are out.
    Either way every choice's text and logprobs begin with the echoed prompt (scores within the bound
    of the model's forward), then generate's greedy tokens."""
    pytest.importorskip("uvicorn")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from genkit.generation.scoring import chunk_positions
    from genkit.serve import build_app
    from genkit.serve.engines import ContinuousEngine
    from genkit.tokenizer import Tokenizer

    vocab = 2**18
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok = Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    model = tiny_llama(seed=0, vocab_size=vocab, hidden_size=16, intermediate_size=32)
    prompt = [1] + [3 + (i * 7919) % (vocab - 3) for i in range(199)]
    assert chunk_positions(vocab) == 64 < len(prompt)
    ref, tol = _reference(model, prompt), _bound(model, prompt)
    engine = ContinuousEngine(model, tok, prompt_cache=prompt_cache)
    app = build_app(model, tokenizer=tok, model_name="tiny", engine=engine)
    with _serving(app) as url:
        status, out = _post(url, {"prompt": prompt, "max_tokens": 3, "n": 3, "temperature": 0, "echo": True,
                                  "logprobs": 1, "prompt_logprobs": 1, "ignore_eos": True})
        assert status == 200, out
        status, only = _post(url, {"prompt": prompt[:-1] + [5], "max_tokens": 0, "echo": True, "logprobs": 1})
        assert status == 200, only
        other = [1] + [3 + (i * 7907 + 1) % (vocab - 3) for i in range(199)]  # not in the prompt cache
        streamed = _streamed(url, {"prompt": other, "max_tokens": 3, "n": 3, "temperature": 0, "echo": True,
                                   "logprobs": 1, "ignore_eos": True, "stream": True})
        assert engine.fallback.stats.prompt_tokens_total == 0  # nothing ran on the generate engine
        reused = engine.manager.reused_prompt_tokens
    assert reused == (4 * (len(prompt) - 1) + len(prompt) - 2 if prompt_cache else 0)
    (choice,) = only["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == tok.decode(prompt[:-1] + [5])
    tokens = _greedy(model, prompt, 3)[0]
    assert len(out["choices"]) == 3
    for c in out["choices"] + [choice]:  # (the scored-only prompt, but its last token, is the other's)
        values = c["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(prompt) + (3 if c is not choice else 0)
        assert all(abs(v - ref[i, t].item()) <= tol for i, (v, t) in enumerate(zip(values[1:len(prompt) - 1],
                                                                                  prompt[1:])))
    for c in out["choices"]:
        assert c["text"] == tok.decode(prompt) + tok.decode(tokens)
        assert c["logprobs"]["tokens"] == [tok.decode([t]) for t in prompt + tokens]
        entries = c["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for i, entry in enumerate(entries[1:]):
            own = entry[str(prompt[i + 1])]
            _agrees(own["logprob"], own["rank"], [], ref[i], prompt[i + 1], tol)
    expected = tok.decode(other) + tok.decode(_greedy(model, other, 3)[0])
    for index in range(3):  # streamed: each choice's first chunk is its echoed prompt
        chunks = [c for c in streamed if c["index"] == index]
        assert chunks[0]["text"] == tok.decode(other) and len(chunks[0]["logprobs"]["tokens"]) == len(other)
        assert "".join(c["text"] for c in chunks) == expected


def _streamed(base: str, body: dict) -> list[dict]:
    """The choices of every chunk of a streamed completion, in order."""
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", **body}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return [c for line in r.read().decode().splitlines() if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"]]


def test_vllm_prompt_logprobs(base, model, tokenizer):  # noqa: F811
    """vLLM's prompt_logprobs beside a generation: per prompt token its id's log-probability, rank and
    text, with the best TOP; the generated tokens are generate's (the scoring forward's cache reused)."""
    prompt = PROMPTS[1]
    status, out = _post(base, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "prompt_logprobs": TOP,
                               "ignore_eos": True})
    assert status == 200, out
    choice = out["choices"][0]
    tokens, _ = _greedy(model, prompt, 8)
    assert choice["text"] == tokenizer.decode(tokens) and choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    ref, tol = _reference(model, prompt), _bound(model, prompt)
    for i, entry in enumerate(entries[1:]):
        token = prompt[i + 1]
        own = entry[str(token)]
        assert list(entry)[0] == str(token) and own["decoded_token"] == tokenizer.decode([token])
        alternatives = [(int(k), v) for k, v in entry.items() if k != str(token) or v["rank"] <= TOP]
        assert [v["rank"] for _, v in alternatives] == list(range(1, TOP + 1))
        assert all(v["decoded_token"] == tokenizer.decode([t]) for t, v in alternatives)
        _agrees(own["logprob"], own["rank"], [t for t, _ in alternatives], ref[i], token, tol)
        assert all(abs(v["logprob"] - ref[i, t].item()) <= tol for t, v in alternatives)


def test_chat_prompt_logprobs(base, model, tokenizer):  # noqa: F811
    status, out = _post(base, {"messages": [{"role": "user", "content": "w5 w6 w7 w9"}], "max_tokens": 2,
                               "temperature": 0, "prompt_logprobs": 0}, route="/v1/chat/completions")
    assert status == 200, out
    prompt = tokenizer.encode("w5 w6 w7 w9 ")
    entries = out["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert [list(e) for e in entries[1:]] == [[str(t)] for t in prompt[1:]]  # 0 alternatives: the token's own
    ref, tol = _reference(model, prompt), _bound(model, prompt)
    for i, e in enumerate(entries[1:]):
        _agrees(e[str(prompt[i + 1])]["logprob"], e[str(prompt[i + 1])]["rank"], [], ref[i], prompt[i + 1], tol)


def test_streamed_echo_with_logprobs(base):
    """Streamed, the echoed prompt and its log-probabilities are the first chunk; the whole equals the
    answer not streamed."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True}
    status, whole = _post(base, body)
    assert status == 200, whole
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", **body, "stream": True}).encode())
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) == len(PROMPTS[0])
    merged = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    expected = whole["choices"][0]["logprobs"]
    # the text offsets of the prompt's tokens, and of the first token after it (at the echoed text's end)
    # (a later token's counts the text streamed before it, which a tokenizer's decoding of a lone
    # token need not equal: as before this change)
    k = len(PROMPTS[0]) + 1
    assert merged.pop("text_offset")[:k] == expected["text_offset"][:k]
    assert expected["text_offset"][k - 1] == len(chunks[0]["text"])
    assert merged == {key: v for key, v in expected.items() if key != "text_offset"}
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


@pytest.mark.parametrize("body, param, message", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available with `stream`"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "must be an integer >= 0 and <= 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "over this server's limit: send an int from 0 to 20"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs", "must be an integer"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens", "must be an integer >= 1"),
])
def test_bad_values_are_named(base, body, param, message):
    status, out = _post(base, {"prompt": PROMPTS[0], **body})
    assert status == 400, out
    assert out["error"]["param"] == param and message in out["error"]["message"]


@pytest.mark.parametrize("budget, within, over, param, entries", [
    (100, {"prompt_logprobs": 11}, {"prompt_logprobs": 12}, "prompt_logprobs", 8 * 13),
    (40, {"echo": True, "logprobs": 4}, {"echo": True, "logprobs": 5}, "logprobs", 8 * 6),
    (40, {"echo": True, "logprobs": 1, "prompt_logprobs": 4}, {"echo": True, "logprobs": 5, "prompt_logprobs": 1},
     "logprobs", 8 * 6),
])
def test_entries_over_the_budget_are_refused_before_anything_runs(tokenizer, budget, within, over, param,  # noqa: F811
                                                                   entries):
    """Prompt tokens x (1 + alternatives), over a request's prompts, beyond the server's budget: a 400
    naming the field that asked for the most, at parsing (nothing queued)."""
    from genkit.serve.limits import Limits
    from genkit.serve.openai_api import APIError, parse_request

    limits = Limits(max_prompt_logprob_entries=budget)
    prompts = [" ".join(f"w{i}" for i in range(3, 8))] * 2  # 5 tokens each: 4 scored each
    parse_request({"model": "m", "prompt": prompts, **within}, chat=False, tokenizer=tokenizer, model_name="m",
                  limits=limits, generation_fields=set())
    with pytest.raises(APIError) as err:
        parse_request({"model": "m", "prompt": prompts, **over}, chat=False, tokenizer=tokenizer, model_name="m",
                      limits=limits, generation_fields=set())
    assert err.value.param == param
    assert f"are {entries} entries" in err.value.message and f"at most {budget}" in err.value.message


def test_encoder_decoder_server_refuses_prompt_logprobs(tokenizer):  # noqa: F811
    from genkit.serve.limits import Limits
    from genkit.serve.openai_api import APIError, parse_request

    with pytest.raises(APIError) as err:
        parse_request({"model": "m", "prompt": "w3 w4", "prompt_logprobs": 1}, chat=False, tokenizer=tokenizer,
                      model_name="m", limits=Limits(encoder_decoder=True), generation_fields=set())
    assert err.value.param == "prompt_logprobs" and "encoder-decoder" in err.value.message


def _get(base: str, route: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + route, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(base, model, tokenizer):  # noqa: F811
    """vLLM's ``GET /tokenizer_info``, behind its flag (off: a 404 naming it): the special tokens, the
    server's chat template and context. What lm-eval's remote tokenizer does with it then works: its
    EOS token's text through ``/tokenize`` (no special tokens added) is the EOS id."""
    status, out = _get(base, "/tokenizer_info")
    assert status == 404 and "--enable-tokenizer-info-endpoint" in out["error"]["message"]
    from genkit.serve import build_app

    app = build_app(model, tokenizer=tokenizer, model_name="tiny", chat_template=CHAT_TEMPLATE,
                    enable_tokenizer_info_endpoint=True)
    with _serving(app) as url:
        status, info = _get(url, "/tokenizer_info")
        assert status == 200
        assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", None)
        assert info["chat_template"] == CHAT_TEMPLATE and info["model_max_length"] == model.config.max_position_embeddings
        status, ids = _post(url, {"prompt": info["eos_token"], "add_special_tokens": False}, route="/tokenize")
        assert (status, ids["tokens"]) == (200, [tokenizer.eos_token_id])
