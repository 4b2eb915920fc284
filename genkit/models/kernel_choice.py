"""Which matrix-product kernel runs each shape class on this CPU: measured, not assumed.

genkit has more than one implementation of the same product, and which is fastest depends on the
CPU (the oneDNN-packed float32 weights that win 2x on one AVX-512 EPYC lose on an AMX Xeon):

- dense (float32, or bfloat16 when the model is bfloat16): ``"packed"`` (oneDNN-packed copies of
  the weights), ``"plain"`` (torch's linear on the column-major weights) or, for float32 where a C
  compiler built it, ``"gemv"`` (genkit's own matrix-vector kernel on the plain weights, both cores
  busy on one row: :mod:`genkit.models.dense_kernel`; products over more than 4 rows run plain);
- quantized (the block kernel): its vector path (``"vnni"`` on AVX-512 VNNI CPUs, ``"avx2"``) or,
  for products of several rows, ``"amx"`` where the CPU has AMX-INT8 and Linux grants it.

A choice never changes the model's dtype: a float32 model stays float32 (bfloat16 products are a
choice only for a bfloat16 model).

Products fall into three shape classes by their number of rows (tokens times sequences):
``"decode"`` (1 row), ``"small"`` (2-16: beams, small batches, continuous-batching decode steps)
and ``"prefill"`` (more). For each class a short timed probe on the model's own weights decides at
first use (one to two seconds on a 135M model, once per machine), by this rule:

- **the default stays unless beaten clearly**: each family has a default, the path genkit ran
  before the choice existed (dense: ``"packed"``; blocks: the vector path) and the first of the
  paths offered to :func:`choose`. The probe runs interleaved rounds (up to PROBE_ROUNDS, at
  least PROBE_MIN_ROUNDS, about PROBE_BUDGET_S seconds per class; the order alternates each
  round) after one warm-up call per path (oneDNN creates its primitive for each new shape on the
  first call), and another path replaces the default only when the median over rounds of its
  time divided by the default's time in the same round is below ``1 - MARGIN`` (at least 10 %
  faster; :func:`decide`). Paired, per-round ratios cancel a load that changes between rounds;
  the median ignores the rounds a preemption spoiled. The unit of work is the caller's runner:
  for dense models a whole step's products with the work the route does around them (each layer's
  RMSNorms, rope, MLP gate and residual adds, which the ``"gemv"`` path runs inside its kernel
  calls; then the LM head) for decode and small, two layers for prefill (:func:`genkit.models.llama_infer._dense_probe`);
- **a preferred path within the slack**: where the probe's unit leaves out work one path saves
  (:data:`PREFERRED`: dense decode on ``"gemv"`` runs each step in one kernel call, embedding to
  LM head, a greedy step reads the head's 8-bit copy, and greedy search speculates exactly, drafting
  with an 8-bit copy of the model and checking up to 16 tokens in one step: 1.5-1.75x on a Zen 5,
  genkit/models/self_speculation.py; the unit times each layer's products alone), that path wins
  when it is no slower than the default and its ratio is within PREFER_SLACK (0.15) of the fastest
  path's. On the Xeon host of session 13 the 124M model's 2-thread probe gave ``plain`` 0.87-0.88
  and ``gemv`` 0.88 of ``packed``, and the decode that followed ran 12 % faster on ``gemv``;
- **never measured on a busy machine**: when the 1-minute load average plus this process's
  threads is above the CPUs available (:func:`genkit.threads.busy`), no probe runs: the class
  gets the default for this process only, nothing is cached, and the next process probes again
  (the reason says ``not cached: machine busy``). Timings taken under load are wrong by up to
  10x (a saturated 2-core machine once measured packed 250 ms vs plain 22 ms for a unit that
  runs faster packed when the machine is quiet);
- **no draws from the global RNG**: the probe's inputs come from a private ``torch.Generator``, so a probe
  in the middle of a seeded run leaves the sampling stream as it was (a first, probing run gives
  the same tokens as a later, cached one).

A quiet probe's result is cached in ``$GENKIT_HOME/kernels/choice-<key>.json``, one file per CPU
model and flags, torch version, genkit version, probe rule (PROBE_VERSION: choices made by an
older rule are not read) and the C kernels' code (a changed kernel is probed anew), written
atomically with its sha256 recorded beside it and checked before it is read
(:func:`genkit.models.kernel_cache.store` / :func:`~genkit.models.kernel_cache.read_checked`: a
tampered file is refused with a warning and the probe runs again).

``GENKIT_KERNEL`` overrides the choice: a comma-separated list of ``PATH`` (every class) or
``CLASS:PATH`` items, e.g. ``GENKIT_KERNEL=plain`` or ``GENKIT_KERNEL=decode:plain,prefill:packed``;
a path this CPU does not have is an error. ``genkit info`` prints what was chosen and why (the
cached choices and this process's, with the probe's timings or ``not cached: machine busy``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import kernel_cache
from .cpu import cache_key, cpu_info

logger = logging.getLogger("genkit.models")

ENV = "GENKIT_KERNEL"
CLASSES = ("decode", "small", "prefill")
PROBE_ROWS = {"decode": 1, "small": 4, "prefill": 64}
SMALL_MAX_ROWS = 16
PROBE_MIN_ROWS = {"decode": 1, "small": 2, "prefill": SMALL_MAX_ROWS + 1}  # the fewest rows of each class
FAMILIES = {"dense": ("packed", "plain", "gemv"), "blocks": ("amx", "vnni", "avx2")}
PROBE_ROUNDS = 9  # interleaved rounds per class at most ...
PROBE_MIN_ROUNDS = 3  # ... and at least, however long they take
PROBE_BUDGET_S = 1.0  # per class: no round starts after this many seconds once PROBE_MIN_ROUNDS are done
MARGIN = 0.10  # another path replaces the default only when at least this much faster (median paired ratio)
# (family, class) -> a path taken over a faster one that beats the default too, when within PREFER_SLACK
# of it: work of that path's steps that the probe's unit does not time (decode on gemv runs in one call)
PREFERRED = {("dense", "decode"): "gemv"}
# A path that runs only products of at least this many rows (fewer run the family's default path): the block
# kernel's AMX tiles (block_kernel.gk_matmul). A class probed with fewer rows is not offered it: its probe would
# time the vector path twice and choose by noise (a "small: amx" choice, session 31's cache on the Xeon guest,
# then moved the AMX threshold from 32 rows to 16)
PATH_MIN_ROWS = {"amx": 16}
PREFER_SLACK = 0.15
PROBE_VERSION = 8  # part of the cache key: choices probed by an older rule (version 1: best of 3, no margin,
# taken under any load; version 2: without the gemv path; version 3: the products alone, before the
# gemv kernel streamed at one core's read speed and took the norms, gate and residuals in; version 4:
# no preferred path; version 5: the preferred path within 0.05 and beating the default by the margin,
# before greedy steps speculated; version 6: AMX probed for the decode and small classes too, where it never
# runs; version 7: one block-kernel choice for every activation rounding) are never read

Runner = Callable[[str, int], None]
"""``run(path, rows)``: one timed unit of work on ``path`` with ``rows`` rows."""


def shape_class(rows: int) -> str:
    """The shape class of a product over ``rows`` rows."""
    return "decode" if rows <= 1 else ("small" if rows <= SMALL_MAX_ROWS else "prefill")


@dataclass
class Choice:
    """The path per shape class, and why (``"probe: ..."``, ``"cached: ..."``, ``"GENKIT_KERNEL"``,
    ``"the only path here"``)."""

    family: str
    signature: str
    paths: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def path(self, rows: int) -> str:
        return self.paths[shape_class(rows)]


CHOSEN: dict[tuple[str, str], Choice] = {}  # this process's choices, for `genkit info`


def parse_override(text: str | None = None) -> dict[str, str]:
    """``GENKIT_KERNEL`` as ``{class: path}`` (see the module docstring); ConfigError when malformed."""
    text = os.environ.get(ENV, "") if text is None else text
    known = sorted({p for paths in FAMILIES.values() for p in paths})
    out: dict[str, str] = {}
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        cls, _, path = item.rpartition(":")
        classes = [cls] if cls else list(CLASSES)
        if cls and cls not in CLASSES or path not in known:
            raise ConfigError(f"{ENV} items are PATH or CLASS:PATH with CLASS one of {', '.join(CLASSES)} and PATH one "
                              f"of {', '.join(known)}; got {item!r}")
        for c in classes:
            out[c] = path
    return out


KERNEL_SOURCES = ("block_kernel.c", "dense_kernel.c")  # the C paths' code: a change in either is probed anew


@functools.cache
def _kernels_digest() -> str:
    """A digest of the C kernels' sources ("-" for one that is missing), so that choices measured on
    an earlier version of a path are not read for a new one; read once per process."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        try:
            digest.update(Path(__file__).with_name(name).read_bytes())
        except OSError:
            digest.update(b"-")
    return digest.hexdigest()[:16]


