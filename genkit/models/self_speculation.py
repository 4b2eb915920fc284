"""Exact self-speculative greedy decoding for float32 models on the dense kernel's one-call step.

A batch-1 float32 decode step reads every weight once per token, so it runs at the speed of memory
(on several CPUs one core reads what transformers reads: no faster kernel is left). A step that runs
T tokens as rows of one product reads the weights once for all T. So a greedy step here:

1. drafts ``gamma`` tokens with an 8-bit copy of the model (the **draft**: every decoder product as
   int8 codes with one scale per 32 weights, on the block kernel, activations rounded to one int8
   digit; the LM head in 4 bits, the blocks of its :data:`RESCORE` largest logits computed again from
   the model's float32 head; under a third of the bytes; attention over the first
   :data:`DRAFT_SINK` positions and the last :data:`DRAFT_WINDOW`, so that its step's cost stays flat
   with the context). The draft writes its keys and values into the
   model's own cache, after the positions the model itself computed, so it needs no cache, prompt or
   history of its own;
2. checks them with the model itself in one step (``gk_decode_verify``): the pending token and the
   ``gamma`` drafts as rows, each row computed exactly as a one-token step computes it (the dense
   kernel gives a row of up to 16 the same bits as alone; norms, rotary embedding, attention and
   SwiGLU are per row). Row ``t``'s argmax is the token greedy search picks after token ``t``;
3. keeps the drafts up to the first one the model disagrees with. Their keys and values, the model's
   own, stay in the cache beyond its length, with the tokens the model gives after each (the cache's
   ``ahead``): the next greedy steps whose token is the one drafted take their answer from there
   without running anything.

The tokens are those of plain greedy search, bit for bit, whatever the draft proposes: a draft only
decides how many tokens one check yields. Anything that writes the cache by another way (a forward,
a crop, a reorder, a grown buffer) drops what is ahead. ``model.self_speculation``: None (the
default) makes the draft where it takes at most :data:`DRAFT_MAX_BYTES` (2 GiB: about 2B parameters;
SmolLM2-135M's takes 137 MB) and speculates while rounds are measured faster than one-token steps
(:meth:`Pace.plain`: with a long context every draft step and every row of a check attends over all
of it; SmolLM2 after a 3000-token prompt ran 0.86x one token per step before this rule, 1.05x with
it), True always (any size, every step), False never (one token per step).

Draft length: chosen before each round for the most tokens per second (:class:`Pace`): the time of a
draft step and of a check of each length as measured in earlier rounds, and the share of drafts the
model agreed with, give each length's expected tokens over its expected time. A check's time grows
little with its rows while the step is bound by memory, and steeply once it is bound by arithmetic:
where that happens depends on the CPU and the model, so it is measured, not assumed. Lengths not yet
measured are estimated from the nearest shorter one (10 % more a row), so the choice tries longer
checks while they pay. The first check of each length is a warm-up, not timed; a time below the
running one moves it most of the way (noise only adds time); every 16 rounds a length next to the best
is checked, so one preempted check does not keep a length out for good.

A check that wants only tokens reads the float32 LM head through its 8-bit copy (once for all rows)
and computes exactly only the logits that can be a row's largest, as a one-token greedy step does;
for each length the check is timed both ways, and the faster is kept (on a Zen 5 the copy saved
6-15 % of a check; where one core reads memory slowly it saves more).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import block_kernel, dense_kernel, weight_arena
from .block_decode import BlockDecoder, _ends, gpt2_extras
from .cache import KVCache
from .dense_kernel import Gemv
from .quant import GROUP, Int4Linear, _int4_symmetric, _int8_symmetric

GAMMA_START = 4
GAMMA_MAX = 15  # a check runs at most 16 rows (gk_decode_verify)
EMA = 0.25  # weight of the latest measurement in the running times
EMA_FASTER = 0.75  # ... when it is faster than the running time: timing noise (a preemption) only adds time
AGREE_MEMORY = 0.98  # the share of drafts kept counts the recent rounds (each earlier one weighs 0.98 times
# the next: about the last 50), so a prompt whose drafts agree less (a long context) is soon seen as such
EXPLORE = 16  # every this many rounds a length next to the best is checked, so none stays measured slow once
UNMEASURED_ROW = 0.1  # an unmeasured check: the nearest shorter one's time, this much more per row
MIN_ROWS = 16  # the block kernel's weights hold rows in blocks of 16
DRAFT_MAX_BYTES = 2 << 30  # model.self_speculation = None makes a draft only up to this size
DRAFT_DIGITS = 1  # activations as one int8 digit a value (llama.cpp's Q8_0 rounding): SmolLM2's draft
# steps 8 % faster than with two, the same drafts kept (a draft only needs to agree, not to be exact)
DRAFT_WINDOW = 512  # a draft step attends over the first DRAFT_SINK positions and the last DRAFT_WINDOW
DRAFT_SINK = 4
BYTES_PER_WEIGHT = 9 / 8  # the block kernel's 8-bit blocks: 576 bytes per 16 rows of 32 weights
HEAD_BYTES_PER_WEIGHT = 5 / 8  # its 4-bit blocks (the draft's LM head where it is rescored): 320 bytes
RESCORE = 8  # a draft step's 4-bit head: the blocks of its 8 largest logits computed again from the model's
# float32 head (SmolLM2: the 8 largest held the 8-bit head's argmax at 99.4 % of draft steps, the largest at 92 %)


@dataclass
class Ahead:
    """Positions the model has computed beyond a cache's length: at ``start + i`` the token
    ``inputs[i]`` (its keys and values are in the cache's buffers) and the greedy token after it,
    ``outputs[i]``. ``owner`` is the decoder whose check wrote them."""

    start: int
    inputs: list[int]
    outputs: list[int]
    owner: int


@dataclass
class Stats:
    """What the draft did: checks run, tokens drafted, drafts kept, tokens answered from ``ahead``,
    one-token steps taken where the pace measured them faster."""

    checks: int = 0
    drafted: int = 0
    accepted: int = 0
    answered_ahead: int = 0
    one_token: int = 0  # steps the pace ran one token at a time, measured faster


@dataclass
class Pace:
    """Running measurements of the rounds: seconds per draft step, seconds per check of ``T`` rows for
    each way of reading the LM head (``copy``: through its 8-bit copy; else the whole float32 head), and
    drafts kept against drafts the model disagreed with (at most one per check), recent rounds weighing
    most."""

    draft_s: float | None = None
    check_s: dict[tuple[int, bool], float] = field(default_factory=dict)
    kept: float = 0.0  # drafts kept, and checks that disagreed with one, over the recent rounds (AGREE_MEMORY)
    rejected: float = 0.0
    warmed: set[tuple[int, bool]] = field(default_factory=set)
    rounds: int = 0
    plain_s: float | None = None  # a one-token greedy step's running time
    plain_warmed: bool = False
    steps: int = 0  # steps decided by :meth:`plain`

    def record(self, drafts: int, draft_s: float, rows: int, check_s: float, kept: int, copy: bool = True) -> None:
        """Take a round's measurements; the first check of each length and way is a warm-up, not timed
        (its first-call work, scratch memory faulted in, would make that length look slow for good).
        A time below the running one moves it most of the way (:data:`EMA_FASTER`): noise only adds."""
        if drafts:
            per = draft_s / drafts
            self.draft_s = per if self.draft_s is None else _running(self.draft_s, per)
        key = (rows, copy)
        if key in self.warmed:
            old = self.check_s.get(key)
            self.check_s[key] = check_s if old is None else _running(old, check_s)
        self.warmed.add(key)
        self.kept = AGREE_MEMORY * self.kept + kept
        self.rejected = AGREE_MEMORY * self.rejected + (kept < drafts)
        self.rounds += 1

    def head_copy(self, rows: int) -> bool:
        """How a check of ``rows`` reads the LM head: through its 8-bit copy (a quarter of the bytes,
        and an 8-bit product of every row plus a few exact logits a row) unless the whole float32 head
        was measured faster at that many rows; each way is timed (after its warm-up) before the times
        decide."""
        copy, whole = self.check_s.get((rows, True)), self.check_s.get((rows, False))
        if copy is None:
            return True
        if whole is None:
            return False
        return copy <= whole

    def _check_times(self, limit: int) -> list[float]:
        """The expected time of a check of 1..``limit`` rows (index: rows - 1), read the faster way:
        measured, or the nearest shorter measured length's (else the shortest's) plus
        :data:`UNMEASURED_ROW` a row."""
        measured: dict[int, float] = {}
        for (t, _), s in self.check_s.items():
            measured[t] = min(s, measured.get(t, s))
        times = []
        for rows in range(1, limit + 1):
            shorter = [t for t in measured if t <= rows]
            base = max(shorter) if shorter else min(measured)
            times.append(measured[base] * (1 + UNMEASURED_ROW * (rows - base)))
        return times

    def record_plain(self, seconds: float) -> None:
        """Take a one-token greedy step's time (the first is a warm-up, not timed)."""
        if self.plain_warmed:
            self.plain_s = seconds if self.plain_s is None else _running(self.plain_s, seconds)
        self.plain_warmed = True

    def plain(self, limit: int) -> bool:
        """Whether the next step should be one token without drafts: when one-token steps were
        measured faster than the best round's tokens per second (long contexts: every draft step and
        every row of a check attends over all of them), with the other way taken every
        :data:`EXPLORE` steps to keep both measured. Speculation is timed first, then two one-token
        steps (a warm-up and one timed)."""
        self.steps += 1
        if limit < 1 or self.draft_s is None or not self.check_s:
            return False
        if self.plain_s is None:
            return True
        faster = 1.0 / self.plain_s >= max(self._rates(limit))
        return faster != (self.steps % EXPLORE == 0)

    def _rates(self, limit: int) -> list[float]:
        """Expected tokens per second of a round of 1..``limit`` drafts (index: drafts - 1)."""
        agree = (self.kept + 1) / (self.kept + self.rejected + 2)  # each draft's chance, one of each assumed
        checks = self._check_times(limit + 1)
        rates = []
        for g in range(1, limit + 1):
            tokens = (1 - agree ** (g + 1)) / (1 - agree) if agree < 1 else g + 1.0
            rates.append(tokens / (g * self.draft_s + checks[g]))  # type: ignore[operator]
        return rates

    def best(self, limit: int, explore: bool = True) -> int:
        """The draft length (1..``limit``) with the most expected tokens per second (every
        :data:`EXPLORE` rounds one next to it, longer and shorter in turn); GAMMA_START (within the
        limit) before anything was measured; 0 for a limit under 1."""
        if limit < 1:
            return 0
        if self.draft_s is None or not self.check_s:  # (nothing timed yet: warm-ups only)
            return min(GAMMA_START, limit)
        rates = self._rates(limit)
        best = 1 + rates.index(max(rates))  # (the shortest of equals, as max over the lengths gave)
        if explore and self.rounds % EXPLORE == EXPLORE - 1:
            up = (self.rounds // EXPLORE) % 2 == 0
            best = best + 1 if up and best < limit or best == 1 and limit > 1 else max(1, best - 1)
        return best


def _running(old: float, new: float) -> float:
    """A running time after a new measurement (:data:`EMA`, :data:`EMA_FASTER`)."""
    weight = EMA_FASTER if new < old else EMA
    return (1 - weight) * old + weight * new


@dataclass
class SelfDraft:
    """The 8-bit draft of one prepared float32 model: its decoder (block-kernel layers) and ends (the
    model's float32 embedding and final norm, an 8-bit LM head), and the current draft length."""

    decoder: BlockDecoder
    ends: Any
    head: Int4Linear  # keeps the head's blocks (the ends point into them) alive
    gamma: int = GAMMA_START  # the last round's draft length
    stats: Stats = field(default_factory=Stats)
    pace: Pace = field(default_factory=Pace)


def _dense(weight: Any) -> Any:
    """The float tensor of a prepared dense weight (a :class:`Gemv`'s, or the tensor itself); anything
    else as it is. By type, not ``getattr(weight, "weight")``: a quantized layer's ``weight`` is its
    de-quantized copy (:mod:`genkit.models.quant_weight`), from which no draft is ever made."""
    return weight.weight if type(weight) is Gemv else weight


def _int8(weight: Any, pad: bool = False) -> Int4Linear | None:
    """An 8-bit block-kernel copy of a float32 ``(out, in)`` weight (a Gemv's or a tensor), or None
    when its shape does not fit the kernel or it is no tensor (a quantized layer); with ``pad`` (the
    draft's head), any number of rows (the layer pads its last panel of 16 with rows of zeros:
    :attr:`Int4Linear.panel_rows`)."""
    w = _dense(weight)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] % MIN_ROWS and not pad or w.shape[1] % GROUP:
        return None
    n, k = int(w.shape[0]), int(w.shape[1])
    with torch.no_grad():
        made = block_kernel.head_proxy(w.detach())  # genkit's column-major float32 weights: in C, 3.6x faster
        lin = (Int4Linear.from_blocks(made[0], k, n, 8, True, "self-draft") if made is not None
               else Int4Linear(k, n, _int8_symmetric(w.detach()), source="self-draft", kernel="blocks"))
    lin.activation_digits = DRAFT_DIGITS
    return lin


