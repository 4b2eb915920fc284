"""The tokenizer genkit loads (``genkit.load_tokenizer``): a small one on top of the ``tokenizers`` library.

It reads a folder holding ``tokenizer.json`` (+ ``tokenizer_config.json`` and
``special_tokens_map.json``), or a ``.gguf`` file's tokenizer metadata (as read by ``genkit.models.gguf``), and offers the part of
transformers' tokenizer API that generation needs: ``__call__`` with padding / truncation /
``return_tensors="pt"``, ``decode`` / ``batch_decode``, the special token ids, ``get_vocab`` and
``convert_ids_to_tokens`` (for stop strings), and ``apply_chat_template`` (jinja2).

This module sits below ``genkit.models`` (the demo model is converted with it); finding a
tokenizer from a reference (a folder, a ``.gguf``, a Hub id, the demo alias) is
``genkit.models.loading.load_tokenizer``.
"""

from __future__ import annotations

import json
import logging
import os
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from .errors import (
    ConfigError,
    CorruptModelError,
    ModelNotFoundError,
    NotSupportedError,
    UnsupportedModelError,
    is_rust_panic,
)

logger = logging.getLogger("genkit.tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# special tokens transformers also registers from tokenizer_config.json (genkit keeps no attribute for them)
_OTHER_SPECIAL_NAMES = ("cls_token", "sep_token", "mask_token")
_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")


class BatchEncoding(dict):
    """The tokenizer's output: a dict (``input_ids``, ``attention_mask``) with attribute access."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def to(self, device: Any) -> BatchEncoding:
        """Move every tensor to ``device`` (in place) and return self."""
        for k, v in self.items():
            if hasattr(v, "to"):
                self[k] = v.to(device)
        return self


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _padding_mode(padding: bool | str) -> str:
    """``padding`` as one of "longest", "max_length", "do_not_pad"."""
    if padding is True:
        padding = "longest"
    if padding is False:
        padding = "do_not_pad"
    if padding not in ("longest", "max_length", "do_not_pad"):
        raise ConfigError(f"`padding`={padding!r} is not valid; accepted: True, False, 'longest', "
                          "'max_length', 'do_not_pad'")
    return padding


def _batch_encoding(ids: list[list[int]], masks: list[list[int]], single: bool, return_tensors: str | None,
                    return_attention_mask: bool) -> BatchEncoding:
    """The encoded batch as lists (one list for a single text) or, with ``return_tensors="pt"``, tensors."""
    out = BatchEncoding()
    if return_tensors == "pt":
        import torch

        if len({len(x) for x in ids}) > 1:
            raise ConfigError("sequences have different lengths; pass `padding=True` to return a tensor")
        out["input_ids"] = torch.tensor(ids, dtype=torch.long)
        if return_attention_mask:
            out["attention_mask"] = torch.tensor(masks, dtype=torch.long)
    else:
        out["input_ids"] = ids[0] if single else ids
        if return_attention_mask:
            out["attention_mask"] = masks[0] if single else masks
    return out


def _rows(encoded_inputs: Any) -> tuple[list[dict[str, Any]], bool]:
    """``pad``'s input as one dict per sequence (from a list of dicts, or a dict of lists or of one
    list), and whether it was a single sequence."""
    if isinstance(encoded_inputs, (list, tuple)):
        if not all(isinstance(r, dict) and "input_ids" in r for r in encoded_inputs):
            raise ConfigError("`encoded_inputs` must be a dict with `input_ids`, or a list of such dicts")
        return list(encoded_inputs), False
    if not isinstance(encoded_inputs, dict) or "input_ids" not in encoded_inputs:
        raise ConfigError("`encoded_inputs` must be a dict with `input_ids`, or a list of such dicts")
    ids = encoded_inputs["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    masks = encoded_inputs.get("attention_mask")
    masks = masks.tolist() if hasattr(masks, "tolist") else masks
    if ids and not isinstance(ids[0], (list, tuple)):  # one sequence
        return [{"input_ids": ids, "attention_mask": masks}], True
    return [{"input_ids": x, "attention_mask": None if masks is None else masks[i]} for i, x in enumerate(ids)], False


def _config_special_tokens(config: dict[str, Any]) -> list[str]:
    """The special tokens ``config`` names: bos/eos/unk/pad/cls/sep/mask and the
    ``additional_special_tokens`` / ``extra_special_tokens`` lists (values of a dict)."""
    found = [_token_content(config.get(n)) for n in _SPECIAL_NAMES + _OTHER_SPECIAL_NAMES]
    for key in _SPECIAL_LISTS:
        extra = config.get(key) or []
        found += [_token_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    return list(dict.fromkeys(t for t in found if t))


def _register_special_tokens(backend: Any, config: dict[str, Any]) -> None:
    """Make the special tokens ``config`` names special tokens of ``backend``, as transformers does
    on loading: matched whole in text, dropped by ``decode(skip_special_tokens=True)``. Before, a
    token of the vocabulary that tokenizer.json does not list among its added tokens (``</s>`` in
    many hand-made files) was spelled out and kept. A token the vocabulary does not have is not
    added (transformers would give it a new id past the model's embeddings)."""
    from tokenizers import AddedToken

    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    missing = [t for t in _config_special_tokens(config) if t not in added and backend.token_to_id(t) is not None]
    if missing:
        backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with transformers-style conveniences.

    Args:
        backend: the ``tokenizers.Tokenizer`` that does the work.
        config: ``tokenizer_config.json`` contents (special tokens, ``chat_template``,
            ``padding_side``, ``model_max_length``...).
        name_or_path: where it came from, for messages.
    """

    def __init__(self, backend: Any, config: dict[str, Any] | None = None, name_or_path: str = "") -> None:
        self._tokenizer = backend
        self.init_config = dict(config or {})
        self.name_or_path = name_or_path
        cfg = self.init_config
        for name in _SPECIAL_NAMES:
            setattr(self, name, _token_content(cfg.get(name)))
        self.padding_side: str = cfg.get("padding_side", "right")
        self.truncation_side: str = cfg.get("truncation_side", "right")
        self.model_max_length: int | None = cfg.get("model_max_length")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.chat_template: str | None = template
        _register_special_tokens(self._tokenizer, cfg)
        # ids added to the vocabulary as special (control) tokens
        self._special_ids = {tok_id for tok_id, tok in self._tokenizer.get_added_tokens_decoder().items()
                             if tok.special}
        for name in _SPECIAL_NAMES:
            tok = getattr(self, name)
            if tok is not None and self._tokenizer.token_to_id(tok) is not None:
                self._special_ids.add(self._tokenizer.token_to_id(tok))

    # -- special tokens ---------------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _set_by_id(self, name: str, token_id: int | None) -> None:
        """Set the special token ``name`` (e.g. ``"pad_token"``) to the token whose id is ``token_id``."""
        if token_id is None:
            setattr(self, name, None)
            return
        token = self._tokenizer.id_to_token(int(token_id))
        if token is None:
            raise ConfigError(f"`{name}_id`={token_id!r} is not in the vocabulary; accepted: 0 to {len(self) - 1}")
        setattr(self, name, token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @bos_token_id.setter
    def bos_token_id(self, value: int | None) -> None:
        self._set_by_id("bos_token", value)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self._set_by_id("eos_token", value)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @pad_token_id.setter
    def pad_token_id(self, value: int | None) -> None:
        self._set_by_id("pad_token", value)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @unk_token_id.setter
    def unk_token_id(self, value: int | None) -> None:
        self._set_by_id("unk_token", value)

    def __setattr__(self, name: str, value: Any) -> None:
        # ``tok.pad_token = tok.eos_token`` as in transformers: a special token set by its text must
        # be one token of the vocabulary (else its id would silently be None)
        if name in _SPECIAL_NAMES and value is not None and "_special_ids" in self.__dict__:
            value = _token_content(value)
            if self._tokenizer.token_to_id(value) is None:
                raise ConfigError(f"`{name}`={value!r} is not a token of this vocabulary; set it to an existing "
                                  f"token (e.g. `tokenizer.{name} = tokenizer.eos_token`)")
            self._special_ids.add(self._tokenizer.token_to_id(value))
        object.__setattr__(self, name, value)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._tokenizer.id_to_token(i) for i in self.all_special_ids]

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        """Token strings (in the vocabulary's own spelling, e.g. ``Ġ`` for a byte-level space)."""
        if isinstance(ids, int) or (hasattr(ids, "dim") and ids.dim() == 0):  # type: ignore[union-attr]
            return self._tokenizer.id_to_token(int(ids))  # type: ignore[arg-type]
        return [self._tokenizer.id_to_token(int(i)) for i in ids
                if not (skip_special_tokens and int(i) in self._special_ids)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, *,
               return_tensors: str | None = None, truncation: bool | str = False, max_length: int | None = None,
               padding: bool | str = False) -> Any:
        """Token ids of one string: a list, or with ``return_tensors="pt"`` a ``(1, length)`` tensor
        (transformers' ``encode``). Tokenized with ``encode_batch``, which lets other threads run
        meanwhile (``encode`` holds the GIL: a server's event loop would stop for a long text)."""
        if text_pair is not None:
            raise ConfigError("`text_pair` is not supported by genkit's tokenizer; accepted: None (encode one text)")
        if not isinstance(text, str):
            raise ConfigError(f"`text` must be a string; got {type(text).__name__}")
        if return_tensors is None and not truncation and padding is False:
            return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self(text, add_special_tokens=add_special_tokens, return_tensors=return_tensors, truncation=truncation,
                    max_length=max_length, padding=padding, return_attention_mask=False)["input_ids"]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def __call__(
        self,
        text: str | Sequence[str],
        *,
        padding: bool | str = False,
        padding_side: str | None = None,
        truncation: bool | str = False,
        max_length: int | None = None,
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
        return_attention_mask: bool = True,
    ) -> BatchEncoding:
        """Encode a string or a list of strings.

        Args:
            padding: False / "do_not_pad", True / "longest", or "max_length" (needs ``max_length``).
            padding_side: "left" or "right"; defaults to ``self.padding_side``. Decoder-only
                generation needs "left".
            truncation: cut sequences longer than ``max_length`` (on ``self.truncation_side``).
            return_tensors: None (lists) or "pt" (torch tensors; a batch of unequal lengths needs padding).
        """
        single = isinstance(text, str)
        if not single and not (isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            raise ConfigError("`text` must be a string or a list of strings")
        texts = [text] if single else list(text)
        padding = _padding_mode(padding)
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ConfigError(f"`padding_side`={side!r} is not valid; accepted: 'left', 'right'")
        if return_tensors not in (None, "pt"):
            raise ConfigError(f"`return_tensors`={return_tensors!r} is not supported; accepted: None, 'pt'")
        limit = self._truncation_limit(truncation, max_length)

        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        ids = [e.ids for e in encodings]
        if limit is not None:
            ids = [x[-limit:] if self.truncation_side == "left" else x[:limit] for x in ids]
        masks = [[1] * len(x) for x in ids]
        if padding == "max_length" and max_length is None:
            raise ConfigError("`padding='max_length'` needs `max_length`")
        if padding != "do_not_pad":
            self._pad(ids, masks, max_length if padding == "max_length" else None, side)
        return _batch_encoding(ids, masks, single, return_tensors, return_attention_mask)

    def _truncation_limit(self, truncation: bool | str, max_length: int | None) -> int | None:
        """The length sequences are cut to (``None``: no truncation)."""
        if not truncation or truncation == "do_not_truncate":
            return None
        limit = max_length if max_length is not None else self.model_max_length
        if limit is None:
            raise ConfigError("`truncation=True` needs `max_length` (or the tokenizer's model_max_length)")
        return limit

    def _pad(self, ids: list[list[int]], masks: list[list[int]], max_length: int | None, side: str) -> None:
        """Pad ``ids`` and ``masks`` in place on ``side``: to ``max_length`` when given (padding
        "max_length"), else to the longest sequence."""
        target = max_length if max_length is not None else max((len(x) for x in ids), default=0)
        pad_id = self.pad_token_id
        if pad_id is None and any(len(x) < target for x in ids):
            raise ConfigError("this tokenizer has no pad token; set `tokenizer.pad_token` "
                              "(e.g. to its eos_token) before padding")
        for i, x in enumerate(ids):
            n = target - len(x)
            if n > 0:
                if side == "left":
                    ids[i] = [pad_id] * n + x
                    masks[i] = [0] * n + masks[i]
                else:
                    ids[i] = x + [pad_id] * n
                    masks[i] = masks[i] + [0] * n

    # -- decoding ---------------------------------------------------------------------------
    @staticmethod
    def _as_list(ids: Any) -> list[int]:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            return [ids]
        return [int(i) for i in ids]

    def _clean_up(self, text: str, clean_up_tokenization_spaces: bool | None) -> str:
        """transformers' ``clean_up_tokenization``: no space before punctuation and contractions
        (default: the tokenizer config's ``clean_up_tokenization_spaces``, False when unset). As in
        transformers 5, skipped with a warning (once) for BPE vocabularies, where it would strip
        spaces the text has; done for the others (WordPiece, Unigram as T5's, WordLevel)."""
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = bool(self.init_config.get("clean_up_tokenization_spaces", False))
        if not clean_up_tokenization_spaces:
            return text
        if type(self._tokenizer.model).__name__ == "BPE":
            from .config.warn import warn_once

            warn_once("clean_up_tokenization_spaces=True is skipped for this BPE tokenizer: the clean-up is meant "
                      "for WordPiece vocabularies and would strip spaces BPE text has (as transformers does); pass "
                      "clean_up_tokenization_spaces=False")
            return text
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                              (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            text = text.replace(before, after)
        return text

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        """Text of a sequence of ids (a list, a 1-D tensor, or a single id); for a batch (a list
        of lists, a 2-D tensor) the list of texts, as transformers 5 answers."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return self.batch_decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)
        text = self._tokenizer.decode(self._as_list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._clean_up(text, clean_up_tokenization_spaces)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        """Texts of a batch (a list of lists or a 2-D tensor)."""
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        texts = self._tokenizer.decode_batch([self._as_list(s) for s in sequences],
                                             skip_special_tokens=skip_special_tokens)
        return [self._clean_up(t, clean_up_tokenization_spaces) for t in texts]

    def pad(self, encoded_inputs: Any, padding: bool | str = True, max_length: int | None = None,
            padding_side: str | None = None, return_attention_mask: bool = True,
            return_tensors: str | None = None) -> BatchEncoding:
        """Pad already-encoded sequences (transformers' ``pad``): ``encoded_inputs`` is a dict of
        lists (``{"input_ids": [[...], ...]}``, e.g. a :class:`BatchEncoding`) or a list of such
        dicts, one per sequence; an ``attention_mask`` given is kept and padded with it."""
        rows, single = _rows(encoded_inputs)
        ids = [self._as_list(r["input_ids"]) for r in rows]
        masks = [self._as_list(r["attention_mask"]) if r.get("attention_mask") is not None else [1] * len(x)
                 for r, x in zip(rows, ids)]
        mode = _padding_mode(padding)
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ConfigError(f"`padding_side`={side!r} is not valid; accepted: 'left', 'right'")
        if mode == "max_length" and max_length is None:
            raise ConfigError("`padding='max_length'` needs `max_length`")
        if mode != "do_not_pad":
            self._pad(ids, masks, max_length if mode == "max_length" else None, side)
        if return_tensors not in (None, "pt"):
            raise ConfigError(f"`return_tensors`={return_tensors!r} is not supported; accepted: None, 'pt'")
        return _batch_encoding(ids, masks, single, return_tensors, return_attention_mask)

    # -- chat -------------------------------------------------------------------------------
    def _template(self, chat_template: str | None) -> str:
        """The chat template to render: the one given, else the tokenizer's (none: a ConfigError)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ConfigError(f"the tokenizer {self.name_or_path or ''} has no chat template; pass `chat_template=` "
                              "(`genkit generate` and `genkit serve`: --chat-template) or add one to its "
                              "tokenizer_config.json")
        return template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        sanitize_control_tokens: bool = False,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> Any:
        """Render ``conversation`` (a list of ``{"role", "content"}``, or a batch of them) with the
        model's chat template, as transformers' ``apply_chat_template`` does (genkit.chat_template):
        ``tools`` (JSON-schema dicts or Python functions), ``documents``, ``add_generation_prompt`` or
        ``continue_final_message``, the special tokens and ``template_kwargs`` reach the template.

        Returns the prompt text when ``tokenize=False``; otherwise a :class:`BatchEncoding`
        (``return_dict=True``, the default, as in transformers 5; with ``assistant_masks`` when
        ``return_assistant_tokens_mask``) or the list of ids. The template adds the special tokens it
        needs, so none are added on top.
        """
        from .chat_template import tool_schemas

        template = self._template(chat_template)
        self._check_chat_options(tokenize, return_dict, continue_final_message, add_generation_prompt,
                                 return_assistant_tokens_mask, sanitize_control_tokens)
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and \
            isinstance(conversation[0], (list, tuple))
        chats = list(conversation) if batched else [conversation]
        if not chats or any(isinstance(c, (list, tuple)) and not c for c in chats):
            raise ConfigError("`conversation` is empty; give at least one {'role': ..., 'content': ...} message")
        variables = {**{n: getattr(self, n) for n in _SPECIAL_NAMES if getattr(self, n) is not None},
                     **template_kwargs}
        schemas = tool_schemas(tools)
        rendered = [self._render_chat(template, chat, tools=schemas, documents=documents,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, **variables) for chat in chats]
        texts = [text for text, _ in rendered]
        if not tokenize:
            return texts if batched else texts[0]
        if "add_special_tokens" in (extra := dict(tokenizer_kwargs or {})):  # transformers: a TypeError
            raise ConfigError("`tokenizer_kwargs` cannot set `add_special_tokens`: the chat template adds the special "
                              "tokens it needs, and none are added on top")
        enc = self(texts if batched else texts[0], padding=padding, truncation=truncation, max_length=max_length,
                   add_special_tokens=False, return_tensors=return_tensors, **extra)
        if return_assistant_tokens_mask:
            enc["assistant_masks"] = self._assistant_masks(texts, [s for _, s in rendered], enc,
                                                            self._truncation_limit(truncation, max_length), batched,
                                                            return_tensors)
        return enc if return_dict else enc["input_ids"]

    def _render_chat(self, template: str, chat: Any, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
        """One conversation rendered (:func:`genkit.chat_template.render_conversation`): its text and
        the spans of its ``{% generation %}`` blocks; an error names this tokenizer's template."""
        from .chat_template import render_conversation

        try:
            return render_conversation(template, chat, **variables)
        except ConfigError as exc:  # does not compile, refuses these messages, runs past a budget
            raise ConfigError(f"the chat template{' of ' + self.name_or_path if self.name_or_path else ''} "
                              f"cannot render this conversation ({exc})") from exc

    @staticmethod
    def _check_chat_options(tokenize: bool, return_dict: bool, continue_final_message: bool | str,
                            add_generation_prompt: bool, assistant_mask: bool, sanitize: bool) -> None:
        if assistant_mask and not (tokenize and return_dict):
            raise ConfigError("`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`")
        if continue_final_message and add_generation_prompt:
            raise ConfigError("`continue_final_message` and `add_generation_prompt` are not compatible: the first "
                              "continues the final message, the second starts a new assistant message")
        if continue_final_message and assistant_mask:
            raise ConfigError("`continue_final_message` is not compatible with `return_assistant_tokens_mask`")
        if sanitize:
            raise NotSupportedError("`sanitize_control_tokens=True` is not supported by genkit's tokenizer; "
                                    "check the control tokens in user text before rendering")

    def _assistant_masks(self, texts: list[str], spans: list[list[tuple[int, int]]], enc: BatchEncoding,
                         limit: int | None, batched: bool, return_tensors: str | None) -> Any:
        """1 for each token that overlaps a ``{% generation %}`` span (transformers' marking), truncated
        and padded as ``enc``'s ids are."""
        lengths = [len(r) for r in enc["input_ids"]] if (batched or return_tensors) else [len(enc["input_ids"])]
        masks = []
        for encoding, row_spans, length in zip(self._tokenizer.encode_batch(texts, add_special_tokens=False), spans,
                                               lengths):
            mask, k = [0] * len(encoding.ids), 0
            for t, (start, end) in enumerate(encoding.offsets):
                while k < len(row_spans) and start >= row_spans[k][1]:
                    k += 1
                if k == len(row_spans):
                    break
                mask[t] = int(end > row_spans[k][0])
            if limit is not None:
                mask = mask[-limit:] if self.truncation_side == "left" else mask[:limit]
            pad = [0] * (length - len(mask))
            masks.append(pad + mask if self.padding_side == "left" else mask + pad)
        if return_tensors == "pt":
            import torch

            return torch.tensor(masks)
        return masks if batched else masks[0]

    # -- saving -----------------------------------------------------------------------------
    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (atomically)."""
        from .fileutil import atomic_write_text

        folder = os.fspath(folder)
        atomic_write_text(os.path.join(folder, "tokenizer.json"), self._tokenizer.to_str())
        cfg = dict(self.init_config)
        for name in _SPECIAL_NAMES:
            cfg[name] = getattr(self, name)
        cfg["padding_side"] = self.padding_side
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        atomic_write_text(os.path.join(folder, "tokenizer_config.json"), json.dumps(cfg, indent=2, ensure_ascii=False))

    def __repr__(self) -> str:
        return (f"Tokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)}, "
                f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r})")


# -- loading ----------------------------------------------------------------------------------
def _read_json(path: str) -> dict[str, Any]:
    """The JSON object in ``path`` ({} when there is no such file); a CorruptModelError naming it
    when it is not UTF-8 JSON holding an object."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptModelError(f"{path}: not valid UTF-8 JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path}: must hold a JSON object; got a {type(data).__name__}")
    return data


def _check_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``config`` (tokenizer_config.json and the files read with it, or a GGUF's settings) when
    the fields the tokenizer reads have their types; a CorruptModelError naming the field if not."""
    def bad(key: str, want: str) -> CorruptModelError:
        return CorruptModelError(f"{where}: `{key}` must be {want}; got {config[key]!r}")

    def is_token(value: Any) -> bool:
        return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))

    for name in _SPECIAL_NAMES + _OTHER_SPECIAL_NAMES:
        if config.get(name) is not None and not is_token(config[name]):
            raise bad(name, "a string or an object with a string `content`")
    for key in _SPECIAL_LISTS:
        tokens = config.get(key)
        values = list(tokens.values()) if isinstance(tokens, dict) else tokens
        if tokens is not None and not (isinstance(values, list) and all(map(is_token, values))):
            raise bad(key, "a list (or an object) of strings or of objects with a string `content`")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str) and not (
            isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                               and isinstance(t.get("template"), str) for t in template)):
        raise bad("chat_template", "a string or a list of {\"name\", \"template\"} strings")
    for key in ("padding_side", "truncation_side"):
        if config.get(key) is not None and config[key] not in ("left", "right"):
            raise bad(key, "'left' or 'right'")
    value = config.get("model_max_length")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise bad("model_max_length", "a positive number")
        config["model_max_length"] = int(value)  # a count of tokens, whatever the file wrote
    for key in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise bad(key, "true or false")
    return config


def tokenizer_from_folder(folder: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer from a folder holding ``tokenizer.json`` (transformers' fast tokenizer format)."""
    from tokenizers import Tokenizer as Backend

    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"no tokenizer.json in {folder}; genkit reads fast-tokenizer folders "
                                "(tokenizer.json) and .gguf files")
    try:
        backend = Backend.from_file(path)
        backend.encode("a", add_special_tokens=True)  # (a post-processor naming a special token it lacks
        # panics in every encode: found here, not in the first request)
    except BaseException as exc:  # (a Rust panic, pyo3's PanicException, is a BaseException)
        if not isinstance(exc, Exception) and not is_rust_panic(exc):
            raise
        raise CorruptModelError(f"{path}: cannot be read as a tokenizers file ({exc})") from exc
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config.update(_check_config(_read_json(os.path.join(folder, name)), os.path.join(folder, name)))
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as fh:
                config["chat_template"] = fh.read()
        except UnicodeDecodeError as exc:
            raise CorruptModelError(f"{jinja}: not UTF-8 text ({exc})") from None
    elif config.get("chat_template") is None:
        path = os.path.join(folder, "chat_template.json")
        tpl = _check_config({"chat_template": _read_json(path).get("chat_template")}, path)["chat_template"]
        if tpl is not None:
            config["chat_template"] = tpl
    return Tokenizer(backend, config, name_or_path=folder)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# llama.cpp pre-tokenizer names -> split regex, for byte-level vocabularies that do not use GPT-2's
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


# llama.cpp token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary, best first.

    A SentencePiece BPE model (and llama.cpp's ``llama`` tokenizer) merges, at each step, the
    adjacent pair whose concatenation is the vocabulary piece of highest score. Every split of a
    piece into two vocabulary pieces is therefore a merge ranked by that piece's score; ties go to
    the longer left part, then the longer right part (the order transformers' GGUF converter uses,
    so both build the same tokenizer).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}  # a duplicated piece keeps its last id, as in llama.cpp
    score_of = dict(zip(tokens, (float(s) for s in scores)))
    # a split point leaves two pieces of lengths the vocabulary has: only those are tried (a long
    # piece would otherwise cost a slice per character, quadratic in its length), the lengths below
    # the piece's own found by bisection (a scan of them all cost every piece the number of lengths)
    has_length = {len(t) for t in vocab}
    lengths = sorted(has_length)
    ranked: list[tuple[float, str, str]] = []
    for piece, score in score_of.items():
        n = len(piece)
        splits = [(piece[:k], piece[k:]) for k in lengths[:bisect_left(lengths, n)] if n - k in has_length
                  and piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((score, left, right) for left, right in splits)
    # stable sort, best first: equal keys keep the order above
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def sentencepiece_merge_work(tokens: Sequence[str]) -> int:
    """An upper bound of what :func:`sentencepiece_merges` reads for ``tokens``: for each piece, the
    split points it tries (the vocabulary's lengths below its own) times its length (each try slices
    and hashes it; each merge made holds it). O(tokens x log lengths), so that a file's vocabulary can
    be refused before the work (``genkit.models.limits``, ``tokenizer_merge_work``)."""
    lengths = sorted({len(t) for t in tokens})
    return sum(bisect_left(lengths, len(t)) * len(t) for t in set(tokens))


def _byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> tuple[Any, dict[str, int]]:
    """GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``): vocabulary and merges."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    table = bytes_to_unicode()
    alphabet = set(table.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= alphabet else "".join(table[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 continuing_subword_prefix="", end_of_word_suffix=""))
    split = GGUF_SPLITS.get(meta.get("pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str], where: str) -> tuple[Any, dict[str, int]]:
    """SentencePiece BPE with byte fallback (``tokenizer.ggml.model == "llama"``).

    Spaces are spelled ``▁`` and one ``▁`` is put in front of the text (unless
    ``add_space_prefix`` is false); the merges come from ``tokenizer.ggml.merges`` when the file
    has them, else from the scores (:func:`sentencepiece_merges`); a character missing from the
    vocabulary becomes its UTF-8 bytes as ``<0xNN>`` tokens. Decoding turns ``▁`` back into spaces,
    bytes back into characters, and drops the one leading space the prefix added.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if meta.get("merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    else:
        scores = list(meta.get("scores") or [])
        if len(scores) != len(tokens):
            raise CorruptModelError(f"{where} `tokenizer.ggml.scores` has {len(scores)} entries for "
                                    f"{len(tokens)} tokens; a 'llama' vocabulary needs one score per token")
        merges = sentencepiece_merges(tokens, scores)
    unk_id = meta.get("unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("add_space_prefix", True))
    # "first": the prefix goes before the text, not again after a special token inside it
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _gguf_tokenizer_config(meta: dict[str, Any], kind: str, tokens: list[str]) -> dict[str, Any]:
    """The special tokens, ``add_bos_token`` / ``add_eos_token`` and the chat template of a GGUF."""
    def tok(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
                              "unk_token": tok("unknown_token_id"), "pad_token": tok("padding_token_id"),
                              "add_bos_token": bool(meta.get("add_bos_token", kind == "llama")),
                              "add_eos_token": bool(meta.get("add_eos_token", False))}
    if meta.get("chat_template"):
        config["chat_template"] = meta["chat_template"]
    return config


def _add_gguf_added_tokens(backend: Any, meta: dict[str, Any], kind: str, tokens: list[str], vocab: dict[str, int],
                           config: dict[str, Any], usable: Any) -> None:
    """Control tokens (and, for ``"llama"``, the named special tokens) become special added tokens,
    user-defined ones plain added tokens."""
    from tokenizers import AddedToken

    types = list(meta.get("token_type") or [])
    control = [t for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL and usable(t)]
    if kind == "llama":  # the named special tokens too (``<unk>`` is typed UNKNOWN, not CONTROL)
        control += [config[n] for n in _SPECIAL_NAMES if config[n] is not None and config[n] not in control]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == _GGUF_USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _gguf_post_processor(config: dict[str, Any], tokens: list[str], vocab: dict[str, int]) -> Any:
    """The template that adds BOS / EOS as ``add_bos_token`` / ``add_eos_token`` say."""
    from tokenizers import processors

    single, specials = "$A", []
    if config["add_bos_token"] and config["bos_token"] is not None:
        single = f"{config['bos_token']} {single}"
        specials.append((config["bos_token"], vocab.get(config["bos_token"], tokens.index(config["bos_token"]))))
    if config["add_eos_token"] and config["eos_token"] is not None:
        single = f"{single} {config['eos_token']}"
        specials.append((config["eos_token"], vocab.get(config["eos_token"], tokens.index(config["eos_token"]))))
    pair = single.replace("$A", "$A $B:1") if specials else "$A $B:1"
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


_GGUF_META_TYPES: dict[str, tuple[str, Any]] = {  # key -> (what it must be, check of one value)
    "pre": ("a string", lambda v: isinstance(v, str)),
    "chat_template": ("a string", lambda v: isinstance(v, str)),
    "add_bos_token": ("a boolean", lambda v: isinstance(v, bool)),
    "add_eos_token": ("a boolean", lambda v: isinstance(v, bool)),
    "add_space_prefix": ("a boolean", lambda v: isinstance(v, bool)),
    **{f"{name}_id": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
       for name in ("bos_token", "eos_token", "unknown_token", "padding_token")},
}
_GGUF_ARRAY_TYPES: dict[str, tuple[str, Any]] = {  # key -> (what its elements must be, check of one)
    "tokens": ("strings", lambda v: isinstance(v, str)),
    "merges": ("strings of two pieces split by a space", lambda v: isinstance(v, str) and len(v.split(" ", 1)) == 2),
    "scores": ("numbers (not NaN)", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v),
    "token_type": ("integers", lambda v: isinstance(v, int) and not isinstance(v, bool)),
}


def _check_gguf_meta(meta: dict[str, Any], where: str) -> None:
    """The types of a GGUF's tokenizer metadata (a value of the wrong GGUF type was a bare
    ValueError or TypeError, or ``"false"`` read as true); a CorruptModelError naming the key."""
    for key, (want, ok) in _GGUF_META_TYPES.items():
        if meta.get(key) is not None and not ok(meta[key]):
            name = "tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"
            raise CorruptModelError(f"{where} `{name}` must be {want}; got {meta[key]!r}")
    for key, (want, ok) in _GGUF_ARRAY_TYPES.items():
        values = meta.get(key)
        if values is None:
            continue
        bad = next((i for i, v in enumerate(values) if not ok(v)), None) if isinstance(values, list) else -1
        if bad is not None:
            got = values if bad == -1 else f"{values[bad]!r} at index {bad}"
            raise CorruptModelError(f"{where} `tokenizer.ggml.{key}` must be an array of {want}; got {got}")


def tokenizer_from_gguf_metadata(meta: dict[str, Any], name_or_path: str = "") -> Tokenizer:
    """Build the tokenizer a GGUF's ``tokenizer.ggml.*`` metadata describes.

    ``meta`` is :func:`genkit.models.gguf.read_gguf_tokenizer`'s dict. ``tokenizer.ggml.model``
    picks the kind: ``"gpt2"`` (byte-level BPE; the split regex follows ``tokenizer.ggml.pre``) or
    ``"llama"`` (SentencePiece BPE with byte fallback: Llama 1/2, Mistral, TinyLlama...). Control
    tokens (type 3) and the bos/eos/unk/pad tokens become special added tokens and user-defined ones
    (type 4) plain added tokens, so they are matched whole. BOS/EOS are added as
    ``add_bos_token``/``add_eos_token`` say (for ``"llama"`` BOS is added when the file does not say,
    as llama.cpp does).
    """
    kind = meta.get("model")
    if not isinstance(kind, str) or kind not in GGUF_TOKENIZER_MODELS:
        raise UnsupportedModelError(f"`tokenizer.ggml.model`: GGUF tokenizer model {kind!r} is not supported; accepted: "
                                    "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE with byte fallback)")
    where = f"{name_or_path or 'GGUF tokenizer'}: metadata"
    if not meta.get("tokens"):
        raise CorruptModelError(f"{where}: the file has no `tokenizer.ggml.tokens`")
    _check_gguf_meta(meta, where)
    tokens: list[str] = list(meta["tokens"])
    try:
        if kind == "gpt2":
            backend, vocab = _byte_level_backend(meta, tokens)
        else:
            backend, vocab = _sentencepiece_backend(meta, tokens, where)
    except CorruptModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library refused the vocabulary or merges
        raise CorruptModelError(f"{where} `tokenizer.ggml.tokens` / `tokenizer.ggml.merges` do not make a "
                                f"{kind!r} tokenizer: {exc}") from None
    if kind == "gpt2":
        spelled = set(bytes_to_unicode().values())

        def usable(t: str) -> bool:  # a control token outside the byte alphabet is a mislabel
            return set(t) <= spelled
    else:

        def usable(t: str) -> bool:
            return True

    config = _gguf_tokenizer_config(meta, kind, tokens)
    _add_gguf_added_tokens(backend, meta, kind, tokens, vocab, config, usable)
    backend.post_processor = _gguf_post_processor(config, tokens, vocab)
    return Tokenizer(backend, config, name_or_path=name_or_path)
