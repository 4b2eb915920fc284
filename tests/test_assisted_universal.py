"""Universal assisted decoding and assisted-decoding details (issue 19, items 3 and 4).

The two tokenizers are real ``tokenizers`` tokenizers built here: the target's has one token per
word (" alpha"), the assistant's cuts words into pieces of at most three letters (" alp", "ha"),
so the vocabularies (and their sizes) differ. The "bigram" models are genkit Llamas whose
attention and MLP outputs are zero, so the next token depends on the current one only, through
weights set here: both continue the same cycle of words, each in its own vocabulary.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from tolerance import hidden_bound

import genkit
from genkit.builtin_strategies.candidates import adapted_threshold
from genkit.builtin_strategies.candidates_universal import text_after, tokens_after
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama
from genkit.tokenizer import Tokenizer

tokenizers = pytest.importorskip("tokenizers")

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel".split()
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: pad, bos and eos of the tiny models


def _tokenizer(pieces: list[str], pattern: str) -> Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers

    raw = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + pieces)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(SPECIALS)
    return Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _pieces(word: str) -> list[str]:
    text = " " + word
    return [text[:4]] + [text[i:i + 3] for i in range(4, len(text), 3)]


TARGET_PIECES = [" " + w for w in WORDS]
ASSISTANT_PIECES = [p for w in WORDS for p in _pieces(w)]


@pytest.fixture(scope="module")
def target_tok():
    return _tokenizer(TARGET_PIECES, r" ?[a-z]+")


@pytest.fixture(scope="module")
def assistant_tok():
    return _tokenizer(ASSISTANT_PIECES, r" ?[a-z]{1,3}")


def _bigram(cycle: list[int], vocab: int, seed: int) -> torch.nn.Module:
    """A Llama whose next token after ``cycle[i]`` is ``cycle[i + 1]`` (cyclically): the residual
    stream carries the current token's one-hot embedding to an LM head that holds the transitions."""
    model = tiny_llama(seed=seed, vocab_size=vocab)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.lm_head.weight.zero_()
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            model.lm_head.weight[b, a] = 1.0
    return model


def _count_passes(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_tokenizers_differ_and_round_trip(target_tok, assistant_tok):
    text = " alpha bravo charlie"
    assert target_tok.tokenize(text) == [" alpha", " bravo", " charlie"]
    assert assistant_tok.tokenize(text) == [" alp", "ha", " bra", "vo", " cha", "rli", "e"]
    assert len(target_tok) != len(assistant_tok)
    for tok in (target_tok, assistant_tok):
        assert tok.decode(tok.encode(text)) == text


def test_universal_assisted_equals_greedy_with_fewer_target_passes(target_tok, assistant_tok):
    target = _bigram(target_tok.encode("".join(TARGET_PIECES)), len(target_tok), seed=1)
    assistant = _bigram(assistant_tok.encode("".join(ASSISTANT_PIECES)), len(assistant_tok), seed=2)
    prompt = torch.tensor([target_tok.encode(" alpha bravo charlie delta echo foxtrot golf hotel alpha bravo")])
    plain = genkit.generate(target, prompt, max_new_tokens=40)
    passes = _count_passes(target)
    out = genkit.generate(target, prompt, max_new_tokens=40, assistant_model=assistant, tokenizer=target_tok,
                          assistant_tokenizer=assistant_tok)
    assert torch.equal(out, plain)
    assert target_tok.decode(out[0, prompt.shape[1]:]).startswith(" charlie delta echo")
    assert out.shape[1] - prompt.shape[1] == 40
    assert len(passes) < 40 / 4, len(passes)  # about 8 words drafted per pass


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_universal_assisted_is_lossless_when_the_assistant_disagrees(target_tok, assistant_tok, seed):
    """Random weights: the drafts are mostly wrong, the output is still the target's greedy output."""
    target = tiny_llama(seed=10 + seed, vocab_size=len(target_tok))
    assistant = tiny_llama(seed=20 + seed, vocab_size=len(assistant_tok))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, len(target_tok), (1, 12), generator=gen)
    kwargs = dict(max_new_tokens=30, eos_token_id=None)
    plain = genkit.generate(target, prompt, **kwargs)
    for schedule in ("constant", "heuristic"):
        out = genkit.generate(target, prompt, assistant_model=assistant, tokenizer=target_tok,
                              assistant_tokenizer=assistant_tok, num_assistant_tokens=4,
                              num_assistant_tokens_schedule=schedule, target_lookbehind=3, assistant_lookbehind=5,
                              **kwargs)
        assert torch.equal(out, plain), schedule