def _rescorable(head_weight: Any) -> bool:
    """Whether a draft's greedy steps can rescore their head's best blocks on this float32 LM head (a
    column-major :class:`~genkit.models.dense_kernel.Gemv`, the dense kernel's one-call route's)."""
    return (type(head_weight) is Gemv and head_weight.column_major and head_weight.fn is not None
            and head_weight.weight.dtype == torch.float32)


def draft_bytes(prepared: Any, head_weight: Any) -> int:
    """The memory the draft of ``prepared`` (:func:`build_draft`) takes, in bytes."""
    weights = [_dense(w) for p in prepared.layers for w in (p.wqkv, p.wo, p.wgu, p.wd)]
    head = _dense(head_weight)
    per = HEAD_BYTES_PER_WEIGHT if _rescorable(head_weight) else BYTES_PER_WEIGHT
    head_numel = head.numel() if isinstance(head, torch.Tensor) else 0  # (no float head: no draft, build_draft)
    return int(sum(w.numel() for w in weights if isinstance(w, torch.Tensor)) * BYTES_PER_WEIGHT + head_numel * per)


def _draft_head(head_weight: Any) -> tuple[Int4Linear | None, bool]:
    """The draft's LM head: 4-bit blocks where its steps can rescore (:func:`_rescorable`), else 8-bit;
    and whether it is the 4-bit one. A vocabulary that is not a multiple of 16 (GPT-2's 50,257) gets
    its last panel padded with rows of zeros, which its greedy steps never choose (``gk_ends.live``,
    set by the ends for every block head)."""
    w = _dense(head_weight)
    if not _rescorable(head_weight) or w.shape[1] % GROUP:
        return _int8(head_weight, pad=True), False
    with torch.no_grad():
        lin = Int4Linear(int(w.shape[1]), int(w.shape[0]), [_int4_symmetric(w.detach())], source="self-draft",
                         kernel="blocks")
    lin.activation_digits = DRAFT_DIGITS
    return lin, True


