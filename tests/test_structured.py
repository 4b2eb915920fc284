"""Structured outputs in the library (issue 27, item 4): ``response_format`` and the ``guided_*``
fields of ``genkit.generate``, on the demo model (SmolLM2-135M-Instruct Q4_1), checked with
``jsonschema`` / ``re`` / ``json``; the processor's per-row state under beam reordering; the errors
that name the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import genkit
from genkit.errors import ConfigError

pytest.importorskip("llguidance")
pytest.importorskip("gguf")
jsonschema = pytest.importorskip("jsonschema")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_helpers import demo_folder, schemas, tiny_bart_folder  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    folder = demo_folder()
    torch.set_num_threads(1)
    return genkit.load_model(folder), genkit.load_tokenizer(folder)


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt")["input_ids"]


def _texts(tok, out, prompt_len):
    return [tok.decode(row[prompt_len:], skip_special_tokens=True) for row in out]


def _ends_with_eos(out, prompt_len, eos=2):
    return all(eos in row[prompt_len:].tolist() for row in out)


def test_json_schema_100_varied_schemas(demo):
    model, tok = demo
    failures = []
    for i, schema in enumerate(schemas(100, seed=0)):
        ids = _prompt(tok, "Reply with a JSON object.")
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        out = genkit.generate(model, ids, max_new_tokens=96, tokenizer=tok, response_format=fmt)
        text = _texts(tok, out, ids.shape[1])[0]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((i, text, str(exc)[:200]))
        assert _ends_with_eos(out, ids.shape[1]), (i, text)  # the grammar completed, then EOS
    assert not failures, failures[:3]


def test_json_object_parses(demo):
    model, tok = demo
    ids = _prompt(tok, "A cat, as JSON.")
    out = genkit.generate(model, ids, max_new_tokens=64, tokenizer=tok, response_format={"type": "json_object"})
    assert isinstance(json.loads(_texts(tok, out, ids.shape[1])[0]), dict)
    plain = genkit.generate(model, ids, max_new_tokens=20, tokenizer=tok, response_format={"type": "text"})
    assert torch.equal(plain, genkit.generate(model, ids, max_new_tokens=20))  # "text": no constraint


def test_guided_regex_choice_and_grammars(demo):
    model, tok = demo
    ids = _prompt(tok, "Give me a product code.")
    out = genkit.generate(model, ids, max_new_tokens=20, tokenizer=tok, guided_regex=r"[A-Z]{3}-[0-9]{2,4}")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", _texts(tok, out, ids.shape[1])[0])

    ids = _prompt(tok, "Is the sky blue?")
    out = genkit.generate(model, ids, max_new_tokens=10, tokenizer=tok, guided_choice=["yes", "no", "maybe not"])
    assert _texts(tok, out, ids.shape[1])[0] in ("yes", "no", "maybe not")

    lark = 'start: NUM " + " NUM (" + " NUM)?\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= num " = " num " + " num\nnum ::= [0-9] | [0-9] [0-9]'
    ids = _prompt(tok, "Write a sum of small numbers.")
    patterns = {lark: r"[0-9]{1,3} \+ [0-9]{1,3}( \+ [0-9]{1,3})?", gbnf: r"[0-9]{1,2} = [0-9]{1,2} \+ [0-9]{1,2}"}
    for grammar, pattern in patterns.items():
        out = genkit.generate(model, ids, max_new_tokens=24, tokenizer=tok, guided_grammar=grammar)
        text = _texts(tok, out, ids.shape[1])[0]
        assert re.fullmatch(pattern, text), (grammar, text)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_beams_sampling_and_batches_each_row_valid(demo):
    model, tok = demo
    enc = tok([tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in ("A person as JSON.", "Tell me about a very old man named Bob, as JSON please.")],
              return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    runs = {
        "beams": dict(num_beams=3, num_return_sequences=2),
        "sampling": dict(do_sample=True, num_return_sequences=3, temperature=1.3),
        "greedy batch": dict(),
    }
    genkit.set_seed(3)
    for name, kw in runs.items():
        out = genkit.generate(model, **enc, max_new_tokens=48, tokenizer=tok, guided_json=SCHEMA, **kw)
        for text in _texts(tok, out, enc["input_ids"].shape[1]):
            jsonschema.validate(json.loads(text), SCHEMA), (name, text)


def test_rows_reordered_like_beams_get_their_own_state(demo):
    """Rows that swap, fork and drop (as beam search reorders them) get the mask a fresh replay
    of each row's history gives."""
    from genkit.builtin_strategies.structured import GrammarLogitsProcessor

    _, tok = demo
    a, b = tok.encode('{"name', add_special_tokens=False), tok.encode('{"age', add_special_tokens=False)
    prompt = [5, 6]
    proc = GrammarLogitsProcessor(tok, json_schema=SCHEMA, prompt_length=2)
    steps = [[prompt, prompt]]
    for k in range(1, max(len(a), len(b)) + 1):
        steps.append([prompt + b[:k], prompt + a[:k], prompt + b[:k]])  # swapped, and row 0 forked
    for rows in steps:
        width = max(len(r) for r in rows)
        rows = [r + r[-1:] * (width - len(r)) for r in rows]
        ids = torch.tensor(rows)
        got = proc(ids, torch.zeros(len(rows), len(tok)))
        fresh = GrammarLogitsProcessor(tok, json_schema=SCHEMA, prompt_length=2)(ids, torch.zeros(len(rows), len(tok)))
        assert torch.equal(got, fresh)


