"""Structured outputs: a logits processor that constrains generation to a JSON schema, a regular
expression, a context-free grammar (Lark or GBNF) or a list of choices.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (the ``structured``
extra: ``pip install 'genkit-lm[structured]'``); docs/structured_outputs.md says why it was chosen
over xgrammar. The config fields (``response_format``, ``guided_json``, ``guided_regex``,
``guided_grammar``, ``guided_choice``) are declared in :mod:`genkit.builtin_strategies.fields`;
:func:`make_structured_output` is their processor factory.

Each row of the batch has its own matcher, found from the tokens the row has generated so far, so
beam search (which reorders and duplicates rows), sampling with several sequences per prompt, and
batches all work: a row whose history extends a known row by one token continues (a copy of) that
row's matcher; any other history is replayed from the start. End-of-sequence is allowed only where
the grammar accepts, and is the only token allowed once the grammar is complete.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import Counter
from copy import copy
from typing import Any

import torch

from genkit.errors import ConfigError, NotSupportedError, is_rust_panic
from genkit.strategy.processing import LogitsProcessor, ProcessorContext

from .fields import MAX_CHOICES

logger = logging.getLogger("genkit.structured")

__all__ = ["EXTRA_HINT", "STRUCTURED_FIELDS", "GrammarLogitsProcessor", "compile_grammar", "grammar_request",
           "make_structured_output"]

EXTRA_HINT = "structured outputs need the `structured` extra (llguidance): pip install 'genkit-lm[structured]'"
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
_KINDS = ("json_schema", "regex", "grammar", "choice")
# JSON as json.dumps writes it: free whitespace lets a small model loop on newlines until max_tokens
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise NotSupportedError(EXTRA_HINT) from exc
    return llguidance


def grammar_request(config: Any) -> tuple[str, str, Any] | None:
    """``(field, kind, value)`` for the structured-output field ``config`` sets (``kind`` one of
    ``json_schema``, ``regex``, ``grammar``, ``choice``), or ``None`` when none is set (or
    ``response_format`` is ``{"type": "text"}``). Two set at once is a :class:`ConfigError`."""
    given = [name for name in STRUCTURED_FIELDS if getattr(config, name, None) is not None]
    fmt = getattr(config, "response_format", None)
    if fmt is not None and fmt.get("type") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise ConfigError(f"set one structured-output field at a time; got {', '.join(f'`{g}`' for g in given)}")
    if not given:
        return None
    name = given[0]
    value = getattr(config, name)
    if name == "response_format":
        schema = value["json_schema"]["schema"] if value["type"] == "json_schema" else {"type": "object"}
        return name, "json_schema", schema
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
            "guided_choice": "choice"}[name]
    return name, kind, value


def compile_grammar(kind: str, value: Any, field: str | None = None) -> str:
    """The llguidance grammar for a JSON schema (a dict), a regex, a Lark/GBNF grammar or a list of
    choices; a value llguidance refuses is a :class:`ConfigError` naming ``field`` (or ``kind``)."""
    llg = _llguidance()
    name = field or kind
    if kind not in _KINDS:
        raise ConfigError(f"the grammar kind must be one of {', '.join(_KINDS)}; got {kind!r}")
    if kind == "choice" and len(value) > MAX_CHOICES:
        raise ConfigError(f"`{name}` may list at most {MAX_CHOICES} choices; got {len(value)}")
    try:
        if kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(list(value)))
        elif kind == "json_schema":  # the schema's own "x-guidance" options override these defaults
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_LAYOUT)
        else:
            grammar = llg.grammar_from(kind, value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"`{name}` is not a valid {kind.replace('_', ' ')}: {exc}") from exc
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConfigError(f"`{name}` is not a valid {kind.replace('_', ' ')}: {error}")
    return str(grammar)


# LLTokenizer per (tokenizer, EOS ids): building one reads the whole vocabulary (~0.5 s)
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer for ``tokenizer`` (a :class:`genkit.Tokenizer` or a transformers
    fast tokenizer: anything with a ``tokenizers`` ``backend_tokenizer``), cached."""
    llg = _llguidance()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "to_str", None)):
        raise ConfigError("structured outputs need a tokenizer backed by the `tokenizers` library "
                          f"(genkit.load_tokenizer, or a transformers fast tokenizer); got {type(tokenizer).__name__}")
    eos = tuple(int(e) for e in eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None
                                                   else ())
    try:
        cached = _LL_TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        cached = {}
    if eos not in cached:
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            cached[eos] = llg.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer), eos_token=list(eos) or None)
        except BaseException as exc:  # (a Rust panic, pyo3's PanicException, is a BaseException)
            if not isinstance(exc, Exception) and not is_rust_panic(exc):
                raise
            raise NotSupportedError(f"structured outputs cannot use this tokenizer: llguidance cannot read it ({exc}); "
                                    "it reads byte-level BPE and SentencePiece-style vocabularies") from exc
    return cached[eos]