def build_draft(prepared: Any, embed: Any, norm: Any, head_weight: Any, positions: Any = None) -> SelfDraft | None:
    """The draft of ``prepared`` (a float32 model on the dense one-call decoder) with the model's
    embedding module ``embed``, final norm module ``norm`` (an RMSNorm; GPT-2's LayerNorm with
    ``positions``, its learned positions' embedding) and LM head weight, or None when a weight's shape
    or a module does not fit the block kernel."""
    layers = []
    for p in prepared.layers:
        weights = [_int8(w) for w in (p.wqkv, p.wo, p.wgu, p.wd)]
        if any(w is None for w in weights):
            return None
        layers.append(p._replace(wqkv=weights[0], wo=weights[1], wgu=weights[2], wd=weights[3]))
    head, rescored = _draft_head(head_weight)
    if head is None:
        return None
    # in huge pages, in the order a draft step reads them, as a quantized model's (before the decoder keeps pointers)
    weight_arena.place([w.blocks for p in layers for w in (p.wqkv, p.wo, p.wgu, p.wd)] + [head.blocks])
    decoder = BlockDecoder.build(layers)
    if decoder is None:
        return None
    for layer in decoder.table:
        layer.window, layer.sink = DRAFT_WINDOW, DRAFT_SINK
    extras = gpt2_extras(norm, positions, decoder.hidden)
    ends = None if extras is None else _ends(embed, norm.weight.detach(), float(norm.eps), False, head, decoder.hidden,
                                             None, extras)
    if ends is None:
        return None
    if rescored:  # (the model's head outlives the draft: the draft goes with the prepared weights)
        ends.rescore_w, ends.rescore_ld, ends.rescore = head_weight.weight.data_ptr(), head_weight.ld, RESCORE
        ends.gemv_cols = ctypes.cast(dense_kernel.library().gk_gemv_t_cols, ctypes.c_void_p).value
    return SelfDraft(decoder, ends, head)


