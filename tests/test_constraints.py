"""``constraints=`` (issue 26): constrained beam search as ``force_words_ids`` runs it, never
accepted and ignored. Items are phrases and disjunctive sets as in ``force_words_ids``, or objects
with ``token_ids`` (transformers 4's ``PhrasalConstraint`` / ``DisjunctiveConstraint``; transformers 5
no longer has them, so the stand-ins below carry the same attribute)."""

from __future__ import annotations

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama

IDS = torch.tensor([[3, 4, 5, 6, 7]])


class PhrasalConstraint:  # transformers 4's: token_ids is the phrase
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


class DisjunctiveConstraint:  # transformers 4's: token_ids is the list of alternatives
    def __init__(self, nested_token_ids: list[list[int]]) -> None:
        self.token_ids = nested_token_ids


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _contains(row: list[int], phrase: list[int]) -> bool:
    return any(row[i:i + len(phrase)] == phrase for i in range(len(row)))


def test_constraints_run_constrained_beam_search(model):
    plain = genkit.generate(model, IDS, max_new_tokens=8, num_beams=4)[0, 5:].tolist()
    assert not _contains(plain, [40, 41])
    got = genkit.generate(model, IDS, max_new_tokens=8, num_beams=4, constraints=[[40, 41]])
    assert _contains(got[0, 5:].tolist(), [40, 41])
    assert torch.equal(got, genkit.generate(model, IDS, max_new_tokens=8, num_beams=4, force_words_ids=[[40, 41]]))


def test_constraint_objects_and_force_words_ids_together(model):
    objects = genkit.generate(model, IDS, max_new_tokens=8, num_beams=4,
                              constraints=[PhrasalConstraint([40, 41]), DisjunctiveConstraint([[50], [51, 52]])])
    lists = genkit.generate(model, IDS, max_new_tokens=8, num_beams=4, force_words_ids=[[40, 41], [[50], [51, 52]]])
    assert torch.equal(objects, lists)
    both = genkit.generate(model, IDS, max_new_tokens=8, num_beams=4, constraints=[PhrasalConstraint([40, 41])],
                           force_words_ids=[[[50], [51, 52]]])
    assert torch.equal(both, lists)  # constraints first, then force_words_ids, as transformers joined them
    config = genkit.GenerationConfig(num_beams=2, constraints=[PhrasalConstraint([4, 5])])
    assert config.constraints == [[4, 5]] and config == genkit.GenerationConfig.from_dict(config.to_dict())


def test_constraints_that_cannot_run_are_refused_naming_them(model):
    with pytest.raises(ConfigError, match=r"`constraints` \(constrained beam search\) needs num_beams > 1"):
        genkit.generate(model, IDS, max_new_tokens=4, constraints=[[40, 41]])
    with pytest.raises(ConfigError, match=r"`constraints` \(constrained beam search\) needs num_beams > 1"):
        genkit.generate(model, IDS, max_new_tokens=4, num_beams=2, do_sample=True, constraints=[[40, 41]])
    with pytest.raises(ConfigError, match="`constraints` must be a list of constraints .* got \\[<object"):
        genkit.generate(model, IDS, max_new_tokens=4, num_beams=2, constraints=[object()])
    with pytest.raises(ConfigError, match=r"`constraints` holds token ids \[500\] outside the model's vocabulary "
                                          r"\(size 128\); accepted ids are 0..127"):
        genkit.generate(model, IDS, max_new_tokens=4, num_beams=2, constraints=[[500]])
