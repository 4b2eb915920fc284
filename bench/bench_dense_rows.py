"""The dense kernel's column-major product over M rows, weights streamed from memory.

A speculative step's check (genkit/models/self_speculation.py) runs its tokens as rows of one
product; this times ``gk_gemv_t`` for M = 1, 2, 4, 8, 16 rows on SmolLM2's gate/up, down, q/k/v and LM head shapes, one
call after another over enough copies of the weight (~400 MB) that each call reads it from memory,
as a decode step does. Prints ms per product and the ratio to one row.

Run: ``python bench/bench_dense_rows.py --threads 1``.
"""

from __future__ import annotations

import argparse
import time

import torch

from genkit.models import dense_kernel
from genkit.models.cpu import describe

SHAPES = ((3072, 576), (576, 1536), (960, 576), (49152, 576))  # (N, K): SmolLM2's fused gate/up, down, q/k/v, head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(describe(), flush=True)
    lib = dense_kernel.library()
    for n, k in SHAPES:
        copies = [torch.randn(k, n).t() for _ in range(max(1, 400_000_000 // (4 * n * k)))]  # column-major
        times = {}
        for m in (1, 2, 4, 8, 16):
            x, y = torch.randn(m, k), torch.empty(m, n)
            lib.gk_gemv_t(x.data_ptr(), k, copies[0].data_ptr(), n, y.data_ptr(), m, n, k, args.threads)  # (scratch)
            start = time.perf_counter()
            for _ in range(args.rounds):
                for w in copies:
                    lib.gk_gemv_t(x.data_ptr(), k, w.data_ptr(), n, y.data_ptr(), m, n, k, args.threads)
            times[m] = (time.perf_counter() - start) / args.rounds / len(copies) * 1e3
        print(f"N={n} K={k}, {args.threads} thread(s), ms per product: "
              + ", ".join(f"M={m} {t:.3f} ({t / times[1]:.2f}x)" for m, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
