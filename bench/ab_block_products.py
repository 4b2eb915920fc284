"""Two versions of the block kernel's C source, their products timed against each other call by call.

Each source is built as ``bench/ab_block_kernel.py`` builds it (genkit's flags for ``--mode``: ``native``,
``avx2``, ``avx-vnni`` or ``portable``; the verified kernel cache), then for each product shape (bits, N
outputs, K inputs; random codes and scales) and each row count M, the builds multiply the same
activations in turn, ``--rounds`` times (alternating call by call, so that a machine whose speed drifts,
or another job on it, moves both alike). Prints the median time of each, the speed-up, the new build's
GMAC/s and whether both gave equal products (bit for bit).

Run: ``git show HEAD:genkit/models/block_kernel.c > /tmp/block_kernel_before.c; python
bench/ab_block_products.py old=/tmp/block_kernel_before.c new=genkit/models/block_kernel.c --mode avx2
--threads 1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from genkit.models import block_kernel as bk
from genkit.models.cpu import describe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_block_kernel import build, use  # noqa: E402

SHAPES = "8:49152:576,8:1536:576,6:1536:576,4:1536:576,4:576:1536"  # the demo model's LM head, gate/up, down


def _weights(bits: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    group = 16 if bits == 6 else 32
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) / 50
    minimum = -32 * scale if bits == 6 else -torch.rand(n, k // group, generator=g) / 10
    return bk.pack(codes, scale, minimum, bits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs=2, help="label=path of a block_kernel.c version (old, then new)")
    ap.add_argument("--mode", default="native", help="genkit's build mode: native, avx2, avx-vnni or portable")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default=SHAPES, help="bits:N:K,... (default: %(default)s)")
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--act", type=int, default=bk.ACT_TWO, help="activation rounding (block_kernel.ACT_*)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe())
    libs = {label: build(label, path, args.mode) for label, path in (s.split("=", 1) for s in args.sources)}
    (old, new) = libs
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        bits, n, k = map(int, shape.split(":"))
        packed = _weights(bits, n, k, g)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            times: dict[str, list[float]] = {label: [] for label in libs}
            out: dict[str, torch.Tensor] = {}
            for _ in range(args.rounds):
                for label, lib in libs.items():
                    use(lib, None)
                    t = time.perf_counter()
                    out[label] = bk.matmul(x, packed, bits, n, args.act)
                    times[label].append(time.perf_counter() - t)
            t_old, t_new = statistics.median(times[old]), statistics.median(times[new])
            print(f"{bits}-bit {n} x {k}, {m:3d} rows, {args.threads} thread(s), {args.mode}: {old} {t_old * 1e3:8.3f} ms, "
                  f"{new} {t_new * 1e3:8.3f} ms ({t_old / t_new:.2f}x; {m * n * k / t_new / 1e9:.1f} GMAC/s); "
                  f"equal products: {torch.equal(out[old], out[new])}", flush=True)


if __name__ == "__main__":
    main()
