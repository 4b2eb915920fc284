"""``StopStringCriteria``: stop when the generated text contains a stop string.

A stop string may span several tokens, and the last token may run past the end of the stop
string ("overshoot"). Checking by decoding the tail every step would cost a tokenizer call per
row per step, so, like transformers, we precompute per-token tables once from the tokenizer's
vocabulary and then check the last tokens of every row with a handful of tensor ops.

Matching is done on UTF-8 bytes: byte-level BPE tokens (GPT-2 style) and byte-fallback tokens
(``<0xNN>``) are mapped to their raw bytes, so a character split across tokens still matches;
other tokens are turned into their text by the tokenizer and encoded.

The tables, for each stop string ``s`` (``n = len(s)`` bytes) and each token ``t``:

* ``inside[t, s]`` -- ``s`` occurs within ``t``: the last token alone completes the match;
* ``tail[t, s, L]`` -- ``t`` starts with the last ``L`` bytes of ``s`` (``0 < L < n``): ``t`` can
  be the last token, covering the end of ``s`` (anything after that is overshoot);
* ``fits[t, s, p]`` -- ``t`` equals the bytes of ``s`` that end ``p`` bytes before its end, and
  does not reach its start (``p + len(t) < n``): ``t`` can sit inside the match;
* ``opens[t, s, p]`` -- ``t`` ends with the first ``n - p`` bytes of ``s``: ``t`` completes the
  match when the tokens after it cover the last ``p`` bytes.

A row matches when its last token has ``tail[.., L]`` for some ``L`` and, walking backwards, the
tokens fit at offsets ``L``, ``L + len(t1)``, ... until one of them ``opens`` the stop string.
Only tokens that appear in some table get a row; every other token maps to an all-false row.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from genkit.errors import ConfigError
from genkit.strategy.processing import StoppingCriteria

logger = logging.getLogger("genkit.stopping")

_SENTINEL_TEXT = "abcdef"


# -- token -> bytes ----------------------------------------------------------------------------

def _byte_level_alphabet() -> dict[str, int]:
    """The printable-character alphabet of byte-level BPE: char -> byte.

    Bytes that are printable Latin-1 characters stand for themselves; the remaining bytes are
    assigned, in order, to the code points from 256 upwards."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    alphabet: dict[str, int] = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


def _decoder_types(tokenizer: Any) -> set[str]:
    """Types of the tokenizers-library decoder pipeline behind ``tokenizer`` (may be empty)."""
    backend = None
    for attr in ("backend_tokenizer", "_tokenizer", "tokenizer"):
        candidate = getattr(tokenizer, attr, None)
        if candidate is not None and hasattr(candidate, "decoder"):
            backend = candidate
            break
    if backend is None and hasattr(tokenizer, "decoder") and not callable(tokenizer.decoder):
        backend = tokenizer
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    found = {type(decoder).__name__}
    try:
        state = decoder.__getstate__()
        if isinstance(state, (bytes, bytearray)):
            state = state.decode()
        config = json.loads(state) if isinstance(state, str) else None
    except Exception:  # noqa: BLE001 -- some decoders expose no JSON state
        config = None

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found


def _byte_fallback(token: str) -> bytes | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    return None


