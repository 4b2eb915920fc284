"""issue 28, inputs to generate: token ids outside the vocabulary, unknown forward keyword
arguments and a device this torch build lacks are clear errors, not IndexError, silent acceptance
or an AssertionError."""

from __future__ import annotations

import json
import os

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import TINY_LLAMA


@pytest.mark.parametrize("bad", [99999, 128, -1])
def test_token_ids_outside_the_vocabulary_are_a_config_error(tiny_model, bad):
    with pytest.raises(ConfigError, match=rf"`input_ids` holds token ids \[{bad}\] outside the model's vocabulary "
                                          r"\(size 128\); accepted ids are 0..127; check the tokenizer"):
        genkit.generate(tiny_model, torch.tensor([[1, bad]]), max_new_tokens=2)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        tiny_model(torch.tensor([[bad, 1]]))


def test_unknown_forward_keywords_are_refused_by_name(tiny_model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ConfigError, match=r"unknown keyword argument\(s\) 'foo' for the model's forward"):
        tiny_model(ids, foo=1)
    with pytest.raises(ConfigError, match=r"`labels` must have the shape of `input_ids` \(1, 3\)"):
        tiny_model(ids, labels=ids[:, :2])
    want = tiny_model(ids).logits
    assert torch.equal(tiny_model(ids, return_dict=True, output_attentions=False).logits, want)


