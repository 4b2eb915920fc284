"""Stopping criteria: max length / new tokens, max time, EOS, and tokenizer-aware stop strings
(checked against a brute-force byte oracle and transformers' StopStringCriteria)."""

from __future__ import annotations

import time

import pytest
import torch

import genkit
from genkit.builtin_strategies.stop_strings import StopStringCriteria, token_bytes
from genkit.builtin_strategies.stopping import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = (["The quick brown fox jumps over the lazy dog. STOP here. Stop! end of story\n"] * 20
          + ["héllo wörld 日本語のテキスト naïve café ###", "x = 1; y = 2; # stop\n"] * 10)
STOPS = ["STOP", "here.", "日本", " end", "a", "ö w", "fox jumps"]


def _train(kind: str) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<pad>", "<s>", "</s>"])
    else:  # sentencepiece-like: "▁" word prefix, text pieces
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request):
    return _train(request.param)


def _oracle(tok_bytes: dict[int, bytes], row: list[int], stops: list[str]) -> bool:
    """A stop string occurs in the text and ends inside the last token."""
    before = b"".join(tok_bytes.get(i, b"") for i in row[:-1])
    full = before + tok_bytes.get(row[-1], b"")
    for s in stops:
        sb = s.encode()
        start = full.find(sb)
        while start >= 0:
            if start + len(sb) > len(before):
                return True
            start = full.find(sb, start + 1)
    return False


def _relevant_ids(tokenizer, stops: list[str]) -> list[int]:
    tb = token_bytes(tokenizer)
    alphabet = set(b"".join(s.encode() for s in stops))
    return sorted(i for i, b in tb.items() if b and set(b) <= alphabet)


def test_stop_strings_match_oracle_and_transformers(tokenizer):
    from transformers.generation.stopping_criteria import StopStringCriteria as RefCriteria

    ours = StopStringCriteria(tokenizer, STOPS)
    ref = RefCriteria(tokenizer, STOPS)
    tb = token_bytes(tokenizer)
    pool = torch.tensor(_relevant_ids(tokenizer, STOPS))
    gen = torch.Generator().manual_seed(0)
    hits = 0
    for length in (1, 2, 3, 5, 9, 14):
        # random rows of tokens made only of stop-string bytes: matches are frequent
        x = pool[torch.randint(0, len(pool), (64, length), generator=gen)]
        got = ours(x)
        expected = torch.tensor([_oracle(tb, row, STOPS) for row in x.tolist()])
        assert torch.equal(got, expected)
        assert torch.equal(got, ref(x, None))
        hits += int(got.sum())
    assert hits > 20  # the test exercised real matches


def test_stop_string_spanning_tokens_and_overshoot(tokenizer):
    text = "The quick brown fox jumps over. STOP here. 日本語 end of story a"
    ids = tokenizer.encode(text, add_special_tokens=False)
    crit = StopStringCriteria(tokenizer, ["fox jumps", "STOP here", "語 en"])
    tb = token_bytes(tokenizer)
    fired = []
    for n in range(1, len(ids) + 1):
        if bool(crit(torch.tensor([ids[:n]]))[0]):
            fired.append(n)
        assert bool(crit(torch.tensor([ids[:n]]))[0]) == _oracle(tb, ids[:n], ["fox jumps", "STOP here", "語 en"])
    assert len(fired) == 3  # each stop string fires once, at the token that completes it
    # the multi-token case: at least one stop string needed more than one token
    assert any(len(tokenizer.encode(s, add_special_tokens=False)) > 1 for s in ["fox jumps", "STOP here"])


def test_stop_strings_in_generate_match_transformers(tiny_pair):
    hf, ours = tiny_pair
    tok = _train("byte_level")
    ids = torch.tensor([[1, 40, 41, 42]])
    full = ours.generate(ids, max_new_tokens=30, eos_token_id=None)
    new_text = tok.decode(full[0, 4:])
    # a stop string (two printable ASCII characters) taken from the actual continuation after
    # its first third, so it must fire before the end
    stop = next(new_text[i:i + 2] for i in range(len(new_text) // 3, len(new_text) - 2)
                if all(33 <= ord(c) < 127 for c in new_text[i:i + 2]))
    ref = hf.generate(ids, do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tok,
                      eos_token_id=None, pad_token_id=0)
    got = ours.generate(ids, max_new_tokens=30, stop_strings=[stop], tokenizer=tok, eos_token_id=None)
    assert torch.equal(got, ref)
    assert got.shape[1] < full.shape[1]
    assert stop in tok.decode(got[0, 4:])


def test_stop_strings_without_tokenizer_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, stop_strings=["x"])