def cache_path() -> Path:
    """The cache file of this CPU model and flags, torch version, genkit version and C kernels' code."""
    import torch

    from .. import __version__
    from .demo import genkit_home

    text = f"{cache_key()}\0{torch.__version__}\0{__version__}\0probe-v{PROBE_VERSION}\0{_kernels_digest()}"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Path(genkit_home()) / "kernels" / f"choice-{key}.json"


def cached_entries() -> dict[str, dict[str, str]]:
    """The verified cache file's entries (``{entry key: {"path", "reason"}}``); {} when it is
    missing or refused."""
    path = cache_path()
    data = kernel_cache.read_checked(path.parent, path.name)
    if data is None:
        return {}
    try:
        entries = json.loads(data.decode("utf-8"))["entries"]
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("the kernel choice cache %s is not used: %s", path, exc)
        return {}
    return entries if isinstance(entries, dict) else {}


def _store(new: dict[str, dict[str, str]]) -> None:
    path = cache_path()
    entries = {**cached_entries(), **new}
    payload = json.dumps({"cpu": cpu_info().name, "entries": entries}, indent=1, sort_keys=True)
    try:
        kernel_cache.store(path.parent, path.name, lambda out: out.write_text(payload, encoding="utf-8"))
    except OSError as exc:
        logger.warning("could not write the kernel choice cache %s: %s", path, exc)