def test_a_device_this_torch_lacks_is_a_config_error(tmp_path):
    from safetensors.torch import save_file

    from genkit.models.tiny import tiny_llama
    save_file({k: v.contiguous() for k, v in tiny_llama().state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(ConfigError, match=r"`device`='nonsense' is not a torch device"):
        genkit.load_model(tmp_path, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"`device`='cuda': (this torch build has no CUDA support|no cuda device)"):
            genkit.load_model(tmp_path, device="cuda")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ConfigError, match=rf"there are {n} cuda device"):
            genkit.load_model(tmp_path, device=f"cuda:{n}")
    assert genkit.load_model(tmp_path, device="cpu").device.type == "cpu"



def test_a_length_past_the_context_is_refused_before_anything_is_allocated(tiny_model):
    """max_new_tokens=10**9 used to size an (rows, 10**9) id buffer (8 GB) before max_time could stop it."""
    context = tiny_model.config.max_position_embeddings
    ids = torch.tensor([[1, 2, 3]])
    for engine in ({}, {"num_beams": 2}, {"penalty_alpha": 0.6, "top_k": 4}):
        with pytest.raises(ConfigError, match=rf"`max_new_tokens` \(1000000000\) with a prompt of 3 tokens needs "
                                              rf"1000000003 positions; the model's context \(`max_position_embeddings`\) "
                                              rf"is {context}: ask for at most {context - 3} new tokens"):
            genkit.generate(tiny_model, ids, max_new_tokens=10**9, max_time=3, **engine)
    with pytest.raises(ConfigError, match=rf"^`max_length` \({context + 1}\) with a prompt of 3 tokens is past the context; "
                                          rf"the model's "
                                          rf"context \(`max_position_embeddings`\) is {context}: ask for at most "):
        genkit.generate(tiny_model, ids, max_length=context + 1)  # named as the caller set it
    with pytest.raises(ConfigError, match=rf"^the prompt has {context} tokens; the model's context "
                                          rf"\(`max_position_embeddings`\) is {context}: shorten the prompt to at most "
                                          rf"{context - 1} tokens"):  # (not "ask for at most 0 new tokens")
        genkit.generate(tiny_model, torch.ones(1, context, dtype=torch.long), max_new_tokens=3)
    out = genkit.generate(tiny_model, ids, max_new_tokens=context - 3, min_new_tokens=context - 3)
    assert out.shape == (1, context)  # the whole context stays usable


# -- hostile generation settings: refused by name before anything is allocated --------------------
# the tiny model's sequence: per position its token id and mask (8 + 8 bytes) and its key/value
# cache (keys and values, 2 layers, 2 key/value heads of 16 float32s: 512 bytes); its logits, 128 float32s
PER_POSITION, PER_SEQUENCE, BUDGET = 16 + 2 * 2 * 2 * 16 * 4, 128 * 4, 100_000
# ... and a beam's: its candidates' and finished hypotheses' ids (8 int64 per position), 3 more rows of
# vocabulary floats per step (the log-softmax, its sum with the beam's score, beam sampling's softmax)
BEAM_PER_POSITION, BEAM_PER_SEQUENCE = PER_POSITION + 64, 4 * PER_SEQUENCE


def _over(held: int, positions: int, need: int) -> str:
    return (f"holds {held} sequence{'s' if held != 1 else ''} of up to {positions} positions at once: about "
            f"{need / 1024:.1f} KiB for their token ids, key/value caches and logits, more than the 97.7 KiB of "
            f"memory available (GENKIT_MAX_GENERATION_BYTES)")


@pytest.mark.parametrize(("settings", "prompts", "name", "per_prompt"), [
    ({"num_beams": 64}, 1, "num_beams", 64),
    ({"num_beams": 32, "num_return_sequences": 2}, 1, "num_beams", 32),
    ({"num_return_sequences": 16, "do_sample": True}, 2, "num_return_sequences", 16),
    ({"penalty_alpha": 0.6, "top_k": 10**9}, 1, "top_k", 128),  # contrastive search: at most the vocabulary
], ids=["beams", "beams-returned", "sampled", "contrastive"])
def test_more_sequences_than_fit_are_refused_naming_the_setting(tiny_model, monkeypatch, settings, prompts, name,
                                                                 per_prompt):
    """num_beams=10**9 asked the allocator for 184 GB of token ids (a RuntimeError), contrastive
    search's top_k=10**9 the same; num_return_sequences=10**8 2.4 GB: now a ConfigError naming the
    setting and the most that fits (GENKIT_MAX_GENERATION_BYTES sets the memory available)."""
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", str(BUDGET))
    ids = torch.tensor([[1, 2, 3], [1, 4, 5]][:prompts])
    beams = name == "num_beams"
    per_position, per_sequence = (BEAM_PER_POSITION, BEAM_PER_SEQUENCE) if beams else (PER_POSITION, PER_SEQUENCE)
    one = prompts * (8 * per_position + per_sequence)  # each prompt's sequence, of 3 + 5 positions
    most = BUDGET // one
    with pytest.raises(ConfigError) as exc:
        genkit.generate(tiny_model, ids, max_new_tokens=5, **settings)
    assert str(exc.value) == (
        f"`{name}` ({settings[name]}) with {prompts} prompt{'s' if prompts > 1 else ''} of 3 tokens and 5 new tokens "
        f"{_over(prompts * per_prompt, 8, one * per_prompt)}; at most {most} fit: set `{name}` to {most} or less")
    fits = {**settings, name: most}
    if name == "num_beams" and "num_return_sequences" in settings:
        fits["num_return_sequences"] = 1
    out = genkit.generate(tiny_model, ids, max_new_tokens=5, **fits)  # the most that fits runs
    assert out.shape[1] == 8


def test_a_length_that_does_not_fit_is_refused_naming_the_most_new_tokens(tiny_model, monkeypatch):
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", str(BUDGET))
    ids = torch.tensor([[1, 2, 3]])
    most = (BUDGET - PER_SEQUENCE) // PER_POSITION - 3
    with pytest.raises(ConfigError) as exc:
        genkit.generate(tiny_model, ids, max_new_tokens=400)  # within the context (512)
    assert str(exc.value) == (f"`max_new_tokens` (400) with 1 prompt of 3 tokens "
                              f"{_over(1, 403, 403 * PER_POSITION + PER_SEQUENCE)}; ask for at most {most} new tokens")
    with pytest.raises(ConfigError) as exc:
        genkit.generate(tiny_model, ids, max_new_tokens=400, num_beams=2)
    assert str(exc.value) == (f"`max_new_tokens` (400) with 1 prompt of 3 tokens (`num_beams`=2) "
                              f"{_over(2, 403, 2 * (403 * BEAM_PER_POSITION + BEAM_PER_SEQUENCE))}; ask for at most "
                              f"{(BUDGET // 2 - BEAM_PER_SEQUENCE) // BEAM_PER_POSITION - 3} new tokens")
    assert genkit.generate(tiny_model, ids, max_new_tokens=most).shape == (1, 3 + most)
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"^GENKIT_MAX_GENERATION_BYTES='lots' is not accepted; use a positive "
                                          r"number of bytes$"):
        genkit.generate(tiny_model, ids, max_new_tokens=2)


KV = PER_POSITION - 16  # the tiny model's key/value cache per position


def _most_new_tokens(per_position: int, per_sequence: int, prompt: int = 3) -> int:
    return (BUDGET - per_sequence) // per_position - prompt