def take_ahead(cache: KVCache, token: int, owner: int) -> int | None:
    """The greedy token after ``token`` at the cache's length when the model computed it ahead (and
    the cache now holds that position), else None (dropping what is ahead)."""
    ahead: Ahead | None = cache.ahead
    if ahead is None:
        return None
    pos = cache.lengths[0]
    if ahead.owner != owner or ahead.start != pos or not ahead.inputs or ahead.inputs[0] != token:
        cache.ahead = None
        return None
    out = ahead.outputs.pop(0)
    ahead.inputs.pop(0)
    ahead.start += 1
    cache.lengths[:] = [pos + 1] * len(cache.lengths)
    if not ahead.inputs:
        cache.ahead = None
    return out


def _room(cache: KVCache, need: int) -> bool:
    """Grow every layer's buffers to hold ``need`` positions (as a write of that many would); False
    when a layer is empty."""
    for i, k in enumerate(cache.keys):
        if k is None:
            return False
        if k.shape[2] < need:
            cache._grow(i, k[:, :, :1], need)
    return True


def _useful(cache: KVCache, pos: int) -> int:
    """The most drafts worth checking at position ``pos``: GAMMA_MAX, or fewer where the cache was
    sized for a generation (``capacity_hint``: its max_length) that ends sooner (a check yields at
    most one token more than its drafts; 0 for the last token, which a plain step gives)."""
    hint = cache.capacity_hint
    return GAMMA_MAX if hint <= pos + 1 else min(GAMMA_MAX, hint - pos - 2)