class _Textifier:
    """Turns one vocabulary token into the text it contributes in the middle of a sequence."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.by_tokens = hasattr(tokenizer, "convert_tokens_to_string") and hasattr(tokenizer, "convert_ids_to_tokens")
        base_ids = self._encode(_SENTINEL_TEXT)
        if self.by_tokens:
            self.base: list[Any] = list(tokenizer.convert_ids_to_tokens(base_ids))
        else:
            if not hasattr(tokenizer, "decode"):
                raise ConfigError("`tokenizer` for stop_strings must provide `decode(ids)` or "
                                  "`convert_tokens_to_string(tokens)`")
            self.base = list(base_ids)

    def _encode(self, text: str) -> list[int]:
        tok = self.tok
        try:
            ids = tok.encode(text, add_special_tokens=False)
        except TypeError:
            ids = tok.encode(text)
        if hasattr(ids, "ids"):  # a tokenizers.Encoding
            ids = ids.ids
        return [int(i) for i in ids]

    def __call__(self, token: str, token_id: int) -> str:
        if self.by_tokens:
            text = self.tok.convert_tokens_to_string(self.base + [token])
        else:
            text = self.tok.decode(self.base + [token_id])
        at = text.find(_SENTINEL_TEXT)
        return text[at + len(_SENTINEL_TEXT):] if at >= 0 else text


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Every vocabulary id of ``tokenizer`` with the UTF-8 bytes it contributes to the text."""
    if not hasattr(tokenizer, "get_vocab"):
        raise ConfigError("`tokenizer` for stop_strings must provide `get_vocab()` (token -> id)")
    vocab: dict[str, int] = tokenizer.get_vocab()
    kinds = _decoder_types(tokenizer)
    alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
    use_fallback = "ByteFallback" in kinds
    textify: _Textifier | None = None
    out: dict[int, bytes] = {}
    for token, idx in vocab.items():
        raw: bytes | None = None
        if alphabet is not None and token and all(c in alphabet for c in token):
            raw = bytes(alphabet[c] for c in token)
        elif use_fallback:
            raw = _byte_fallback(token)
        if raw is None:
            if textify is None:
                textify = _Textifier(tokenizer)
            raw = textify(token, int(idx)).encode("utf-8")
        out[int(idx)] = raw
    return out


# -- tables ------------------------------------------------------------------------------------

class _Tables:
    """The per-token tables for one tokenizer and one tuple of stop strings (see module doc)."""

    def __init__(self, vocab_bytes: dict[int, bytes], stops: tuple[bytes, ...]) -> None:
        width = max(len(s) for s in stops)  # P: offsets / overlap lengths 0..width-1
        num = len(stops)
        rows: dict[int, int] = {}  # token id -> table row (row 0: matches nothing)
        entries: list[tuple[int, int, str, int]] = []  # (row, stop index, table, position)
        substrings = []
        for s in stops:
            where: dict[bytes, list[int]] = {}
            n = len(s)
            for start in range(n):
                for end in range(start + 1, n + 1):
                    if start == 0:
                        continue  # reaching the start of s is "opens", not "fits"
                    where.setdefault(s[start:end], []).append(n - end)
            substrings.append(where)
        stop_bytes = [set(s) for s in stops]
        for idx, t in vocab_bytes.items():
            if not t:
                continue
            found: list[tuple[int, str, int]] = []
            for k, s in enumerate(stops):
                if stop_bytes[k].isdisjoint(t):
                    continue
                n = len(s)
                if s in t:
                    found.append((k, "inside", 0))
                for L in range(1, min(n - 1, len(t)) + 1):
                    if t[:L] == s[n - L:]:
                        found.append((k, "tail", L))
                for p in substrings[k].get(t, ()):
                    found.append((k, "fits", p))
                for p in range(1, n):
                    need = n - p
                    if len(t) >= need and t.endswith(s[:need]):
                        found.append((k, "opens", p))
            if found:
                row = rows.setdefault(idx, len(rows) + 1)
                entries.extend((row, k, table, pos) for k, table, pos in found)
        num_rows = len(rows) + 1
        self.inside = torch.zeros((num_rows, num), dtype=torch.bool)
        self.tail = torch.zeros((num_rows, num, width), dtype=torch.bool)
        self.fits = torch.zeros((num_rows, num, width), dtype=torch.bool)
        self.opens = torch.zeros((num_rows, num, width), dtype=torch.bool)
        for row, k, table, pos in entries:
            if table == "inside":
                self.inside[row, k] = True
            else:
                getattr(self, table)[row, k, pos] = True
        max_id = max(vocab_bytes) if vocab_bytes else 0
        self.row_of = torch.zeros(max_id + 2, dtype=torch.long)  # last slot: unknown / padding ids
        self.length = torch.zeros(num_rows, dtype=torch.long)
        for idx, row in rows.items():
            self.row_of[idx] = row
            self.length[row] = len(vocab_bytes[idx])
        self.stop_len = torch.tensor([len(s) for s in stops], dtype=torch.long)
        self.width = width
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        got = self._on.get(device)
        if got is None:
            got = tuple(t.to(device) for t in (self.row_of, self.length, self.inside, self.tail, self.fits,
                                               self.opens, self.stop_len))
            self._on[device] = got
        return got


