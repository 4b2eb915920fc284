"""The model side of a decoding loop: cache, attention mask, positions and the token history."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from genkit.errors import ConfigError, NotSupportedError
from genkit.protocols import ModelOutput

from .call import StrategyCall

__all__ = ["Stepper"]


class Stepper:
    """Runs the model for a strategy. It owns the running sequences (``rows, max_length`` buffer),
    the cache, the attention mask of a left-padded batch and the positions of new tokens.

    >>> stepper = Stepper(call)                       # doctest: +SKIP
    >>> logits = stepper.prefill()                    # (rows, vocab), float32, last position
    >>> logits = stepper.step(next_tokens)            # append one token per row, run it
    >>> logits = stepper.step(next_tokens, rows=idx)  # beam search: continue rows ``idx`` first

    ``rows_per_prompt`` expands each prompt to that many rows after the prefill (beam search: the
    prompt is run once, then the cache is repeated). ``output_hidden_states`` keeps the hidden
    states of the last forward in :attr:`hidden_states`. With ``use_cache=False`` every forward
    re-runs the whole sequence (a passed cache is left untouched).

    A step may also be split in two: :meth:`push` appends tokens (and reorders rows), :meth:`forward`
    runs whatever the cache does not hold yet. :meth:`crop` rolls back (speculative decoding), inside
    :meth:`rollback` (which a cache with sliding-window layers needs once the sequence passes the window).

    Partial depth (``num_layers=k`` on a model with ``supports_partial_depth``) writes the new
    positions into the first ``k`` layers of the same cache. The stepper remembers how far those
    layers got: forwards at the same depth continue from there, and a forward at another depth (the
    full model verifying a draft) first drops what only the shallow layers hold and runs those
    positions again, so every layer it runs sees every position.
    """

    def __init__(self, call: StrategyCall, *, rows_per_prompt: int = 1, output_hidden_states: bool = False) -> None:
        if rows_per_prompt < 1:
            raise ConfigError(f"`rows_per_prompt` must be >= 1; got {rows_per_prompt}")
        self.call = call
        self.model = call.model
        self.use_cache = call.use_cache
        self.output_hidden_states = output_hidden_states
        # output_attentions=True: the model returns its attention weights (and an encoder-decoder
        # model's decoder its cross-attentions), kept for the last forward in `attentions`
        self.output_attentions = bool(getattr(call.config, "output_attentions", False))
        self.attentions: tuple[Any, Any] | None = None
        self.rows_per_prompt = rows_per_prompt
        self.max_length = call.max_length
        self.hidden_states: tuple[torch.Tensor, ...] | None = None
        rows = call.batch * rows_per_prompt
        self.ids = torch.full((rows, self.max_length), call.pad_token_id, dtype=torch.long, device=call.device)
        self.ids[:, :call.prompt_len] = call.input_ids.repeat_interleave(rows_per_prompt, dim=0)
        self.length = call.prompt_len
        self.mask, self._shift = _mask_buffer(call.attention_mask, self.max_length, rows_per_prompt)
        self.cache = _open_cache(call) if self.use_cache else None
        # leading tokens of the history whose keys/values the cache holds (a passed prompt cache
        # may hold a prefix; the rest of the prompt is run by the first forward)
        self._fed = self.cache.get_seq_length() if self.cache is not None else 0
        # (depth, positions) when a partial-depth forward left the first `depth` layers ahead of the rest
        self._shallow: tuple[int, int] | None = None
        self._rollback = False  # inside rollback(): every crop reaches the cache
        if self._fed >= call.prompt_len:
            raise ConfigError(
                f"`past_key_values` already holds {self._fed} positions but `input_ids` has {call.prompt_len} "
                "tokens: pass the whole prompt, cached prefix included, with at least one token more")

    # -- reading -------------------------------------------------------------------------------
    @property
    def sequences(self) -> torch.Tensor:
        """The running sequences ``(rows, length)`` (a view of the buffer)."""
        return self.ids[:, :self.length]

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def pending(self) -> int:
        """Tokens of the history that the next :meth:`forward` runs."""
        return self.length - self._fed if self.use_cache else self.length

    # -- running -------------------------------------------------------------------------------
    def prefill(self, *, num_layers: int | None = None) -> torch.Tensor:
        """Run the prompt (only the part a passed-in cache lacks); return the last position's
        logits ``(rows, vocab)`` in float32, expanded to ``rows_per_prompt`` rows per prompt."""
        call = self.call
        if self.length != call.prompt_len:
            raise ConfigError("prefill() runs the prompt once, before any token is pushed")
        held = self._fed
        ids, pos = call.input_ids[:, held:], call.position_ids
        if pos is not None:
            pos = pos[:, held:]
        out = self._run(ids, attention_mask=call.attention_mask if self.mask is not None else None,
                        position_ids=pos, keep=1, num_layers=num_layers)
        self._held(self.length, num_layers)
        logits = out.logits[:, -1, :].float()
        n = self.rows_per_prompt
        if n > 1:
            if self.cache is not None:
                self.cache.repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            if self.hidden_states is not None:
                self.hidden_states = tuple(h.repeat_interleave(n, dim=0) for h in self.hidden_states)
            if self.attentions is not None:
                self.attentions = tuple(None if a is None else tuple(t.repeat_interleave(n, dim=0) for t in a)
                                        for a in self.attentions)  # type: ignore[assignment]
        return logits

    def push(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Append ``tokens`` (``(rows,)`` one per row, or ``(rows, k)``) to the sequences; with
        ``rows``, first continue from those rows (row ``i`` becomes old row ``rows[i]``: the
        sequences, the cache, the mask and the positions follow)."""
        if rows is not None:
            self._reorder(rows)
        k = 1 if tokens.dim() == 1 else int(tokens.shape[1])
        if self.length + k > self.max_length:
            raise ConfigError(f"cannot append {k} tokens: the sequences hold {self.length} of max_length "
                              f"{self.max_length}")
        if k == 1:
            self.ids[:, self.length] = tokens.view(-1)
        else:
            self.ids[:, self.length:self.length + k] = tokens
        self.length += k

    def forward(self, keep: int | None = None, *, num_layers: int | None = None) -> torch.Tensor:
        """Run the tokens the cache does not hold yet (all of them without a cache). Returns the
        float32 logits of the last position ``(rows, vocab)``, or of the last ``keep`` positions
        ``(rows, keep, vocab)`` when ``keep`` is given."""
        out = self._pending(1 if keep is None else keep, num_layers)
        if keep is None:
            return out.logits[:, -1, :].float()
        return out.logits[:, -keep:, :].float()

    def forward_greedy(self) -> torch.Tensor | None:
        """:meth:`forward` for one pending token per row when only the argmax of its logits is
        wanted (greedy search with nothing else reading the scores): each row's token ``(rows,)``
        from the model's ``greedy_step`` (:meth:`genkit.models.base.GenkitModel.greedy_step`: the
        same tokens, without computing every logit), or None, with nothing run, where the model or
        this step has no such path; the caller then calls :meth:`forward`."""
        return cast("torch.Tensor | None", self._one_token("greedy_step"))

    def forward_top(self, k: int) -> torch.Tensor | None:
        """:meth:`forward` for one pending token per row when the scores are filtered to the ``k``
        largest before anything else reads them (sampling whose processors begin with a temperature
        and a top-k filter): the logits ``(rows, vocab)`` from the model's ``top_logits_step``
        (:meth:`genkit.models.base.GenkitModel.top_logits_step`: -inf where an entry cannot be among
        the ``k`` largest, so the filtered scores are the same), or None as :meth:`forward_greedy`."""
        out = self._one_token("top_logits_step", k)
        return None if out is None else cast(torch.Tensor, out[:, -1, :])

    def _one_token(self, method: str, *extra: Any) -> Any:
        """The model's optional ``method`` for one pending token per row (no hidden states or
        attentions kept, every layer, on a cache), or None where there is none or it declines."""
        fn = getattr(self.model, method, None)
        if (fn is None or not self.use_cache or self.cache is None or self.output_hidden_states
                or self.output_attentions or self._shallow is not None or self.length - self._fed != 1):
            return None
        n = self.length
        mask = self.mask[:, :n] if self.mask is not None else None
        out = fn(self.ids[:, n - 1:n], mask, self._positions(n - 1, n), self.cache, *extra)
        if out is not None:
            self._held(n, None)
        return out

    def advance(self) -> None:
        """Run the pending tokens for the cache and :attr:`hidden_states` only, without the LM
        head: for a strategy that projects the hidden states itself (DoLa reads the final and the
        premature layers through the head in one product)."""
        self._pending(torch.zeros(0, dtype=torch.long, device=self.ids.device), None)

    def _pending(self, want: int | torch.Tensor, num_layers: int | None) -> ModelOutput:
        n = self.length
        mask = self.mask[:, :n] if self.mask is not None else None
        if not self.use_cache:
            return self._run(self.ids[:, :n], attention_mask=mask, position_ids=None, keep=want, num_layers=num_layers)
        start = self._start(num_layers)
        out = self._run(self.ids[:, start:n], attention_mask=mask, position_ids=self._positions(start, n), keep=want,
                        num_layers=num_layers)
        self._held(n, num_layers)
        return out

    def step(self, tokens: torch.Tensor, rows: torch.Tensor | None = None, *,
             num_layers: int | None = None) -> torch.Tensor:
        """:meth:`push` then :meth:`forward`: logits ``(rows, vocab)`` after one token per row, or
        ``(rows, k, vocab)`` (one per new token) for ``tokens`` of shape ``(rows, k)``."""
        self.push(tokens, rows)
        return self.forward(None if tokens.dim() == 1 else int(tokens.shape[1]), num_layers=num_layers)

    @contextmanager
    def rollback(self, *, processors: bool = True) -> Iterator[None]:
        """Open around the forwards that :meth:`crop` rolls back (speculative decoding, contrastive
        search). A cache whose sliding-window layers drop the positions that leave the window
        (transformers' ``DynamicCache`` of Gemma2/3, Mistral or Qwen2 with ``sliding_window``) keeps
        them meanwhile (its optional ``record_past(on)``, :class:`genkit.protocols.Cache`), and every
        crop, even one that keeps every token, cuts them back to the window. Plain decoding does not
        open it: recording would hold every past position. Caches that keep every position
        (genkit's ``KVCache``) need nothing.

        ``processors``: the call's logits processors are called on histories that go back too
        (drafts verified, then rolled back): those with a cache of their own and a
        ``record_past(on)`` method (classifier-free guidance's unconditional branch) are told the
        same. Contrastive search, whose processors see one growing history, passes False."""
        owners = [self.cache, *(self.call.logits_processor or () if processors else ())]
        records: list[Callable[[bool], None]] = [
            record for record in (getattr(owner, "record_past", None) for owner in owners) if callable(record)]
        for record in records:
            record(True)
        self._rollback = True
        try:
            yield
        finally:
            self._rollback = False
            for record in records:
                record(False)

    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` tokens (the cache keeps at most that many positions;
        whatever it lacks is run by the next :meth:`forward`)."""
        if not 0 < length <= self.length:
            raise ConfigError(f"cannot crop to {length} tokens: the sequences hold {self.length}")
        self.length = length
        held = self._shallow[1] if self._shallow is not None else self._fed
        if (held > length or self._rollback) and self.cache is not None:
            self.cache.crop(length)
        self._fed = min(self._fed, length)
        if self._shallow is not None:
            depth, ahead = self._shallow
            self._shallow = (depth, min(ahead, length)) if min(ahead, length) > self._fed else None

    # -- internals -----------------------------------------------------------------------------
    def _start(self, num_layers: int | None) -> int:
        """The first position a cached forward at this depth runs. Positions that only a shallower
        (or another partial) depth holds are dropped from the cache first."""
        if self._shallow is not None:
            depth, ahead = self._shallow
            if depth == num_layers:
                return ahead
            if self.cache is not None:
                self.cache.crop(self._fed)
            self._shallow = None
        return self._fed

    def _positions(self, start: int, n: int) -> torch.Tensor | None:
        """Positions of the history's tokens ``start..n-1`` for a cached forward: generated tokens of
        a left-padded batch count from the row's first real token (index minus its pad count); None
        otherwise (prompt tokens get theirs from the mask, in the model)."""
        if self._shift is not None and start >= self.call.prompt_len:
            return torch.arange(start, n, device=self.ids.device)[None, :] - self._shift
        return None

    def _held(self, n: int, num_layers: int | None) -> None:
        """After a cached forward up to position ``n`` at depth ``num_layers`` (None: every layer)."""
        if num_layers is None:
            self._fed, self._shallow = n, None
        else:
            self._shallow = (num_layers, n)

    def _reorder(self, rows: torch.Tensor) -> None:
        n = self.length
        self.ids[:, :n] = self.ids[rows, :n]
        if self.cache is not None:
            self.cache.reorder(rows)
        if self.mask is not None and self._shift is not None:
            self.mask = self.mask.index_select(0, rows)
            self._shift = self._shift.index_select(0, rows)

    def _run(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
             keep: int | torch.Tensor, num_layers: int | None) -> ModelOutput:
        extra: dict[str, Any] = {"output_attentions": True} if self.output_attentions else {}
        if num_layers is None:
            out = self.model(ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=self.cache, use_cache=self.use_cache,
                             output_hidden_states=self.output_hidden_states, logits_to_keep=keep, **extra)
        else:
            if not getattr(self.model, "supports_partial_depth", False):
                raise NotSupportedError(
                    f"partial depth (num_layers={num_layers}) is not supported by {type(self.model).__name__}: "
                    "its forward cannot stop after the first layers")
            out = self.model(ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=self.cache, use_cache=self.use_cache,
                             output_hidden_states=self.output_hidden_states, logits_to_keep=keep,
                             num_layers=num_layers, **extra)
        if self.use_cache and out.past_key_values is not None:
            self.cache = out.past_key_values
        self.hidden_states = out.hidden_states if self.output_hidden_states else None
        if self.output_attentions:
            self.attentions = (getattr(out, "attentions", None), getattr(out, "cross_attentions", None))
        return cast(ModelOutput, out)


def _mask_buffer(attention_mask: torch.Tensor | None, max_length: int,
                 repeats: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For a left-padded batch: the mask for ``max_length`` tokens (ones after the prompt) and
    each row's number of pad tokens ``(rows, 1)`` (position = index - pads). ``(None, None)``
    when nothing is padded (the model then needs no mask)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None, None
    rows, prompt_len = attention_mask.shape
    buf = torch.ones((rows * repeats, max_length), dtype=attention_mask.dtype, device=attention_mask.device)
    buf[:, :prompt_len] = attention_mask.repeat_interleave(repeats, dim=0)
    pads = prompt_len - attention_mask.sum(-1, keepdim=True)
    return buf, pads.repeat_interleave(repeats, dim=0)


def _open_cache(call: StrategyCall) -> Any:
    """The passed-in cache, else a new one sized for ``max_length`` when the model makes its own
    (``model.new_cache``), else ``None`` (the model then returns one from its first forward)."""
    if call.past_key_values is not None:
        return call.past_key_values
    new_cache = getattr(call.model, "new_cache", None)
    return new_cache(call.max_length) if new_cache is not None else None
