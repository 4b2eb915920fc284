"""The block kernel's attention alone, two (or more) versions of its C source side by side: time per call
and whether every version gives the same bits.

Each source is compiled into a small program (this file's harness, ``#include``-ing the source; genkit's
flags for ``--mode``) that fills a K/V cache and queries with fixed pseudo-random floats and calls the
kernel's ``attend`` (what a decode step runs for each layer) over and over: one row after ``context``
positions, or ``rows`` rows sharing one cache row as a self-speculative check does; the cache either
the KVCache's layout or paged blocks of 16 in reverse order (each key and value set by its layer, head,
position and element, so that versions with different cache layouts read the same numbers); ``hot`` (one layer's cache, read again
and again) or ``cold`` (30 layers' caches in turn, as a step reads them). The versions run
alternately, round after round; the medians and the ratio against the first version are printed, and
a hash of each version's output bits.

Run: ``git show HEAD:genkit/models/block_kernel.c > /tmp/before.c; python bench/ab_attention.py
old=/tmp/before.c new=genkit/models/block_kernel.c [--threads 1,2] [--mode native|avx2]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from genkit.models import block_kernel
from genkit.models.cpu import describe

HARNESS = r"""
#include SOURCE
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static float next(unsigned *s) { *s = *s * 1664525u + 1013904223u; return (float)(*s >> 8) / 8388608.0f - 1.0f; }
/* The K/V cache's values are set by position (kv_at), so versions whose cache layouts differ read the same
 * values and give the same bits when they compute the same */
int main(int argc, char **argv) {
    if (argc != 10) return 2;
    const int nq = atoi(argv[1]), nkv = atoi(argv[2]), d = atoi(argv[3]), context = atoi(argv[4]);
    const int rows = atoi(argv[5]), calls = atoi(argv[6]), threads = atoi(argv[7]), layers = atoi(argv[8]);
    const int block = atoi(argv[9]);
    gk_layer L;
    memset(&L, 0, sizeof L);
    L.num_heads = nq; L.num_kv_heads = nkv; L.head_dim = d;
    int cap = context + rows, width = (cap + (block > 0 ? block : 1) - 1) / (block > 0 ? block : 1);
    gk_kv kv = {cap, NULL, 0, 0, rows};
    int32_t *table = NULL;
    if (block > 0) {  /* paged: each row's blocks in reverse order */
        cap = width * block;
        table = malloc(sizeof(int32_t) * (size_t)width * rows);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < width; b++) table[r * width + b] = width - 1 - b;
        kv.capacity = 0; kv.table = table; kv.width = width; kv.block_size = block; kv.seq = 1;
    }
    const size_t n = (size_t)nkv * cap * d;
    unsigned s = 1;
    float *k = calloc(n * layers, sizeof(float)), *v = calloc(n * layers, sizeof(float));
    for (int l = 0; l < layers; l++)  /* each (layer, head, position, element) its own value, wherever the layout puts it */
        for (int j = 0; j < nkv; j++)
            for (int t = 0; t < context + rows; t++)
                for (int e = 0; e < d; e++) {
                    unsigned h = (unsigned)(((l * 131 + j) * 1000003 + t) * 613 + e) * 2654435761u;
                    const size_t at = n * l + kv_at(&kv, 0, j, t, nkv, d) + e;
                    k[at] = next(&h);
                    v[at] = next(&h);
                }
    const int nqkv = (nq + 2 * nkv) * d;
    float *qkv = malloc(sizeof(float) * (size_t)rows * nqkv), *scores = malloc(sizeof(float) * (size_t)rows * nq * cap);
    float *att = malloc(sizeof(float) * (size_t)rows * nq * d);
    for (int i = 0; i < rows * nqkv; i++) qkv[i] = 2.0f * next(&s);
    int32_t pos[64];
    for (int r = 0; r < rows; r++) pos[r] = context - 1 + r;
    attend(&L, qkv, rows, pos, k, v, &kv, scores, cap, att, threads);
    unsigned hash = 2166136261u;
    for (int i = 0; i < rows * nq * d; i++) { unsigned u; memcpy(&u, att + i, 4); hash = (hash ^ u) * 16777619u; }
    double t = now();
    for (int c = 0; c < calls; c++)
        attend(&L, qkv, rows, pos, k + n * (c % layers), v + n * (c % layers), &kv, scores, cap, att, threads);
    printf("%.3f %08x\n", (now() - t) / calls * 1e6, hash);
    return 0;
}
"""

CASES = [  # label, (query heads, K/V heads, head dim), context, rows, layers, paged block
    ("SmolLM2 1 row, 3000 positions, hot", (9, 3, 64), 3000, 1, 1, 0),
    ("SmolLM2 1 row, 3000 positions, cold", (9, 3, 64), 3000, 1, 30, 0),
    ("SmolLM2 check of 5 rows, 3000, cold", (9, 3, 64), 3000, 5, 30, 0),
    ("SmolLM2 1 row, 200 positions, hot", (9, 3, 64), 200, 1, 1, 0),
    ("SmolLM2 1 row, 3000, paged 16, cold", (9, 3, 64), 3000, 1, 30, 16),
    ("124M Llama 1 row, 3000, cold", (12, 12, 64), 3000, 1, 30, 0),
    ("8 heads of 128 on 2 K/V heads, 2000, hot", (8, 2, 128), 2000, 1, 1, 0),
]


def build(label: str, source: str, mode: str, folder: Path) -> Path:
    """The harness over ``source``, built with genkit's flags for ``mode``."""
    cc = block_kernel._compiler()
    if cc is None:
        raise SystemExit("no C compiler found")
    harness = folder / "harness.c"
    harness.write_text(HARNESS)
    exe = folder / f"attend_{label}"
    flags = [f for f in block_kernel._flags(mode) if f not in ("-fPIC", "-shared")]
    subprocess.run([cc, *flags, f'-DSOURCE="{Path(source).resolve()}"', str(harness), "-o", str(exe), "-lm"],
                   check=True)
    return exe


def run(exe: Path, case: tuple, threads: int) -> tuple[float, str]:
    _, (nq, nkv, d), context, rows, layers, block = case
    calls = max(20, 3_000_000 // (context * rows * nq))
    out = subprocess.run([str(exe), *map(str, (nq, nkv, d, context, rows, calls, threads, layers, block))],
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="label=path of a block_kernel.c version (two or more)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", default="native", help="genkit's build mode: native (this CPU) or avx2")
    args = ap.parse_args()
    print(describe(), flush=True)
    pairs = [s.split("=", 1) for s in args.sources]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        raise SystemExit("give two or more sources as label=path")
    with tempfile.TemporaryDirectory() as tmp:
        exes = {label: build(label, path, args.mode, Path(tmp)) for label, path in pairs}
        for threads in [int(t) for t in args.threads.split(",")]:
            for case in CASES:
                times: dict[str, list[float]] = {label: [] for label in exes}
                bits: dict[str, str] = {}
                for _ in range(args.rounds):
                    for label, exe in exes.items():
                        us, bits[label] = run(exe, case, threads)
                        times[label].append(us)
                med = {label: statistics.median(t) for label, t in times.items()}
                first = next(iter(med.values()))
                cells = "  ".join(f"{label} {m:.1f} us ({first / m:.2f}x)" for label, m in med.items())
                same = "same bits" if len(set(bits.values())) == 1 else f"BITS DIFFER {bits}"
                print(f"{threads} thread(s), {args.mode}, {case[0]}: {cells}; {same}", flush=True)


if __name__ == "__main__":
    main()
