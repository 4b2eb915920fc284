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
def gemv_route(tmp_path, monkeypatch):
    """The float32 decode route on genkit's dense kernel (``GENKIT_KERNEL=gemv``), with a fresh
    kernel choice under a temporary ``GENKIT_HOME``; the thread count restored after."""
    from genkit.models import kernel_choice

    monkeypatch.setenv("GENKIT_HOME", str(tmp_path))
    monkeypatch.setenv(kernel_choice.ENV, "gemv")
    kernel_choice.CHOSEN.clear()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    kernel_choice.CHOSEN.clear()


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


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizers!",
          "caf\u00e9 \u65e5\u672c \U0001f600 emoji", "    indented code\n\treturn x", "numbers 12345 and 3.14"] * 20


def write_bpe_tokenizer(path, vocab_size=400):
    """A small byte-level BPE tokenizer folder (tokenizer.json + tokenizer_config.json with a chat
    template; ids 0-2 are <pad>, <s>, </s>), trained on CORPUS; returns ``path``."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1",
                                                           special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64,
    }))
    return path


def write_tiny_model(path, seed=0):
    """A model folder genkit (and transformers) load: ``genkit.models.tiny.tiny_llama`` with the
    400-token tokenizer of :func:`write_bpe_tokenizer` (config.json, model.safetensors, tokenizer);
    returns ``path``."""
    import json

    from safetensors.torch import save_file

    from genkit.models.tiny import TINY_LLAMA, tiny_llama

    write_bpe_tokenizer(path)
    model = tiny_llama(seed=seed, vocab_size=400)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 400}))
    return path