def test_universal_assisted_sampling_keeps_running_and_respects_lengths(target_tok, assistant_tok):
    target = _bigram(target_tok.encode("".join(TARGET_PIECES)), len(target_tok), seed=1)
    assistant = _bigram(assistant_tok.encode("".join(ASSISTANT_PIECES)), len(assistant_tok), seed=2)
    prompt = torch.tensor([target_tok.encode(" alpha bravo charlie")])
    torch.manual_seed(0)
    out = genkit.generate(target, prompt, max_new_tokens=17, do_sample=True, top_k=1, assistant_model=assistant,
                          tokenizer=target_tok, assistant_tokenizer=assistant_tok)
    assert torch.equal(out, genkit.generate(target, prompt, max_new_tokens=17))  # top_k=1 sampling is greedy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"assistant_tokenizer": "T"}, r"`assistant_tokenizer` is the tokenizer of `assistant_model`"),
    ({"assistant_model": "A", "assistant_tokenizer": "T"}, r"`assistant_tokenizer` needs `tokenizer=`"),
    ({"assistant_model": "A"}, r"another vocabulary .* pass `tokenizer=` .* and `assistant_tokenizer=`"),
    ({"assistant_model": "A", "assistant_tokenizer": "T", "tokenizer": "TT"}, r"`tokenizer` must be a tokenizer"),
    ({"target_lookbehind": 0}, r"`target_lookbehind` must be an int >= 1"),
    ({"assistant_lookbehind": "5"}, r"`assistant_lookbehind` must be an int >= 1"),
])
def test_universal_assisted_inputs_are_checked(target_tok, assistant_tok, kwargs, message):
    target = tiny_llama(seed=1, vocab_size=len(target_tok))
    objects = {"A": tiny_llama(seed=2, vocab_size=len(assistant_tok)), "T": assistant_tok, "TT": object()}
    kwargs = {k: objects.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises((ConfigError, ValueError), match=message):
        genkit.generate(target, torch.tensor([[3, 4, 5]]), max_new_tokens=3, **kwargs)


def test_text_is_carried_across_tokenizers_at_word_boundaries(target_tok, assistant_tok):
    target = target_tok.encode(" alpha bravo charlie")
    assert text_after(target, 2, target_tok, context=1) == " charlie"
    assistant = assistant_tok.encode(" alpha bravo")
    assert tokens_after(assistant[-3:], " charlie", assistant_tok) == assistant_tok.encode(" charlie")
    assert tokens_after(assistant_tok.encode(" alp"), "ha bravo", assistant_tok) == assistant_tok.encode("ha bravo")
    # a boundary inside a token ("e" + "cho" re-encodes as "ech", "o"): no prefix of the re-encoding
    # spells the held text, so there is no clean continuation
    assert tokens_after(assistant_tok.encode("e"), "cho", assistant_tok) is None


# -- assisted decoding details ----------------------------------------------------------------------

def test_prompt_lookup_wins_over_the_assistant_model_as_in_transformers(tiny_pair, caplog):
    hf, ours = tiny_pair
    assistant = tiny_llama(seed=5)
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 5]])
    passes = _count_passes(assistant)
    with caplog.at_level(logging.WARNING, logger="genkit.assisted"):
        out = genkit.generate(ours, ids, max_new_tokens=12, assistant_model=assistant, prompt_lookup_num_tokens=3)
    assert passes == []  # the assistant never ran
    assert "`assistant_model` is not used" in caplog.text
    theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                         assistant_model=tiny_pair[0])
    assert torch.equal(out, theirs)


