"""The server's generation engine: requests in, token events out, from a worker thread.

:class:`GenerateEngine` runs each request with :func:`genkit.generate` on one worker thread, one
request (with its ``n`` choices as one batch, or one after another for a seeded request that samples:
choice ``i`` draws what the request seeded ``seed + i`` draws) at a time. Tokens reach the request's
:class:`RequestStream` as they are chosen (an ``asyncio`` queue fed with
``loop.call_soon_threadsafe``), with their log-probabilities when asked. Cancelling a request (a
client that went away) stops its generation at the next step; a request still queued never starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from genkit.errors import ConfigError, NotSupportedError
from genkit.strategy import choose, eos_token_ids
from genkit.threads import release_openmp_workers

logger = logging.getLogger("genkit.serve")

__all__ = ["EngineStats", "GenerateEngine", "PromptEvent", "Request", "RequestStream", "TokenEvent", "push_all"]


@dataclass
class Request:
    """One generation: ``prompt_ids`` (a list of token ids), ``n`` choices, the keyword arguments
    for ``genkit.generate`` (``max_new_tokens``, sampling fields, ``stop_strings``, ...), a seed,
    and how many log-probabilities to report per token (``None``: none)."""

    prompt_ids: list[int]
    n: int = 1
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None
    id: str = ""
    # the prompt's own tokens scored first, with this many alternatives (genkit.generation.scoring)
    prompt_logprobs: int | None = None
    generate: bool = True  # False: the prompt is only scored (OpenAI's max_tokens 0 with echo)


@dataclass
class TokenEvent:
    """Tokens chosen at one step: ``tokens[i]`` for choice ``i`` (``None`` once it has finished);
    ``logprobs[i]`` = (the token's log-probability, [(token id, log-probability), ...] best first);
    ``finish[i]``: the reason choice ``i`` finished with this token (``genkit.strategy.FINISH_REASONS``,
    the engine's own finish decision), ``None`` while it goes on."""

    tokens: list[int | None]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    finish: list[str | None] | None = None


@dataclass
class PromptEvent:
    """The prompt's own tokens scored (:func:`genkit.generation.scoring.score_prompt`), pushed before
    the request's first :class:`TokenEvent` when ``Request.prompt_logprobs`` asks for them:
    ``scores[i]`` is prompt token ``i + 1``'s. ``first``: the first of the HTTP request's choices
    this prompt's choices begin at (set where a request of several prompts merges its events)."""

    prompt_ids: list[int]
    scores: list[Any]
    first: int = 0


def push_all(items: list[tuple[RequestStream, Any]]) -> None:
    """:meth:`RequestStream.push` of each ``(stream, item)`` in order, with one call into each
    stream's event loop for all of them (one wake-up of the loop for a batching step's tokens)."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
    for stream, item in items:
        batches.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in batches.items():
        if not loop.is_closed():
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class RequestStream:
    """The events of one request, read with ``async for`` in the server's event loop. The last
    item is ``None`` (finished) or an exception (the request failed)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()  # stop generating (the client left, or needs no more)
        self.client_cancelled = False  # the client left before the end (counted in the metrics)
        self.on_cancel: Any = None  # set by an engine that must act at once (continuous batching)
        # time.perf_counter() marks on the way to the first token (logged by genkit.serve.app at debug level)
        self.marks: dict[str, float] = {}

    def push(self, item: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def cancel(self) -> None:
        """The client went away: stop, and count the request as cancelled."""
        self.client_cancelled = True
        self.release()

    def release(self) -> None:
        """The client has all it wants (a stop string, every choice finished): stop generating."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]


@dataclass
class EngineStats:
    """Counters for ``/metrics``."""

    requests_total: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    generated_tokens_total: int = 0
    generated_tokens_alone_total: int = 0
    cache_free_blocks: int = 0
    cache_prompt_blocks: int = 0
    cache_blocks: int = 0


class _Stop:
    """A stopping criterion that ends a generation whose request was cancelled."""

    finish_reason = "cancelled"  # genkit.strategy.FINISH_REASONS

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stream.cancelled.is_set(), dtype=torch.bool,
                          device=input_ids.device)


class _Streamer:
    """Receives each step of ``generate`` (the tokens, then the scores they were chosen from and
    the rows they finish: ``put_step``, see ``genkit.strategy.FinishTracker``) and pushes
    :class:`TokenEvent` items, with log-probabilities from the sampler's ``genkit.strategy.choose``
    when ``top`` is not ``None``."""

    def __init__(self, stream: RequestStream, rows: int, top: int | None, stats: EngineStats, first: int = 0) -> None:
        # row r of the generation is choice first + r of the request's n (a choice generated alone: rows=1)
        self.stream, self.rows, self.top, self.stats, self.first = stream, rows, top, stats, first
        self.prompt_seen = False
        self.done = [False] * rows
        self.pending: torch.Tensor | None = None

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate streams the prompt first
            self.prompt_seen = True
            return
        self._flush(None, None)
        self.pending = value.reshape(-1)

    def put_step(self, scores: torch.Tensor | None, finished: list[str | None]) -> None:
        self._flush(scores, finished)

    def end(self) -> None:
        self._flush(None, None)

    def _flush(self, scores: torch.Tensor | None, finished: list[str | None] | None) -> None:
        if self.pending is None:
            return
        ids, self.pending = self.pending, None
        choice = None
        if self.top is not None and scores is not None:
            choice = choose(scores, False, logprobs=True, top=self.top, tokens=ids)
        width, first = self.stream.request.n, self.first
        tokens: list[int | None] = [None] * width
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = (
            [None] * width if self.top is not None else None)
        for row, tok in enumerate(ids.tolist()):
            if self.done[row]:
                continue
            tokens[first + row] = int(tok)
            self.stats.generated_tokens_total += 1
            if logprobs is not None and choice is not None:
                _, lp, alternatives = choice.row(row)
                logprobs[first + row] = (float(lp or 0.0), alternatives)
        finish: list[str | None] = [None] * width
        for row in range(self.rows):
            reason = None if self.done[row] or finished is None else finished[row]
            finish[first + row] = reason
            self.done[row] = self.done[row] or reason is not None
        self.stream.push(TokenEvent(tokens, logprobs, finish))


class GenerateEngine:
    """Runs requests on ``model`` one at a time on a worker thread (see the module docstring)."""

    name = "generate"

    def __init__(self, model: Any, tokenizer: Any, max_queue: int = 0) -> None:
        from genkit.generation.api import as_protocol_model
        from genkit.generation.encoder_decoder import text_prompt_refusal

        model = as_protocol_model(model)  # a transformers model in genkit's adapter, as generate runs it
        why = text_prompt_refusal(model, "genkit serve")
        if why is not None:
            raise NotSupportedError(why)
        self.model, self.tokenizer = model, tokenizer  # an encoder-decoder model's prompt: its encoder's input
        self.stats = EngineStats()
        self._queue: queue.Queue[RequestStream | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="genkit-serve-engine", daemon=True)
        self._lock = threading.Lock()
        # generation runs in the worker thread: the caller's idle OpenMP pool beside its pool would make
        # the runtime sleep workers between parallel regions (a SmolLM2 float32 token 22.5 -> 13.9 ms
        # at 2 threads once released; genkit.threads)
        release_openmp_workers()
        self._thread.start()

    def warm_up(self, prompt_ids: list[int], new_tokens: int = 4, timeout: float = 300.0) -> float | None:
        """Nothing (the continuous batching engine's :meth:`ContinuousEngine.warm_up` runs a request;
        this engine's models, encoder-decoders among them, take other prompts): None."""
        return None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> RequestStream:
        stream = RequestStream(request, loop)
        with self._lock:
            self.stats.requests_total += 1
            self.stats.requests_waiting += 1
        self._queue.put(stream)
        return stream

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop after the running request; requests still queued are cancelled."""
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        for stream in pending:
            stream.cancel()
            stream.push(RuntimeError("the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            stream = self._queue.get()
            if stream is None:
                return
            with self._lock:
                self.stats.requests_waiting -= 1
            if stream.cancelled.is_set():
                with self._lock:
                    self.stats.requests_cancelled += stream.client_cancelled
                stream.push(None)
                continue
            with self._lock:
                self.stats.requests_running += 1
            try:
                self._generate(stream)
                stream.push(None)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                logger.warning("request %s failed: %s", stream.request.id, exc)
                with self._lock:
                    self.stats.requests_failed += 1
                stream.push(exc)
            finally:
                with self._lock:
                    self.stats.requests_running -= 1
                    self.stats.requests_cancelled += stream.client_cancelled

    def _generate(self, stream: RequestStream) -> None:
        """The request's ``n`` choices as rows of one ``generate``, except a seeded request that
        samples several: choice ``i`` is then generated alone after ``torch.manual_seed(seed + i)``,
        as continuous batching seeds it (vLLM's rule), so it draws what the one-choice request with
        seed ``seed + i`` draws (``n`` rows after one seed would draw other tokens for every choice).
        A strategy that runs one row (drafting, early exit) generates its choices one after another.
        Prompt log-probabilities asked for are computed first (:meth:`_score`)."""
        request = stream.request
        kwargs = dict(request.generate_kwargs)
        streams, samples, plain, one_row = _plan(self.model, kwargs)
        if streams:  # the server cuts the text at a stop string and releases the request there (_Stop)
            kwargs.pop("stop_strings", None)
        if not streams and request.logprobs is not None:
            raise ConfigError("`logprobs` cannot be reported with beam search (num_beams > 1): a token's "
                              "log-probability is its beam's, not the sequence's; drop one of them")
        self.stats.prompt_tokens_total += len(request.prompt_ids) * request.n
        one_call = request.n == 1 or (not one_row and (request.seed is None or not (streams and samples)))
        if request.prompt_logprobs is not None:
            cache = self._score(stream, kwargs, reuse=plain and request.n == 1)
            if cache is not None:
                kwargs["past_key_values"] = cache
        if not request.generate or stream.cancelled.is_set():
            return
        if one_call:
            self._generate_rows(stream, kwargs, streams, request.n, 0, request.seed)
            return
        for i in range(request.n):
            if stream.cancelled.is_set():  # the client left: the choices not begun are not generated
                return
            self._generate_rows(stream, kwargs, streams, 1, i, None if request.seed is None else request.seed + i)

    def _score(self, stream: RequestStream, kwargs: dict[str, Any], reuse: bool) -> Any:
        """Push the prompt's :class:`PromptEvent`; the cache its forward filled when ``reuse`` (one
        row of a plain greedy or sampling ``generate`` follows, which then computes only the prompt's
        last token), else None."""
        from genkit.generation.scoring import score_prompt

        request = stream.request
        max_new = kwargs.get("max_new_tokens") or 0
        reuse = reuse and request.generate
        scored = score_prompt(self.model, request.prompt_ids, top_n=request.prompt_logprobs or 0, keep_cache=reuse,
                              cache_length=len(request.prompt_ids) + max_new)
        stream.push(PromptEvent(list(request.prompt_ids), scored.tokens))
        return scored.cache

    def _generate_rows(self, stream: RequestStream, kwargs: dict[str, Any], streams: bool, rows: int, first: int,
                       seed: int | None) -> None:
        """Choices ``first`` .. ``first + rows - 1`` of ``stream``'s request: ``rows`` rows of one
        ``generate`` after ``torch.manual_seed(seed)`` (unless ``seed`` is None)."""
        import genkit
        from genkit.generation.encoder_decoder import new_tokens_start

        request = stream.request
        streamer = _Streamer(stream, rows, request.logprobs, self.stats, first)
        ids = torch.tensor([request.prompt_ids])
        kwargs = dict(kwargs)
        if rows > 1 and streams:  # a row per choice: what num_return_sequences expands the prompt to, and
            ids = ids.repeat(rows, 1)  # a deterministic strategy (greedy, contrastive, DoLa) runs it too
        elif rows > 1:  # beam search: the n best hypotheses
            kwargs["num_return_sequences"] = rows
        # every prompt token counts, a pad id among them (as on continuous batching): generate infers
        # no mask from the pad id of a prompt given with one
        with torch.no_grad(), _seeded(seed, self.model):
            out = genkit.generate(self.model, ids, attention_mask=torch.ones_like(ids), tokenizer=self.tokenizer,
                                  streamer=streamer if streams else None, stopping_criteria=[_Stop(stream)], **kwargs)
        if not streams:  # the best hypotheses are known at the end: emit them now, as if streamed
            eos = set(eos_token_ids(kwargs.get("eos_token_id", self.model.generation_config.eos_token_id)))
            # an encoder-decoder model's sequences are the decoder's: its start token, then the new ones
            sequences = out.sequences if hasattr(out, "sequences") else out
            _emit(streamer, sequences, new_tokens_start(self.model, ids.shape[1]), eos)


@contextlib.contextmanager
def _seeded(seed: int | None, model: Any) -> Iterator[None]:
    """Torch's global generator seeded with ``seed`` for one request, and put back as it was after it
    (as vLLM keeps a seeded request's generator apart): the requests without a seed that follow draw
    what they would have drawn had the seeded one not run."""
    if seed is None:
        yield
        return
    device = getattr(model, "device", torch.device("cpu"))
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def _emit(streamer: _Streamer, sequences: torch.Tensor, prompt_len: int, eos: set[int]) -> None:
    """Finished sequences through ``streamer`` column by column, a row ending at its EOS token."""
    streamer.put(sequences[:, :prompt_len])
    for column in sequences[:, prompt_len:].T:
        if all(streamer.done):
            break
        streamer.put(column)
        streamer.put_step(None, ["eos" if int(t) in eos else None for t in column.tolist()])
    streamer.end()


def _plan(model: Any, kwargs: dict[str, Any]) -> tuple[bool, bool, bool, bool]:
    """(whether ``generate`` runs these settings with a streamer, whether it may sample, whether it
    is plain greedy or sampling, which a prompt cache may be passed to, whether its strategy runs
    one row: assisted decoding's drafts and early exit). Beam search knows its tokens only at the
    end (its rows are hypotheses that change until then). A recipe (``custom_generate``), or
    settings ``generate`` will refuse, may sample."""
    from genkit.generation.api import merge_config
    from genkit.generation_mode import GenerationMode

    settings = {k: v for k, v in kwargs.items() if k not in ("custom_generate", "trust_remote_code")}
    try:
        config, _ = merge_config(model, None, settings)
    except ValueError:  # a recipe's own settings, or a bad one: generate reports it
        return True, True, False, False
    streams = int(config.num_beams or 1) == 1
    recipe = kwargs.get("custom_generate") is not None
    mode = None if recipe else config.get_generation_mode()
    plain = mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
    return streams, bool(config.do_sample) or recipe, plain, mode == GenerationMode.ASSISTED_GENERATION