def _probe(paths: tuple[str, ...], run: Runner, rows: int, prefer: str | None = None) -> tuple[str, str]:
    """The path for ``rows`` rows among ``paths`` (``paths[0]``: the default), by the module
    docstring's rule (``prefer``: see :func:`decide`), and the timings that decided it."""
    for p in paths:  # warm-up: first calls create oneDNN primitives, allocate and fault pages in
        run(p, rows)
    times: dict[str, list[float]] = {p: [] for p in paths}
    start = time.perf_counter()
    for r in range(PROBE_ROUNDS):
        for p in paths if r % 2 == 0 else paths[::-1]:
            t = time.perf_counter()
            run(p, rows)
            times[p].append(time.perf_counter() - t)
        if r + 1 >= PROBE_MIN_ROUNDS and time.perf_counter() - start > PROBE_BUDGET_S:
            break
    winner, why = decide(times, prefer)
    return winner, f"probe at {rows} rows, {why}"


def decide(times: dict[str, list[float]], prefer: str | None = None) -> tuple[str, str]:
    """The path that ``times`` (seconds per round, each path's round ``i`` taken next to the
    others'; the first key is the default) elect by the module docstring's rule, and why. A
    ``prefer`` path no slower than the default wins when within PREFER_SLACK of the fastest path's
    ratio (:data:`PREFERRED`: the probe leaves out work of its steps)."""
    default, *others = times
    ratio = {p: statistics.median(t / d for t, d in zip(times[p], times[default])) for p in others}
    best = min(ratio, key=lambda p: ratio[p])
    winner = best if ratio[best] < 1 - MARGIN else default
    timings = ", ".join(f"{p} {statistics.median(times[p]) * 1e3:.2f} ms" for p in times)
    why = (f"median of {len(times[default])} rounds: {timings}; {best}/{default} {ratio[best]:.2f} "
           f"(below {1 - MARGIN:.2f} replaces the default)")
    if prefer in ratio and prefer != winner and ratio[prefer] <= 1.0 and ratio[prefer] <= ratio[best] + PREFER_SLACK:
        return prefer, f"{why}; {prefer} ({ratio[prefer]:.2f}) preferred within {PREFER_SLACK:.2f} of it"
    return winner, why