def test_output_hidden_states_in_assisted_decoding_match_greedy(tiny_pair):
    _, ours = tiny_pair
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 5]])
    kw = dict(max_new_tokens=10, return_dict_in_generate=True, output_hidden_states=True, output_scores=True)
    plain = genkit.generate(ours, ids, **kw)
    assisted = genkit.generate(ours, ids, prompt_lookup_num_tokens=3, **kw)
    assert torch.equal(assisted.sequences, plain.sequences)
    assert len(assisted.hidden_states) == len(plain.hidden_states) == plain.sequences.shape[1] - ids.shape[1]
    for step_a, step_p in zip(assisted.hidden_states, plain.hidden_states):
        assert len(step_a) == len(step_p) == ours.config.num_hidden_layers + 1
        for depth, (a, p) in enumerate(zip(step_a, step_p)):
            assert a.shape == p.shape
            atol = hidden_bound(ours.config, plain.sequences.shape[1], depth, p)
            torch.testing.assert_close(a, p, atol=atol, rtol=0)


def _roc_reference(probs: list[float], matches: list[int]) -> float:
    """The definition: for each candidate threshold (inf, then the distinct scores from the
    highest), predict "accepted" where prob >= threshold; the first threshold of least
    fpr + 3 * fnr wins."""
    best, best_cost = float("inf"), None
    pos = sum(matches)
    neg = len(matches) - pos
    for t in [float("inf"), *sorted(set(probs), reverse=True)]:
        tp = sum(1 for p, m in zip(probs, matches) if p >= t and m)
        fp = sum(1 for p, m in zip(probs, matches) if p >= t and not m)
        cost = fp / neg + 3 * (1 - tp / pos)
        if best_cost is None or cost < best_cost:
            best, best_cost = t, cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_adapted_threshold_is_the_roc_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 6 + seed * 5
    probs = (torch.rand(n, generator=gen) * 10).round().div(10).tolist()  # ties on purpose
    matches = [int(p > 0.4) if i % 3 else 1 - int(p > 0.4) for i, p in enumerate(probs)]
    if len(set(matches)) < 2:
        matches[0] = 1 - matches[0]
    assert adapted_threshold(probs, matches) == _roc_reference(probs, matches)


def test_the_draft_models_confidence_threshold_adapts_and_stays_lossless(tiny_pair):
    from genkit.builtin_strategies.assisted import build_candidate_generator

    _, ours = tiny_pair
    assistant = tiny_llama(seed=3)
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    plain = genkit.generate(ours, ids, max_new_tokens=40, eos_token_id=None)
    out = genkit.generate(ours, ids, max_new_tokens=40, eos_token_id=None, assistant_model=assistant,
                          num_assistant_tokens=6)
    assert torch.equal(out, plain)
    config = genkit.GenerationConfig(num_assistant_tokens=6).with_defaults()  # as generate passes it
    generator = build_candidate_generator(ours, config, assistant_model=assistant)
    assert generator.adaptive_threshold and generator.confidence_threshold == 0.4
    seq = ids
    for _ in range(6):  # rounds of drafting against the target's greedy continuation
        candidates, _ = generator.get_candidates(seq)
        k = candidates.shape[1] - seq.shape[1]
        want = plain[0, seq.shape[1]:seq.shape[1] + k]
        agree = (candidates[0, seq.shape[1]:] == want).long().cumprod(0).sum().item()
        generator.update_candidate_strategy(candidates, torch.zeros(1, k + 1, 128), int(agree))
        seq = plain[:, :seq.shape[1] + int(agree) + 1]
    assert len(generator._probs) == len(generator._matches)
    if 0 in generator._matches and 1 in generator._matches and len(generator._probs) > 5:
        assert generator.confidence_threshold == adapted_threshold(generator._probs, generator._matches)
    no_adapt = build_candidate_generator(ours, genkit.GenerationConfig(assistant_confidence_threshold=0.0).with_defaults(),
                                         assistant_model=assistant)
    assert not no_adapt.adaptive_threshold