@pytest.mark.parametrize(("settings", "per_position", "per_sequence"), [
    ({"guidance_scale": 1.5}, PER_POSITION + KV, 2 * PER_SEQUENCE),  # the unconditional branch's cache and logits
    ({"guidance_scale": 1.5, "negative_prompt_ids": torch.arange(1, 41)[None]},  # 37 positions past the prompt
     PER_POSITION + KV, 2 * PER_SEQUENCE + 37 * KV),
    ({"assistant": True}, 2 * PER_POSITION, 2 * PER_SEQUENCE),  # the assistant's ids, cache and logits
], ids=["guidance", "negative-prompt", "assistant"])
def test_what_guidance_and_an_assistant_hold_counts_in_the_memory_check(tiny_model, monkeypatch, settings,
                                                                        per_position, per_sequence):
    """Classifier-free guidance runs a second branch with its own cache and logits (a negative prompt
    longer than the prompt holds more), assisted decoding an assistant model with its own: the memory
    check counted only the model's sequence, so a length that fitted that alone could exhaust memory."""
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", str(BUDGET))
    settings = dict(settings)
    if settings.pop("assistant", False):
        settings["assistant_model"] = tiny_model
    ids = torch.tensor([[1, 2, 3]])
    most = _most_new_tokens(per_position, per_sequence)
    assert most < _most_new_tokens(PER_POSITION, PER_SEQUENCE)
    with pytest.raises(ConfigError, match=rf"^`max_new_tokens` \({most + 1}\) with 1 prompt of 3 tokens holds 1 "
                                          rf"sequence of up to {most + 4} positions at once: .*; ask for at most {most} "
                                          rf"new tokens$"):
        genkit.generate(tiny_model, ids, max_new_tokens=most + 1, **settings)
    assert genkit.generate(tiny_model, ids, max_new_tokens=most, min_new_tokens=most, **settings).shape == (1, 3 + most)


@pytest.mark.parametrize("outputs", [{"output_scores": True}, {"output_scores": True, "output_logits": True},
                                     {"output_hidden_states": True}, {"output_attentions": True}],
                         ids=["scores", "scores-logits", "hidden-states", "attentions"])
def test_recorded_outputs_count_in_the_memory_check(tiny_model, monkeypatch, outputs):
    """output_scores / output_logits keep a vocabulary row per step, output_hidden_states every layer's
    state per position, output_attentions each layer's heads' weights over the positions before (the
    square of the length): 4,000 new tokens with output_attentions on a 32-layer model were 8 GB
    the check did not see."""
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", str(BUDGET))
    cfg = tiny_model.config
    per_position = PER_POSITION + 4 * 128 * (bool(outputs.get("output_scores")) + bool(outputs.get("output_logits")))
    per_position += 4 * (cfg.num_hidden_layers + 1) * cfg.hidden_size if "output_hidden_states" in outputs else 0
    per_pair = 4 * cfg.num_hidden_layers * cfg.num_attention_heads if "output_attentions" in outputs else 0
    most = max(n for n in range(1, 2000) if n * per_position + n * n * per_pair + PER_SEQUENCE <= BUDGET) - 3
    assert most < _most_new_tokens(PER_POSITION, PER_SEQUENCE)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ConfigError, match=rf"^`max_new_tokens` \({most + 1}\) with 1 prompt of 3 tokens holds 1 "
                                          rf"sequence of up to {most + 4} positions at once: about [\d.]+ KiB for their "
                                          rf"token ids, key/value caches, logits and the outputs recorded, more than "
                                          rf"the 97.7 KiB of memory available \(GENKIT_MAX_GENERATION_BYTES\); ask for "
                                          rf"at most {most} new tokens$"):
        genkit.generate(tiny_model, ids, max_new_tokens=most + 1, return_dict_in_generate=True, **outputs)
    out = genkit.generate(tiny_model, ids, max_new_tokens=most, min_new_tokens=most, return_dict_in_generate=True,
                          **outputs)
    assert out.sequences.shape == (1, 3 + most)


def test_an_encoder_decoders_cross_attention_counts_in_the_memory_check(monkeypatch):
    """Each sequence of an encoder-decoder model holds its decoder's cross-attention keys and values over
    every encoder position (per beam): counted beside its own cache."""
    pytest.importorskip("transformers")
    from seq2seq_models import build

    from genkit.models.memory import kv_bytes_per_position

    model = build("t5")
    kv = kv_bytes_per_position(model.config)
    assert kv == 2 * 2 * 4 * 8 * 4  # 2 decoder layers of 4 heads of 8, keys and values, float32
    source = torch.arange(3, 3 + 50)[None]
    budget = 4 * (40 * (kv + 16) + 96 * 4 + 50 * kv)  # 4 beams of 40 positions over 50 encoder positions
    monkeypatch.setenv("GENKIT_MAX_GENERATION_BYTES", str(budget))
    # (the decoder's prompt is its start token: 40 new tokens make 41 positions, one more than the budget's 40)
    with pytest.raises(ConfigError, match=r"^`num_beams` \(4\) with 1 prompt of 1 token and 40 new tokens holds 4 "
                                          r"sequences of up to 41 positions at once: .*; at most 3 fit: set `num_beams` "
                                          r"to 3 or less$"):
        genkit.generate(model, source, num_beams=4, max_new_tokens=40)
    assert genkit.generate(model, source, num_beams=3, max_new_tokens=40, min_new_tokens=40).shape == (1, 41)


