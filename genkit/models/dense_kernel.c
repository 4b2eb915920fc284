/* genkit's float32 matrix-vector product for batch-1 (and few-row) decode: y (M, N) = x (M, K) @ W^T
 * on the weight as torch stores it, no copy, no repacking (see genkit/models/dense_kernel.py).
 *
 * A decode step's products read every weight once per token: they are bound by memory bandwidth, and
 * torch's linear over one row runs on one thread. Here OpenMP shares each product among `threads`,
 * the vector code is written with GCC vector extensions (16 floats: one AVX-512 register, two AVX2
 * ones, four SSE ones; -march=native picks), and each weight vector loaded is used for every row of x
 * (at most a few) before the next is read. gk_gemv_pre adds a decoder layer's work around the
 * product in the same call (RMSNorm or the MLP's gate before it, the residual after it).
 *
 * Two layouts of W (N, K):
 * - column-major (stride (1, ldw): genkit's CPU layout, genkit/models/llama_infer.py:lay_out): W^T is
 *   K rows of N floats, read front to back. The K rows are split among the threads; each adds its
 *   rows into its own partial y (the first thread's is y itself, the others' a per-calling-thread
 *   scratch buffer), up to 16 rows of x from four long streams of rows at once (a row's bits the
 *   same whatever rows are beside it: rows_pass), more rows RT (8) consecutive rows at a time; the
 *   partials are summed at the end;
 * - row-major (stride (ldw, 1): nn.Linear's own): the N rows are split among the threads; four
 *   rows at a time, each a dot product with every row of x.
 */
#pragma GCC optimize("fp-contract=fast") /* fused multiply-adds: -std=c11 turns contraction off */
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#define VW 16      /* floats per vector */
#ifndef PF
#define PF 128     /* the row-major product's prefetch distance, floats ahead in each stream */
#endif
#ifndef PFH
#define PFH 3      /* prefetcht0 */
#endif
#ifndef RT
#define RT 8       /* rows of W^T per pass of the column-major product */
#endif
#ifndef RS
#define RS 4       /* weight streams of the one-row column-major product (part_t_row) */
#endif
#ifndef PFT
#define PFT 0      /* its prefetch distance in floats (0: none; the hardware's prefetchers suffice) */
#endif
#ifndef EXACT_ROWS
#define EXACT_ROWS 16 /* up to this many rows, each row's product is the same bits as alone (part_t_rows) */
#endif
/* part_t_rows' vectors (PW floats: one register of the build's widest) and steps of the RS streams per
 * pass (RR; AVX2's 16 registers cannot hold all RR * RS weight vectors, but the ones reloaded come from
 * L1: RR 4 was still the fastest there) */
#ifdef __AVX512F__
#define PW 16
#else
#define PW 8
#endif
#ifndef RR
#define RR 4
#endif
#ifndef PF_NARROW
#define PF_NARROW 1024 /* rows_pass over 2+ rows of W^T at most this wide asks for the next pass's weights */
#endif
#define MIN_WORK 65536  /* products below this many weights run on one thread */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float pv __attribute__((vector_size(PW * 4), aligned(4)));

#define ld16(p) (*(const v16 *)(p))

static __thread float *scratch_buf;
static __thread size_t scratch_n;

/* A scratch buffer of n floats owned by the calling thread (kept for its next call); NULL on failure. */
static float *scratch(size_t n) {
    if (n > scratch_n) {
        free(scratch_buf);
        scratch_buf = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        scratch_n = scratch_buf != NULL ? n : 0;
    }
    return scratch_buf;
}

/* p (M, N) = x[:, k0:k1] @ Wt[k0:k1, :] for M <= EXACT_ROWS rows of x, Wt row k at w + k * ldw: RS
 * weight streams at once, stream u reading rows k0 + u * span ... k0 + (u + 1) * span - 1 front to
 * back, each vector of p loaded once per pass of rr steps, the rr steps' RS weight vectors added into
 * it (r, then the streams u), stored once; each weight vector loaded once for all M rows. Each stream
 * is one long sequential read, so the hardware prefetchers never restart (eight streams of one row
 * each, restarting every eight rows, read 8-10 % slower on a 2-core Zen 5 EPYC). Rows left over
 * (RS * span < k1 - k0) are added one at a time. Over 2+ rows of x, a narrow W^T (N <= PF_NARROW:
 * rows of at most a page, too short for the hardware's prefetchers to run ahead while the rows'
 * arithmetic holds the core) has the next pass's weights asked for during this pass (SmolLM2's down
 * product at 8 rows, 1 thread, Zen 5: 0.176 -> 0.113 ms; wider ones were no faster). A row's partial
 * sums take the same steps in the same order whatever M and rr are, so a row's product is the same bits
 * whatever rows are computed beside it: a speculative step's check runs the draft's tokens as rows of
 * one step and must give each token what a one-token step gives (genkit/models/self_speculation.py). */
