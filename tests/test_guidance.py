"""Classifier-free guidance (issue 19, item 2): ``guidance_scale`` with and without a negative
prompt against transformers 5 on the same weights; greedy, sampling, batched; the unconditional
branch's cache; validation."""

from __future__ import annotations

import pytest
import torch

import genkit
from genkit.errors import ConfigError, NotSupportedError

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 17, 33], [0, 0, 1, 44, 45]])
MASK = (IDS != 0).long()
NEG = torch.tensor([[1, 7, 8], [1, 100, 101]])


def _both(tiny_pair, batch, negative, seed=None, **kw):
    hf, ours = tiny_pair
    extra = {} if negative is None else {"negative_prompt_ids": negative[:batch]}
    if seed is not None:
        torch.manual_seed(seed)
    theirs = hf.generate(IDS[:batch], attention_mask=MASK[:batch], max_new_tokens=20, pad_token_id=0, **extra, **kw)
    if seed is not None:
        torch.manual_seed(seed)
    mine = genkit.generate(ours, IDS[:batch], attention_mask=MASK[:batch], max_new_tokens=20, **extra, **kw)
    return theirs, mine


@pytest.mark.parametrize("negative", [None, NEG], ids=["no-negative", "negative"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("scale", [1.5, 3.0, 0.0])
def test_greedy_guidance_matches_transformers(tiny_pair, batch, negative, scale):
    theirs, mine = _both(tiny_pair, batch, negative, guidance_scale=scale, do_sample=False)
    assert torch.equal(mine, theirs)
    plain = genkit.generate(tiny_pair[1], IDS[:batch], attention_mask=MASK[:batch], max_new_tokens=20)
    if scale != 0.0 or negative is not None:
        assert not torch.equal(mine, plain)


@pytest.mark.parametrize("negative", [None, NEG], ids=["no-negative", "negative"])
@pytest.mark.parametrize("batch", [1, 2])
def test_sampled_guidance_matches_transformers_under_the_same_seed(tiny_pair, batch, negative):
    theirs, mine = _both(tiny_pair, batch, negative, seed=11, guidance_scale=1.5, do_sample=True, top_k=30)
    assert torch.equal(mine, theirs)


def test_guidance_without_the_cache_matches_transformers(tiny_pair):
    theirs, mine = _both(tiny_pair, 2, NEG, guidance_scale=2.0, do_sample=False, use_cache=False)
    assert torch.equal(mine, theirs)


def test_the_unconditional_branch_runs_one_token_per_step(tiny_pair):
    """Its cache is kept between steps: after the negative prompt, each forward is one token."""
    from genkit.builtin_strategies.guidance import UnbatchedClassifierFreeGuidanceLogitsProcessor

    _, ours = tiny_pair
    lengths = []

    class Counting:
        def __init__(self, model):
            self.model, self.config = model, model.config

        def __call__(self, ids, **kw):
            lengths.append(ids.shape[1])
            return self.model(ids, **kw)

        def new_cache(self, n=0):
            return self.model.new_cache(n)

    proc = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, Counting(ours), unconditional_ids=NEG[:1])
    out = genkit.generate(ours, IDS[:1], max_new_tokens=10, min_new_tokens=10, logits_processor=[proc])
    assert out.shape[1] == IDS.shape[1] + 10
    assert lengths == [3] + [1] * 9


def test_padded_negative_prompts_give_each_row_what_it_gets_alone(tiny_pair):
    """A left-padded batch of negative prompts: positions skip the padding (as on the conditional
    branch), so each row equals its own unbatched generation."""
    _, ours = tiny_pair
    neg = torch.tensor([[0, 0, 1, 7], [1, 100, 101, 102]])
    neg_mask = (neg != 0).long()
    batched = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=12, guidance_scale=2.0,
                              negative_prompt_ids=neg, negative_prompt_attention_mask=neg_mask)
    for row in range(2):
        keep = neg_mask[row].bool()
        ids = IDS[row:row + 1, MASK[row].bool()]
        alone = genkit.generate(ours, ids, max_new_tokens=12, guidance_scale=2.0,
                                negative_prompt_ids=neg[row:row + 1, keep])
        assert torch.equal(batched[row, -12:], alone[0, -12:])


def test_guidance_in_assisted_decoding_equals_guided_greedy(tiny_pair):
    """The processor follows the history it is called on (drafts verified, then rolled back)."""
    _, ours = tiny_pair
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9]])
    plain = genkit.generate(ours, ids, max_new_tokens=16, guidance_scale=1.5, negative_prompt_ids=NEG[:1])
    assisted = genkit.generate(ours, ids, max_new_tokens=16, guidance_scale=1.5, negative_prompt_ids=NEG[:1],
                               prompt_lookup_num_tokens=3)
    assert torch.equal(assisted, plain)


def test_negative_prompt_is_expanded_for_several_samples_per_prompt(tiny_pair):
    _, ours = tiny_pair
    torch.manual_seed(0)
    out = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=6, guidance_scale=1.5, do_sample=True,
                          num_return_sequences=3, negative_prompt_ids=NEG)
    assert out.shape == (6, 11)
    one = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=6, guidance_scale=1.5,
                          negative_prompt_ids=NEG[:1])  # one negative prompt for every row
    assert one.shape == (2, 11)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"guidance_scale": -1.0}, ConfigError, r"`guidance_scale` must be a finite number >= 0"),
    ({"guidance_scale": float("inf")}, ConfigError, r"`guidance_scale` must be a finite number >= 0"),
    ({"guidance_scale": "high"}, ConfigError, r"`guidance_scale` must be a finite number >= 0"),
    ({"negative_prompt_ids": NEG[:1]}, ConfigError, r"`negative_prompt_ids` is the negative prompt.*set `guidance_scale`"),
    ({"guidance_scale": 1.5, "negative_prompt_attention_mask": torch.ones(1, 3)}, ConfigError,
     r"`negative_prompt_attention_mask` was given without `negative_prompt_ids`"),
    ({"guidance_scale": 1.5, "negative_prompt_ids": NEG[:1], "negative_prompt_attention_mask": torch.ones(1, 4)},
     ConfigError, r"`negative_prompt_attention_mask` must have the shape of `negative_prompt_ids` \(1, 3\)"),
    ({"guidance_scale": 1.5, "negative_prompt_ids": torch.tensor([1, 2])}, ConfigError,
     r"`negative_prompt_ids` must be a 2-D tensor of token ids"),
    ({"guidance_scale": 1.5, "negative_prompt_ids": torch.ones(3, 2, dtype=torch.long)}, ConfigError,
     r"`negative_prompt_ids` has 3 rows; give one per prompt \(2\) or one for all"),
    ({"guidance_scale": 1.5, "num_beams": 2}, NotSupportedError, r"`guidance_scale` .* not with beam search"),
])
def test_bad_guidance_inputs_are_refused_naming_the_field(tiny_pair, kwargs, error, message):
    _, ours = tiny_pair
    with pytest.raises(error, match=message):
        genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=3, **kwargs)


def test_guidance_scale_one_is_off(tiny_pair, caplog):
    _, ours = tiny_pair
    plain = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=5)
    with caplog.at_level("WARNING", logger="genkit.guidance"):
        off = genkit.generate(ours, IDS, attention_mask=MASK, max_new_tokens=5, guidance_scale=1,
                              negative_prompt_ids=NEG)
    assert torch.equal(off, plain)
    assert "`guidance_scale`=1 turns classifier-free guidance off" in caplog.text
