"""Shared fixtures: tiny random models (native and, where transformers is installed, its twin)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per xdist worker: two workers on two cores must not oversubscribe them
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """genkit logs some warnings once per process (genkit.config.warn_once): every test starts
    with none logged, so what it sees does not depend on the tests that ran before it."""
    from genkit.config import WARNED

    WARNED.clear()
    yield


@pytest.fixture
def tiny_model():
    from genkit.models.tiny import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Llama saved by transformers' save_pretrained (GQA, untied)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tiny_hf_dir):
    """(transformers model, genkit model) with the same weights."""
    import transformers

    import genkit

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval()
    ours = genkit.load_model(tiny_hf_dir)
    return hf, ours