#ifndef GROUPED /* rows_pass over 3+ rows: G rows' sums of V vectors held in registers (group_pass), on AVX2 */
#if PW == 8 && defined(__AVX2__)
#define GROUPED 1
#else
#define GROUPED 0
#endif
#endif
#define GROUP_ROWS 6   /* AVX2's 16 registers: 6 rows x 2 vectors of sums, 2 weight vectors, a broadcast x */
#ifndef ONE_STEP_ROWS /* part_t_rows over at most this many rows takes one step per pass (4 weight streams, not
                       * 16): on the Xeon guest, SmolLM2's four layer products at 2-8 rows 7-12 % faster
                       * (AVX-512; at 16 rows 1.3x slower), at 3-6 rows in one group 16-23 % faster than
                       * rows_pass's own loop (AVX2 build) */
#define ONE_STEP_ROWS (GROUPED ? GROUP_ROWS : PW == 16 ? 8 : 2)
#endif

/* Ask for the next pass's cache line at column j of each of its rr * RS rows (rows_pass's `ahead`) */
static inline __attribute__((always_inline)) void next_pass(const float *wr, long span, long ldw, int j, const int rr) {
    for (int q = 0; q < rr; q++)
        for (int u = 0; u < RS; u++) __builtin_prefetch(wr + (rr + q + u * span) * ldw + j, 0, 3);
}

/* p[g][j + v * PW] += sum over the pass's rr steps q and RS streams u (in that order, as rows_pass
 * adds them) of w[q + u * span][j + v * PW] * x[g][q][u], for g < G <= GROUP_ROWS rows and v < V <= 2
 * vectors: each row's sums stay in registers through the pass and each weight vector is loaded once
 * for all G rows (rows_pass's own loop keeps RR * RS weight vectors in registers instead, which
 * AVX2's 16 cannot hold: reloads and broadcasts made its rows' products load-bound). */
static inline __attribute__((always_inline)) void group_rows(float (*xv)[RR][RS], const float *wr, long span,
                                                             long ldw, float *p, int N, int j, const int rr,
                                                             const int G, const int V) {
    pv s[GROUP_ROWS][2];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) s[g][v] = *(pv *)(p + (size_t)g * N + j + v * PW);
    for (int q = 0; q < rr; q++)
        for (int u = 0; u < RS; u++) {
            const float *wq = wr + (q + u * span) * ldw + j;
            pv w0 = *(const pv *)wq, w1 = V > 1 ? *(const pv *)(wq + PW) : w0;
            for (int g = 0; g < G; g++) {
                s[g][0] += w0 * xv[g][q][u];
                if (V > 1) s[g][1] += w1 * xv[g][q][u];
            }
        }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) *(pv *)(p + (size_t)g * N + j + v * PW) = s[g][v];
}

/* group_rows with G and V as constants (the sums' registers are named at compile time) */
static inline __attribute__((always_inline)) void group_pass(float (*xv)[RR][RS], const float *wr, long span,
                                                             long ldw, float *p, int N, int j, const int rr, int G,
                                                             const int V) {
    switch (G) {
    case 1: group_rows(xv, wr, span, ldw, p, N, j, rr, 1, V); break;
    case 2: group_rows(xv, wr, span, ldw, p, N, j, rr, 2, V); break;
    case 3: group_rows(xv, wr, span, ldw, p, N, j, rr, 3, V); break;
    case 4: group_rows(xv, wr, span, ldw, p, N, j, rr, 4, V); break;
    case 5: group_rows(xv, wr, span, ldw, p, N, j, rr, 5, V); break;
    default: group_rows(xv, wr, span, ldw, p, N, j, rr, 6, V); break;
    }
}

/* A pass's whole vectors of p (columns 0 .. the returned j - 1) over M rows: group_pass on the rows in
 * groups of GROUP_ROWS, two vectors at a time, then one; with `ahead`, the next pass's cache lines
 * asked for (as rows_pass's own loop does) */
