"""Streamers: text printed / yielded equals the decoded text; end() on every exit path."""

from __future__ import annotations

import asyncio
import threading
import unicodedata

import pytest
import torch

import genkit
from genkit.builtin_strategies.streamers import (
    AsyncTextIteratorStreamer,
    BaseStreamer,
    TextIteratorStreamer,
    TextStreamer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPT = [[1, 40, 41, 42]]


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE tokenizer (multi-byte characters split across tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = ["Hello world, this is a test of streaming text.\nA new line here. "] * 20 + ["日本語のテキスト café"] * 5
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      special_tokens=["<pad>", "<s>", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t)


class Recorder(TextStreamer):
    def __init__(self, tokenizer, **kw):
        super().__init__(tokenizer, **kw)
        self.chunks: list[str] = []
        self.ended = 0

    def on_finalized_text(self, text, stream_end=False):
        self.chunks.append(text)
        self.ended += int(stream_end)


def test_text_streamer_prints_the_decoded_text(tiny_model, tok, capsys):
    ids = torch.tensor(PROMPT)
    out = tiny_model.generate(ids, max_new_tokens=25, eos_token_id=None, streamer=TextStreamer(tok))
    assert capsys.readouterr().out == tok.decode(out[0]) + "\n"
    out = tiny_model.generate(ids, max_new_tokens=25, eos_token_id=None,
                              streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == tok.decode(out[0, ids.shape[1]:]) + "\n"


def test_streamer_by_registered_name(tiny_model, tok, capsys):
    out = genkit.generate(tiny_model, torch.tensor(PROMPT), max_new_tokens=10, eos_token_id=None, streamer="text",
                          tokenizer=tok)
    assert capsys.readouterr().out == tok.decode(out[0]) + "\n"
    reg = genkit.get_registry()
    assert reg.get("streamer", "iterator").load() is TextIteratorStreamer
    assert reg.get("streamer", "async_iterator").load() is AsyncTextIteratorStreamer


def test_words_are_released_whole_and_utf8_is_never_split(tok):
    text = "Hello world, this is 日本語 café text.\nA new line here. end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))  # some prefix cuts a character
    rec = Recorder(tok)
    rec.put(torch.tensor([ids[:1]]))
    for i in ids[1:]:
        rec.put(torch.tensor([i]))
    rec.end()
    assert "".join(rec.chunks) == text
    assert rec.ended == 1
    for chunk in rec.chunks[:-1]:
        assert "\ufffd" not in chunk
        # released: up to a space or newline, a CJK character, or text of letters, digits and spaces only
        assert (chunk == "" or chunk[-1] in " \n" or "\u3040" <= chunk[-1] <= "\u9fff"
                or all(c.isspace() or unicodedata.category(c)[0] in "LMN" for c in chunk)), chunk
    assert "Hello" in rec.chunks and ", " in rec.chunks  # the comma waits for the space after it


def test_chunks_match_transformers_text_streamer(tiny_model, tok):
    from transformers.generation.streamers import TextStreamer as RefStreamer

    class RefRecorder(RefStreamer):
        def __init__(self, tokenizer, **kw):
            super().__init__(tokenizer, **kw)
            self.chunks: list[str] = []

        def on_finalized_text(self, text, stream_end=False):
            self.chunks.append(text)

    ids = tok.encode("Hello world, this is a test of streaming text.\nA new line here. A new")
    ours, ref = Recorder(tok, skip_prompt=True), RefRecorder(tok, skip_prompt=True)
    for s in (ours, ref):
        s.put(torch.tensor([[1, 2]]))
        for i in ids:
            s.put(torch.tensor([i]))
        s.end()
    assert [c for c in ours.chunks if c] == [c for c in ref.chunks if c]


def test_iterator_streamer_yields_the_full_text(tiny_model, tok):
    ids = torch.tensor(PROMPT)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=30)
    result: dict[str, torch.Tensor] = {}

    def run():
        with torch.no_grad():
            result["out"] = tiny_model.generate(ids, max_new_tokens=30, eos_token_id=None, streamer=streamer)

    th = threading.Thread(target=run)
    th.start()
    text = "".join(streamer)
    th.join()
    assert text == tok.decode(result["out"][0, ids.shape[1]:])


def test_async_iterator_streamer_yields_the_full_text(tiny_model, tok):
    ids = torch.tensor(PROMPT)

    async def main():
        streamer = AsyncTextIteratorStreamer(tok, skip_prompt=True, timeout=30)

        def run():
            with torch.no_grad():
                return tiny_model.generate(ids, max_new_tokens=20, eos_token_id=None, streamer=streamer)

        task = asyncio.create_task(asyncio.to_thread(run))
        pieces = [piece async for piece in streamer]
        return "".join(pieces), await task

    text, out = asyncio.run(main())
    assert text == tok.decode(out[0, ids.shape[1]:])


def test_async_streamer_needs_a_running_loop(tok):
    with pytest.raises(RuntimeError, match="running event loop"):
        AsyncTextIteratorStreamer(tok)


class ExplodingLlama(genkit.LlamaForCausalLM):
    """A real tiny Llama whose forward fails on its 4th call (a crash mid-generation)."""

    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == 4:
            raise RuntimeError("boom at step 4")
        return super().forward(*args, **kwargs)


def test_model_error_mid_generation_still_ends_the_stream(tok):
    from genkit.models.tiny import tiny_llama

    base = tiny_llama(seed=0)
    model = ExplodingLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.eval()
    ExplodingLlama.calls = 0
    streamer = TextIteratorStreamer(tok, timeout=30)
    errors: list[BaseException] = []

    def run():
        try:
            with torch.no_grad():
                model.generate(torch.tensor(PROMPT), max_new_tokens=30, eos_token_id=None, streamer=streamer)
        except RuntimeError as exc:
            errors.append(exc)

    th = threading.Thread(target=run)
    th.start()
    pieces = list(streamer)  # terminates: end() ran although the model raised
    th.join(timeout=30)
    assert not th.is_alive()
    assert len(errors) == 1 and "boom at step 4" in str(errors[0])
    assert tok.decode(PROMPT[0]) in "".join(pieces)


def test_custom_base_streamer_gets_end_on_error(tiny_model):
    class Counting(BaseStreamer):
        def __init__(self):
            self.puts, self.ends = 0, 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                raise KeyError("streamer failure")

        def end(self):
            self.ends += 1

    s = Counting()
    with pytest.raises(KeyError):
        tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=10, eos_token_id=None, streamer=s)
    assert s.ends == 1


def test_streamer_argument_errors(tok):
    with pytest.raises(ValueError, match="tokenizer"):
        TextStreamer(None)
    with pytest.raises(ValueError, match="timeout"):
        TextIteratorStreamer(tok, timeout=-1)
    with pytest.raises(ValueError, match="batch size 1"):
        TextStreamer(tok).put(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(NotImplementedError):
        BaseStreamer().put(torch.tensor([1]))


# -- parity with transformers' streamers on real tokenizers ------------------------------------

STRESS = ["Hello \U0001f44b\U0001f3fd world! \U0001f468\u200d\U0001f469\u200d\U0001f467 family",
          "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587", "e\u0301 caf\u00e9 na\u00efve \u2211\u222b",
          "  two leading spaces\n\nnew\tline\n  indented\n", "it's (a) [test]: x=1, y=\"2\"; done.",
          "\U0001f1eb\U0001f1f7 \U0001d518\U0001d52b\U0001d526 \u0bb5\u0ba3\u0b95\u0bcd\u0b95\u0bae\u0bcd"]


class RefRecorder(transformers.TextStreamer):
    def __init__(self, tokenizer, **kw):
        super().__init__(tokenizer, **kw)
        self.chunks: list[str] = []

    def on_finalized_text(self, text, stream_end=False):
        self.chunks.append(text)


@pytest.fixture(scope="module")
def real_pairs(tmp_path_factory):
    """(genkit tokenizer, transformers tokenizer) twins: a SentencePiece GGUF with byte fallback
    (test_gguf_llama_tokenizer's) and a byte-level BPE folder whose special tokens only its config names."""
    pytest.importorskip("gguf")
    from test_gguf_llama_tokenizer import write_tiny_llama_gguf
    from test_tokenizer import _plain_bpe_folder

    folder = tmp_path_factory.mktemp("sp")
    write_tiny_llama_gguf(folder / "tiny.gguf")
    plain = _plain_bpe_folder(tmp_path_factory.mktemp("plain") / "tok", {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    return {"sentencepiece": (genkit.load_tokenizer(folder / "tiny.gguf"),
                              transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="tiny.gguf")),
            "config-specials": (genkit.load_tokenizer(plain), transformers.AutoTokenizer.from_pretrained(plain))}


def _feed(streamer, steps):
    for step in steps:
        streamer.put(torch.tensor([step]))
    streamer.end()
    return streamer


@pytest.mark.parametrize("name", ["sentencepiece", "config-specials"])
@pytest.mark.parametrize("kwargs", [{}, {"skip_prompt": True}, {"skip_special_tokens": True},
                                    {"skip_prompt": True, "skip_special_tokens": True}])
def test_chunks_match_transformers_on_real_tokenizers(real_pairs, name, kwargs):
    """Token by token (multi-byte characters split over byte tokens, newlines, special tokens),
    and on random ids (invalid UTF-8): the same non-empty chunks as transformers' TextStreamer on
    the transformers twin of the tokenizer, and their concatenation is the decoded text."""
    import random

    ours, ref = real_pairs[name]
    specials = sorted(ref.all_special_ids)
    sequences = [[[specials[0]]] + [[i] for i in ref.encode(t, add_special_tokens=False)]
                 for t in (STRESS if name == "sentencepiece" else ["ab a\nb</s>c <pad>a"])]
    rng = random.Random(0)
    for _ in range(60):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(ref)) for _ in range(12)]
        sequences.append([ids[:2]] + [[i] for i in ids[2:]])
    for steps in sequences:
        got = _feed(Recorder(ours, **kwargs), steps).chunks
        want = _feed(RefRecorder(ref, **kwargs), steps).chunks
        assert [c for c in got if c] == [c for c in want if c], steps
        if name == "config-specials" and kwargs.get("skip_special_tokens"):
            assert "</s>" not in "".join(got) and "<pad>" not in "".join(got)


def test_streamed_generate_matches_transformers_streamer_on_sentencepiece(real_pairs):
    """Through generate with a tiny model on the SentencePiece vocabulary: genkit's streamers give
    transformers' TextStreamer's chunks for the same ids, and the iterator streamers its text."""
    from genkit.models.tiny import tiny_llama

    ours, ref = real_pairs["sentencepiece"]
    model = tiny_llama(seed=0, vocab_size=len(ours))
    prompt = torch.tensor([ours.encode("Hello \u65e5\u672c\u8a9e \U0001f600")])
    for kwargs in ({}, {"skip_prompt": True, "skip_special_tokens": True}):
        rec = Recorder(ours, **kwargs)
        out = model.generate(prompt, max_new_tokens=40, eos_token_id=None, streamer=rec)
        steps = [prompt[0].tolist()] + [[t] for t in out[0, prompt.shape[1]:].tolist()]
        want = _feed(RefRecorder(ref, **kwargs), steps).chunks
        assert [c for c in rec.chunks if c] == [c for c in want if c]
        it = TextIteratorStreamer(ours, timeout=30, **kwargs)
        model.generate(prompt, max_new_tokens=40, eos_token_id=None, streamer=it)
        assert "".join(it) == "".join(want)


def test_iterator_timeouts_raise_as_transformers():
    import queue

    tok = _ByteTok()
    with pytest.raises(queue.Empty):
        next(iter(TextIteratorStreamer(tok, timeout=0.05)))
    with pytest.raises(queue.Empty):
        next(iter(transformers.TextIteratorStreamer(tok, timeout=0.05)))

    async def first(streamer):
        return await streamer.__anext__()

    async def main(cls):
        with pytest.raises(TimeoutError):
            await first(cls(tok, timeout=0.05))

    asyncio.run(main(AsyncTextIteratorStreamer))
    asyncio.run(main(transformers.AsyncTextIteratorStreamer))


class _ByteTok:
    def decode(self, ids, **kwargs):
        return bytes(ids).decode("utf-8", "replace")