def test_stop_string_criteria_rejects_bad_arguments(tokenizer):
    for bad in ([], "", [""], [3]):
        with pytest.raises(ValueError, match="stop_strings"):
            StopStringCriteria(tokenizer, bad)
    with pytest.raises(ValueError, match="tokenizer"):
        StopStringCriteria(None, ["x"])


def test_max_length_and_max_new_tokens(tiny_model):
    ids = torch.tensor([[1, 5, 6]])
    assert tiny_model.generate(ids, max_length=9, eos_token_id=None).shape == (1, 9)
    assert tiny_model.generate(ids, max_new_tokens=4, eos_token_id=None).shape == (1, 7)
    # max_new_tokens wins over max_length
    assert tiny_model.generate(ids, max_new_tokens=2, max_length=50, eos_token_id=None).shape == (1, 5)
    crit = MaxLengthCriteria(5)
    assert crit(torch.zeros(2, 4, dtype=torch.long)).tolist() == [False, False]
    assert crit(torch.zeros(2, 5, dtype=torch.long)).tolist() == [True, True]


def test_max_time_stops_generation(tiny_model):
    class Slow(genkit.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            time.sleep(0.05)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    start = time.time()
    out = tiny_model.generate(torch.tensor([[1, 2]]), max_new_tokens=400, max_time=0.3, eos_token_id=None,
                              stopping_criteria=[Slow()])
    assert 3 <= out.shape[1] < 100
    assert time.time() - start < 5
    crit = MaxTimeCriteria(10.0, initial_timestamp=time.time() - 11)
    assert crit(torch.zeros(3, 2, dtype=torch.long)).all()
    assert not MaxTimeCriteria(10.0)(torch.zeros(1, 2, dtype=torch.long)).any()


def test_eos_criteria_one_or_many_ids():
    ids = torch.tensor([[4, 2], [4, 5], [4, 7]])
    assert EosTokenCriteria(2)(ids).tolist() == [True, False, False]
    assert EosTokenCriteria([2, 7])(ids).tolist() == [True, False, True]
    assert EosTokenCriteria(torch.tensor([5]))(ids).tolist() == [False, True, False]


@pytest.mark.parametrize(("make", "field"), [
    (lambda: MaxLengthCriteria(0), "max_length"),
    (lambda: MaxLengthCriteria(10, max_position_embeddings=0), "max_position_embeddings"),
    (lambda: MaxTimeCriteria(0), "max_time"),
    (lambda: MaxTimeCriteria(-2.5), "max_time"),
    (lambda: EosTokenCriteria(-1), "eos_token_id"),
    (lambda: EosTokenCriteria([]), "eos_token_id"),
    (lambda: EosTokenCriteria(torch.tensor([1.5])), "eos_token_id"),
])
def test_criteria_validation(make, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        make()


def test_eos_per_row_finishing_pads_finished_rows(tiny_pair):
    """Rows that emit EOS stop and are padded while the others go on (same as transformers)."""
    hf, ours = tiny_pair
    ids3 = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
    mask = (ids3 != 0).long()
    first = ours.generate(ids3, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    eos = int(first[0, 5 + 3])  # a token row 0 really emits at its 4th step
    ref = hf.generate(ids3, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    got = ours.generate(ids3, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, ref)
    assert (got[0, 9:] == 0).all()


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_genkit_tokenizer_gives_the_same_token_bytes_and_matches(kind):
    """genkit's own Tokenizer (no convert_tokens_to_string) works for stop strings too."""
    from genkit.tokenizer import Tokenizer

    hf_tok = _train(kind)
    ours = Tokenizer(hf_tok.backend_tokenizer)
    assert token_bytes(ours) == token_bytes(hf_tok)
    pool = torch.tensor(_relevant_ids(hf_tok, STOPS))
    x = pool[torch.randint(0, len(pool), (64, 6), generator=torch.Generator().manual_seed(5))]
    assert torch.equal(StopStringCriteria(ours, STOPS)(x), StopStringCriteria(hf_tok, STOPS)(x))
