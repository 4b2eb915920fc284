"""Assisted decoding: the built-in ``assisted`` strategy with the ``prompt_lookup`` and
``draft_model`` candidate generators. Greedy verification must reproduce greedy decoding token
for token; the references are plain greedy runs of the same model (and transformers' prompt
lookup decoding on the same weights)."""

from __future__ import annotations

import pytest
import torch
from tolerance import frequency_bound, logits_bound

import genkit
from genkit.builtin_strategies.assisted import _speculative_accept
from genkit.builtin_strategies.candidates import PromptLookupCandidateGenerator
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(seed=1)


def _repetitive_prompt(seed: int, length: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 128, (1, length), generator=g)
    return torch.cat([base, base, base[:, : length // 2]], dim=1)


class ForwardCounter:
    """Counts forward passes of a module through a forward hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self.handle.remove()


class Recorder:
    """A streamer that keeps what it receives."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_lookup_equals_greedy(target, seed):
    ids = _repetitive_prompt(seed)
    greedy = genkit.generate(target, ids, max_new_tokens=30)
    counter = ForwardCounter(target)
    try:
        assisted = genkit.generate(target, ids, max_new_tokens=30, prompt_lookup_num_tokens=6,
                                   max_matching_ngram_size=3)
    finally:
        counter.close()
    assert torch.equal(assisted, greedy)
    assert assisted.shape[1] == ids.shape[1] + 30


def test_draft_model_equals_greedy_and_saves_passes(target, draft):
    ids = _repetitive_prompt(3)
    greedy = genkit.generate(target, ids, max_new_tokens=32)
    for kwargs in ({"num_assistant_tokens": 4},
                   {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic"}):
        out = genkit.generate(target, ids, max_new_tokens=32, assistant_model=draft, **kwargs)
        assert torch.equal(out, greedy), kwargs
    # the target itself as assistant: every draft is accepted, so the target runs far fewer passes
    counter = ForwardCounter(target)
    try:
        out = genkit.generate(target, ids, max_new_tokens=32, assistant_model=tiny_llama(seed=0),
                              num_assistant_tokens=8, assistant_confidence_threshold=0.0)
    finally:
        counter.close()
    assert torch.equal(out, greedy)
    assert counter.calls <= 32 // 9 + 2, counter.calls


def test_processors_apply_per_position(target, draft):
    ids = _repetitive_prompt(4)
    kwargs = {"max_new_tokens": 30, "repetition_penalty": 1.4, "no_repeat_ngram_size": 3}
    greedy = genkit.generate(target, ids, **kwargs)
    assert torch.equal(genkit.generate(target, ids, prompt_lookup_num_tokens=5, **kwargs), greedy)
    assert torch.equal(genkit.generate(target, ids, assistant_model=draft, num_assistant_tokens=4, **kwargs), greedy)


def test_eos_stops_where_greedy_stops(target):
    ids = _repetitive_prompt(5)
    free = genkit.generate(target, ids, max_new_tokens=30, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 6])  # a token greedy emits as its 7th new token
    greedy = genkit.generate(target, ids, max_new_tokens=30, eos_token_id=eos)
    assisted = genkit.generate(target, ids, max_new_tokens=30, eos_token_id=eos, prompt_lookup_num_tokens=8)
    assert torch.equal(assisted, greedy)
    assert int(assisted[0, -1]) == eos and assisted.shape[1] <= ids.shape[1] + 7


def test_scores_streamer_and_dict_output_match_greedy(target):
    ids = _repetitive_prompt(6)
    ref = genkit.generate(target, ids, max_new_tokens=20, return_dict_in_generate=True, output_scores=True,
                          output_logits=True)
    rec = Recorder()
    out = genkit.generate(target, ids, max_new_tokens=20, return_dict_in_generate=True, output_scores=True,
                          output_logits=True, prompt_lookup_num_tokens=5, streamer=rec)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 20
    atol = logits_bound(target, out.sequences)  # the same logits, from drafts checked in one forward
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    assert rec.puts[0] == ids[0].tolist()
    assert [t for put in rec.puts[1:] for t in put] == out.sequences[0, ids.shape[1]:].tolist()
    assert rec.ended == 1


def test_left_padded_prompt(target):
    ids = _repetitive_prompt(7)
    padded = torch.cat([torch.zeros((1, 3), dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones_like(ids)], dim=1)
    greedy = genkit.generate(target, padded, attention_mask=mask, max_new_tokens=20)
    assisted = genkit.generate(target, padded, attention_mask=mask, max_new_tokens=20, prompt_lookup_num_tokens=4)
    assert torch.equal(assisted, greedy)


def test_selection_and_candidate_generator_field(target):
    assisted = genkit.GenerationMode.ASSISTED_GENERATION
    assert genkit.GenerationConfig(prompt_lookup_num_tokens=3).get_generation_mode() == assisted
    assert genkit.GenerationConfig(candidate_generator="prompt_lookup").get_generation_mode() == assisted
    assert genkit.GenerationConfig().get_generation_mode(assistant_model=target) == assisted
    assert genkit.GenerationConfig().get_generation_mode() == "greedy_search"
    with pytest.raises(ConfigError, match=r"`prompt_lookup_num_tokens` works with num_beams=1; got num_beams=2"):
        genkit.GenerationConfig(num_beams=2, prompt_lookup_num_tokens=3)  # (transformers drops it, with a warning)
    ids = _repetitive_prompt(8)
    by_name = genkit.generate(target, ids, max_new_tokens=12, candidate_generator="prompt_lookup",
                              candidate_generator_kwargs={"num_output_tokens": 3})
    assert torch.equal(by_name, genkit.generate(target, ids, max_new_tokens=12))
    assert torch.equal(genkit.generate(target, ids, max_new_tokens=12, custom_generate="assisted",
                                       prompt_lookup_num_tokens=3), by_name)


def test_errors_name_the_parameter(target):
    ids = _repetitive_prompt(9)
    with pytest.raises(ValueError, match="unknown candidate generator 'nope'; registered: .*prompt_lookup"):
        genkit.generate(target, ids, max_new_tokens=5, candidate_generator="nope")
    with pytest.raises(ValueError, match="`candidate_generator` must be the name of a registered candidate"):
        genkit.GenerationConfig(candidate_generator=3)
    with pytest.raises(ValueError, match="`candidate_generator_kwargs` must be a dict"):
        genkit.GenerationConfig(candidate_generator_kwargs=["corpus"])
    with pytest.raises(ValueError, match="batch size 1"):
        genkit.generate(target, ids.repeat(2, 1), max_new_tokens=5, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="needs a draft source"):
        genkit.generate(target, ids, max_new_tokens=5, custom_generate="assisted")
    with pytest.raises(ValueError, match="vocab_size 64 vs the target's 128"):
        genkit.generate(target, ids, max_new_tokens=5, assistant_model=tiny_llama(seed=1, vocab_size=64))
    with pytest.raises(ValueError, match="`prompt_lookup_num_tokens` must be an int >= 1"):
        PromptLookupCandidateGenerator(num_output_tokens=0)


def test_sampling_with_one_hot_target_equals_greedy(target, draft):
    """With top_k=1 the target distribution is one-hot, so speculative sampling must give greedy."""
    ids = _repetitive_prompt(10)
    greedy = genkit.generate(target, ids, max_new_tokens=20)
    torch.manual_seed(0)
    a = genkit.generate(target, ids, max_new_tokens=20, do_sample=True, top_k=1, prompt_lookup_num_tokens=4)
    b = genkit.generate(target, ids, max_new_tokens=20, do_sample=True, top_k=1, assistant_model=draft,
                        num_assistant_tokens=4)
    assert torch.equal(a, greedy) and torch.equal(b, greedy)


def test_sampling_runs_and_is_reproducible(target, draft):
    ids = _repetitive_prompt(11)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(genkit.generate(target, ids, max_new_tokens=15, do_sample=True, assistant_model=draft,
                                    num_assistant_tokens=3))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[1] == ids.shape[1] + 15 and int(runs[0].max()) < 128


def test_speculative_acceptance_preserves_target_distribution():
    """The first emitted token of a round, with x drawn from q, must be distributed as p."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p_logits = torch.randn(vocab, generator=g) * 1.5
    q_logits = torch.randn(vocab, generator=g) * 1.5
    p = torch.softmax(p_logits, -1)
    q = torch.softmax(q_logits, -1)
    torch.manual_seed(1)
    trials = 6000
    counts = torch.zeros(vocab)
    drafts = torch.multinomial(q, trials, replacement=True)
    for x in drafts.tolist():
        n, extra = _speculative_accept(torch.tensor([[x]]), q_logits[None, None], [p_logits[None], p_logits[None]])
        counts[x if n == 1 else extra] += 1
    freq = counts / trials
    assert float((freq - p).abs().max()) < frequency_bound(trials, vocab) / 2, (freq, p)


def test_matches_transformers_prompt_lookup(tiny_pair):
    hf, ours = tiny_pair
    ids = _repetitive_prompt(12)
    mask = torch.ones_like(ids)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, prompt_lookup_num_tokens=5,
                      pad_token_id=0)
    out = genkit.generate(ours, ids, attention_mask=mask, max_new_tokens=25, prompt_lookup_num_tokens=5)
    assert out.tolist() == ref.tolist()


def test_prompt_cache_reuse(target, draft):
    """A passed cache holding a prefix of the prompt (docs/api.md, "Reusing a prompt cache"): the
    output equals plain greedy; a cache holding the whole prompt is refused as by the other strategies."""
    import copy

    ids = _repetitive_prompt(11)
    prompt_cache = target.new_cache()
    target(ids[:, :12], past_key_values=prompt_cache)
    greedy = genkit.generate(target, ids, max_new_tokens=12)
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": draft}):
        got = genkit.generate(target, ids, past_key_values=copy.deepcopy(prompt_cache), max_new_tokens=12, **kw)
        assert torch.equal(got, greedy), kw
    full = target.new_cache()
    target(ids, past_key_values=full)
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": draft}):
        with pytest.raises(ValueError, match=r"`past_key_values` already holds 25 positions but `input_ids` has 25"):
            genkit.generate(target, ids, past_key_values=copy.deepcopy(full), max_new_tokens=4, **kw)


def test_prompt_cache_reuse_with_a_transformers_model_and_cache(tiny_pair):
    """transformers' recipe on a transformers model: the prefix is prefilled into a plain
    ``DynamicCache`` (whose ``crop`` takes the number of positions to remove, not to keep)."""
    import copy

    import transformers

    hf, _ = tiny_pair
    ids = _repetitive_prompt(12)
    prompt_cache = transformers.DynamicCache(config=hf.config)
    hf(ids[:, :12], past_key_values=prompt_cache)
    greedy = hf.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": tiny_llama(seed=1)}):
        cache = copy.deepcopy(prompt_cache)
        out = genkit.generate(hf, ids, past_key_values=cache, max_new_tokens=12, eos_token_id=None,
                              return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, greedy), kw
        assert out.past_key_values.get_seq_length() == greedy.shape[1] - 1


@pytest.mark.parametrize("extra", ["same assistant", "other assistant", "prompt lookup"])
def test_assisted_attentions_and_hidden_states_equal_greedy(tiny_model, extra):
    """output_attentions / output_hidden_states with assisted decoding and prompt lookup: per token,
    what greedy search records (the verifying forward cut per token, drafted tokens after it left out)."""
    ids = torch.tensor([[1, 5, 9, 11, 5, 9]])
    kw = dict(max_new_tokens=5, output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
    greedy = genkit.generate(tiny_model, ids, **kw)
    helper = {"same assistant": {"assistant_model": tiny_model}, "other assistant": {"assistant_model": tiny_llama(seed=1)},
              "prompt lookup": {"prompt_lookup_num_tokens": 2}}[extra]
    out = genkit.generate(tiny_model, ids, **kw, **helper)
    assert torch.equal(out.sequences, greedy.sequences) and len(out.attentions) == len(greedy.attentions) == 5
    for ours, ref in ((out.attentions, greedy.attentions), (out.hidden_states, greedy.hidden_states)):
        for step_ours, step_ref in zip(ours, ref, strict=True):
            for a, b in zip(step_ours, step_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_assisted_attentions_of_an_encoder_decoder_equal_greedy(name):
    """An encoder-decoder model's decoder attentions, cross-attentions and hidden states with
    assisted decoding: what greedy search records."""
    import seq2seq_models as S

    model = S.build(name)
    model.set_attn_implementation("eager")  # SDPA returns no attention weights
    x = {k: v[:1] for k, v in S.inputs(name).items()}
    kw = dict(max_new_tokens=4, output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
    greedy = genkit.generate(model, **x, **kw)
    out = genkit.generate(model, **x, **kw, assistant_model=model)
    assert torch.equal(out.sequences, greedy.sequences)
    for part in ("cross_attentions", "decoder_attentions", "decoder_hidden_states"):
        for step_ours, step_ref in zip(getattr(out, part), getattr(greedy, part), strict=True):
            for a, b in zip(step_ours, step_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