def test_a_billion_beams_are_refused_against_the_memory_there_is(tiny_model):
    """The audit's case, against the machine's own memory (MemAvailable, the cgroup, ulimit -v)."""
    with pytest.raises(ConfigError, match=r"^`num_beams` \(1000000000\) with 1 prompt of 3 tokens and 2 new tokens "
                                          r"holds 1000000000 sequences of up to 5 positions at once: about [\d.]+ TiB "
                                          r"for their token ids, key/value caches and logits, more than the [\d.]+ "
                                          r"[KMGT]iB of memory available \(.+\); at most \d+ fit: set `num_beams` to "
                                          r"\d+ or less$"):
        genkit.generate(tiny_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, num_beams=10**9)



def test_the_memory_available_obeys_the_address_space_limit():
    """Under ``ulimit -v`` (the audit ran its cases under 3 GB) the memory available is what the limit
    leaves, not the machine's MemAvailable: the process's size counts against it."""
    import subprocess
    import sys

    script = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000)); "
              "from genkit.models.memory import available_memory; print(*available_memory('cpu'), sep='|')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "GENKIT_MAX_GENERATION_BYTES"})
    value, source = done.stdout.strip().split("|")
    assert 0 < int(value) < 3_000_000_000, done.stderr[-2000:]  # (never more than the limit leaves)
    assert source in ("the address-space limit (ulimit -v)", "MemAvailable in /proc/meminfo") or "cgroup" in source

def test_contrastive_top_k_past_the_vocabulary_names_every_token(tiny_model):
    """top_k=10**9 made torch.topk fail (after sizing 10**9 candidate rows); it is every token of the
    vocabulary, as top_k=128 is."""
    ids = torch.tensor([[1, 2, 3], [1, 4, 5]])
    want = genkit.generate(tiny_model, ids, max_new_tokens=4, penalty_alpha=0.6, top_k=128)
    for low_memory in (False, True):
        got = genkit.generate(tiny_model, ids, max_new_tokens=4, penalty_alpha=0.6, top_k=10**9, low_memory=low_memory)
        assert got.tolist() == want.tolist()


def test_a_sampling_temperature_too_small_to_scale_by_is_refused(tiny_model):
    """temperature=1e-320 divided the logits into inf, then sampling failed on NaN probabilities (a
    RuntimeError); vLLM reads a temperature under 1e-5 as greedy: here it is a ConfigError."""
    ids = torch.tensor([[1, 2, 3]])
    for t in (1e-320, 9.99e-6):
        with pytest.raises(ConfigError) as exc:
            genkit.generate(tiny_model, ids, max_new_tokens=3, do_sample=True, temperature=t)
        assert str(exc.value) == (f"`temperature` must be >= 1e-05 when do_sample=True; got {t!r}: a smaller one "
                                  "overflows the scaled logits. For greedy decoding set do_sample=False.")
    genkit.set_seed(0)
    out = genkit.generate(tiny_model, ids, max_new_tokens=3, do_sample=True, temperature=1e-5)
    assert out.tolist() == genkit.generate(tiny_model, ids, max_new_tokens=3).tolist()  # as good as greedy


def test_huge_length_penalties_score_beams_without_overflow(tiny_model):
    """length_penalty=1e308 made beam search's `length ** length_penalty` an OverflowError; the
    divisor is kept in float32's range, so 1e308 ranks as 1000 does (both past it), -1e308 as -1000;
    a value that is no finite number is refused when set."""
    from genkit.builtin_strategies.beam_common import length_normalizer

    assert length_normalizer(7, 1.5) == 7.0 ** 1.5 and length_normalizer(1, 1e308) == 1.0
    assert length_normalizer(2, 1e308) == length_normalizer(2, 1000) == 3.4028234663852886e38
    assert length_normalizer(2, -1e308) == length_normalizer(2, -1000) == 1.1754943508222875e-38
    ids = torch.tensor([[1, 2, 3], [1, 4, 5]])
    for strategy in ({"num_beams": 3}, {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
                     {"num_beams": 3, "force_words_ids": [[7]]}):
        for big, moderate in ((1e308, 1000.0), (-1e308, -1000.0)):
            got = genkit.generate(tiny_model, ids, max_new_tokens=4, length_penalty=big, eos_token_id=9, **strategy)
            want = genkit.generate(tiny_model, ids, max_new_tokens=4, length_penalty=moderate, eos_token_id=9,
                                   **strategy)
            assert got.tolist() == want.tolist()
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"^`length_penalty` must be a finite number \(exponent on the sequence "
                                              r"length\); got (inf|nan)\.$"):
            genkit.GenerationConfig(length_penalty=bad)