_CACHE_LOCK = threading.Lock()
_BYTES_CACHE: weakref.WeakKeyDictionary[Any, dict[int, bytes]] = weakref.WeakKeyDictionary()
_TABLE_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[bytes, ...], _Tables]] = weakref.WeakKeyDictionary()


def _tables_for(tokenizer: Any, stops: tuple[bytes, ...]) -> _Tables:
    try:
        with _CACHE_LOCK:
            per_tok = _TABLE_CACHE.get(tokenizer)
            if per_tok is not None and stops in per_tok:
                return per_tok[stops]
            vocab_bytes = _BYTES_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable / not hashable: no cache
        return _Tables(token_bytes(tokenizer), stops)
    if vocab_bytes is None:
        vocab_bytes = token_bytes(tokenizer)
    tables = _Tables(vocab_bytes, stops)
    with _CACHE_LOCK:
        _BYTES_CACHE[tokenizer] = vocab_bytes
        _TABLE_CACHE.setdefault(tokenizer, {})[stops] = tables
    return tables


class StopStringCriteria(StoppingCriteria):
    """Done where the generated text now contains one of ``stop_strings``.

    ``tokenizer`` must provide ``get_vocab()`` and either ``convert_tokens_to_string`` /
    ``convert_ids_to_tokens`` (transformers tokenizers) or ``encode``/``decode``. The check is
    "the stop string ends inside the last token", so each occurrence is caught at the step that
    completes it.
    """

    finish_reason = "stop_string"  # genkit.strategy.FINISH_REASONS

    def __init__(self, tokenizer: Any, stop_strings: str | Iterable[str]) -> None:
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        stop_strings = list(stop_strings) if stop_strings is not None else []
        if not stop_strings or not all(isinstance(s, str) and s for s in stop_strings):
            raise ConfigError(f"`stop_strings` must be a non-empty string or a non-empty list of non-empty strings; "
                              f"got {stop_strings!r}")
        if tokenizer is None:
            raise ConfigError("`tokenizer` is required for stop_strings: pass `tokenizer=` to generate()")
        self.stop_strings: tuple[str, ...] = tuple(stop_strings)
        self._stops = tuple(s.encode("utf-8") for s in self.stop_strings)
        self.tables = _tables_for(tokenizer, self._stops)

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        row_of, length, inside, tail, fits, opens, stop_len = self.tables.on(input_ids.device)
        cur = input_ids.shape[1]
        k = self.tables.width  # how many trailing tokens can take part in one match
        last = input_ids[:, max(0, cur - k):].flip(1)  # (batch, <=k), most recent first
        unknown = row_of.shape[0] - 1
        ids = torch.where((last < 0) | (last >= unknown), unknown, last)
        rows = row_of[ids]  # (batch, k')
        done = inside[rows[:, 0]].any(dim=-1)
        if rows.shape[1] == 1 or k == 1:
            return done
        rows_before = rows[:, 1:]  # tokens before the last one, walking backwards
        lens = length[rows_before]
        offset_before = torch.cumsum(lens, dim=1) - lens  # bytes covered by tokens between (exclusive)
        covered = torch.arange(k, device=input_ids.device)  # L: bytes of s the last token covers
        # p[b, L, j]: offset (from the end of s) at which token j (0-based before the last) must sit
        p = covered[None, :, None] + offset_before[:, None, :]
        inside_s = p[:, None] < stop_len[None, :, None, None]  # (batch, stops, L, j)
        p_idx = p.clamp(max=k - 1)[:, None].expand(-1, stop_len.shape[0], -1, -1)
        r_idx = rows_before[:, None, None, :].expand_as(p_idx)
        s_idx = torch.arange(stop_len.shape[0], device=input_ids.device)[None, :, None, None].expand_as(p_idx)
        fit = fits[r_idx, s_idx, p_idx] & inside_s
        opened = opens[r_idx, s_idx, p_idx] & inside_s
        chain = torch.cumprod(fit.to(torch.uint8), dim=-1).bool()
        ok_before = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], dim=-1)
        completes = (ok_before & opened).any(dim=-1)  # (batch, stops, L)
        start = tail[rows[:, 0]]  # (batch, stops, L)
        return done | (start & completes).any(dim=-1).any(dim=-1)