class GrammarLogitsProcessor(LogitsProcessor):
    """Sets to ``-inf`` the scores of the tokens the grammar does not allow next, row by row.

    Give exactly one of ``json_schema`` (a dict), ``regex``, ``grammar`` (Lark or GBNF text) or
    ``choice`` (a list of strings). ``prompt_length``: where the generated tokens start in
    ``input_ids`` (by default, the length of the first ``input_ids`` the processor sees, which is
    the prompt under ``generate``); ``eos_token_id``: the end-of-sequence id(s) allowed where the
    grammar accepts (by default the tokenizer's). One processor serves one ``generate`` call (a copy,
    ``copy.deepcopy``, is a fresh processor on the same compiled grammar: continuous batching gives each
    request its own). A token the grammar allowed that the engine then fails on (one of llguidance's
    limits, e.g. a regex too large for its lexer) is a :class:`ConfigError` naming the field: the output
    could not be kept to the grammar.
    """

    def __init__(self, tokenizer: Any, *, json_schema: dict[str, Any] | None = None, regex: str | None = None,
                 grammar: str | None = None, choice: list[str] | None = None, prompt_length: int | None = None,
                 eos_token_id: int | list[int] | None = None, field: str | None = None) -> None:
        given = {k: v for k, v in zip(_KINDS, (json_schema, regex, grammar, choice)) if v is not None}
        if len(given) != 1:
            raise ConfigError("GrammarLogitsProcessor takes exactly one of `json_schema`, `regex`, `grammar`, "
                              f"`choice`; got {', '.join(given) or 'none'}")
        (kind, value), = given.items()
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.tokenizer = ll_tokenizer(tokenizer, eos)
        self.kind, self.field = kind, field or kind
        self.grammar = compile_grammar(kind, value, self.field)
        self._root = _llguidance().LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if self._root.is_error():  # the first line: a panic's message comes with llguidance's backtrace
            raise ConfigError(f"`{self.field}`: {self._root.get_error().splitlines()[0]}")
        self.prompt_length = self._given_length = prompt_length
        self.vocab = self.tokenizer.vocab_size
        self._states: dict[tuple[int, ...], Any] = {}
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # each history's allowed tokens (bitmask words)
        self._warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> GrammarLogitsProcessor:
        """A fresh processor on the same compiled grammar and tokenizer (shared: read only), no row advanced."""
        twin = copy(self)
        twin.prompt_length, twin._states, twin._masks, twin._warned = self._given_length, {}, {}, False
        return twin

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        histories = [tuple(row) for row in input_ids[:, self.prompt_length:].tolist()]
        matchers = self._matchers(histories)
        bitmask = self._bitmask(matchers)
        self._masks = dict(zip(histories, bitmask))
        allowed = self._allowed(matchers, bitmask, scores.shape[-1]).to(scores.device)
        return scores.masked_fill(~allowed, float("-inf"))  # type: ignore[return-value]

    def _matchers(self, histories: list[tuple[int, ...]]) -> list[Any]:
        """Each row's matcher, advanced over the row's generated tokens."""
        keys = set(histories)
        children = Counter(h[:-1] for h in keys if h)
        current: dict[tuple[int, ...], Any] = {}
        for key in histories:
            if key in current:
                continue
            parent = key[:-1]
            matcher = self._states.get(key)
            if matcher is None and key and parent in self._states:
                matcher = self._states[parent]
                if children[parent] > 1 or parent in keys:  # others continue it too: fork
                    matcher = matcher.deep_copy()
                else:
                    del self._states[parent]
                matcher.consume_token(key[-1])
                self._check_engine(matcher, parent, key[-1])
            elif matcher is None:  # a history never seen (a rolled-back draft, a first call): replay it
                matcher = self._root.deep_copy()
                if key:
                    matcher.consume_tokens(list(key))
            current[key] = matcher
        self._states = current
        return [current[h] for h in histories]

    def _check_engine(self, matcher: Any, parent: tuple[int, ...], token: int) -> None:
        """Raise where ``matcher`` failed on a ``token`` its grammar allowed after ``parent`` (the engine
        itself failed: one of its limits); a token it did not allow (padding, a token another processor
        forced) leaves the row unconstrained, as documented."""
        mask = self._masks.get(parent)
        if not matcher.is_error() or mask is None or not 0 <= token < 32 * mask.numel():
            return
        if int(mask[token // 32]) >> (token % 32) & 1:
            raise ConfigError(f"`{self.field}`: the grammar engine (llguidance) failed after {len(parent) + 1} "
                              f"generated tokens on a token the grammar allowed: {matcher.get_error().splitlines()[0]}; "
                              "the output cannot be kept to it (a smaller pattern or schema fits the engine's limits)")

    def _bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """``(rows, words)`` int32: bit ``t % 32`` of word ``t // 32`` set where row's grammar allows
        token ``t``; a row whose matcher failed (see :meth:`_allowed`) has none set."""
        bitmask = torch.zeros((len(matchers), (self.vocab + 31) // 32), dtype=torch.int32)
        for i, matcher in enumerate(matchers):
            if not matcher.is_error():
                row = bitmask[i]
                matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        return bitmask

    def _allowed(self, matchers: list[Any], bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """``(rows, vocab)`` bool: True where the grammar allows the token. A row whose matcher
        failed (a finished row given padding, a token another processor forced) is left free."""
        free = [i for i, matcher in enumerate(matchers) if matcher.is_error()]
        if free and not self._warned:
            self._warned = True
            logger.debug("structured output: row %d left the grammar (%s); not constraining it",
                         free[0], matchers[free[0]].get_error())
        bits = (bitmask.view(torch.uint8).unsqueeze(-1) & _BITS) != 0  # little-endian: token 8*b + j
        allowed = bits.reshape(len(matchers), -1)[:, :min(self.vocab, vocab)]
        if vocab > allowed.shape[1]:  # the model's vocabulary is padded past the tokenizer's
            allowed = torch.cat([allowed, allowed.new_zeros((len(matchers), vocab - allowed.shape[1]))], dim=1)
        if free:
            allowed[free] = True
        return allowed


def make_structured_output(config: Any, ctx: ProcessorContext) -> GrammarLogitsProcessor | None:
    """The processor of ``response_format`` / ``guided_*`` (None when none is set)."""
    request = grammar_request(config)
    if request is None:
        return None
    field, kind, value = request
    if ctx.tokenizer is None:
        raise ConfigError(f"`{field}` needs the tokenizer to know what each token spells: pass `tokenizer=` to "
                          "generate()")
    return GrammarLogitsProcessor(ctx.tokenizer, **{kind: value}, prompt_length=ctx.input_ids_seq_length,
                                  eos_token_id=list(ctx.eos_token_ids), field=field)
