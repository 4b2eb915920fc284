"""Two (or more) versions of the block kernel's C source, timed against each other in one process.

Each source is built and loaded as genkit loads its kernel (its flags for this CPU, the verified
kernel cache under ``$GENKIT_HOME``, so an unchanged source is not built again); the demo model
(SmolLM2-135M-Instruct Q4_1, or with ``--float32`` its float32 conversion on the one-call dense
decoder, the ``gemv`` route, one token per step unless ``--self-speculation``) then decodes after a
prompt of ``--context`` random ids with each build in turn, round after round (builds alternating,
so that a machine whose speed drifts moves all of them alike), timing the decode steps alone (no
prefill), and the median tokens/s per build is printed with
whether every build gave the same greedy tokens. A kernel change is kept or dropped on such an A/B,
not on two runs minutes apart: on the shared machines this project meets, speed moves 20-30 % from
one minute to the next.

Attention's cost grows with the context: ``--context 3000`` times steps after 3000 prompt positions.
``--requests N`` (N > 1) times continuous batching instead: ``generate_batch`` of N such prompts (each
its own random ids), every step a row per request (the block kernel's multi-row products), tokens/s
counted over the whole batch, prefill included.

Run: ``python bench/ab_block_kernel.py old=/tmp/block_kernel_before.c new=genkit/models/block_kernel.c
--threads 2,1 --rounds 7 --tokens 128`` (``git show HEAD:genkit/models/block_kernel.c >
/tmp/block_kernel_before.c`` gives the committed version).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import genkit
from genkit.models import block_kernel
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, genkit_home


class _Clock:
    """A streamer that notes when each put arrives (the prompt's first, then each step's tokens)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.tokens += value.reshape(-1).tolist()

    def end(self) -> None:
        pass


def _decode(model: Any, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    """ms per token of the decode steps alone (from the first new token to the last: no prefill), and the
    tokens."""
    clock = _Clock()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new + 1, do_sample=False, eos_token_id=None, pad_token_id=0,
                       streamer=clock)
    return (clock.times[-1] - clock.times[1]) / (len(clock.tokens) - 1) * 1e3, clock.tokens


def _batch(model: Any, prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
    """ms per generated token of ``generate_batch`` over ``prompts`` (``new`` greedy tokens each, no EOS),
    and all the tokens, request after request."""
    start = time.perf_counter()
    out = model.generate_batch(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    seconds = time.perf_counter() - start
    tokens = [t for rid in sorted(out) for t in out[rid].generated_tokens]
    return seconds / (new * len(prompts)) * 1e3, tokens


def build(label: str, source: str, mode: str) -> Any:
    """``source`` built and loaded as genkit loads its own kernel (:func:`block_kernel.build_cached`:
    genkit's flags for ``mode``, the verified kernel cache, AMX tiles granted in native mode)."""
    cc = block_kernel._compiler()
    if cc is None:
        raise SystemExit("no C compiler found: the block kernel cannot be built here")
    lib = block_kernel.build_cached(cc, mode, Path(source), stem=f"genkit_blocks_ab_{label}")
    block_kernel.declare(lib)
    if mode == "native":
        lib.gk_amx_init()  # as block_kernel.library() does: multi-row products may then take the AMX path
    return lib


def use(lib: Any, model: Any) -> None:
    """Make ``lib`` the block kernel every later product and decode step calls. Each call passes the
    AMX threshold the kernel choice gave ``model``'s weights; a build from before session 33 keeps one
    of its own instead (``gk_set_amx_rows``), set here to the model's (never told, it would run every
    product on the vector path)."""
    block_kernel._lib, block_kernel._tried = lib, True
    if hasattr(lib, "gk_set_amx_rows"):
        prepared = getattr(model, "_prepared", None)  # (None before the first step: the warm-up round's first)
        lib.gk_set_amx_rows(prepared[1].layers[0].wgu.amx_rows if prepared and prepared[1].choice else 0)


def ab_round(model: Any, ids: torch.Tensor, libs: dict[str, Any], new: int, rates: dict[str, list[float]],
             tokens: dict[str, list[int]]) -> None:
    """One round: each build decodes ``new`` tokens in turn (``ids`` one prompt ``(1, T)``: ``generate``;
    more rows: ``generate_batch`` over them); its tokens/s and tokens are recorded."""
    for label, lib in libs.items():
        use(lib, model)
        ms, tokens[label] = _decode(model, ids, new) if ids.shape[0] == 1 else _batch(model, ids.tolist(), new)
        rates[label].append(1e3 / ms)


def _model(float32: bool, speculate: bool) -> Any:
    """The demo GGUF (Q4_1), or its float32 conversion on the dense one-call decoder."""
    if not float32:
        return genkit.load_model(demo_gguf_path(f"{genkit_home()}/bench-gguf"))
    from genkit.models import kernel_choice
    from genkit.models.demo import ensure_demo_model

    os.environ[kernel_choice.ENV] = "gemv"  # the one-call dense decoder, whose steps the block kernel runs
    model = genkit.load_model(ensure_demo_model())
    model.self_speculation = None if speculate else False
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="label=path of a block_kernel.c version (two or more)")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mode", default="native", help="genkit's build mode: native (this CPU) or avx2")
    ap.add_argument("--context", type=int, default=12, help="prompt length (random ids)")
    ap.add_argument("--float32", action="store_true", help="the demo model's float32 conversion (gemv route)")
    ap.add_argument("--self-speculation", action="store_true",
                    help="with --float32: model.self_speculation = None (genkit's default) instead of False")
    ap.add_argument("--requests", type=int, default=1, help="N > 1: continuous batching over N prompts")
    args = ap.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    pairs = [s.split("=", 1) for s in args.sources]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        raise SystemExit("give two or more sources as label=path")
    libs = {label: build(label, path, args.mode) for label, path in pairs}
    model = _model(args.float32, args.self_speculation)
    ids = torch.randint(3, 40000, (max(1, args.requests), args.context), generator=torch.Generator().manual_seed(1))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        rates: dict[str, list[float]] = {label: [] for label in libs}
        tokens: dict[str, list[int]] = {}
        ab_round(model, ids, libs, 4, {label: [] for label in libs}, {})  # warm-up: faults the weights in
        for _ in range(args.rounds):
            ab_round(model, ids, libs, args.tokens, rates, tokens)
        same = len({tuple(t) for t in tokens.values()}) == 1
        cells = "  ".join(f"{label} {statistics.median(r):.1f}" for label, r in rates.items())
        print(f"{threads} thread(s), {args.mode}, {args.requests} request(s), context {args.context}, medians of {args.rounds} (tok/s): "
              f"{cells}; {'same tokens' if same else 'TOKENS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