static inline __attribute__((always_inline)) int group_vectors(float (*xv)[RR][RS], const float *wr, long span,
                                                               long ldw, float *p, int M, int N, const int rr,
                                                               int ahead) {
    int j = 0;
    for (; j + 2 * PW <= N; j += 2 * PW) {
        if (ahead) next_pass(wr, span, ldw, j, rr);
        for (int m0 = 0; m0 < M; m0 += GROUP_ROWS)
            group_pass(xv + m0, wr, span, ldw, p + (size_t)m0 * N, N, j, rr, M - m0 < GROUP_ROWS ? M - m0 : GROUP_ROWS, 2);
    }
    for (; j + PW <= N; j += PW)
        for (int m0 = 0; m0 < M; m0 += GROUP_ROWS)
            group_pass(xv + m0, wr, span, ldw, p + (size_t)m0 * N, N, j, rr, M - m0 < GROUP_ROWS ? M - m0 : GROUP_ROWS, 1);
    return j;
}

/* (GCC 12 with -mavx2 sees the tail below read xv where the loops that write it have not run: they
 * write every xv[m][q][u] it reads, m < M, q < steps, u < RS) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void rows_pass(const float *x, int ldx, const float *w, long ldw,
                                                             float *p, int M, int N, int k0, int k1, const int rr) {
    memset(p, 0, sizeof(float) * (size_t)M * N);
    const long span = (k1 - k0) / RS;
    /* rr consecutive steps r per pass: each vector of p is loaded once, takes the rr steps' RS weight
     * vectors in the order part_t_row adds them (r, then the streams u), and is stored once */
    for (long r = 0; r < span; r += rr) {
        const int steps = span - r < rr ? (int)(span - r) : rr;
        const float *wr = w + (size_t)(k0 + r) * ldw;
        const int ahead = M > 1 && N <= PF_NARROW && r + 2 * rr <= span;
        float xv[EXACT_ROWS][RR][RS]; /* the rows' x values of these steps, read once (p may alias x for all C knows) */
        for (int m = 0; m < M; m++)
            for (int q = 0; q < steps; q++)
                for (int u = 0; u < RS; u++) xv[m][q][u] = x[(size_t)m * ldx + k0 + r + q + u * span];
        int j = 0;
#if GROUPED
        if (steps == rr && M > 2) /* AVX2: the rows' sums in registers, each weight vector loaded once a pass */
            j = group_vectors(xv, wr, span, ldw, p, M, N, rr, ahead);
#endif
        if (steps == rr)
            for (; j + PW <= N; j += PW) {
                pv wv[RR][RS];
                if (ahead && j % 16 == 0) next_pass(wr, span, ldw, j, rr);
                for (int q = 0; q < rr; q++)
                    for (int u = 0; u < RS; u++) wv[q][u] = *(const pv *)(wr + (q + u * span) * ldw + j);
                for (int m = 0; m < M; m++) {
                    pv s = *(pv *)(p + (size_t)m * N + j);
                    for (int q = 0; q < rr; q++)
                        for (int u = 0; u < RS; u++) s += wv[q][u] * xv[m][q][u];
                    *(pv *)(p + (size_t)m * N + j) = s;
                }
            }
        for (; j < N; j++)
            for (int m = 0; m < M; m++) {
                float s = p[(size_t)m * N + j];
                for (int q = 0; q < steps; q++)
                    for (int u = 0; u < RS; u++) s += wr[(q + u * span) * ldw + j] * xv[m][q][u];
                p[(size_t)m * N + j] = s;
            }
    }
    for (long k = k0 + RS * span; k < k1; k++) {
        const float *w0 = w + (size_t)k * ldw;
        for (int m = 0; m < M; m++) {
            const float xk = x[(size_t)m * ldx + k];
            float *pm = p + (size_t)m * N;
            for (int j = 0; j < N; j++) pm[j] += w0[j] * xk;
        }
    }
}

#pragma GCC diagnostic pop

/* one row of x (batch-1 decode): rows_pass, one step per pass */
static void part_t_row(const float *x, const float *w, long ldw, float *p, int N, int k0, int k1) {
    rows_pass(x, 0, w, ldw, p, 1, N, k0, k1, 1);
}

static void part_t_rows(const float *x, int ldx, const float *w, long ldw, float *p, int M, int N, int k0, int k1) {
    if (M <= ONE_STEP_ROWS)
        rows_pass(x, ldx, w, ldw, p, M, N, k0, k1, 1);
    else
        rows_pass(x, ldx, w, ldw, p, M, N, k0, k1, RR);
}

/* p (M, N) = x[:, k0:k1] @ Wt[k0:k1, :]: one row through part_t_row, up to EXACT_ROWS rows through
 * part_t_rows (each row's bits as alone); more rows RT rows of Wt per
 * pass, each vector of p loaded once, the RT weight vectors added into it, stored once, the rows of
 * x (at most a few) reusing each weight vector from L1. */