def _plain_step(pace: Pace, decoder: BlockDecoder, ends: Any, rope: Any, token: int, cache: KVCache) -> int | None:
    """A one-token greedy step of the model (:meth:`BlockDecoder.argmax`), timed for the pace."""
    cos, sin = rope(cache.lengths[0], 1)
    start = time.perf_counter()
    out = decoder.argmax(torch.tensor([[token]]), cos, sin, cache, ends)
    if out is None:
        return None
    pace.record_plain(time.perf_counter() - start)
    return int(out[0])


def speculate(draft: SelfDraft, decoder: BlockDecoder, ends: Any, rope: Any, token: int, cache: KVCache,
              always: bool = False) -> int | None:
    """One round: drafts after ``token`` (at the cache's length; as many as :meth:`Pace.best` says),
    checked by the model's ``decoder`` with ``ends``, or (unless ``always``) a one-token step where
    :meth:`Pace.plain` says it is faster; returns the greedy token after ``token``,
    leaves the cache one position longer and the kept drafts in ``cache.ahead``. ``rope(start, n)``:
    the model's cos/sin rows for positions ``start..start+n-1``. None, with the cache as it was, where
    a step declines."""
    pos, layers = cache.lengths[0], len(cache.lengths)
    useful = _useful(cache, pos)
    if not always and draft.pace.plain(useful):
        draft.stats.one_token += 1
        return _plain_step(draft.pace, decoder, ends, rope, token, cache)
    gamma = draft.pace.best(useful)
    if gamma < 1 or not _room(cache, pos + gamma + 1):
        return None
    draft.gamma = gamma
    cache.ahead = None
    tokens = [token]
    start = time.perf_counter()
    for i in range(gamma):
        cos, sin = rope(pos + i, 1)
        out = draft.decoder.argmax(torch.tensor([[tokens[-1]]]), cos, sin, cache, draft.ends)
        if out is None:
            break
        tokens.append(int(out[0]))
    cache.lengths[:] = [pos] * layers
    t = len(tokens)
    cos, sin = rope(pos, t)  # (None, None for a model without rotary positions)
    drafted = time.perf_counter()
    copy = draft.pace.head_copy(t)
    checked = decoder.verify(torch.tensor(tokens), cos, sin, cache, ends, head_copy=copy)
    if checked is None:  # (nothing written: the cache is at pos already)
        return None
    greedy = checked.tolist()
    kept = 0
    while kept < t - 1 and tokens[kept + 1] == greedy[kept]:
        kept += 1
    draft.pace.record(t - 1, drafted - start, t, time.perf_counter() - drafted, kept, copy)
    cache.lengths[:] = [pos + 1] * layers
    if kept:
        cache.ahead = Ahead(pos + 1, tokens[1:kept + 1], greedy[1:kept + 1], id(decoder))
    stats = draft.stats
    stats.checks, stats.drafted, stats.accepted = stats.checks + 1, stats.drafted + t - 1, stats.accepted + kept
    return int(greedy[0])
