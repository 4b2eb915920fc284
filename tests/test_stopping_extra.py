"""ConfidenceCriteria and validate_stopping_criteria (issue 18, item 6), against transformers 5."""

from __future__ import annotations

import warnings

import pytest
import torch

import genkit

transformers = pytest.importorskip("transformers")
from transformers.generation import stopping_criteria as hf_sc  # noqa: E402


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_confidence_criteria_matches_transformers(threshold):
    gen = torch.Generator().manual_seed(0)
    ours, ref = genkit.ConfidenceCriteria(threshold), hf_sc.ConfidenceCriteria(threshold)
    for _ in range(20):
        scores = (torch.randn(1, 16, generator=gen) * 3,)
        ids = torch.randint(0, 16, (1, 5), generator=gen)
        assert ours(ids, scores) == ref(ids, scores)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True, None])
def test_confidence_criteria_threshold_is_validated(bad):
    with pytest.raises(ValueError, match=r"`assistant_confidence_threshold` must be a number in \[0, 1\]"):
        genkit.ConfidenceCriteria(bad)


def test_validate_stopping_criteria_as_in_transformers():
    from genkit.strategy.processing import StoppingCriteriaList

    given = StoppingCriteriaList([genkit.MaxTimeCriteria(10.0)])
    out = genkit.validate_stopping_criteria(given, 12)
    assert out.max_length == 12 and given.max_length is None and len(given) == 1  # a copy, extended
    ids = torch.ones((2, 12), dtype=torch.long)
    assert out(ids, None).tolist() == [True, True]
    other = StoppingCriteriaList([genkit.MaxLengthCriteria(8)])
    with pytest.warns(UserWarning, match="different `max_length`"):
        kept = genkit.validate_stopping_criteria(other, 12)
    assert kept.max_length == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        genkit.validate_stopping_criteria(StoppingCriteriaList([genkit.MaxLengthCriteria(12)]), 12)
    ref = hf_sc.validate_stopping_criteria(hf_sc.StoppingCriteriaList([hf_sc.MaxTimeCriteria(10.0)]), 12)
    assert [type(c).__name__ for c in ref] == [type(c).__name__ for c in out]