static void part_t(const float *x, int ldx, const float *w, long ldw, float *p, int M, int N, int k0, int k1) {
    if (M == 1) {
        part_t_row(x, w, ldw, p, N, k0, k1);
        return;
    }
    if (M <= EXACT_ROWS) {
        part_t_rows(x, ldx, w, ldw, p, M, N, k0, k1);
        return;
    }
    memset(p, 0, sizeof(float) * (size_t)M * N);
    int k = k0;
    for (; k + RT <= k1; k += RT) {
        const float *wr = w + (size_t)k * ldw;
        int j = 0;
        for (; j + VW <= N; j += VW) {
            if (PFT > 0)
                for (int u = 0; u < RT; u++) __builtin_prefetch(wr + u * ldw + j + PFT, 0, PFH);
            for (int m = 0; m < M; m++) {
                const float *xm = x + (size_t)m * ldx + k;
                v16 s = *(v16 *)(p + (size_t)m * N + j);
                for (int u = 0; u < RT; u++) s += ld16(wr + u * ldw + j) * xm[u];
                *(v16 *)(p + (size_t)m * N + j) = s;
            }
        }
        for (; j < N; j++)
            for (int m = 0; m < M; m++) {
                const float *xm = x + (size_t)m * ldx + k;
                float s = p[(size_t)m * N + j];
                for (int u = 0; u < RT; u++) s += wr[u * ldw + j] * xm[u];
                p[(size_t)m * N + j] = s;
            }
    }
    for (; k < k1; k++) {
        const float *w0 = w + (size_t)k * ldw;
        for (int m = 0; m < M; m++) {
            float xk = x[(size_t)m * ldx + k], *pm = p + (size_t)m * N;
            for (int j = 0; j < N; j++) pm[j] += w0[j] * xk;
        }
    }
}

/* y (M, N) = x (M, K; row stride ldx) @ W^T, W column-major: element (n, k) at w[k * ldw + n].
 * Returns 0, or -1 when the scratch memory cannot be had. */
int gk_gemv_t(const float *x, int ldx, const float *w, long ldw, float *y, int M, int N, int K, int threads) {
    if ((long)N * K < MIN_WORK || threads < 1) threads = 1;
    if (threads > K / RT) threads = K / RT > 0 ? K / RT : 1;
    if (threads == 1) {
        part_t(x, ldx, w, ldw, y, M, N, 0, K);
        return 0;
    }
    size_t size = (size_t)M * N;
    float *extra = threads > 1 ? scratch((size_t)(threads - 1) * size) : NULL;
    if (threads > 1 && extra == NULL) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int per = ((K + nt - 1) / nt + RT - 1) / RT * RT;
        int k0 = t * per < K ? t * per : K, k1 = k0 + per < K ? k0 + per : K;
        part_t(x, ldx, w, ldw, t == 0 ? y : extra + (size_t)(t - 1) * size, M, N, k0, k1);
        if (nt > 1) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (size_t i = 0; i < size; i++) {
                float s = y[i];
                for (int u = 1; u < nt; u++) s += extra[(size_t)(u - 1) * size + i];
                y[i] = s;
            }
        }
    }
    return 0;
}

/* y[j] for the columns j of the 16-column blocks `blocks` (n of them) of a one-row column-major
 * product, each bit for bit as gk_gemv_t(x, K, w, ldw, y, 1, N, K, threads) computes it (the same
 * split of K among `threads`, the same part_t_row on each part, the parts added in the same order),
 * on the calling thread; other columns of y are not written. A greedy decode step's LM head computes
 * only the columns that can hold the argmax this way (block_kernel.c, gk_decode_top). Returns 0. */
int gk_gemv_t_cols(const float *x, const float *w, long ldw, float *y, int N, int K, int threads,
                   const int *blocks, int n) {
    if ((long)N * K < MIN_WORK || threads < 1) threads = 1;
    if (threads > K / RT) threads = K / RT > 0 ? K / RT : 1;
    const int per = ((K + threads - 1) / threads + RT - 1) / RT * RT;
    float part[VW];
    for (int i = 0; i < n; i++) {
        const int j0 = blocks[i] * VW, width = N - j0 < VW ? N - j0 : VW;
        /* a block's K cache lines lie ldw floats apart, where no hardware prefetcher follows: the next
         * block's are asked for while this one is computed, so many reads are in flight at once */
        for (int k = 0; i + 1 < n && k < K; k++) __builtin_prefetch(w + (size_t)k * ldw + blocks[i + 1] * VW, 0, 3);
        for (int t = 0; t < threads; t++) {
            int k0 = t * per < K ? t * per : K, k1 = k0 + per < K ? k0 + per : K;
            part_t_row(x, w + j0, ldw, t == 0 ? y + j0 : part, width, k0, k1);
            if (t > 0)
                for (int j = 0; j < width; j++) y[j0 + j] = y[j0 + j] + part[j];
        }
    }
    return 0;
}