def choose(family: str, signature: str, available: tuple[str, ...], run: Runner) -> Choice:
    """The path per shape class for ``family`` (``"dense"`` or ``"blocks"``) among ``available`` on
    this CPU (``available[0]``: the family's default), for weights described by ``signature``:
    ``GENKIT_KERNEL`` first, then the cache, then a probe (cached), or the default for this process
    when the machine is busy (not cached)."""
    import torch

    from ..threads import busy

    override = {c: p for c, p in parse_override().items() if p in FAMILIES[family]}
    for cls, path in override.items():
        if path not in available:
            raise ConfigError(f"{ENV} asks for {path!r} ({cls}), which this CPU or build does not have; available "
                              f"here: {', '.join(available)}")
    choice = Choice(family, signature)
    entries = cached_entries() if len(available) > 1 else {}
    threads = torch.get_num_threads()
    fresh: dict[str, dict[str, str]] = {}
    why_busy: str | None = None
    for cls in CLASSES:
        key = f"{family}|{signature}|threads={threads}|{cls}"
        here = tuple(p for p in available if PROBE_ROWS[cls] >= PATH_MIN_ROWS.get(p, 1))
        if cls in override:
            choice.paths[cls], choice.reasons[cls] = override[cls], f"{ENV}={os.environ.get(ENV, '')}"
        elif len(here) == 1:
            choice.paths[cls], choice.reasons[cls] = here[0], _only_path(available, here[0])
        elif entries.get(key, {}).get("path") in here:
            choice.paths[cls], choice.reasons[cls] = entries[key]["path"], "cached " + entries[key].get("reason", "")
        elif why_busy or (why_busy := busy(threads)):
            choice.paths[cls] = available[0]
            choice.reasons[cls] = f"the default, not probed, not cached: machine busy ({why_busy}); probed next time"
        else:
            path, why = _probe(here, run, PROBE_ROWS[cls], PREFERRED.get((family, cls)))
            choice.paths[cls], choice.reasons[cls] = path, why
            fresh[key] = {"path": path, "reason": why}
    if fresh:
        _store(fresh)
    for cls in CLASSES:
        logger.info("kernel for %s %s products: %s (%s)", family, cls, choice.paths[cls], choice.reasons[cls])
    CHOSEN[(family, signature)] = choice
    return choice


def _only_path(available: tuple[str, ...], path: str) -> str:
    """The reason a class runs ``path`` without a probe: the only path here, or the others run only
    larger products (:data:`PATH_MIN_ROWS`)."""
    others = [p for p in available if p != path]
    if not others:
        return "the only path here"
    return "the only path here for this class (" + ", ".join(f"{p} runs products of {PATH_MIN_ROWS[p]}+ rows only"
                                                             for p in others) + ")"


def describe() -> list[str]:
    """Lines for ``genkit info``: the override, the cache file and every choice it holds."""
    import torch

    from ..threads import busy

    path = cache_path()
    why_busy = busy(torch.get_num_threads())
    lines = [f"{ENV}={os.environ.get(ENV, '') or '(not set: probe on a quiet machine, then cache)'}",
             "machine now: " + (f"busy ({why_busy}): a first run keeps the defaults and caches nothing" if why_busy
                                else "quiet: a first run probes and caches its choice"),
             f"choice cache: {path}"]
    entries = cached_entries()
    if not entries:
        lines.append("  (no choices cached yet: they are made when a model first runs)")
    for key in sorted(entries):
        family, signature, threads, cls = key.split("|")
        lines.append(f"  {family} {cls:<8} {threads:<10} {entries[key].get('path')!s:<7} "
                     f"[{signature}] {entries[key].get('reason', '')}")
    for (family, signature), choice in CHOSEN.items():
        for cls in CLASSES:
            lines.append(f"  this process: {family} {cls:<8} {choice.paths[cls]:<7} [{signature}] {choice.reasons[cls]}")
    return lines


def dense_signature(weights: list[Any]) -> str:
    """What a dense probe depends on: dtype and the distinct matrix shapes with their counts."""
    shapes: dict[tuple[int, ...], int] = {}
    for w in weights:
        shapes[tuple(w.shape)] = shapes.get(tuple(w.shape), 0) + 1
    dtype = str(weights[0].dtype).replace("torch.", "") if weights else "none"
    return dtype + ";" + ";".join(f"{n}x{'x'.join(map(str, s))}" for s, n in sorted(shapes.items()))