def test_eos_only_where_the_grammar_accepts(demo):
    from genkit.builtin_strategies.structured import GrammarLogitsProcessor

    _, tok = demo
    yes = tok.encode("yes", add_special_tokens=False)
    proc = GrammarLogitsProcessor(tok, choice=["yes", "yesterday"], prompt_length=1)
    first = proc(torch.tensor([[7]]), torch.zeros(1, len(tok)))
    assert first[0, tok.eos_token_id] == float("-inf")  # nothing written yet
    after = proc(torch.tensor([[7] + yes]), torch.zeros(1, len(tok)))
    assert after[0, tok.eos_token_id] == 0  # "yes" is complete: EOS may come, or "terday"
    done = proc(torch.tensor([[7] + tok.encode("yesterday", add_special_tokens=False)]), torch.zeros(1, len(tok)))
    assert torch.isfinite(done[0]).nonzero().flatten().tolist() == [tok.eos_token_id]  # complete: only EOS


def test_errors_name_the_field(demo):
    from genkit.builtin_strategies.structured import GrammarLogitsProcessor

    model, tok = demo
    ids = _prompt(tok, "Hi")
    with pytest.raises(ConfigError, match=r"`response_format` must be .*json_schema"):
        genkit.GenerationConfig(response_format={"type": "xml"})
    for bad in ([], [f"option {i}" for i in range(16385)]):
        with pytest.raises(ConfigError, match="`guided_choice` must be a non-empty list of at most 16384 non-empty "
                                              "strings"):
            genkit.GenerationConfig(guided_choice=bad)
    with pytest.raises(ConfigError, match="`choice` may list at most 16384 choices; got 100000"):
        GrammarLogitsProcessor(tok, choice=[f"option {i}" for i in range(100_000)])
    with pytest.raises(ConfigError, match="`guided_json` must be a JSON schema"):
        genkit.GenerationConfig(guided_json="{not json")
    with pytest.raises(ConfigError, match="one structured-output field at a time; got `guided_json`, `guided_regex`"):
        genkit.generate(model, ids, max_new_tokens=2, tokenizer=tok, guided_json={"type": "object"}, guided_regex="a")
    with pytest.raises(ConfigError, match="`guided_regex` is not a valid regex"):
        genkit.generate(model, ids, max_new_tokens=2, tokenizer=tok, guided_regex="([a-z")
    with pytest.raises(ConfigError, match="`guided_grammar` is not a valid grammar"):
        genkit.generate(model, ids, max_new_tokens=2, tokenizer=tok, guided_grammar="start: undefined_rule")
    with pytest.raises(ConfigError, match="`guided_choice` needs the tokenizer.*pass `tokenizer=`"):
        genkit.generate(model, ids, max_new_tokens=2, guided_choice=["a"])


def test_without_the_extra_the_error_names_it(tmp_path):
    """Without llguidance, asking for structured output is a NotSupportedError naming the extra
    (a subprocess where the import of llguidance fails)."""
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "import torch, genkit\n"
        "from genkit.models.tiny import tiny_llama\n"
        "try:\n"
        "    genkit.generate(tiny_llama(seed=0), torch.tensor([[1, 2]]), max_new_tokens=2, tokenizer=object(),\n"
        "                    guided_regex='a+')\n"
        "except genkit.errors.NotSupportedError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'genkit-lm[structured]'" in out.stdout, out.stderr


def test_assisted_decoding_gives_greedy_constrained_tokens(demo):
    """Prompt lookup drafts tokens the grammar may refuse; verification calls the processor on
    candidate histories and rolls back: the result is constrained greedy's."""
    model, tok = demo
    ids = _prompt(tok, 'Copy this JSON: {"name": "Bob", "age": 33}')
    greedy = genkit.generate(model, ids, max_new_tokens=30, tokenizer=tok, guided_json=SCHEMA)
    drafted = genkit.generate(model, ids, max_new_tokens=30, tokenizer=tok, guided_json=SCHEMA,
                              prompt_lookup_num_tokens=4)
    assert torch.equal(greedy, drafted)
    jsonschema.validate(json.loads(_texts(tok, greedy, ids.shape[1])[0]), SCHEMA)