static inline float hsum(const v16 *v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += (*v)[i];
    return s;
}

/* y[m, n0:n0+r] for r <= 4 rows of W (row stride ldw) starting at wr. */
static void rows_n(const float *x, int ldx, const float *wr, long ldw, float *y, int M, int N, int K, int n0, int r) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * ldx;
        v16 acc[4] = {0};
        int k = 0;
        for (; k + VW <= K; k += VW) {
            v16 xv = ld16(xm + k);
            for (int i = 0; i < r; i++) {
                if (m == 0) __builtin_prefetch(wr + i * ldw + k + PF, 0, PFH);
                acc[i] += ld16(wr + i * ldw + k) * xv;
            }
        }
        for (int i = 0; i < r; i++) {
            float s = hsum(&acc[i]);
            for (int kk = k; kk < K; kk++) s += wr[i * ldw + kk] * xm[kk];
            y[(size_t)m * N + n0 + i] = s;
        }
    }
}

/* y (M, N) = x (M, K; row stride ldx) @ W^T, W row-major: element (n, k) at w[n * ldw + k]. Returns 0. */
int gk_gemv_n(const float *x, int ldx, const float *w, long ldw, float *y, int M, int N, int K, int threads) {
    if ((long)N * K < MIN_WORK || threads < 1) threads = 1;
    int blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int b = 0; b < blocks; b++) {
        int n0 = 4 * b, r = N - n0 < 4 ? N - n0 : 4;
        rows_n(x, ldx, w + (size_t)n0 * ldw, ldw, y, M, N, K, n0, r);
    }
    return 0;
}

/* What gk_gemv_pre does to x before the product (GK_PRE_*; genkit/models/dense_kernel.py PRE_*). */
#define GK_PRE_NONE 0
#define GK_PRE_RMS 1   /* each row x * (1 / sqrt(mean(x^2) + eps)) * g: a decoder layer's RMSNorm */
#define GK_PRE_GATE 2  /* a row is (gate (K), up (K)) at row stride ldx: silu(gate) * up, the MLP's product */

static __thread float *pre_buf;
static __thread size_t pre_n;

/* xs (M, K) from x as `pre` says. */
static void prepare(int pre, const float *x, int ldx, int M, int K, const float *g, float eps, float *xs) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * ldx;
        float *o = xs + (size_t)m * K;
        if (pre == GK_PRE_RMS) {
            v16 acc = {0};
            int k = 0;
            for (; k + VW <= K; k += VW) acc += ld16(xm + k) * ld16(xm + k);
            float s = hsum(&acc);
            for (; k < K; k++) s += xm[k] * xm[k];
            float r = 1.0f / sqrtf(s / (float)K + eps);
            for (k = 0; k < K; k++) o[k] = g[k] * (xm[k] * r);
        } else {
            for (int k = 0; k < K; k++) o[k] = xm[k] / (1.0f + expf(-xm[k])) * xm[K + k];
        }
    }
}

/* y (M, N) = res + pre(x) @ W^T: the product of gk_gemv_t (column_major) or gk_gemv_n, on x
 * prepared as `pre` says (GK_PRE_*; g, eps: the RMSNorm's weight and epsilon), plus the (M, N)
 * residual res when it is not NULL (added after the product, as torch's x + linear(...)).
 * Returns 0, or -1 when scratch memory cannot be had. */
int gk_gemv_pre(int column_major, const float *x, int ldx, const float *w, long ldw, float *y, int M, int N, int K,
                int threads, int pre, const float *g, float eps, const float *res) {
    if (pre != GK_PRE_NONE) {
        size_t n = (size_t)M * K;
        if (n > pre_n) {
            free(pre_buf);
            pre_buf = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
            pre_n = pre_buf != NULL ? n : 0;
        }
        if (pre_buf == NULL) return -1;
        prepare(pre, x, ldx, M, K, g, eps, pre_buf);
        x = pre_buf;
        ldx = K;
    }
    int rc = column_major ? gk_gemv_t(x, ldx, w, ldw, y, M, N, K, threads) : gk_gemv_n(x, ldx, w, ldw, y, M, N, K, threads);
    if (res != NULL)
        for (size_t i = 0; i < (size_t)M * N; i++) y[i] = res[i] + y[i];
    return rc;
}