# -- a sliding-window assistant ----------------------------------------------------------------------

WINDOW = 8


def _hf_bigram(family: str, cycle: list[int], vocab: int, *, window: int | None, attention: float) -> object:
    """A transformers ``family`` model continuing ``cycle`` (as :func:`_bigram`), with attention
    whose output is scaled by ``attention``: 0 leaves the bigram alone, 40 makes the tokens in the
    (sliding) window change some of its choices, so a draft depends on what the cache holds."""
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    if family == "qwen2":  # the second layer slides
        config = transformers.Qwen2Config(**base, sliding_window=window, use_sliding_window=window is not None,
                                          max_window_layers=1)
    else:
        config = transformers.MistralConfig(**base, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention)
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, config.hidden_size))
        model.lm_head.weight.zero_()
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            model.lm_head.weight[b, a] = 1.0
    policy = model.generation_config
    policy.num_assistant_tokens, policy.num_assistant_tokens_schedule = 6, "constant"
    policy.assistant_confidence_threshold = 0.0
    return model


def _verified(model: torch.nn.Module) -> tuple[list[list[int]], object]:
    """The token ids of each forward of ``model`` (the target: its prefill, then each round's
    drafts), filled as it runs, and the hook's handle."""
    seen: list[list[int]] = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0])[0].tolist()), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_universal_assisted_with_a_sliding_window_assistant_past_its_window(target_tok, assistant_tok, family,
                                                                           caplog, tmp_path):
    """The assistant (another tokenizer) is a transformers model with sliding-window layers (window
    8) whose ``DynamicCache`` drops the positions leaving the window: the prompt is 27 assistant
    tokens and drafts are rejected, so its cache is rolled back past the window every round. The
    tokens are transformers' greedy tokens of the target (transformers 5.24's own universal assisted
    decoding fails here: its assistant's cache records the past during its first ``generate`` only,
    so the next crop leaves fewer positions than the mask expects, a RuntimeError), and the drafts
    are those of the same assistant run natively by genkit, whose cache keeps every position (and
    not those of the assistant without a window: the window changes them)."""
    target = _hf_bigram("mistral", target_tok.encode("".join(TARGET_PIECES)), len(target_tok), window=None,
                        attention=0.0)
    swapped = WORDS[:3] + [WORDS[4], WORDS[3]] + WORDS[5:]  # it drafts "echo" after "charlie", not "delta"
    assistant = _hf_bigram(family, assistant_tok.encode("".join(" " + w for w in swapped)), len(assistant_tok),
                           window=WINDOW, attention=40.0)
    assistant.save_pretrained(tmp_path)
    native = genkit.load_model(tmp_path)
    native.generation_config = assistant.generation_config
    prompt = torch.tensor([target_tok.encode(" alpha bravo charlie delta echo foxtrot golf hotel alpha bravo charlie "
                                             "delta")])
    assert len(assistant_tok.encode(target_tok.decode(prompt[0]))) > 3 * WINDOW
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, tokenizer=target_tok,
              assistant_tokenizer=assistant_tok)
    greedy = target.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0).tolist()
    runs = []
    unwindowed = _hf_bigram(family, assistant_tok.encode("".join(" " + w for w in swapped)), len(assistant_tok),
                            window=None, attention=40.0)
    for drafter in (assistant, native, unwindowed):
        seen, hook = _verified(target)
        with caplog.at_level(logging.DEBUG, logger="genkit.assisted"):
            out = genkit.generate(target, prompt, assistant_model=drafter, **kw)
        assert out.tolist() == greedy
        drafted, accepted = map(int, re.findall(r"(\d+) drafted, (\d+) accepted", caplog.text)[-1])
        assert 0 < accepted < drafted, (drafted, accepted)  # some drafts kept, some rolled back
        runs.append(seen)
        hook.remove()
    assert runs[0] == runs[1] != runs[2]
