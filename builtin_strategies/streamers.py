"""Streamers: receive token ids as they are generated (``put``) and a final ``end()``.

``generate()`` calls ``put(prompt_ids)`` once, then ``put(new_ids)`` each step, and always calls
``end()`` -- also when generation raises -- so an iterator streamer never leaves its consumer
waiting. The text streamers work with any tokenizer exposing ``decode(ids, **kwargs)``.

Text is released as soon as it cannot change (transformers >= 5.24's rules): new text made only of
letters, digits and spaces at once, as is a CJK character; text with a symbol in it (which may start
formatting, or be an incomplete UTF-8 sequence decoded as U+FFFD) up to its last space; a newline
flushes everything and keeps the last token as context for the next line's leading space.
"""

from __future__ import annotations

import asyncio
import logging
import unicodedata
from collections.abc import Iterator
from queue import Queue
from typing import Any

import torch

from genkit.errors import ConfigError, InvalidStateError, NotSupportedError

logger = logging.getLogger("genkit.streamers")

__all__ = ["AsyncTextIteratorStreamer", "BaseStreamer", "TextIteratorStreamer", "TextStreamer"]


# CJK Unified Ideographs and their extensions / compatibility blocks: each char is a word
_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def is_cjk(char: str) -> bool:
    """True for a CJK ideograph (such text has no spaces, so each character is released at once)."""
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


class BaseStreamer:
    """Base class: ``put(value)`` receives token ids, ``end()`` marks the end of the stream."""

    def put(self, value: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement put(value)")

    def end(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement end()")


class TextStreamer(BaseStreamer):
    """Print the decoded text to stdout as soon as it cannot change (the rules of transformers >= 5.24).

    Args:
        tokenizer: anything with ``decode(ids, **decode_kwargs) -> str``.
        skip_prompt: do not print the prompt (the first ``put``).
        **decode_kwargs: passed to ``tokenizer.decode`` (e.g. ``skip_special_tokens=True``).

    Only batch size 1 is supported (one stream of text).
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, **decode_kwargs: Any) -> None:
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ConfigError("`tokenizer` must provide decode(ids, **kwargs) -> str; "
                              f"got {type(tokenizer).__name__}")
        if not isinstance(skip_prompt, bool):
            raise ConfigError(f"`skip_prompt` must be True or False; got {skip_prompt!r}")  # noqa: TRY004
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def _decode(self) -> str:
        return str(self.tokenizer.decode(self.token_cache, **self.decode_kwargs))

    def put(self, value: torch.Tensor | list[int]) -> None:
        """Receive token ids: ``(1, n)`` or ``(n,)`` (a tensor or a list)."""
        if isinstance(value, torch.Tensor):
            if value.dim() > 1:
                if value.shape[0] > 1:
                    raise NotSupportedError(f"{type(self).__name__} supports batch size 1 only; got a batch of {value.shape[0]}")
                value = value[0]
            ids = [int(v) for v in value.reshape(-1).tolist()]
        else:
            ids = [int(v) for v in value]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        self.token_cache.extend(ids)
        text = self._decode()
        if text.endswith("\n"):
            # flush, but keep the last token as decoding context: the next line's leading space survives
            ready = text[self.print_len:]
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(str(self.tokenizer.decode(self.token_cache, **self.decode_kwargs)))
        elif (text and is_cjk(text[-1])) or all(c.isspace() or unicodedata.category(c)[0] in "LMN"
                                                 for c in text[self.print_len:]):
            # CJK, or only letters (with their marks), digits and spaces: nothing can change them
            ready = text[self.print_len:]
            self.print_len += len(ready)
        else:
            # a symbol may start formatting or be half a character (U+FFFD): release up to the last space
            cut = text.rfind(" ") + 1
            ready = text[self.print_len:cut] if cut > self.print_len else ""
            self.print_len += len(ready)
        if ready:
            self.on_finalized_text(ready)

    def end(self) -> None:
        """Flush what is left and mark the end of the stream (safe to call more than once)."""
        ready = ""
        if self.token_cache:
            ready = self._decode()[self.print_len:]
        self.token_cache = []
        self.print_len = 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(ready, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Where released text goes; override to send it elsewhere."""
        print(text, flush=True, end=None if stream_end else "")


class TextIteratorStreamer(TextStreamer):
    """Collect released text in a queue; iterate over it (typically while ``generate`` runs in
    another thread). Iteration stops after ``end()``.

    Args:
        timeout: seconds to wait for the next piece of text before ``queue.Empty`` is raised
            (None: wait forever).
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None,
                 **decode_kwargs: Any) -> None:
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number of seconds > 0 or None; got {timeout!r}")
        self.text_queue: Queue[str | None] = Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration()
        return value


class AsyncTextIteratorStreamer(TextStreamer):
    """Like ``TextIteratorStreamer`` for ``async for``: create it inside the running event loop,
    run ``generate`` in a thread (``asyncio.to_thread``), iterate here.

    Args:
        timeout: seconds to wait for the next piece of text before ``TimeoutError`` is raised.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None,
                 **decode_kwargs: Any) -> None:
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number of seconds > 0 or None; got {timeout!r}")
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError as exc:
            raise InvalidStateError("AsyncTextIteratorStreamer must be created inside a running event loop "
                                    "(e.g. in an async function)") from exc
        self.text_queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.loop.call_soon_threadsafe(self.text_queue.put_nowait, text)
        if stream_end:
            self.loop.call_soon_threadsafe(self.text_queue.put_nowait, self.stop_signal)

    def __aiter__(self) -> AsyncTextIteratorStreamer:
        return self

    async def __anext__(self) -> str:
        value = await asyncio.wait_for(self.text_queue.get(), timeout=self.timeout)
        if value is self.stop_signal:
            raise StopAsyncIteration()
        return value