def test_an_encoder_decoder_models_decoder_is_constrained_after_its_start_token(tmp_path):
    """Structured outputs on an encoder-decoder model (a tiny random BART through the transformers
    adapter, a byte-level BPE tokenizer): the grammar starts after the decoder's start token, not after
    the encoder's prompt, and every row of greedy, beam and sampled search is in the language and ends
    with EOS."""
    pytest.importorskip("transformers")
    eot = tiny_bart_folder(tmp_path)
    tok = genkit.load_tokenizer(tmp_path)
    model = genkit.load_model(tmp_path)
    ids = tok("hello there, a long prompt for the encoder", return_tensors="pt")["input_ids"]
    runs = [(dict(guided_choice=["yes", "no", "maybe not"]), r"yes|no|maybe not"),
            (dict(guided_regex=r"[A-Z]{3}-[0-9]{2,4}"), r"[A-Z]{3}-[0-9]{2,4}"),
            (dict(guided_choice=["yes", "no"], num_beams=3, num_return_sequences=2), r"yes|no"),
            (dict(guided_regex=r"[a-z]{2,5}", do_sample=True, num_return_sequences=3), r"[a-z]{2,5}")]
    genkit.set_seed(0)
    for kw, pattern in runs:
        out = genkit.generate(model, ids, max_new_tokens=12, tokenizer=tok, **kw)
        assert out.shape[0] == kw.get("num_return_sequences", 1)
        for row in out.tolist():
            assert row[0] == eot and eot in row[1:], (kw, row)  # the decoder's start, then EOS ends the text
            text = tok.decode(row[1:row.index(eot, 1)])
            assert re.fullmatch(pattern, text), (kw, text)


def test_a_grammar_the_engine_gives_up_on_is_an_error_not_free_text(demo):
    """llguidance's lexer gives up on `a{1000000}` a token in ("too many expressions constructed"):
    that is an error naming the field, not the rest of the output left unconstrained."""
    model, tok = demo
    ids = _prompt(tok, "Say a")
    for field, value in (("guided_regex", "a{1000000}"), ("guided_json", {"type": "string", "pattern": "^(x{1000}){1000}$"})):
        with pytest.raises(ConfigError, match=rf"^`{field}`: the grammar engine \(llguidance\) failed after \d+ "
                                              r"generated tokens on a token the grammar allowed: lexer error: too many "
                                              r"expressions constructed; the output cannot be kept to it"):
            genkit.generate(model, ids, max_new_tokens=8, do_sample=False, tokenizer=tok, **{field: value})


def test_one_grammar_processor_given_to_a_batch_keeps_every_request_in_its_grammar(demo):
    """A GrammarLogitsProcessor given to generate_batch or to generate(cache_implementation="paged")
    runs as each request's own (a copy): every request answers from the choices, with the tokens that
    generate gives its prompt alone (one object served every request before: the 19-token prompt left
    the grammar, read from the 7-token prompt's position)."""
    from genkit.builtin_strategies.structured import GrammarLogitsProcessor

    model, tok = demo
    texts = ["Is the sky blue? Answer:", "Question: is water wet, and is the sun a star like the other stars? Answer:"]
    prompts = [tok(t)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) == 2
    alone = [genkit.generate(model, torch.tensor([p]), max_new_tokens=6, do_sample=False,
                             logits_processor=[GrammarLogitsProcessor(tok, choice=["yes", "no"])])[0, len(p):].tolist()
             for p in prompts]
    assert all(tok.decode(t, skip_special_tokens=True) in ("yes", "no") for t in alone)
    one = GrammarLogitsProcessor(tok, choice=["yes", "no"])
    out = genkit.generate_batch(model, prompts, max_new_tokens=6, do_sample=False, logits_processor=[one])
    assert [o.generated_tokens for o in out.values()] == alone
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    paged = genkit.generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            cache_implementation="paged", logits_processor=[one])
    assert [row[width:][:len(t)].tolist() for row, t in zip(paged, alone)] == alone


@pytest.mark.parametrize("field", [{"guided_choice": ["alpha"]}, {"guided_regex": "a+"},
                                   {"response_format": {"type": "json_object"}}])
def test_a_tokenizer_llguidance_cannot_read_is_a_not_supported_error(field):
    """A WordPiece (BERT-style) tokenizer.json: llguidance's bare ValueError ("can't determine
    decoder type") came out of generate, and out of every such `genkit batch` row"""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from genkit.errors import NotSupportedError
    from genkit.models.tiny import tiny_llama
    from genkit.tokenizer import Tokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "alpha": 3, "a": 4, "##a": 5}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]"})
    with pytest.raises(NotSupportedError, match=r"structured outputs cannot use this tokenizer: llguidance cannot read "
                                                r"it \(can't determine decoder type"):
        genkit.generate(tiny_llama(seed=0), torch.tensor([[1, 3]]), max_new_tokens=2, tokenizer=tok, **field)
