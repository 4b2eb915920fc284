"""Two ways of decoding with one model, timed in one process round after round (alternating, so
that a machine whose speed drifts moves both alike): the loop the ``ab_*`` scripts share."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_kernel_choice import _decode  # generation time less a 1-token run's, as there

Decode = Callable[[Any, torch.Tensor, int], tuple[float, list[int]]]


def alternate(model: Any, ids: torch.Tensor, ways: tuple[str, str], switch: Callable[[Any, bool], None],
              threads: list[int], rounds: int, tokens: int, label: str, decode: Decode = _decode) -> None:
    """``decode`` (default: greedy, bench_kernel_choice's) of ``tokens`` new tokens per round,
    ``ways[0]`` with ``switch(model, False)`` then ``ways[1]`` with ``switch(model, True)``, for each
    thread count; prints the medians of ``rounds`` (round 0 warms up: faults the weights in, makes
    what a way builds on first use), their ratio and whether both gave the same tokens. Leaves
    ``switch(model, True)``."""
    for n in threads:
        torch.set_num_threads(n)
        rates: dict[str, list[float]] = {way: [] for way in ways}
        out: dict[str, list[int]] = {}
        for rnd in range(rounds + 1):
            for way in ways:
                switch(model, way == ways[1])
                ms, out[way] = decode(model, ids, tokens if rnd else 4)
                if rnd:
                    rates[way].append(1e3 / ms)
        switch(model, True)
        same = len({tuple(t) for t in out.values()}) == 1
        a, b = (statistics.median(rates[w]) for w in ways)
        print(f"{n} thread(s), {label}, medians of {rounds} (tok/s): {ways[0]} {a:.1f}  {ways[1]} {b:.1f} "
              f"({b / a:.3f}x); {'same tokens' if same else 'TOKENS DIFFER'}", flush=True)
