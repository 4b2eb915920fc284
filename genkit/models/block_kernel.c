/* genkit block kernels: y = x @ W^T for weights kept in GGUF-style blocks of 32.
 *
 * Each group of 32 weights of an output row is w = d * u + m with an unsigned code u (4-bit:
 * 0..15, or 8-bit: 0..255) and float16 d, m. Activations are written as two int8 digits per
 * block of 32: x ~ dx * q1 + (dx / 254) * q2, the second digit rounding what the first left over
 * (llama.cpp keeps only the first; two digits make the products as exact as the float16 scales,
 * at the cost of twice the integer work, which is cheap next to reading the weights). A block's
 * contribution is
 *     (d * dx2) * (254 * sum(u * q1) + sum(u * q2)) + m * (dx * sum(q1) + dx2 * sum(q2)),  dx2 = dx / 254
 * each integer sum one AVX-512 VNNI instruction per 64 products, the two combined in int32 and
 * converted to float once (digits512).
 *
 * One-digit mode (`act` argument, genkit's activation_digits=1): llama.cpp's rounding instead. Only
 * q1 is computed (the q2 work is compiled out), the block scale is float16 (dx = fp16(amax / 127),
 * q1 still rounded with 127 / amax in float32), and the offset term's activation sum is
 *     GK_ACT_Q8_1 (weights with a free minimum: Q4_1, Q4_K): sx = fp16(amax / 127 * sum(q1))  (Q8_1's s)
 *     GK_ACT_Q8_0 (symmetric weights, m = -8 d, -128 d or -32 d: Q4_0, Q8_0, Q6_K): sx = dx * sum(q1),
 *                 exact in float32, so m * sx cancels the code offset as llama.cpp's signed codes do.
 *
 * Layout (written by genkit/models/block_linear.py): rows in panels of 16; per panel, per block,
 *   4-bit: 4 chunks of 64 bytes; byte 4r+j of chunk c holds row r's code 8c+j (low nibble) and
 *          8c+4+j (high nibble); then 16 float16 d, then 16 float16 m       (320 bytes)
 *   8-bit: 8 chunks of 64 bytes; byte 4r+j of chunk c holds row r's code 4c+j;
 *          then 16 float16 d, then 16 float16 m                               (576 bytes)
 *   6-bit (GGUF Q6_K: w = d * (u - 32), codes 0..63, one d per 16 weights): the 8-bit chunks,
 *          then d of each row's first 16 weights, then of its last 16 (16 float32 each: Q6_K's
 *          d is a float16 times an int8, which float16 would round)             (640 bytes)
 * so a panel's 16 dot products are 16 lanes of one register and need no horizontal sums.
 *
 * Built on first use by the machine's C compiler with -march=native: AVX-512 VNNI where the CPU
 * has it, else AVX2 (vpmaddubsw + vpmaddwd, same exact integer sums), else the portable loops.
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GK_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GK_AVX2 1
#include <immintrin.h>
#ifdef __AVXVNNI__
#define GK_AVXVNNI 1 /* AVX-VNNI (256-bit vpdpbusd) without AVX-512: Intel's client CPUs since Alder Lake, Xeon 6 E-cores */
#else
#define GK_WIDE 1 /* AVX2 alone: 6- and 8-bit codes against the two digits combined in int16 (gk_dw below) */
#endif
#endif
#if defined(GK_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define GK_AMX 1  /* AMX int8 tiles for products of many rows; used only after gk_amx_init() says yes */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GK_ROWS 16
#ifndef GK_PREFETCH
/* how far ahead one-row products prefetch their weights, in bytes (2 KB: 1 KB left a core's decode
 * 10-20 % slower on the AMD EPYC, where one core reads 12-13 GB/s) */
#define GK_PREFETCH 2048
#endif
#define GK_GROUP 32
#define GK_MT 4
/* how activations are rounded (see above); GK_ACT_LLAMA_Q8_1 / _Q8_0: the same one-digit rounding,
 * with the products summed in llama.cpp's float order (numerics="llama.cpp": panel_llama below) */
enum { GK_ACT_TWO = 0, GK_ACT_Q8_1 = 1, GK_ACT_Q8_0 = 2, GK_ACT_LLAMA_Q8_1 = 3, GK_ACT_LLAMA_Q8_0 = 4 };

/* Per-operation wall time of the decode step, built only with -DGK_PROFILE (bench/profile_block_kernel.py):
 * gk_profile(out) copies the seconds spent per category into out[GK_PROF_N] and clears them. */
enum { GK_P_NORM, GK_P_QUANT, GK_P_QKV, GK_P_ROPE, GK_P_ATTEND, GK_P_O, GK_P_RESID, GK_P_GU, GK_P_SILU, GK_P_DOWN,
       GK_P_HEAD, GK_P_OTHER, GK_PROF_N };
#ifdef GK_PROFILE
#include <time.h>
static double gk_prof[GK_PROF_N];
static int gk_prof_cat = GK_P_OTHER;  /* what the next gk_matmul's panel work counts as */
static double gk_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static double gk_t0;  /* the caller is one thread: decode_rows, or a gk_matmul from Python */
#define GK_T0 (gk_t0 = gk_now())
#define GK_T(k) do { double gk_t1 = gk_now(); gk_prof[k] += gk_t1 - gk_t0; gk_t0 = gk_t1; } while (0)
#define GK_CAT(k) (gk_prof_cat = (k))
void gk_profile(double *out) {
    for (int i = 0; i < GK_PROF_N; i++) {
        out[i] = gk_prof[i];
        gk_prof[i] = 0.0;
    }
}
#else
#define GK_T0 (void)0
#define GK_T(k) (void)0
#define GK_CAT(k) (void)0
#endif

/* bytes of one block of a panel (internal uses inline this one: an exported function is called through
 * the PLT in a shared library, so its value was unknown to the loops it sizes) */
static inline int block_bytes(int bits) { return bits == 4 ? 320 : (bits == 6 ? 640 : 576); }
int gk_block_bytes(int bits) { return block_bytes(bits); }

/* 2: AVX-512 VNNI, 3: AVX2 with AVX-VNNI, 1: AVX2 (+FMA, F16C), 0: the portable loops */
int gk_simd(void) {
#if defined(GK_VNNI)
    return 2;
#elif defined(GK_AVXVNNI)
    return 3;
#elif defined(GK_AVX2)
    return 1;
#else
    return 0;
#endif
}

__attribute__((unused)) static int gk_amx_ready = 0;     /* CPUID has AMX-TILE and AMX-INT8 and Linux granted the tile state */

/* 1 when this build has the AMX path, the CPU has AMX-INT8 and Linux lets this process use the
 * tiles (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); 0 otherwise (the VNNI path runs). */
int gk_amx_init(void) {
#ifdef GK_AMX
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return 0;  /* AMX-TILE, AMX-INT8 */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    gk_amx_ready = 1;
    return 1;
#else
    return 0;
#endif
}


static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal */
            float f = ldexpf((float)man, -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifndef GK_VNNI /* (the AVX-512 build rounds 16 blocks at once: quantize_blocks512 below) */
/* One block of 32 values -> digits q1, q2 (see quantize_rows); returns the scale d, the digit sums
 * over the block (s[0], s[1]) and over its first half (s[2], s[3]). With two == 0 only q1 (q2 is
 * not touched; s[1] = s[3] = 0). */
static inline __attribute__((always_inline)) float quantize_block(const float *xb, int8_t *q1, int8_t *q2, int *s,
                                                                  int two) {
#ifdef GK_AVX2
    /* the scalar loop below in vectors: the same roundings (mul, sub, round to nearest even), no FMA */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256 x[4], v[4], r[4];
    for (int k = 0; k < 4; k++) x[k] = _mm256_loadu_ps(xb + 8 * k);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x[0], absmask), _mm256_and_ps(x[1], absmask)),
                              _mm256_max_ps(_mm256_and_ps(x[2], absmask), _mm256_and_ps(x[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f, id2 = 254.0f * id;
    const __m256 vd = _mm256_set1_ps(d), vid = _mm256_set1_ps(id), vid2 = _mm256_set1_ps(id2);
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_round_ps(_mm256_mul_ps(x[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[k] = _mm256_min_ps(_mm256_max_ps(v[k], lo), hi);
        if (!two) continue;
        r[k] = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(x[k], _mm256_mul_ps(v[k], vd)), vid2),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[k] = _mm256_min_ps(_mm256_max_ps(r[k], lo), hi);
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 *digits[2] = {v, r};
    int8_t *outs[2] = {q1, q2};
    s[1] = s[3] = 0;
    for (int t = 0; t < (two ? 2 : 1); t++) {
        __m256 *u = digits[t];
        __m256i w01 = _mm256_packs_epi32(_mm256_cvtps_epi32(u[0]), _mm256_cvtps_epi32(u[1]));
        __m256i w23 = _mm256_packs_epi32(_mm256_cvtps_epi32(u[2]), _mm256_cvtps_epi32(u[3]));
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
        _mm256_storeu_si256((__m256i *)outs[t], bytes);
        /* integer-valued floats of at most 127 in magnitude: these sums are exact */
        __m256 first = _mm256_add_ps(u[0], u[1]), all = _mm256_add_ps(first, _mm256_add_ps(u[2], u[3]));
        __m256 pair[2] = {all, first};
        for (int k = 0; k < 2; k++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(pair[k]), _mm256_extractf128_ps(pair[k], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
            s[2 * k + t] = (int)_mm_cvtss_f32(h);
        }
    }
    return d;
#else
    float amax = 0.0f;
    for (int j = 0; j < GK_GROUP; j++) amax = fmaxf(amax, fabsf(xb[j]));
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f, id2 = 254.0f * id;
    s[0] = s[1] = 0;
    for (int j = 0; j < GK_GROUP; j++) {
        if (j == GK_GROUP / 2) {
            s[2] = s[0];
            s[3] = s[1];
        }
        float v = nearbyintf(xb[j] * id);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q1[j] = (int8_t)v;
        s[0] += (int)v;
        if (!two) continue;
        float r = nearbyintf((xb[j] - v * d) * id2);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q2[j] = (int8_t)r;
        s[1] += (int)r;
    }
    return d;
#endif
}
#endif

#if defined(GK_VNNI) || defined(GK_AVX2)
/* Asks for a block's `bb` bytes of weights GK_PREFETCH bytes ahead (into L1), and two panels (`pbytes` each)
 * further on in the same stream (into L2): one core reads memory faster with more reads in flight (batch-1
 * decode's row_vnni; the first pass of matmul_panels' tiles) */
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *wb, int bb, size_t pbytes) {
    if (GK_PREFETCH > 0)
        for (int off = 0; off < bb; off += 64) {
            _mm_prefetch((const char *)(wb + GK_PREFETCH + off), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + 2 * pbytes + GK_PREFETCH + off), _MM_HINT_T1);
        }
}
#endif

/* f rounded to the nearest float16 (ties to even; F16C's vcvtps2ph, as ggml's GGML_FP32_TO_FP16) */
static float round_f16(float f) {
#if defined(GK_VNNI) || defined(GK_AVX2)
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    float a = fabsf(f);
    if (!(a < 65520.0f)) return a > 0.0f && f == f ? copysignf(INFINITY, f) : f;  /* overflow, NaN */
    if (a < 6.103515625e-05f) return nearbyintf(f * 16777216.0f) / 16777216.0f;  /* subnormal: steps of 2^-24 */
    int e;
    frexpf(f, &e);
    return ldexpf(nearbyintf(ldexpf(f, 11 - e)), e - 11);  /* 11 significant bits */
#endif
}

#define GK_CHUNK(panels, threads) ((panels) / (8 * (threads)) > 0 ? (panels) / (8 * (threads)) : 1)

/* How a product's panels are shared among threads. Each thread owns a contiguous range of the
 * panels and takes its chunks (about an eighth of the range each) in order from the front, so it
 * reads one stream of weights and its prefetches run on into its next chunk. A thread whose range is
 * done takes half of what another range has left, from its end, and makes it its own range (so
 * others can take from it in turn): the owner goes on down its stream undisturbed, and the two
 * threads touch the same range's cache line a few times a product, not once a chunk (taking single
 * chunks from the owner's front made both threads bounce that line for every chunk to the end: with
 * SmolLM2's weights in the cache, 2-thread one-row products took 2-5 % longer on a Zen 5 EPYC). So a
 * thread the system takes off its core for a while (another process, the server's event loop) leaves
 * its remaining chunks to the others instead of holding up the whole product, while on a quiet
 * machine each thread reads its range as one stream (chunks handed out in turn made each chunk a new
 * stream: on a 2-core Zen 5 EPYC, 2-thread decode ran at 303 tok/s against 396 this way). Threads
 * beyond GK_SHARE_PARTS share a range with another. Every panel is computed whole by one thread: the
 * results do not depend on which. */
#define GK_SHARE_PARTS 64
typedef struct {
    struct {
        uint64_t range; /* what is left of the part to take: next (low 32 bits) up to end (high 32 bits) */
    } __attribute__((aligned(64))) part[GK_SHARE_PARTS]; /* a cache line each */
    int parts, chunk;
} gk_share;

static inline uint64_t share_range(int next, int end) { return (uint64_t)(uint32_t)end << 32 | (uint32_t)next; }

static void share_init(gk_share *s, int items, int threads) {
    s->parts = threads < GK_SHARE_PARTS ? threads : GK_SHARE_PARTS;
    s->chunk = GK_CHUNK(items, s->parts);
    for (int t = 0; t < s->parts; t++)
        s->part[t].range = share_range((int)((long)items * t / s->parts), (int)((long)items * (t + 1) / s->parts));
}

/* Half of what is left in part o (all of it when no more than a chunk), taken from its end; 0 when
 * nothing is left. */
static int share_steal(gk_share *s, int o, int *a, int *b) {
    uint64_t old = __atomic_load_n(&s->part[o].range, __ATOMIC_RELAXED);
    for (;;) {
        int next = (int)(uint32_t)old, end = (int)(old >> 32), left = end - next;
        if (left <= 0) return 0;
        int take = left <= s->chunk ? left : (left + 1) / 2;
        if (__atomic_compare_exchange_n(&s->part[o].range, &old, share_range(next, end - take), 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            *a = end - take;
            *b = end;
            return 1;
        }
    }
}

/* The next chunk [*a, *b) for thread t: from the front of its own part; when that is done, half of
 * what another part has left, from its end, which becomes the thread's own part (a thread beyond
 * GK_SHARE_PARTS, which shares its part, does what it takes whole); 0 when nothing is left. *r: the
 * parts looked at since the own part ran out, starting from 0. */
static inline int share_next(gk_share *s, int t, int *r, int *a, int *b) {
    int own = t % s->parts;
    for (;;) {
        if (*r == 0) {
            uint64_t old = __atomic_fetch_add(&s->part[own].range, (uint64_t)s->chunk, __ATOMIC_RELAXED);
            int next = (int)(uint32_t)old, end = (int)(old >> 32);
            if (next < end) {
                *a = next;
                *b = next + s->chunk < end ? next + s->chunk : end;
                return 1;
            }
            *r = 1;
        }
        int sa = 0, sb = 0;
        while (*r < s->parts && !share_steal(s, (t + *r) % s->parts, &sa, &sb)) ++*r;
        if (*r == s->parts) return 0;
        if (t >= s->parts) {
            *a = sa;
            *b = sb;
            return 1;
        }
        __atomic_store_n(&s->part[own].range, share_range(sa, sb), __ATOMIC_RELAXED);
        *r = 0;
    }
}

#ifdef GK_VNNI
#define GK_QBLOCKS 16 /* blocks quantize_blocks512 takes at once */
/* The digits of n (1..GK_QBLOCKS) consecutive blocks, the AVX2 build's quantize_block in 512-bit vectors: the same
 * roundings, bit for bit (mul, sub, round to nearest even, no FMA; the scales' divisions in one vector,
 * each lane the IEEE quotient the scalar division gives), and the digit sums from the stored bytes (a
 * byte-sum instruction over the digits offset to unsigned: exact integers). d[b] and s[b] as
 * quantize_block returns them for block b. Per block the single-block code's two horizontal reductions
 * per digit and two scalar divisions were most of its time: 1.5 ns a value on the 2-core Xeon guest
 * (session 38), 6 % of a quantized continuous-batching run there. */
static inline __attribute__((always_inline)) void quantize_blocks512(const float *xb, int8_t *q1, int8_t *q2,
                                                                     int n, float *d, int (*s)[4], int two) {
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);  /* (integer AND: AVX-512 F, no DQ needed) */
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    float am[GK_QBLOCKS] __attribute__((aligned(64))), id[GK_QBLOCKS] __attribute__((aligned(64))),
        id2[GK_QBLOCKS] __attribute__((aligned(64)));
    for (int b = 0; b < GK_QBLOCKS; b++) {
        if (b >= n) {
            am[b] = 0.0f;
            continue;
        }
        const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(xb + GK_GROUP * b), absmask));
        const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(xb + GK_GROUP * b + 16), absmask));
        am[b] = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    }
    const __m512 a = _mm512_load_ps(am);
    const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_ps(d, _mm512_div_ps(a, hi));  /* d = amax / 127 */
    const __m512 inv = _mm512_maskz_div_ps(pos, hi, a);  /* 127 / amax, 0 where amax is 0 */
    _mm512_store_ps(id, inv);
    _mm512_store_ps(id2, _mm512_mul_ps(_mm512_set1_ps(254.0f), inv));
    for (int b = 0; b < n; b++) {
        const __m512 vd = _mm512_set1_ps(d[b]), vid = _mm512_set1_ps(id[b]), vid2 = _mm512_set1_ps(id2[b]);
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_loadu_ps(xb + GK_GROUP * b + 16 * h);
            __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(x, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128((__m128i *)(q1 + GK_GROUP * b + 16 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
            if (!two) continue;
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(x, _mm512_mul_ps(v, vd)), vid2),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            _mm_storeu_si128((__m128i *)(q2 + GK_GROUP * b + 16 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
        }
    }
    /* digit sums: each 8 bytes' sum of (digit + 128) in a 64-bit lane; a block's 32 bytes are 4 lanes */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int t = 0; t < (two ? 2 : 1); t++) {
        const int8_t *q = t ? q2 : q1;
        for (int b = 0; b < n; b += 2) {
            uint64_t lane[8];
            const __m512i bytes = b + 1 < n ? _mm512_loadu_si512((const void *)(q + GK_GROUP * b))
                                            : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + GK_GROUP * b)));
            _mm512_storeu_si512((void *)lane, _mm512_sad_epu8(_mm512_xor_si512(bytes, flip), _mm512_setzero_si512()));
            for (int k = 0; k < 2 && b + k < n; k++) {
                const int first = (int)(lane[4 * k] + lane[4 * k + 1]) - 16 * 128;
                s[b + k][2 + t] = first;
                s[b + k][t] = first + (int)(lane[4 * k + 2] + lane[4 * k + 3]) - 16 * 128;
            }
        }
    }
    if (!two)
        for (int b = 0; b < n; b++) s[b][1] = s[b][3] = 0;
}
#endif

/* x (M, K) float32 -> int8 digits per value, per block the scale dx and the activation sums sx over
 * the block and over each half (sx16). act GK_ACT_TWO: two digits q1, q2, dx = d / 254 (the scale of
 * 254 q1 + q2, q1's scale being d), sx = d * sum(q1) + d / 254 * sum(q2); one digit (llama.cpp's
 * rounding): dx is q1's scale, see the top comment.
 * Rows are shared among `threads` when there are many. */
static void quantize_rows(const float *x, int M, int K, int8_t *q1, int8_t *q2, float *dx, float *sx,
                          float *sx16, int threads, int act) {
    const int nb = K / GK_GROUP, two = act == GK_ACT_TWO;
    if ((size_t)M * K < 65536 || threads > M) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int m = 0; m < M; m++) {
#ifdef GK_VNNI
        float dq[GK_QBLOCKS];
        int sq[GK_QBLOCKS][4];
#endif
        for (int b = 0; b < nb; b++) {
            size_t off = (size_t)m * K + (size_t)b * GK_GROUP, i = (size_t)m * nb + b;
            int s[4];
#ifdef GK_VNNI
            const int g = b % GK_QBLOCKS;
            if (g == 0)
                quantize_blocks512(x + off, q1 + off, two ? q2 + off : NULL, nb - b < GK_QBLOCKS ? nb - b : GK_QBLOCKS,
                                   dq, sq, two);
            const float d = dq[g];
            memcpy(s, sq[g], sizeof s);
#else
            const float d = quantize_block(x + off, q1 + off, two ? q2 + off : NULL, s, two);
#endif
            if (!two) {
                float d16 = round_f16(d);
                dx[i] = d16;
                if (act == GK_ACT_Q8_1) {
                    sx[i] = round_f16(d * (float)s[0]);
                    sx16[2 * i] = round_f16(d * (float)s[2]);
                    sx16[2 * i + 1] = round_f16(d * (float)(s[0] - s[2]));
                } else {
                    sx[i] = d16 * (float)s[0];
                    sx16[2 * i] = d16 * (float)s[2];
                    sx16[2 * i + 1] = d16 * (float)(s[0] - s[2]);
                }
                continue;
            }
            float d2 = d / 254.0f;  /* the scale of 254 q1 + q2 (see the top comment) */
            dx[i] = d2;
            sx[i] = d * (float)s[0] + d2 * (float)s[1];
            sx16[2 * i] = d * (float)s[2] + d2 * (float)s[3];
            sx16[2 * i + 1] = d * (float)(s[0] - s[2]) + d2 * (float)(s[1] - s[3]);
        }
    }
}

#ifdef GK_VNNI
/* A block's two digit sums as the one integer the float scale multiplies: 254 s1 + s2 (s1 alone with
 * one digit). Exact in int32 (at most 254 * 32 * 255 * 127 + 32 * 255 * 127 in magnitude), and exact
 * again as a float for 4-bit codes (under 2^24); one conversion, one scale, one FMA per block instead
 * of two of each: the epilogue shares the vector pipes with the dot products (5-9 % of a 4-bit product
 * of 32-128 rows on a Zen 5 EPYC). */
static inline __attribute__((always_inline)) __m512i digits512(int two, __m512i s1, __m512i s2) {
    return two ? _mm512_add_epi32(_mm512_mullo_epi32(s1, _mm512_set1_epi32(254)), s2) : s1;
}

/* MT activation rows against one panel (a panel's 16 rows in one register); pf: whether this pass fetches
 * the weights ahead (matmul_panels) */
static inline __attribute__((always_inline)) void panel_vnni(
        int bits, int two, const uint8_t *w, int nb, const int8_t *q, const int8_t *q2, const float *dx,
        const float *sx, const float *sx16, int K, int MT, float *y, int ldy, int pf) {
    __m512 acc[GK_MT], accm[GK_MT];
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm512_setzero_ps();
        accm[i] = _mm512_setzero_ps();
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb;
        if (pf) fetch_ahead(wb, bb, (size_t)nb * bb);
        if (bits == 6) {  /* two halves of 16 weights, each with its own scale and offset */
            __m512i h[2][GK_MT], h2[2][GK_MT];
            for (int i = 0; i < MT; i++) {
                h[0][i] = h[1][i] = h2[0][i] = h2[1][i] = _mm512_setzero_si512();
            }
            for (int c = 0; c < 8; c++) {
                __m512i p = _mm512_loadu_si512((const void *)(wb + 64 * c));
                for (int i = 0; i < MT; i++) {
                    size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 4 * c;
                    int32_t a, r;
                    memcpy(&a, q + off, 4);
                    h[c / 4][i] = _mm512_dpbusd_epi32(h[c / 4][i], p, _mm512_set1_epi32(a));
                    if (!two) continue;
                    memcpy(&r, q2 + off, 4);
                    h2[c / 4][i] = _mm512_dpbusd_epi32(h2[c / 4][i], p, _mm512_set1_epi32(r));
                }
            }
            for (int half = 0; half < 2; half++) {
                __m512 d = _mm512_loadu_ps((const float *)(wb + cb + 64 * half));
                __m512 m = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));
                for (int i = 0; i < MT; i++) {
                    __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)i * nb + b]));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(digits512(two, h[half][i], h2[half][i])), scale, acc[i]);
                    accm[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx16[2 * ((size_t)i * nb + b) + half]), accm[i]);
                }
            }
            continue;
        }
        __m512i isum[GK_MT], isum2[GK_MT];
        for (int i = 0; i < MT; i++) {
            isum[i] = _mm512_setzero_si512();
            isum2[i] = _mm512_setzero_si512();
        }
        if (bits == 4) {
            for (int c = 0; c < 4; c++) {
                __m512i p = _mm512_loadu_si512((const void *)(wb + 64 * c));
                __m512i lo = _mm512_and_si512(p, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
                for (int i = 0; i < MT; i++) {
                    size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 8 * c;
                    int32_t a0, a1, r0, r1;
                    memcpy(&a0, q + off, 4);
                    memcpy(&a1, q + off + 4, 4);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], lo, _mm512_set1_epi32(a0));
                    isum[i] = _mm512_dpbusd_epi32(isum[i], hi, _mm512_set1_epi32(a1));
                    if (!two) continue;
                    memcpy(&r0, q2 + off, 4);
                    memcpy(&r1, q2 + off + 4, 4);
                    isum2[i] = _mm512_dpbusd_epi32(isum2[i], lo, _mm512_set1_epi32(r0));
                    isum2[i] = _mm512_dpbusd_epi32(isum2[i], hi, _mm512_set1_epi32(r1));
                }
            }
        } else {
            for (int c = 0; c < 8; c++) {
                __m512i p = _mm512_loadu_si512((const void *)(wb + 64 * c));
                for (int i = 0; i < MT; i++) {
                    size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 4 * c;
                    int32_t a, r;
                    memcpy(&a, q + off, 4);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], p, _mm512_set1_epi32(a));
                    if (!two) continue;
                    memcpy(&r, q2 + off, 4);
                    isum2[i] = _mm512_dpbusd_epi32(isum2[i], p, _mm512_set1_epi32(r));
                }
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb + 32)));
        for (int i = 0; i < MT; i++) {
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)i * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(digits512(two, isum[i], isum2[i])), scale, acc[i]);
            accm[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)i * nb + b]), accm[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + (size_t)i * ldy, _mm512_add_ps(acc[i], accm[i]));
}
/* Eight activation digits from offset `off` of a block, each group of four broadcast to a register:
 * the first digits' (q) at off and off + 4, the second digits' (r) likewise */
static inline __attribute__((always_inline)) void digits_vnni(const int8_t *q, const int8_t *r, int off, __m512i *q0,
                                                              __m512i *q1, __m512i *r0, __m512i *r1) {
    int32_t a[4];
    memcpy(&a[0], q + off, 4);
    memcpy(&a[1], q + off + 4, 4);
    memcpy(&a[2], r + off, 4);
    memcpy(&a[3], r + off + 4, 4);
    *q0 = _mm512_set1_epi32(a[0]);
    *q1 = _mm512_set1_epi32(a[1]);
    *r0 = _mm512_set1_epi32(a[2]);
    *r1 = _mm512_set1_epi32(a[3]);
}

/* One activation row (batch-1 decode) through P (1 or 2) panels `gap` panels apart: panel_vnni's
 * arithmetic for MT = 1, with the block's activation digits broadcast once for both panels, the
 * integer sums of each split over two accumulators per digit (panel_vnni's single chain of eight
 * dependent dpbusd bounded one row), and the weights fetched GK_PREFETCH bytes ahead, and two panels
 * further on too (into L2): one core reads memory faster with more reads in flight (on the AVX-512
 * Xeon, 10-12 GB/s with one stream, 15.9 with eight; decode 11-15 % faster, session 10). The float
 * steps are panel_vnni's, in its order: the same results to the bit. */
static inline __attribute__((always_inline)) void row_vnni(int bits, int two, const uint8_t *w, size_t pbytes,
                                                           size_t gap, int P, int nb, const int8_t *q,
                                                           const int8_t *q2, const float *dx, const float *sx,
                                                           float *y) {
    __m512 acc[2], accm[2];
    for (int k = 0; k < P; k++) acc[k] = accm[k] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int b = 0; b < nb; b++) {
        const int8_t *qb = q + (size_t)b * GK_GROUP, *rb = two ? q2 + (size_t)b * GK_GROUP : qb;
        __m512i s1a[2], s1b[2], s2a[2], s2b[2];
        for (int k = 0; k < P; k++) {
            const uint8_t *wb = w + k * gap * pbytes + (size_t)b * bb;
            fetch_ahead(wb, bb, pbytes);
            s1a[k] = s1b[k] = s2a[k] = s2b[k] = _mm512_setzero_si512();
        }
        if (bits == 4) {
            for (int c = 0; c < 4; c++) {
                __m512i A0, A1, R0, R1;
                digits_vnni(qb, rb, 8 * c, &A0, &A1, &R0, &R1);
                for (int k = 0; k < P; k++) {
                    const uint8_t *wb = w + k * gap * pbytes + (size_t)b * bb;
                    __m512i p = _mm512_loadu_si512((const void *)(wb + 64 * c));
                    __m512i lo = _mm512_and_si512(p, low), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
                    s1a[k] = _mm512_dpbusd_epi32(s1a[k], lo, A0);
                    s1b[k] = _mm512_dpbusd_epi32(s1b[k], hi, A1);
                    if (!two) continue;
                    s2a[k] = _mm512_dpbusd_epi32(s2a[k], lo, R0);
                    s2b[k] = _mm512_dpbusd_epi32(s2b[k], hi, R1);
                }
            }
        } else {
            for (int c = 0; c < 8; c += 2) {
                __m512i A0, A1, R0, R1;
                digits_vnni(qb, rb, 4 * c, &A0, &A1, &R0, &R1);
                for (int k = 0; k < P; k++) {
                    const uint8_t *wb = w + k * gap * pbytes + (size_t)b * bb;
                    __m512i p0 = _mm512_loadu_si512((const void *)(wb + 64 * c));
                    __m512i p1 = _mm512_loadu_si512((const void *)(wb + 64 * c + 64));
                    s1a[k] = _mm512_dpbusd_epi32(s1a[k], p0, A0);
                    s1b[k] = _mm512_dpbusd_epi32(s1b[k], p1, A1);
                    if (!two) continue;
                    s2a[k] = _mm512_dpbusd_epi32(s2a[k], p0, R0);
                    s2b[k] = _mm512_dpbusd_epi32(s2b[k], p1, R1);
                }
            }
        }
        __m512 xs = _mm512_set1_ps(dx[b]), sxb = _mm512_set1_ps(sx[b]);
        for (int k = 0; k < P; k++) {
            const uint8_t *wb = w + k * gap * pbytes + (size_t)b * bb;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb + 32)));
            __m512i s = digits512(two, _mm512_add_epi32(s1a[k], s1b[k]), _mm512_add_epi32(s2a[k], s2b[k]));
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, xs), acc[k]);
            accm[k] = _mm512_fmadd_ps(m, sxb, accm[k]);
        }
    }
    for (int k = 0; k < P; k++) _mm512_storeu_ps(y + GK_ROWS * gap * k, _mm512_add_ps(acc[k], accm[k]));
}

/* y (1, N) of a one-row product: panels in pairs through row_vnni, pairs shared among threads. Pair h
 * is panels h and h + pairs, so a thread's range of pairs reads two long sequential streams of
 * weights (neighbouring panels as pairs restarted both streams every pair: 1 thread 5-8 % slower on
 * a 2-core Zen 5 EPYC) */
static void matmul_row_vnni(int bits, int two, const uint8_t *w, size_t panel_bytes, int panels, int nb,
                            const int8_t *q, const int8_t *q2, const float *dx, const float *sx, float *y,
                            int threads) {
    int pairs = (panels + 1) / 2;
    if (threads > pairs) threads = pairs;
/* bits, digits and panel count as constants: each combination its own specialised loop */
#define GK_ROW(B, D) (both ? row_vnni(B, D, wp, panel_bytes, pairs, 2, nb, q, q2, dx, sx, yp) \
                           : row_vnni(B, D, wp, panel_bytes, pairs, 1, nb, q, q2, dx, sx, yp))
    gk_share share;
    share_init(&share, pairs, threads);
#pragma omp parallel num_threads(threads)
    for (int t = omp_get_thread_num(), r = 0, a, b; share_next(&share, t, &r, &a, &b);) {
        for (int h = a; h < b; h++) {  /* pair h: panels h and h + pairs */
            const uint8_t *wp = w + (size_t)h * panel_bytes;
            float *yp = y + (size_t)h * GK_ROWS;
            const int both = h + pairs < panels;
            if (bits == 4) {
                if (two) GK_ROW(4, 1); else GK_ROW(4, 0);
            } else {
                if (two) GK_ROW(8, 1); else GK_ROW(8, 0);
            }
        }
    }
#undef GK_ROW
}
#endif

#ifdef GK_AVX2
/* AVX2 has no VNNI: u8 x s8 products go through vpmaddubsw (pairs summed into int16) and vpmaddwd
 * (pairs of int16 summed into int32). A panel is done as two halves of 8 rows (one ymm of
 * int32 lanes each: bytes 32g..32g+31 of every 64-byte chunk). Bounds: |q| <= 127, so a 4-bit code
 * pair is at most 3810 and eight of them (a whole block) still fit int16. 6- and 8-bit codes meet the
 * two digits combined into one int16 in vpmaddwd (gk_dw); with one digit, 8-bit codes are split into
 * nibbles (the high one weighted 16 by vpmaddwd) and 6-bit pairs (<= 16002) are widened at once (gk_dp).
 * With AVX-VNNI (GK_AVXVNNI) vpdpbusd sums each 4 bytes straight into int32: the same exact sums. */

/* acc + u . s per 4 bytes, in int32 lanes */
static inline __m256i gk_dp(__m256i acc, __m256i u, __m256i s) {
#ifdef GK_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* A 4-bit block's sums: acc + u . s per 4 bytes, and the int32 lanes at the end. With AVX-VNNI gk_dp
 * (int32 at once); else vpmaddubsw into int16 (which hold a block's, above) and one vpmaddwd at the
 * end. `one` is the int16 1s vpmaddwd takes. */
#ifdef GK_AVXVNNI
#define GK_DOT(acc, u, s) gk_dp(acc, u, s)
#define GK_DOT_END(acc) (acc)
#else
#define GK_DOT(acc, u, s) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
#define GK_DOT_END(acc) _mm256_madd_epi16(acc, one)
#endif

static inline __m256i gk_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#ifdef GK_WIDE
/* Without VNNI an 8-bit code times a digit overflows vpmaddubsw's int16 pairs, so codes were split
 * into nibbles: four vpmaddubsw per 4 codes and row for the two digits. Instead the two digits are
 * combined once per activation row into a = 254 q1 + q2 (|a| <= 32385, an int16) and the codes,
 * widened to int16 (even and odd bytes of each 4-byte lane), meet them in vpmaddwd: two per 4 codes
 * and row, whose int32 sums are 254 sum(u q1) + sum(u q2) exactly (digits256's integer: at most
 * 32 * 255 * 32385 < 2^31 a block), so the results keep their bits. combine_digits writes each
 * group of 4 as a0 a2 a1 a3: a 32-bit broadcast then gives the even bytes' pair, the next one the odd. */
static void combine_digits(const int8_t *q1, const int8_t *q2, int16_t *a, size_t n) {
    const __m256i f = _mm256_set1_epi16(254);
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    for (size_t i = 0; i < n; i += 16) {
        __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q1 + i)));
        __m256i v2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q2 + i)));
        __m256i v = _mm256_add_epi16(_mm256_mullo_epi16(v1, f), v2);
        _mm256_storeu_si256((__m256i *)(a + i), _mm256_shuffle_epi8(v, order));
    }
}

/* acc + the 4 codes of each 32-bit lane of p (6- or 8-bit) times the combined digits a[0..3] */
static inline __attribute__((always_inline)) __m256i gk_dw(__m256i acc, __m256i even, __m256i odd, const int16_t *a) {
    int32_t e, o;
    memcpy(&e, a, 4);
    memcpy(&o, a + 2, 4);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_set1_epi32(e)),
                                                  _mm256_madd_epi16(odd, _mm256_set1_epi32(o))));
}
#define GK_EVEN(p) _mm256_and_si256(p, _mm256_set1_epi16(0xFF))
#define GK_ODD(p) _mm256_srli_epi16(p, 8)
#define GK_APART(bits, two) ((two) && (bits) == 4) /* whether a block's two digit sums come apart (4-bit codes) */
#else
#define GK_APART(bits, two) (two)
#endif

/* digits512 in 8 lanes */
static inline __attribute__((always_inline)) __m256i digits256(int two, __m256i s1, __m256i s2) {
    return two ? _mm256_add_epi32(_mm256_mullo_epi32(s1, _mm256_set1_epi32(254)), s2) : s1;
}

static inline __attribute__((always_inline)) void panel_avx2(
        int bits, int two, const uint8_t *w, int g, int nb, const int8_t *q, const int8_t *q2, const int16_t *a,
        const float *dx, const float *sx, const float *sx16, int K, int MT, float *y, int ldy, int pf) {
    const int apart = GK_APART(bits, two);
    __m256 acc[GK_MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    __attribute__((unused)) const __m256i one = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);  /* not with AVX-VNNI */
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb + 32 * g;
        if (pf && g == 0) fetch_ahead(wb, bb, (size_t)nb * bb);  /* (the second group of 8 rows finds it cached) */
        if (bits == 6) {
            for (int half = 0; half < 2; half++) {
                __m256i h1[GK_MT], h2[GK_MT];
                for (int i = 0; i < MT; i++) h1[i] = h2[i] = _mm256_setzero_si256();
                for (int c = 4 * half; c < 4 * half + 4; c++) {
                    __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
#ifdef GK_WIDE
                    const __m256i ev = GK_EVEN(p), od = GK_ODD(p);
#endif
                    for (int i = 0; i < MT; i++) {
                        size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 4 * c;
#ifdef GK_WIDE
                        if (two) {
                            h1[i] = gk_dw(h1[i], ev, od, a + off);
                            continue;
                        }
#endif
                        h1[i] = gk_dp(h1[i], p, gk_bcast(q + off));
                        if (two) h2[i] = gk_dp(h2[i], p, gk_bcast(q2 + off));
                    }
                }
                __m256 d = _mm256_loadu_ps((const float *)(wb - 32 * g + cb + 64 * half + 32 * g));
                __m256 m = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
                for (int i = 0; i < MT; i++) {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(digits256(apart, h1[i], h2[i])),
                                             _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)i * nb + b])), acc[i]);
                    acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx16[2 * ((size_t)i * nb + b) + half]), acc[i]);
                }
            }
            continue;
        }
        __m256i isum[GK_MT], isum2[GK_MT];
        if (bits == 4) {
            __m256i s1[GK_MT], s2[GK_MT];
            for (int i = 0; i < MT; i++) s1[i] = s2[i] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                for (int i = 0; i < MT; i++) {
                    size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 8 * c;
                    s1[i] = GK_DOT(s1[i], lo, gk_bcast(q + off));
                    s1[i] = GK_DOT(s1[i], hi, gk_bcast(q + off + 4));
                    if (!two) continue;
                    s2[i] = GK_DOT(s2[i], lo, gk_bcast(q2 + off));
                    s2[i] = GK_DOT(s2[i], hi, gk_bcast(q2 + off + 4));
                }
            }
            for (int i = 0; i < MT; i++) {
                isum[i] = GK_DOT_END(s1[i]);
                isum2[i] = two ? GK_DOT_END(s2[i]) : isum[i];
            }
        } else {
#ifdef GK_AVXVNNI /* 8-bit codes straight into vpdpbusd: no nibbles */
            for (int i = 0; i < MT; i++) isum[i] = isum2[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                for (int i = 0; i < MT; i++) {
                    size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 4 * c;
                    isum[i] = gk_dp(isum[i], p, gk_bcast(q + off));
                    if (two) isum2[i] = gk_dp(isum2[i], p, gk_bcast(q2 + off));
                }
            }
#else
            if (two) { /* the digits combined (gk_dw) */
                for (int i = 0; i < MT; i++) isum[i] = isum2[i] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                    const __m256i ev = GK_EVEN(p), od = GK_ODD(p);
                    for (int i = 0; i < MT; i++)
                        isum[i] = gk_dw(isum[i], ev, od, a + (size_t)i * K + (size_t)b * GK_GROUP + 4 * c);
                }
            } else { /* one digit: the codes as nibbles (the high one weighted 16 by vpmaddwd) */
                __m256i l1[GK_MT], u1[GK_MT];
                for (int i = 0; i < MT; i++) l1[i] = u1[i] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    __m256i p = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                    __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                    for (int i = 0; i < MT; i++) {
                        __m256i x = gk_bcast(q + (size_t)i * K + (size_t)b * GK_GROUP + 4 * c);
                        l1[i] = _mm256_add_epi16(l1[i], _mm256_maddubs_epi16(lo, x));
                        u1[i] = _mm256_add_epi16(u1[i], _mm256_maddubs_epi16(hi, x));
                    }
                }
                for (int i = 0; i < MT; i++)
                    isum[i] = isum2[i] = _mm256_add_epi32(_mm256_madd_epi16(l1[i], one), _mm256_madd_epi16(u1[i], sixteen));
            }
#endif
        }
        const uint8_t *scales = wb - 32 * g + cb;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * g)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * g)));
        for (int i = 0; i < MT; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(digits256(apart, isum[i], isum2[i])),
                                     _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)i * nb + b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(size_t)i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * g, acc[i]);
}

/* One activation row against one panel (batch-1 decode), 4- or 8-bit codes: the same integer sums
 * and the same float operations per lane as panel_avx2 with MT = 1, but both groups of 8 rows in
 * one pass over the panel (each 64-byte chunk read once, each activation word broadcast once, two
 * independent chains of FMAs), the weights prefetched GK_PREFETCH bytes ahead. */
static inline __attribute__((always_inline)) void gk_fold(__m256 *acc, int two, __m256i isum, __m256i isum2, __m256 d,
                                                          __m256 m, float xd, float sxb) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(digits256(two, isum, isum2)), _mm256_mul_ps(d, _mm256_set1_ps(xd)), *acc);
    *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(sxb), *acc);
}

static inline __attribute__((always_inline)) void row_avx2(int bits, int two, const uint8_t *w, int nb,
                                                           const int8_t *q, const int8_t *q2, const int16_t *a,
                                                           const float *dx, const float *sx, float *y) {
    const int apart = GK_APART(bits, two);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    __attribute__((unused)) const __m256i one = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);  /* not with AVX-VNNI */
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb;
        const int8_t *qb = q + (size_t)b * GK_GROUP, *rb = two ? q2 + (size_t)b * GK_GROUP : qb;
        if (GK_PREFETCH > 0)
            for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)(wb + GK_PREFETCH + off), _MM_HINT_T0);
        __m256i i1a, i2a, i1b, i2b;
        if (bits == 4) {
            __m256i s1a = _mm256_setzero_si256(), s2a = s1a, s1b = s1a, s2b = s1a;
            for (int c = 0; c < 4; c++) {
                __m256i pa = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                __m256i pb = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
                __m256i loa = _mm256_and_si256(pa, low), hia = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low);
                __m256i lob = _mm256_and_si256(pb, low), hib = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low);
                __m256i a0 = gk_bcast(qb + 8 * c), a1 = gk_bcast(qb + 8 * c + 4);
                s1a = GK_DOT(GK_DOT(s1a, loa, a0), hia, a1);
                s1b = GK_DOT(GK_DOT(s1b, lob, a0), hib, a1);
                if (!two) continue;
                __m256i r0 = gk_bcast(rb + 8 * c), r1 = gk_bcast(rb + 8 * c + 4);
                s2a = GK_DOT(GK_DOT(s2a, loa, r0), hia, r1);
                s2b = GK_DOT(GK_DOT(s2b, lob, r0), hib, r1);
            }
            i1a = GK_DOT_END(s1a);
            i2a = GK_DOT_END(s2a);
            i1b = GK_DOT_END(s1b);
            i2b = GK_DOT_END(s2b);
        } else {
#ifdef GK_AVXVNNI /* 8-bit codes straight into vpdpbusd: no nibbles */
            i1a = i2a = i1b = i2b = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i pa = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                __m256i pb = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
                __m256i a = gk_bcast(qb + 4 * c);
                i1a = gk_dp(i1a, pa, a);
                i1b = gk_dp(i1b, pb, a);
                if (!two) continue;
                __m256i r = gk_bcast(rb + 4 * c);
                i2a = gk_dp(i2a, pa, r);
                i2b = gk_dp(i2b, pb, r);
            }
#else
            if (two) { /* the digits combined (gk_dw) */
                const int16_t *ab = a + (size_t)b * GK_GROUP;
                i1a = i1b = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    __m256i pa = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                    __m256i pb = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
                    i1a = gk_dw(i1a, GK_EVEN(pa), GK_ODD(pa), ab + 4 * c);
                    i1b = gk_dw(i1b, GK_EVEN(pb), GK_ODD(pb), ab + 4 * c);
                }
            } else { /* one digit: the codes as nibbles (the high one weighted 16 by vpmaddwd) */
                __m256i l1a = _mm256_setzero_si256(), u1a = l1a, l1b = l1a, u1b = l1a;
                for (int c = 0; c < 8; c++) {
                    __m256i pa = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
                    __m256i pb = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
                    __m256i loa = _mm256_and_si256(pa, low), hia = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low);
                    __m256i lob = _mm256_and_si256(pb, low), hib = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low);
                    __m256i x = gk_bcast(qb + 4 * c);
                    l1a = _mm256_add_epi16(l1a, _mm256_maddubs_epi16(loa, x));
                    u1a = _mm256_add_epi16(u1a, _mm256_maddubs_epi16(hia, x));
                    l1b = _mm256_add_epi16(l1b, _mm256_maddubs_epi16(lob, x));
                    u1b = _mm256_add_epi16(u1b, _mm256_maddubs_epi16(hib, x));
                }
                i1a = _mm256_add_epi32(_mm256_madd_epi16(l1a, one), _mm256_madd_epi16(u1a, sixteen));
                i1b = _mm256_add_epi32(_mm256_madd_epi16(l1b, one), _mm256_madd_epi16(u1b, sixteen));
            }
            i2a = i1a;
            i2b = i1b;
#endif
        }
        const uint8_t *scales = wb + cb;
        float xd = dx[b], sxb = sx[b];
        gk_fold(&acc0, apart, i1a, i2a, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32))), xd, sxb);
        gk_fold(&acc1, apart, i1b, i2b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16))),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 48))), xd, sxb);
    }
    _mm256_storeu_ps(y, acc0);
    _mm256_storeu_ps(y + 8, acc1);
}

#if defined(GK_WIDE) && defined(__GNUC__) && !defined(__clang__)
#define GK_CHUNK_ASM 1 /* (gcc's operand syntax; other compilers take rows2_avx2's intrinsics) */
/* rows2_avx2's step for one 64-byte chunk (each of 16 outputs' next 8 codes) on AVX2 alone, written out
 * so that its sums stay in registers: gcc's own allocation of the intrinsics kept a sum on the stack,
 * whose load-add-store chain bounded the loop (about half the speed). The nibbles are taken apart once;
 * for each activation word at p (the 4 digits of the low codes, then at p + 4 of the high) vpmaddubsw
 * meets the codes of both groups of 8 outputs and vpaddw adds the int16 pairs into sums A (group 0)
 * and B (group 1): GK_DOT's operations in GK_DOT's order. */
#define GK_CHUNK_STEP(p, A, B)                                                                           \
    "vpbroadcastd (%[" p "]), %t[bc]\n\t"                                                                \
    "vpmaddubsw %t[bc], %t[la], %t[t]\n\tvpaddw %t[t], %t[" A "], %t[" A "]\n\t"                          \
    "vpmaddubsw %t[bc], %t[lb], %t[t]\n\tvpaddw %t[t], %t[" B "], %t[" B "]\n\t"                          \
    "vpbroadcastd 4(%[" p "]), %t[bc]\n\t"                                                               \
    "vpmaddubsw %t[bc], %t[ha], %t[t]\n\tvpaddw %t[t], %t[" A "], %t[" A "]\n\t"                          \
    "vpmaddubsw %t[bc], %t[hb], %t[t]\n\tvpaddw %t[t], %t[" B "], %t[" B "]\n\t"
#define GK_CHUNK_NIBBLES                                                                                 \
    "vmovdqu (%[pw]), %t[la]\n\tvpsrlw $4, %t[la], %t[ha]\n\t"                                            \
    "vpand %t[low], %t[la], %t[la]\n\tvpand %t[low], %t[ha], %t[ha]\n\t"                                  \
    "vmovdqu 32(%[pw]), %t[lb]\n\tvpsrlw $4, %t[lb], %t[hb]\n\t"                                          \
    "vpand %t[low], %t[lb], %t[lb]\n\tvpand %t[low], %t[hb], %t[hb]\n\t"

/* s[0..3]: row 0's sums (first digit groups 0, 1; second digit groups 0, 1), s[4..7] row 1's */
static inline __attribute__((always_inline)) void chunk2_two(const uint8_t *pw, const int8_t *q0, const int8_t *q1,
                                                             const int8_t *r0, const int8_t *r1, __m256i low,
                                                             __m256i *s) {
    __m256i la, ha, lb, hb, bc, t;
    __asm__(GK_CHUNK_NIBBLES GK_CHUNK_STEP("q0", "s0", "s1") GK_CHUNK_STEP("r0", "s2", "s3")
            GK_CHUNK_STEP("q1", "s4", "s5") GK_CHUNK_STEP("r1", "s6", "s7")
            : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3]), [s4] "+x"(s[4]),
              [s5] "+x"(s[5]), [s6] "+x"(s[6]), [s7] "+x"(s[7]), [la] "=&x"(la), [ha] "=&x"(ha), [lb] "=&x"(lb),
              [hb] "=&x"(hb), [bc] "=&x"(bc), [t] "=&x"(t)
            : [low] "x"(low), [pw] "r"(pw), [q0] "r"(q0), [q1] "r"(q1), [r0] "r"(r0), [r1] "r"(r1)
            : "memory");  /* (reads pw[0..63], q0/q1/r0/r1[0..7]: more operands than an asm takes) */
}

/* one digit: s[0..1] row 0's sums, s[2..3] row 1's */
static inline __attribute__((always_inline)) void chunk2_one(const uint8_t *pw, const int8_t *q0, const int8_t *q1,
                                                             __m256i low, __m256i *s) {
    __m256i la, ha, lb, hb, bc, t;
    __asm__(GK_CHUNK_NIBBLES GK_CHUNK_STEP("q0", "s0", "s1") GK_CHUNK_STEP("q1", "s2", "s3")
            : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3]), [la] "=&x"(la), [ha] "=&x"(ha),
              [lb] "=&x"(lb), [hb] "=&x"(hb), [bc] "=&x"(bc), [t] "=&x"(t)
            : [low] "x"(low), [pw] "r"(pw), [q0] "r"(q0), [q1] "r"(q1)
            : "memory");
}
#undef GK_CHUNK_STEP
#undef GK_CHUNK_NIBBLES
#endif

/* Two activation rows against one panel of 4-bit codes (the multi-row products' tile: prompts,
 * continuous batching's steps): row_avx2's pass for two rows at once, each 64-byte chunk's nibbles
 * taken apart once for both, each row's digits broadcast once for both groups of 8 outputs. Every
 * integer sum and float operation per lane is panel_avx2's (254 i1 + i2 through vpmaddwd's pairs), so
 * the products keep their bits. The loop's live values fit AVX2's 16 registers (8 int16 sums, 4 nibble
 * vectors, a broadcast, a product; chunk2_two); the float sums live in y, read and written once a block.
 * panel_avx2 with 4 rows kept 8 sums and 4 float sums live and spilled sums inside its inner loop: on
 * the Zen 3 EPYC at 1 thread this tile is 1.2-1.5x as fast (SmolLM2's shapes, 2-256 rows; bench/ab_block_products.py). */
static inline __attribute__((always_inline)) void rows2_avx2(int two, const uint8_t *w, int nb, const int8_t *q,
                                                            const int8_t *q2, const float *dx, const float *sx,
                                                            int K, float *y, int ldy, int pf) {
    for (int i = 0; i < 2; i++)  /* (kept in registers, gcc spilled int16 sums for them) */
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, _mm256_setzero_ps());
    const __m256i low = _mm256_set1_epi8(0x0F);
    __attribute__((unused)) const __m256i one = _mm256_set1_epi16(1);  /* not with AVX-VNNI */
    const size_t pbytes = (size_t)nb * 320;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 320;
        if (pf) fetch_ahead(wb, 320, pbytes);
        __m256i s[2][4];  /* per row: group 0's and group 1's sums of the first digit, then of the second */
        for (int i = 0; i < 2; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = _mm256_setzero_si256();
#ifdef GK_CHUNK_ASM
        __m256i *sums = &s[0][0];
        for (int c = 0; c < 4; c++) {
            const size_t off = (size_t)b * GK_GROUP + 8 * c;
            if (two)
                chunk2_two(wb + 64 * c, q + off, q + K + off, q2 + off, q2 + K + off, low, sums);
            else
                chunk2_one(wb + 64 * c, q + off, q + K + off, low, sums);
        }
        if (!two) { /* (chunk2_one's order: row 0's two sums, then row 1's) */
            s[1][0] = s[0][2];
            s[1][1] = s[0][3];
        }
#else
        for (int c = 0; c < 4; c++) {
            __m256i pa = _mm256_loadu_si256((const __m256i *)(wb + 64 * c));
            __m256i pb = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32));
            __m256i loa = _mm256_and_si256(pa, low), hia = _mm256_and_si256(_mm256_srli_epi16(pa, 4), low);
            __m256i lob = _mm256_and_si256(pb, low), hib = _mm256_and_si256(_mm256_srli_epi16(pb, 4), low);
            for (int i = 0; i < 2; i++) {
                size_t off = (size_t)i * K + (size_t)b * GK_GROUP + 8 * c;
                __m256i a0 = gk_bcast(q + off), a1 = gk_bcast(q + off + 4);
                s[i][0] = GK_DOT(GK_DOT(s[i][0], loa, a0), hia, a1);
                s[i][1] = GK_DOT(GK_DOT(s[i][1], lob, a0), hib, a1);
                if (!two) continue;
                __m256i r0 = gk_bcast(q2 + off), r1 = gk_bcast(q2 + off + 4);
                s[i][2] = GK_DOT(GK_DOT(s[i][2], loa, r0), hia, r1);
                s[i][3] = GK_DOT(GK_DOT(s[i][3], lob, r0), hib, r1);
            }
        }
#endif
        const uint8_t *scales = wb + 256;
        for (int i = 0; i < 2; i++) {
            float xd = dx[(size_t)i * nb + b], sxb = sx[(size_t)i * nb + b];
            for (int h = 0; h < 2; h++) {
                __m256 a = _mm256_loadu_ps(y + (size_t)i * ldy + 8 * h);
#ifdef GK_AVXVNNI
                const int apart = two;
                __m256i i1 = s[i][h], i2 = two ? s[i][2 + h] : i1;
#else  /* 254 i1 + i2 (digits256) as vpmaddwd's pairs: the int16 sums times 254 and 1, the same integers */
                const int apart = 0;
                __m256i i1 = two ? _mm256_add_epi32(_mm256_madd_epi16(s[i][h], _mm256_set1_epi16(254)),
                                                    _mm256_madd_epi16(s[i][2 + h], one))
                                 : _mm256_madd_epi16(s[i][h], one), i2 = i1;
#endif
                gk_fold(&a, apart, i1, i2, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * h))),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * h))), xd, sxb);
                _mm256_storeu_ps(y + (size_t)i * ldy + 8 * h, a);
            }
        }
    }
}

/* rows2_avx2 with the digit count a constant, each its own function: inlined into matmul_panels'
 * loops, gcc kept that function's constants in registers and spilled the sums */
static __attribute__((noinline)) void rows2_avx2_one(const uint8_t *w, int nb, const int8_t *q, const float *dx,
                                                     const float *sx, int K, float *y, int ldy, int pf) {
    rows2_avx2(0, w, nb, q, q, dx, sx, K, y, ldy, pf);
}

static __attribute__((noinline)) void rows2_avx2_two(const uint8_t *w, int nb, const int8_t *q, const int8_t *q2,
                                                     const float *dx, const float *sx, int K, float *y, int ldy,
                                                     int pf) {
    rows2_avx2(1, w, nb, q, q2, dx, sx, K, y, ldy, pf);
}
#endif

__attribute__((unused)) static void panel_portable(int bits, int two, const uint8_t *w, int nb, const int8_t *q,
                                                   const int8_t *q2, const float *dx, const float *sx,
                                                   const float *sx16, int K, int MT, float *y, int ldy) {
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    const int halves = bits == 6 ? 2 : 1, span = GK_GROUP / halves;
    for (int i = 0; i < MT; i++) {
        float acc[GK_ROWS] = {0};
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = w + (size_t)b * bb;
            const int8_t *xq = q + (size_t)i * K + (size_t)b * GK_GROUP;
            const int8_t *xr = two ? q2 + (size_t)i * K + (size_t)b * GK_GROUP : xq;
            float xd = dx[(size_t)i * nb + b];
            for (int half = 0; half < halves; half++) {
                const uint16_t *dh = (const uint16_t *)(wb + cb), *mh = dh + GK_ROWS;
                float xs = halves == 2 ? sx16[2 * ((size_t)i * nb + b) + half] : sx[(size_t)i * nb + b];
                for (int r = 0; r < GK_ROWS; r++) {
                    int32_t isum = 0, isum2 = 0;
                    for (int k = span * half; k < span * (half + 1); k++) {
                        int code;
                        if (bits == 4) {
                            int c = k / 8, j = k % 8;
                            uint8_t byte = wb[64 * c + 4 * r + (j & 3)];
                            code = j < 4 ? (byte & 0x0F) : (byte >> 4);
                        } else {
                            code = wb[64 * (k / 4) + 4 * r + (k % 4)];
                        }
                        isum += code * (int)xq[k];
                        isum2 += two ? code * (int)xr[k] : 0;
                    }
                    float dw, mw;
                    if (bits == 6) {
                        memcpy(&dw, wb + cb + 64 * half + 4 * r, 4);
                        mw = -32.0f * dw;
                    } else {
                        uint16_t dr, mr;
                        memcpy(&dr, dh + r, 2);
                        memcpy(&mr, mh + r, 2);
                        dw = f16_to_f32(dr);
                        mw = f16_to_f32(mr);
                    }
                    acc[r] += (float)(two ? 254 * isum + isum2 : isum) * (dw * xd) + mw * xs;
                }
            }
        }
        for (int r = 0; r < GK_ROWS; r++) y[(size_t)i * ldy + r] = acc[r];
    }
}

static void matmul_panels(int bits, int two, const uint8_t *w, size_t panel_bytes, int panels, int nb,
                          const int8_t *q, const int8_t *q2, const int16_t *a16, const float *dx, const float *sx,
                          const float *sx16, float *y, int M, int N, int K, int threads);

#ifdef GK_AMX
/* AMX: per block of 32 weights, C(16 tokens x 16 rows) = A(tokens x 32 int8 digits) . B(8 x 64 bytes:
 * the panel's codes, 4 per row per B row: exactly the 8-bit layout's chunks, and the 4-bit layout's
 * chunks split into low and high nibbles) with TDPBSUD (signed A, unsigned B), once per digit. The
 * int32 sums equal the VNNI path's, and they are scaled in the same order, so the results are the
 * same bits. Tiles: 0 = B, 1-2 = A (q1, q2), 3-4 and 5-6 = C (two blocks in flight: a block's sums
 * are stored while the next block's products run, and scaled one block later, so that neither the
 * tile unit nor the vector units wait for the other). Activations come padded to 16 rows. */
#define GK_AMX_REST 12  /* fewer rows than this after the last 16 go to the vector path */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gk_tilecfg;

static void amx_config(void) {
    gk_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = 8;
    cfg.colsb[0] = 64;
    for (int t = 1; t <= 2; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 32;
    }
    for (int t = 3; t <= 6; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The B tiles of a 4-bit panel (nb blocks of 8 x 64 bytes: low nibbles, then high, per chunk), made
 * once per panel for all its row groups. */
static void amx_unpack4(const uint8_t *w, int nb, uint8_t *bt) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * block_bytes(4);
        uint8_t *o = bt + (size_t)b * 512;
        for (int c = 0; c < 4; c++) {
            __m512i p = _mm512_loadu_si512((const void *)(wb + 64 * c));
            _mm512_store_si512((void *)(o + 128 * c), _mm512_and_si512(p, low));
            _mm512_store_si512((void *)(o + 128 * c + 64), _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
        }
    }
}

/* Block b's products into C tiles c1, c2 (3-4 or 5-6: macros, as tile numbers must be immediates). */
#define GK_AMX_TDP(c1, c2) do {                                    \
        _tile_zero(c1);                                            \
        _tile_loadd(0, bsrc, 64);                                  \
        _tile_loadd(1, q + (size_t)b * 512, 32);                   \
        _tile_dpbsud(c1, 1, 0);                                    \
        if (two) {                                                 \
            _tile_zero(c2);                                        \
            _tile_loadd(2, q2 + (size_t)b * 512, 32);              \
            _tile_dpbsud(c2, 2, 0);                                \
        }                                                          \
    } while (0)
#define GK_AMX_STORE(c1, c2, slot) do {                            \
        _tile_stored(c1, cs[slot][0], 64);                         \
        if (two) _tile_stored(c2, cs[slot][1], 64);                \
    } while (0)

static void panel_amx(int bits, int two, const uint8_t *w, const uint8_t *bt, int nb, const int8_t *q,
                      const int8_t *q2, const float *dx, const float *sx, int MT, float *y, int ldy) {
    __m512 acc[16];
    int32_t cs[2][2][16][16] __attribute__((aligned(64)));
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b <= nb + 1; b++) {
        if (b < nb) {
            const void *bsrc = bits == 4 ? (const void *)(bt + (size_t)b * 512) : (const void *)(w + (size_t)b * bb);
            if (b & 1) GK_AMX_TDP(5, 6); else GK_AMX_TDP(3, 4);
        }
        if (b >= 1 && b <= nb) {  /* block b - 1's sums out of the tiles (its products ran while block b's were issued) */
            if ((b - 1) & 1) GK_AMX_STORE(5, 6, 1); else GK_AMX_STORE(3, 4, 0);
        }
        if (b >= 2) {  /* block b - 2's sums, stored one block ago, scaled */
            const int p = b - 2, slot = p & 1;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (size_t)p * bb + cb)));
            for (int i = 0; i < MT; i++) {
                __m512i s1 = _mm512_load_si512((const void *)cs[slot][0][i]);
                __m512i s = two ? digits512(1, s1, _mm512_load_si512((const void *)cs[slot][1][i])) : s1;
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)i * nb + p])),
                                         acc[i]);
            }
        }
    }
    /* the offsets' sums, each row's in the same order of blocks as the VNNI path, the 16 rows side by side
     * (one row after another would be one chain of dependent multiply-adds) */
    __m512 accm[16];
    for (int i = 0; i < 16; i++) accm[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (size_t)b * bb + cb + 32)));
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) accm[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)i * nb + b]), accm[i]);
    }
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + (size_t)i * ldy, _mm512_add_ps(acc[i], accm[i]));
}
#undef GK_AMX_TDP
#undef GK_AMX_STORE

/* gk_matmul on AMX tiles (4- and 8-bit weights; M >= 16, see gk_matmul): activations quantized into rows
 * padded to 16. */
static int matmul_amx(int bits, const uint8_t *w, const float *x, float *y, int M, int N, int K, int threads, int act) {
    int nb = K / GK_GROUP, panels = N / GK_ROWS, Mp = (M + 15) / 16 * 16;
    size_t panel_bytes = (size_t)nb * block_bytes(bits);
    int8_t *q = (int8_t *)calloc(2 * (size_t)Mp * K + 4 * sizeof(float) * (size_t)Mp * nb + 64, 1);
    if (q == NULL) return -1;
    int8_t *q2 = q + (size_t)Mp * K;
    float *dx = (float *)(((uintptr_t)(q2 + (size_t)Mp * K) + 63) & ~(uintptr_t)63);
    float *sx = dx + (size_t)Mp * nb, *sx16 = sx + (size_t)Mp * nb;
    quantize_rows(x, M, K, q, q2, dx, sx, sx16, threads, act);
    if (threads > panels) threads = panels;
    /* the rows after the last 16 when they are few: on the vector path (same bits), since a tile group of
     * rows padded to 16 costs as much as 16 rows there; Ma >= 16 rows (M >= 16) stay for the tiles */
    const int rest = M % 16 < GK_AMX_REST ? M % 16 : 0, Ma = M - rest, Mt = (Ma + 15) / 16 * 16;
    /* the A tiles of those rows one after the other: per group of 16 rows, per block, 16 x 32 digits */
    int8_t *qa = (int8_t *)aligned_alloc(64, 2 * (size_t)Mt * K);
    if (qa == NULL) {
        free(q);
        return -1;
    }
    int8_t *qa2 = qa + (size_t)Mt * K;
    for (int m0 = 0; m0 < Mt; m0 += 16)
        for (int b = 0; b < nb; b++)
            for (int r = 0; r < 16; r++) {
                size_t o = ((size_t)m0 * nb + (size_t)b * 16 + (size_t)r) * GK_GROUP, i = (size_t)(m0 + r) * K + (size_t)b * GK_GROUP;
                memcpy(qa + o, q + i, GK_GROUP);
                if (act == GK_ACT_TWO) memcpy(qa2 + o, q2 + i, GK_GROUP);
            }
    int failed = 0;
    if (rest)
        matmul_panels(bits, act == GK_ACT_TWO, w, panel_bytes, panels, nb, q + (size_t)Ma * K, q2 + (size_t)Ma * K, NULL,
                      dx + (size_t)Ma * nb, sx + (size_t)Ma * nb, sx16 + 2 * (size_t)Ma * nb, y + (size_t)Ma * N, rest, N, K,
                      threads);
    /* panels in groups of at most 16 and 512 KB of B tiles (they stay in the L2 cache), the groups shared evenly by the
     * threads; per group, each 16 rows' A tiles go through all its panels (the outputs written row by row) */
    const int most = nb >= 1024 ? 1 : (1024 / nb < 16 ? 1024 / nb : 16);  /* at most 512 KB of B tiles */
    const int per = (panels + threads * most - 1) / (threads * most), group = (panels + threads * per - 1) / (threads * per);
    const int groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *bt = bits == 4 ? (uint8_t *)aligned_alloc(64, (size_t)group * nb * 512) : NULL;
        if (bits == 4 && bt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        amx_config();
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            if (bits == 4 && bt == NULL) continue;
            const int p0 = g * group, p1 = p0 + group < panels ? p0 + group : panels;
            if (bits == 4)
                for (int p = p0; p < p1; p++) amx_unpack4(w + (size_t)p * panel_bytes, nb, bt + (size_t)(p - p0) * nb * 512);
            for (int m0 = 0; m0 < Ma; m0 += 16) {
                int mt = Ma - m0 < 16 ? Ma - m0 : 16;
                for (int p = p0; p < p1; p++)
                    panel_amx(bits, act == GK_ACT_TWO, w + (size_t)p * panel_bytes, bt + (size_t)(p - p0) * nb * 512, nb,
                              qa + (size_t)m0 * K, qa2 + (size_t)m0 * K, dx + (size_t)m0 * nb, sx + (size_t)m0 * nb, mt,
                              y + (size_t)m0 * N + (size_t)p * GK_ROWS, N);
            }
        }
        _tile_release();
        free(bt);
    }
    free(qa);
    free(q);
    return failed ? -1 : 0;
}
#endif


/* ---- numerics="llama.cpp": the float operations of llama.cpp's CPU backend (AVX2 build), in its order ----
 * so that a decode step gives the same bits as ggml's, not just the same rule up to rounding. */

/* One panel (16 rows) times one activation row, as ggml_vec_dot_q4_1_q8_1 / _q4_0_q8_0 / _q8_0_q8_0 sum
 * on AVX2: per block, 8 lanes of 4 consecutive products (integer), each lane accumulated as
 * fma(d_w * d_x, lane, acc); Q4_1's offsets as summs = fma(m, s_x, summs); the result is
 * ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)) + summs (hsum_float_8). Symmetric weights (act
 * GK_ACT_LLAMA_Q8_0) use the signed codes u - 8 (4-bit) or u - 128 (8-bit), as Q4_0 and Q8_0 store them. */
static __attribute__((unused)) void panel_llama(int bits, int act, const uint8_t *w, int nb, const int8_t *q, const float *dx,
                        const float *sx, float *y) {
    /* rows innermost: each row's operations stay in llama.cpp's order, the 16 rows go side by side */
    float acc[8][GK_ROWS], summ[GK_ROWS], dw[GK_ROWS], mw[GK_ROWS];
    memset(acc, 0, sizeof acc);
    memset(summ, 0, sizeof summ);
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512, off = bits == 4 ? 8 : 128;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb;
        const int8_t *qb = q + (size_t)b * GK_GROUP;
        uint16_t dh[GK_ROWS], mh[GK_ROWS];
        memcpy(dh, wb + cb, sizeof dh);
        memcpy(mh, wb + cb + sizeof dh, sizeof mh);
        for (int r = 0; r < GK_ROWS; r++) {
            dw[r] = f16_to_f32(dh[r]) * dx[b];  /* d0 * d1 */
            mw[r] = f16_to_f32(mh[r]);
        }
        int is[8][GK_ROWS];
        for (int l = 0; l < 8; l++) {
            /* lane l holds the block's values 4l..4l+3: 4-bit chunk l/2, low nibbles for even l */
            const uint8_t *chunk = wb + 64 * (bits == 4 ? l / 2 : l);
            const int shift = bits == 4 ? 4 * (l & 1) : 0, mask = bits == 4 ? 15 : 255;
            const int8_t *ql = qb + 4 * l;
            const int qsum = act == GK_ACT_LLAMA_Q8_0 ? off * (ql[0] + ql[1] + ql[2] + ql[3]) : 0;
            for (int r = 0; r < GK_ROWS; r++) {
                const uint8_t *c4 = chunk + 4 * r;
                is[l][r] = ((c4[0] >> shift) & mask) * ql[0] + ((c4[1] >> shift) & mask) * ql[1] +
                           ((c4[2] >> shift) & mask) * ql[2] + ((c4[3] >> shift) & mask) * ql[3] - qsum;
            }
        }
        for (int l = 0; l < 8; l++)
            for (int r = 0; r < GK_ROWS; r++) acc[l][r] = fmaf(dw[r], (float)is[l][r], acc[l][r]);
        if (act == GK_ACT_LLAMA_Q8_1)
            for (int r = 0; r < GK_ROWS; r++) summ[r] = fmaf(mw[r], sx[b], summ[r]);
    }
    for (int r = 0; r < GK_ROWS; r++) {
        float h0 = acc[4][r] + acc[0][r], h1 = acc[5][r] + acc[1][r], h2 = acc[6][r] + acc[2][r],
              h3 = acc[7][r] + acc[3][r];
        y[r] = ((h0 + h2) + (h1 + h3)) + summ[r];
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* panel_llama with 8 rows per vector: the same integer lane sums (exact, however they are formed) and
 * the same float operations per row in the same order (fma per lane and block, the offsets' fma, the
 * pairwise final sum), so its results are panel_llama's bit for bit (tests/test_llama_numerics.py). */
/* 8-bit codes u = s + 128 times int8 q, 4 products per 32-bit lane: sum u q = sum s q + 128 sum q,
 * with s q as |s| times sign(q, s) (exact) */
static inline __m256i lane_sums_llama_u8(__m256i v, __m256i a) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    __m256i sq = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(a, s)), ones);
    __m256i qs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), ones);
    return _mm256_add_epi32(sq, _mm256_slli_epi32(qs, 7));
}

/* The codes of lane l from its weight bytes v: 4-bit, the nibbles (*u); Q8_0, the signed codes s = v - 128
 * (*u) and |s| (*su); 8-bit Q8_1, v itself */
static inline __attribute__((always_inline)) void lane_codes_llama(int bits, int act, int l, __m256i v, __m256i *u,
                                                                   __m256i *su) {
    *u = *su = v;
    if (bits == 4) {
        *u = _mm256_and_si256(l & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    } else if (act == GK_ACT_LLAMA_Q8_0) {
        *u = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
        *su = _mm256_sign_epi8(*u, *u);
    }
}

/* The 8 rows' integer sums of lane l (4 products each) with the activations ql[0..3] (lane_codes_llama's
 * u, su of the weight bytes v): exact, as ggml's are; Q4_0's and Q8_0's are of the signed codes */
static inline __attribute__((always_inline)) __m256i lane_sum_llama(int bits, int act, __m256i v, __m256i u, __m256i su,
                                                                    const int8_t *ql) {
    int32_t a4;
    memcpy(&a4, ql, 4);
    const __m256i a = _mm256_set1_epi32(a4), ones = _mm256_set1_epi16(1);
    if (bits == 4) {  /* codes 0..15 times int8: pair sums stay far inside int16 */
        __m256i is = _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones);
        if (act == GK_ACT_LLAMA_Q8_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * (ql[0] + ql[1] + ql[2] + ql[3])));
        return is;
    }
    if (act == GK_ACT_LLAMA_Q8_0)  /* s q as |s| times q with s's sign */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(su, _mm256_sign_epi8(a, u)), ones);
    return lane_sums_llama_u8(v, a);
}

/* One panel times one activation row, 8 panel rows per register, all 8 lanes in one pass over the blocks */
static inline __attribute__((always_inline)) void panel_llama_avx2(int bits, int act, const uint8_t *w, int nb,
                                                                   const int8_t *q, const float *dx, const float *sx,
                                                                   float *y) {
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int g = 0; g < 2; g++) {  /* rows 8g..8g+7 */
        __m256 acc[8], summ = _mm256_setzero_ps();
        for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = w + (size_t)b * bb;
            const int8_t *qb = q + (size_t)b * GK_GROUP;
            if (g == 0 && GK_PREFETCH > 0)  /* the second pass finds the panel in the cache */
                for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)(wb + GK_PREFETCH + off), _MM_HINT_T0);
            const __m256 dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + cb + 16 * g))),
                                            _mm256_set1_ps(dx[b]));
            for (int l = 0; l < 8; l++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * (bits == 4 ? l / 2 : l) + 32 * g));
                __m256i u, su;
                lane_codes_llama(bits, act, l, v, &u, &su);
                acc[l] = _mm256_fmadd_ps(dw, _mm256_cvtepi32_ps(lane_sum_llama(bits, act, v, u, su, qb + 4 * l)), acc[l]);
            }
            if (act == GK_ACT_LLAMA_Q8_1) {
                const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + cb + 32 + 16 * g)));
                summ = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[b]), summ);
            }
        }
        __m256 h0 = _mm256_add_ps(acc[4], acc[0]), h1 = _mm256_add_ps(acc[5], acc[1]);
        __m256 h2 = _mm256_add_ps(acc[6], acc[2]), h3 = _mm256_add_ps(acc[7], acc[3]);
        _mm256_storeu_ps(y + 8 * g, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(h0, h2), _mm256_add_ps(h1, h3)), summ));
    }
}

/* Lanes l0..l0+3 of panel rows 8g..8g+7 times two activation rows (q, q + K; dx, sx and dx, sx + nb) over
 * all blocks, into acc[m][l0..l0+3] (and Q8_1's offset sums into summ[m] when l0 is 0): the rows share
 * the weight loads and their unpacking; each accumulator's operations are panel_llama_avx2's */
static inline __attribute__((always_inline)) void lanes2_llama_avx2(
        int bits, int act, int l0, int g, const uint8_t *w, int nb, const int8_t *q, int K, const float *dx,
        const float *sx, __m256 acc[2][8], __m256 summ[2]) {
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb;
        if (l0 == 0 && g == 0 && GK_PREFETCH > 0)  /* the first of panel2_llama_avx2's four passes */
            for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)(wb + GK_PREFETCH + off), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + cb + 16 * g)));
        const __m256 dw[2] = {_mm256_mul_ps(d, _mm256_set1_ps(dx[b])), _mm256_mul_ps(d, _mm256_set1_ps(dx[nb + b]))};
        for (int l = l0; l < l0 + 4; l++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * (bits == 4 ? l / 2 : l) + 32 * g));
            __m256i u, su;
            lane_codes_llama(bits, act, l, v, &u, &su);
            for (int m = 0; m < 2; m++) {
                const __m256i is = lane_sum_llama(bits, act, v, u, su, q + (size_t)m * K + (size_t)b * GK_GROUP + 4 * l);
                acc[m][l] = _mm256_fmadd_ps(dw[m], _mm256_cvtepi32_ps(is), acc[m][l]);
            }
        }
        if (act == GK_ACT_LLAMA_Q8_1 && l0 == 0) {
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + cb + 32 + 16 * g)));
            for (int m = 0; m < 2; m++) summ[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[(size_t)m * nb + b]), summ[m]);
        }
    }
}

/* panel_llama_avx2 for two activation rows (row m: q + m K, dx/sx + m nb, y + m N): the lanes in two
 * passes of 4 over the blocks (lanes2_llama_avx2), so that the two rows' accumulators fit the 16
 * registers; then each row's final sums as panel_llama's */
static inline __attribute__((always_inline)) void panel2_llama_avx2(int bits, int act, const uint8_t *w, int nb,
                                                                    const int8_t *q, int K, const float *dx,
                                                                    const float *sx, float *y, int N) {
    for (int g = 0; g < 2; g++) {
        __m256 acc[2][8], summ[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int m = 0; m < 2; m++)
            for (int l = 0; l < 8; l++) acc[m][l] = _mm256_setzero_ps();
        lanes2_llama_avx2(bits, act, 0, g, w, nb, q, K, dx, sx, acc, summ);
        lanes2_llama_avx2(bits, act, 4, g, w, nb, q, K, dx, sx, acc, summ);
        for (int m = 0; m < 2; m++) {
            const __m256 *a = acc[m];
            __m256 h0 = _mm256_add_ps(a[4], a[0]), h1 = _mm256_add_ps(a[5], a[1]);
            __m256 h2 = _mm256_add_ps(a[6], a[2]), h3 = _mm256_add_ps(a[7], a[3]);
            _mm256_storeu_ps(y + (size_t)m * N + 8 * g,
                             _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(h0, h2), _mm256_add_ps(h1, h3)), summ[m]));
        }
    }
}

/* panel_llama_avx2 specialised for each weight kind and row count (constants): the M rows two at a time */
#define GK_LLAMA_KIND(B, A)                                                                                    \
    for (int m = 0; m < M; m += 2) {                                                                           \
        if (M - m >= 2) {                                                                                      \
            panel2_llama_avx2(B, A, w, nb, q + (size_t)m * K, K, dx + (size_t)m * nb, sx + (size_t)m * nb,       \
                              y + (size_t)m * N, N);                                                           \
        } else {                                                                                               \
            float out[GK_ROWS];                                                                                \
            panel_llama_avx2(B, A, w, nb, q + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb, out);     \
            memcpy(y + (size_t)m * N, out, sizeof out);                                                        \
        }                                                                                                      \
    }
#ifdef GK_VNNI
/* panel_llama with the panel's 16 rows in one register: a lane's sums of four products are one
 * vpdpbusd (the same exact integers), and each row's float operations are panel_llama's in its order,
 * so the results are panel_llama's bit for bit (tests/test_llama_numerics.py) */
static inline __attribute__((always_inline)) void panel_llama_vnni(int bits, int act, const uint8_t *w, int nb,
                                                                   const int8_t *q, const float *dx, const float *sx,
                                                                   float *y) {
    const int bb = block_bytes(bits), cb = bits == 4 ? 256 : 512, off = bits == 4 ? 8 : 128;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[8], summ = _mm512_setzero_ps();
    for (int l = 0; l < 8; l++) acc[l] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * bb;
        const int8_t *qb = q + (size_t)b * GK_GROUP;
        if (GK_PREFETCH > 0)
            for (int o = 0; o < bb; o += 64) {
                _mm_prefetch((const char *)(wb + GK_PREFETCH + o), _MM_HINT_T0);
                /* the next panel's weights as far ahead, into L2 (row_vnni's two streams per panel) */
                _mm_prefetch((const char *)(wb + (size_t)nb * bb + GK_PREFETCH + o), _MM_HINT_T1);
            }
        const __m512 dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb))),
                                        _mm512_set1_ps(dx[b]));
        for (int l = 0; l < 8; l++) {
            __m512i v = _mm512_loadu_si512((const void *)(wb + 64 * (bits == 4 ? l / 2 : l)));
            if (bits == 4) v = _mm512_and_si512(l & 1 ? _mm512_srli_epi16(v, 4) : v, low);
            const int8_t *ql = qb + 4 * l;
            int32_t a;
            memcpy(&a, ql, 4);
            __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_set1_epi32(a));
            if (act == GK_ACT_LLAMA_Q8_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(off * (ql[0] + ql[1] + ql[2] + ql[3])));
            acc[l] = _mm512_fmadd_ps(dw, _mm512_cvtepi32_ps(is), acc[l]);
        }
        if (act == GK_ACT_LLAMA_Q8_1) {
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + cb + 32)));
            summ = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[b]), summ);
        }
    }
    __m512 h0 = _mm512_add_ps(acc[4], acc[0]), h1 = _mm512_add_ps(acc[5], acc[1]);
    __m512 h2 = _mm512_add_ps(acc[6], acc[2]), h3 = _mm512_add_ps(acc[7], acc[3]);
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(h0, h2), _mm512_add_ps(h1, h3)), summ));
}

/* with AVX-512 VNNI: panel_llama_vnni for each weight kind, row after row (the panel stays in L1) */
#undef GK_LLAMA_KIND
#define GK_LLAMA_KIND(B, A)                                                                                  \
    for (int m = 0; m < M; m++)                                                                              \
        panel_llama_vnni(B, A, w, nb, q + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb, y + (size_t)m * N);
#endif
static void panel_llama_rows(int bits, int act, const uint8_t *w, int nb, const int8_t *q, int K, const float *dx,
                             const float *sx, float *y, int N, int M) {
    if (bits == 4 && act == GK_ACT_LLAMA_Q8_1) GK_LLAMA_KIND(4, GK_ACT_LLAMA_Q8_1)
    else if (bits == 4) GK_LLAMA_KIND(4, GK_ACT_LLAMA_Q8_0)
    else if (act == GK_ACT_LLAMA_Q8_0) GK_LLAMA_KIND(8, GK_ACT_LLAMA_Q8_0)
    else GK_LLAMA_KIND(8, GK_ACT_LLAMA_Q8_1)
}
#undef GK_LLAMA_KIND
#else
/* the portable build: panel_llama row after row */
static void panel_llama_rows(int bits, int act, const uint8_t *w, int nb, const int8_t *q, int K, const float *dx,
                             const float *sx, float *y, int N, int M) {
    for (int m = 0; m < M; m++) {
        float out[GK_ROWS];
        panel_llama(bits, act, w, nb, q + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb, out);
        memcpy(y + (size_t)m * N, out, sizeof out);
    }
}
#endif

/* gk_matmul for the llama.cpp-order acts: activations rounded as GK_ACT_Q8_1 / _Q8_0, then panel_llama */
static int matmul_llama(int bits, const uint8_t *w, const float *x, float *y, int M, int N, int K, int threads,
                        int act) {
    int nb = K / GK_GROUP, panels = N / GK_ROWS;
    size_t panel_bytes = (size_t)nb * block_bytes(bits);
    int8_t *q = (int8_t *)malloc((size_t)M * K + 4 * sizeof(float) * (size_t)M * nb + 64);
    if (q == NULL) return -1;
    float *dx = (float *)(((uintptr_t)(q + (size_t)M * K) + 63) & ~(uintptr_t)63);
    float *sx = dx + (size_t)M * nb, *sx16 = sx + (size_t)M * nb;
    GK_T0;
    quantize_rows(x, M, K, q, NULL, dx, sx, sx16, threads, act - 2);
    GK_T(GK_P_QUANT);
    if (threads > panels) threads = panels;
    gk_share share;
    share_init(&share, panels, threads);
#pragma omp parallel num_threads(threads)
    for (int t = omp_get_thread_num(), r = 0, a, b; share_next(&share, t, &r, &a, &b);)
        for (int p = a; p < b; p++)
            panel_llama_rows(bits, act, w + (size_t)p * panel_bytes, nb, q, K, dx, sx, y + (size_t)p * GK_ROWS, N, M);
    GK_T(gk_prof_cat == GK_P_OTHER && M == 1 ? GK_P_HEAD : gk_prof_cat);
    GK_CAT(GK_P_OTHER);
    free(q);
    return 0;
}

/* A product of at least this many rows asks for the next panel's weights while it works on a panel:
 * a panel's tiles take long enough that the hardware's prefetchers, which do not look past the 4 KB
 * page, leave the next panel's first reads waiting on memory (Zen 5 EPYC, 1 thread: the LM head's
 * product of 16-64 rows 24-30 % faster, a quantized continuous-batching run of 32 requests 5-7 %, of 8
 * requests 4.5 % more with 8 rows than with 16 as the threshold); fewer rows are bound by reading the
 * weights, which those prefetchers stream well (4 rows: 5-30 % slower with it, a run of 4 requests
 * 8 %). matmul_llama's panels are bound by their float steps: no gain there, none asked. */
#define GK_PANEL_PREFETCH_ROWS 8
/* matmul_panels takes a product's rows GK_MB at a time through all of a chunk's panels: their activations
 * (two digits of 16 rows: 18 KB for K = 576) stay in L1 while the chunk's weights come from L2; panel by
 * panel, a prompt's 256 rows were read from L2 again for each panel (3-12 % slower on the Zen 3 EPYC) */
#define GK_MB 16

/* Asks for the part of the next panel (`next`, panel_bytes long) that rows m0..m0+mt-1 of M stand
 * for, so that the panel's tiles together ask for all of it, spread over their work */
static inline void prefetch_panel_part(const uint8_t *next, size_t panel_bytes, int m0, int mt, int M) {
    size_t lo = panel_bytes * (size_t)m0 / (size_t)M, hi = panel_bytes * (size_t)(m0 + mt) / (size_t)M;
    for (size_t off = lo & ~(size_t)63; off < hi; off += 64) __builtin_prefetch(next + off, 0, 3);
}

/* y (M, N) of gk_matmul's quantized activations (q, q2, dx, sx, sx16): each panel's rows GK_MT at a
 * time through the vector tile (panel_vnni, panel_avx2, row_avx2) or the portable loops, panels
 * shared among threads */
static void matmul_panels(int bits, int two, const uint8_t *w, size_t panel_bytes, int panels, int nb,
                          const int8_t *q, const int8_t *q2, const int16_t *a16, const float *dx, const float *sx,
                          const float *sx16, float *y, int M, int N, int K, int threads) {
    gk_share share;
    share_init(&share, panels, threads);
#pragma omp parallel num_threads(threads)
    for (int t = omp_get_thread_num(), r = 0, a, b; share_next(&share, t, &r, &a, &b);) {
        for (int mb = 0; mb < M; mb += GK_MB)
        for (int p = a; p < b; p++) {
            const uint8_t *wp = w + (size_t)p * panel_bytes;
            const int me = M - mb < GK_MB ? M : mb + GK_MB;
            for (int m0 = mb; m0 < me; m0 += GK_MT) {
                int mt = me - m0 < GK_MT ? me - m0 : GK_MT;
                if (mb == 0 && M >= GK_PANEL_PREFETCH_ROWS && p + 1 < b) prefetch_panel_part(wp + panel_bytes, panel_bytes, m0, mt, me);
                const int8_t *qm = q + (size_t)m0 * K, *rm = q2 + (size_t)m0 * K;
                __attribute__((unused)) const int16_t *am = a16 == NULL ? NULL : a16 + (size_t)m0 * K;
                const float *dm = dx + (size_t)m0 * nb, *sm = sx + (size_t)m0 * nb, *hm = sx16 + 2 * (size_t)m0 * nb;
                float *ym = y + (size_t)m0 * N + (size_t)p * GK_ROWS;
                /* the first pass over a panel reads its weights as a one-row product does (row_vnni): asks
                 * for them GK_PREFETCH bytes ahead, and two panels further on into L2 (one core reads faster
                 * with more reads in flight). On the AVX-512 Xeon guest, quantized continuous batching of 2
                 * requests 1.26x / 1.54x as fast (1 / 2 threads), 4 requests 1.32x / 1.39x, 8-16 requests
                 * 1.07-1.14x, the AVX2 build 1.04-1.23x there; the same bits (session 32) */
                __attribute__((unused)) const int pf = m0 == 0;
#if defined(GK_VNNI) || defined(GK_AVX2)
/* bits, the digit count, the tile's rows and whether it fetches ahead as constants, so that each tile is
 * its own specialised loop (tiles that do not fetch ahead compile as they did without it) */
#define GK_SWITCH(B, D, F)                      \
    switch (mt) {                               \
        case 1: GK_TILE(B, D, 1, F); break;     \
        case 2: GK_TILE(B, D, 2, F); break;     \
        case 3: GK_TILE(B, D, 3, F); break;     \
        default: GK_TILE(B, D, 4, F); break;    \
    }
#ifdef GK_VNNI /* a panel's 16 rows in one register */
#define GK_TILE(B, D, MT, F) panel_vnni(B, D, wp, nb, qm, rm, dm, sm, hm, K, MT, ym, N, F)
#define GK_TILES(B, D, F) GK_SWITCH(B, D, F)
#else /* AVX2: a panel's 16 rows as two groups of 8 */
#define GK_TILE(B, D, MT, F) panel_avx2(B, D, wp, g, nb, qm, rm, am, dm, sm, hm, K, MT, ym, N, F)
#define GK_TILES(B, D, F)                                                                             \
    if (B == 4) { /* 4-bit codes: rows two at a time (rows2_avx2), an odd one as batch-1 decode's */      \
        int i = 0;                                                                                    \
        for (; i + 2 <= mt; i += 2)                                                                   \
            if (D) rows2_avx2_two(wp, nb, qm + (size_t)i * K, rm + (size_t)i * K, dm + (size_t)i * nb,  \
                                  sm + (size_t)i * nb, K, ym + (size_t)i * N, N, F && i == 0);        \
            else rows2_avx2_one(wp, nb, qm + (size_t)i * K, dm + (size_t)i * nb, sm + (size_t)i * nb, K, \
                                ym + (size_t)i * N, N, F && i == 0);                                  \
        if (i < mt) row_avx2(B, D, wp, nb, qm + (size_t)i * K, rm + (size_t)i * K, am,                \
                             dm + (size_t)i * nb, sm + (size_t)i * nb, ym + (size_t)i * N);           \
    } else if (mt == 1 && B != 6)                                                                     \
        row_avx2(B, D, wp, nb, qm, rm, am, dm, sm, ym);                                               \
    else                                                                                              \
        for (int g = 0; g < 2; g++) { GK_SWITCH(B, D, F) }
#endif
#define GK_BITS(D, F)        \
    if (bits == 4) {         \
        GK_TILES(4, D, F)    \
    } else if (bits == 8) {  \
        GK_TILES(8, D, F)    \
    } else {                 \
        GK_TILES(6, D, F)    \
    }
                if (two && pf) {
                    GK_BITS(1, 1)
                } else if (two) {
                    GK_BITS(1, 0)
                } else if (pf) {
                    GK_BITS(0, 1)
                } else {
                    GK_BITS(0, 0)
                }
#undef GK_BITS
#undef GK_TILES
#undef GK_TILE
#undef GK_SWITCH
#else
                panel_portable(bits, two, wp, nb, qm, rm, dm, sm, hm, K, mt, ym, N);
#endif
            }
        }
    }
}

/* y (M, N) = x (M, K) @ W^T; W in the block layout above (N a multiple of 16, K of 32); act: how
 * activations are rounded (GK_ACT_TWO, GK_ACT_Q8_1, GK_ACT_Q8_0); amx_rows: products of at least this
 * many rows (and at least 16) run on AMX tiles where gk_amx_init() succeeded (0: never; the caller's
 * model's kernel choice, genkit/models/kernel_choice.py). Returns 0, -1 when the scratch memory cannot
 * be had, -3 for bad bits, -4 for a bad act. */
int gk_matmul(int bits, const uint8_t *w, const float *x, float *y, int M, int N, int K, int threads, int act,
              int amx_rows) {
    if (bits != 4 && bits != 6 && bits != 8) return -3;
    if (act < GK_ACT_TWO || act > GK_ACT_LLAMA_Q8_0 || (act >= GK_ACT_LLAMA_Q8_1 && bits == 6)) return -4;
    if (threads < 1) threads = 1;
    if (act >= GK_ACT_LLAMA_Q8_1) return matmul_llama(bits, w, x, y, M, N, K, threads, act);
#ifndef GK_AMX
    (void)amx_rows;
#else
    /* AMX from 16 rows: fewer fill no tile group (and the rows after the last 16 are the vector path's, below) */
    if (gk_amx_ready && amx_rows > 0 && M >= amx_rows && M >= 16 && bits != 6)
        return matmul_amx(bits, w, x, y, M, N, K, threads, act);
#endif
    int nb = K / GK_GROUP, panels = N / GK_ROWS;
    size_t panel_bytes = (size_t)nb * block_bytes(bits);
    const int two = act == GK_ACT_TWO;
#ifdef GK_WIDE
    const size_t wide = two && bits != 4 ? sizeof(int16_t) * (size_t)M * K : 0;  /* the digits combined (gk_dw) */
#else
    const size_t wide = 0;
#endif
    int8_t *q = (int8_t *)malloc(2 * (size_t)M * K + 4 * sizeof(float) * (size_t)M * nb + wide + 128);
    if (q == NULL) return -1;
    int8_t *q2 = q + (size_t)M * K;
    float *dx = (float *)(((uintptr_t)(q2 + (size_t)M * K) + 63) & ~(uintptr_t)63);
    float *sx = dx + (size_t)M * nb, *sx16 = sx + (size_t)M * nb;
    int16_t *a16 = wide ? (int16_t *)(((uintptr_t)(sx16 + 2 * (size_t)M * nb) + 63) & ~(uintptr_t)63) : NULL;
    GK_T0;
    quantize_rows(x, M, K, q, q2, dx, sx, sx16, threads, act);
#ifdef GK_WIDE
    if (wide) combine_digits(q, q2, a16, (size_t)M * K);
#endif
    GK_T(GK_P_QUANT);
    if (threads > panels) threads = panels;
#ifdef GK_VNNI
    if (M == 1 && bits != 6)
        matmul_row_vnni(bits, two, w, panel_bytes, panels, nb, q, q2, dx, sx, y, threads);
    else
#endif
        matmul_panels(bits, two, w, panel_bytes, panels, nb, q, q2, a16, dx, sx, sx16, y, M, N, K, threads);
    GK_T(gk_prof_cat == GK_P_OTHER && M == 1 ? GK_P_HEAD : gk_prof_cat);  /* from Python: one row is the LM head */
    GK_CAT(GK_P_OTHER);
    free(q);
    return 0;
}

/* ---- one batch-1 decode step through Llama decoder layers whose projections are block weights ----
 * The same computation as genkit/models/llama_infer.py:run_layers for one token: RMSNorm, fused
 * q/k/v, rotary embedding (x * cos + swap_halves(x) * sin, the sin table carrying the sign), the
 * key/value written into the cache at `pos`, attention over positions 0..pos (grouped heads),
 * o projection, RMSNorm, fused gate/up, silu(gate) * up, down projection; residual adds in place. */
typedef struct {
    const uint8_t *wqkv, *wo, *wgu, *wd;
    const float *norm1, *norm2;
    int bits_qkv, bits_o, bits_gu, bits_d;
    int num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    int act_qkv, act_o, act_gu, act_d; /* each product's activation rounding (GK_ACT_*) */
    int llama; /* numerics="llama.cpp": norm, rope, float16 K/V and attention, SwiGLU as ggml computes them, in the
                * float order of its AVX2 build (GK_LLAMA_AVX2) or its AVX-512 builds (GK_LLAMA_AVX512, and
                * GK_LLAMA_AVX512FP16 on CPUs with AVX-512 FP16); 0: genkit's */
    /* float32 layers: the dense kernel's column-major product (genkit/models/dense_kernel.c gk_gemv_t,
     * its address passed in from that library) and each weight's leading dimension; NULL: block weights */
    int (*gemv)(const float *x, int ldx, const float *w, long ldw, float *y, int M, int N, int K, int threads);
    long ld_qkv, ld_o, ld_gu, ld_d;
    /* a self-speculative draft's layers (genkit/models/self_speculation.py): attention over the first `sink`
     * positions and the last `window` only (a guess needs no more; its step's cost stays flat with the
     * context); 0: every position */
    int window, sink;
    /* Qwen3's per-head RMSNorms of q and k (transformers' Qwen3RMSNorm over each head_dim-long head, in
     * float32, with weights q_norm/k_norm of head_dim floats and epsilons q_eps/k_eps), applied after the
     * q/k/v product and before the rotary embedding; NULL: none (Llama, Mistral, Qwen2) */
    const float *q_norm, *k_norm;
    float q_eps, k_eps;
    /* GPT-2's block (genkit/models/gpt2.py): LayerNorms (norm1/norm2 with the biases norm1_b/norm2_b; NULL:
     * RMSNorms), each product's bias (NULL: none), an un-gated MLP (gelu: wgu holds `intermediate` outputs and
     * GELU's tanh form runs on them; 0: SwiGLU over gate and up), no rotary embedding (no_rope), the attention's
     * score scale (0: 1 / sqrt(head_dim)) */
    const float *norm1_b, *norm2_b, *b_qkv, *b_o, *b_gu, *b_d;
    int gelu, no_rope;
    float scale;
    int amx_rows; /* the block products' gk_matmul amx_rows (the model's kernel choice; 0: never AMX) */
} gk_layer;

enum { GK_W_QKV, GK_W_O, GK_W_GU, GK_W_D };

/* the layer's attention score scale: its own (GPT-2's per-layer one), else 1 / sqrt(head_dim) */
static float score_scale(const gk_layer *L) {
    return L->scale > 0.0f ? L->scale : 1.0f / sqrtf((float)L->head_dim);
}
/* gk_layer.llama: whose float order (ggml's SIMD build; AVX512FP16: AVX-512 with float16 arithmetic) */
enum { GK_LLAMA_AVX2 = 1, GK_LLAMA_AVX512 = 2, GK_LLAMA_AVX512FP16 = 3 };

/* y (rows, N) = x (rows, K) @ W^T for the layer's weight `which` (GK_W_*): the block kernel's
 * product, or the dense kernel's for a float32 layer; then the weight's bias (Qwen2's q/k/v, GPT-2's;
 * none: NULL) added to each row, as torch's linear adds it */
static int layer_product(const gk_layer *L, int which, const float *x, float *y, int rows, int N, int K,
                         int threads) {
    const uint8_t *w[4] = {L->wqkv, L->wo, L->wgu, L->wd};
    int rc;
    if (L->gemv != NULL) {
        const long ld[4] = {L->ld_qkv, L->ld_o, L->ld_gu, L->ld_d};
        rc = L->gemv(x, K, (const float *)w[which], ld[which], y, rows, N, K, threads);
    } else {
        const int bits[4] = {L->bits_qkv, L->bits_o, L->bits_gu, L->bits_d};
        const int act[4] = {L->act_qkv, L->act_o, L->act_gu, L->act_d};
        rc = gk_matmul(bits[which], w[which], x, y, rows, N, K, threads, act[which], L->amx_rows);
    }
    const float *bias[4] = {L->b_qkv, L->b_o, L->b_gu, L->b_d};
    if (rc == 0 && bias[which] != NULL)
        for (int r = 0; r < rows; r++) {
            float *yr = y + (size_t)r * N;
#pragma omp simd
            for (int i = 0; i < N; i++) yr[i] += bias[which][i];
        }
    return rc;
}

static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    float r = 1.0f / sqrtf(s / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* LayerNorm (GPT-2's; weight w, bias b): (x - mean) * (1 / sqrt(var + eps)) * w + b, the biased variance */
static void layer_norm(const float *x, const float *w, const float *b, float eps, int n, float *out) {
    float s = 0.0f, v = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i];
    const float mean = s / (float)n;
#pragma omp simd reduction(+ : v)
    for (int i = 0; i < n; i++) v += (x[i] - mean) * (x[i] - mean);
    const float r = 1.0f / sqrtf(v / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = (x[i] - mean) * r * w[i] + b[i];
}

static void rope(float *v, const float *cos_, const float *sin_, int d) {
    int half = d / 2;
    float tmp[512];
    memcpy(tmp, v, sizeof(float) * d);
    for (int i = 0; i < d; i++) v[i] = tmp[i] * cos_[i] + tmp[i < half ? i + half : i - half] * sin_[i];
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Where a row's key/value of head j at position t lives in its layer's cache: genkit's KVCache
 * (per cache row [kv_heads][capacity][head_dim]; step row r is cache row r / seq: a prompt's tokens
 * are seq consecutive step rows), or the paged store of continuous batching (blocks of
 * [kv_heads][block_size][head_dim]; position t in block table[row][t / block_size], at t % block_size). */
typedef struct {
    int capacity;          /* KVCache: positions per row; 0 for the paged store */
    const int32_t *table;  /* paged: rows x width block ids */
    int width, block_size;
    int seq;               /* KVCache: step rows per cache row */
} gk_kv;

static inline size_t kv_at(const gk_kv *kv, int r, int j, int t, int nkv, int d) {
    if (kv->table == NULL) return (((size_t)(kv->seq > 1 ? r / kv->seq : r) * nkv + j) * kv->capacity + t) * d;
    const size_t block = (size_t)kv->table[(size_t)r * kv->width + t / kv->block_size];
    return ((block * nkv + j) * kv->block_size + t % kv->block_size) * d;
}

/* ---- numerics="llama.cpp" in the decode step: ggml's CPU operations (AVX2 build), op for op ---- */

/* ggml_compute_forward_rms_norm (fused with the weight): double sum, float mean, x * scale * w */
static void rms_norm_llama(const float *x, const float *w, float eps, int n, float *out) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

/* ggml's rotate_pairs as gcc contracts it (checked against llama.cpp's rotated q): x0 cos - x1 sin
 * as fma(x0, cos, -(x1 sin)), x0 sin + x1 cos as fma(x0, sin, x1 cos), the other product rounded
 * (genkit's halves layout: pair i is (i, i + d/2); sin_ holds -s, s) */
static void rope_llama(float *v, const float *cos_, const float *sin_, int d) {
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        float x0 = v[i], x1 = v[i + half], c = cos_[i], s = sin_[i + half];
        v[i] = fmaf(x0, c, -(x1 * s));
        v[i + half] = fmaf(x0, s, x1 * c);
    }
}

/* llama.cpp's element e of a head is genkit's (e / 2) + (e % 2) * d / 2: the GGUF file interleaves
 * the rotary halves of q and k, which genkit's loader undoes; the sums below go in llama.cpp's order */
static inline int llama_index(int e, int d) { return (e >> 1) + (e & 1) * (d / 2); }

/* ggml_vec_dot_f16 on AVX2 of k (genkit's order) and q (llama.cpp's order): 4 accumulators of 8
 * lanes over steps of 32, reduced pairwise */
static __attribute__((unused)) float dot_f16_llama(const float *x, const float *y, int n) {
    float acc[4][8] = {{0}};
    int np = n & ~31;
    for (int i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++)
                acc[j][l] = fmaf(x[llama_index(i + 8 * j + l, n)], y[i + 8 * j + l], acc[j][l]);
    for (int l = 0; l < 8; l++) {
        acc[0][l] += acc[2][l];
        acc[1][l] += acc[3][l];
    }
    for (int l = 0; l < 8; l++) acc[0][l] += acc[1][l];
    float t[4];
    for (int l = 0; l < 4; l++) t[l] = acc[0][l] + acc[0][l + 4];
    double sum = (double)((t[0] + t[1]) + (t[2] + t[3]));
    for (int i = np; i < n; i++) sum += (double)(x[llama_index(i, n)] * y[i]);
    return (float)sum;
}

/* ggml_vec_dot_f16 on AVX-512 (its F32x16 dot: 4 accumulators of 16 lanes over steps of 64, x0 + x2 and
 * x1 + x3, their sum, then _mm512_reduce_add_ps as gcc builds it: the 256-bit halves, the 128-bit
 * halves, then (t0 + t2) + (t1 + t3)) of k (genkit's order) and q (llama.cpp's order); the tail in double */
static float reduce_16_llama(const float *a) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static __attribute__((unused)) float dot_f16_llama512(const float *x, const float *y, int n) {
    float acc[4][16] = {{0}}, a[16];
    int np = n & ~63;
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 16; l++)
                acc[j][l] = fmaf(x[llama_index(i + 16 * j + l, n)], y[i + 16 * j + l], acc[j][l]);
    for (int l = 0; l < 16; l++) a[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    double sum = (double)reduce_16_llama(a);
    for (int i = np; i < n; i++) sum += (double)(x[llama_index(i, n)] * y[i]);
    return (float)sum;
}

#ifdef GK_VNNI
/* dot_f16_llama512 with 16 lanes per register: llama.cpp's elements 16g..16g+15 are genkit's 8g..8g+7
 * (its even ones) and half+8g..half+8g+7 (its odd ones), interleaved into llama's lane order; the
 * same fma per lane and step, the same sums */
static float dot_f16_llama512_vec(const float *k, const float *qh, int n) {
    const int half = n / 2, np = n & ~63;
    const __m512i inter = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++) {
            const int g = i / 16 + j;
            const __m512 kv = _mm512_permutex2var_ps(_mm512_castps256_ps512(_mm256_loadu_ps(k + 8 * g)), inter,
                                                     _mm512_castps256_ps512(_mm256_loadu_ps(k + half + 8 * g)));
            acc[j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(qh + i + 16 * j), acc[j]);
        }
    float a[16];
    _mm512_storeu_ps(a, _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
    double sum = (double)reduce_16_llama(a);
    for (int i = np; i < n; i++) sum += (double)(k[llama_index(i, n)] * qh[i]);
    return (float)sum;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GK_LLAMA_VEC 1
/* 8 floats rounded to float16 and back (vcvtps2ph with ties to even, as round_f16 and ggml's stores) */
static inline __m256 round_f16_8(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

/* The 8 values of llama.cpp's elements 8g..8g+7 of a head in genkit's layout (d/2 = half): genkit's
 * 4g..4g+3 (llama's even elements) in lanes 0-3, half+4g..half+4g+3 (its odd ones) in lanes 4-7 */
static inline __m256 load_llama_group(const float *v, int g, int half) {
    return _mm256_loadu2_m128(v + half + 4 * g, v + 4 * g);
}

/* dot_f16_llama with 8 lanes per register: the same fma per llama lane and step (lane 2m of llama's
 * order is lane m here, lane 2m+1 lane 4+m: load_llama_group), the same lane-wise pair sums, then
 * the same final sums of llama's lanes ((L0+L4)+(L1+L5)) + ((L2+L6)+(L3+L7)) and the tail. qa: the
 * rounded q grouped as load_llama_group reads k (round_f16 of q, genkit's layout). */
static float dot_f16_llama_avx2(const float *k, const float *qa, const float *qh, int n) {
    const int half = n / 2, np = n & ~31;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++) {
            const int g = i / 8 + j;
            acc[j] = _mm256_fmadd_ps(load_llama_group(k, g, half), load_llama_group(qa, g, half), acc[j]);
        }
    acc[0] = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    float a[8];
    _mm256_storeu_ps(a, acc[0]);
    double sum = (double)(((a[0] + a[2]) + (a[4] + a[6])) + ((a[1] + a[3]) + (a[5] + a[7])));
    for (int i = np; i < n; i++) sum += (double)(k[llama_index(i, n)] * qh[i]);
    return (float)sum;
}
#endif

/* q . k of one position in the float order `order` (GK_LLAMA_*): qa is q rounded in genkit's layout, qh
 * in llama.cpp's */
static inline float dot_llama(int order, const float *k, const float *qa, const float *qh, int d) {
    (void)qa;
    if (order >= GK_LLAMA_AVX512) {
#ifdef GK_VNNI
        return dot_f16_llama512_vec(k, qh, d);
#else
        return dot_f16_llama512(k, qh, d);
#endif
    }
#ifdef GK_LLAMA_VEC
    return dot_f16_llama_avx2(k, qa, qh, d);
#else
    return dot_f16_llama(k, qh, d);
#endif
}

#define GK_ATT_HEADS 4 /* query heads of one K/V head that attend in one pass over the positions */
#ifndef GK_ATT_AHEAD
#define GK_ATT_AHEAD 4 /* positions between a key's prefetch and its use */
#endif

/* x v + y of float16 values (held in floats) rounded once to float16, as AVX-512 FP16's vfmadd does:
 * the exact sum in units of 2^-48 (128-bit integers: |x v| < 2^32, so it fits), rounded to the float16
 * quantum at its size, ties to even; inf beyond 65504 */
static __attribute__((unused)) float fma_f16(float x, float v, float y) {
    if (!isfinite(x) || !isfinite(v) || !isfinite(y)) return round_f16(x * v + y);  /* inf and NaN as vfmadd */
    const int64_t X = (int64_t)ldexpf(x, 24), V = (int64_t)ldexpf(v, 24), Y = (int64_t)ldexpf(y, 24);
    const __int128 t = (__int128)X * V + (__int128)Y * ((__int128)1 << 24);
    if (t == 0) return x * v + y;  /* the zero's sign as IEEE gives it */
    const unsigned __int128 a = t < 0 ? -(unsigned __int128)t : (unsigned __int128)t;
    const uint64_t hi = (uint64_t)(a >> 64);
    const int bits = hi ? 128 - __builtin_clzll(hi) : 64 - __builtin_clzll((uint64_t)a);
    const int shift = (bits - 49 > -14 ? bits - 49 : -14) + 38;  /* float16's quantum: 2^(max(e, -14) - 10) */
    unsigned __int128 m = a >> shift;
    const unsigned __int128 rem = a & ((((unsigned __int128)1) << shift) - 1), half = ((unsigned __int128)1) << (shift - 1);
    if (rem > half || (rem == half && (m & 1))) m++;
    float r = ldexpf((float)(uint64_t)m, shift - 48);
    if (r > 65504.0f) r = INFINITY;
    return t < 0 ? -r : r;
}

/* ggml's float16 vector steps under AVX-512 FP16 (ggml_vec_scale_f16 / ggml_vec_mad_f16 over n values, a
 * multiple of 128): the weight rounded to float16, then acc * w and v * w + acc in float16 arithmetic,
 * one rounding each (the product of two float16 values is exact in float32, so round_f16 of it is
 * vmulph's). Where the kernel has AVX-512 FP16, vfmadd on 16 values at a time, else fma_f16. */
static void scale_f16_llama(float *acc, int n, float m) {
    const float mh = round_f16(m);
    for (int e = 0; e < n; e++) acc[e] = round_f16(acc[e] * mh);
}

static void mad_f16_llama(float *acc, const float *v, int n, float w) {
#if defined(__AVX512FP16__) && defined(__AVX512VL__)
    const __m256h wh = _mm256_set1_ph((_Float16)w);
    for (int e = 0; e < n; e += 16) {
        const __m256h a = _mm512_cvtxps_ph(_mm512_loadu_ps(acc + e)), x = _mm512_cvtxps_ph(_mm512_loadu_ps(v + e));
        _mm512_storeu_ps(acc + e, _mm512_cvtxph_ps(_mm256_fmadd_ph(x, wh, a)));
    }
#else
    const float wh = round_f16(w);
    for (int e = 0; e < n; e++) acc[e] = fma_f16(v[e], wh, acc[e]);
#endif
}

/* One position of llama.cpp's online softmax for one head (score s, value vt): a new maximum rescales
 * the float16 accumulator acc by expf(old - s), else the value's weight is expf(s - max); then
 * acc = round_f16(fma(v, weight, acc)) and S = fma(S, rescale, weight). The vector build does the
 * elementwise work 8 lanes at a time (the same operation per element, so the same bits). Under
 * GK_LLAMA_AVX512FP16 the first d & ~127 values take ggml's float16 steps (scale_f16_llama,
 * mad_f16_llama) and the rest its scalar loop, as above. */
static inline void online_step_llama(int order, float *acc, float *M, float *S, float s, const float *vt, int d) {
    const int nh = order == GK_LLAMA_AVX512FP16 ? d & ~127 : 0;
#ifdef GK_LLAMA_VEC
    const int dv = nh + ((d - nh) & ~7);
#else
    const int dv = nh;
#endif
    float ms = 1.0f, vs = 1.0f;
    if (s > *M) {
        ms = expf(*M - s);
        *M = s;
        scale_f16_llama(acc, nh, ms);
#ifdef GK_LLAMA_VEC
        const __m256 vms = _mm256_set1_ps(ms);
        for (int e = nh; e < dv; e += 8) _mm256_storeu_ps(acc + e, round_f16_8(_mm256_mul_ps(_mm256_loadu_ps(acc + e), vms)));
#endif
        for (int e = dv; e < d; e++) acc[e] = round_f16(acc[e] * ms);
    } else {
        vs = expf(s - *M);
    }
    mad_f16_llama(acc, vt, nh, vs);
#ifdef GK_LLAMA_VEC
    const __m256 vvs = _mm256_set1_ps(vs);
    for (int e = nh; e < dv; e += 8)
        _mm256_storeu_ps(acc + e, round_f16_8(_mm256_fmadd_ps(_mm256_loadu_ps(vt + e), vvs, _mm256_loadu_ps(acc + e))));
#endif
    for (int e = dv; e < d; e++) acc[e] = round_f16(fmaf(vt[e], vs, acc[e]));
    *S = fmaf(*S, ms, vs);
}

/* llama.cpp's CPU flash attention with a float16 K/V cache (ggml_compute_forward_flash_attn_ext_f16_one_chunk)
 * for query heads q[0..n-1] (n <= GK_ATT_HEADS) of K/V head j: q rounded to float16, online softmax over
 * positions 0..last with the weighted values summed in a float16 accumulator (each step fma in float32,
 * then rounded), divided by the sum at the end. Each head's operations are llama.cpp's, in its order;
 * the heads only share the pass over the cache (each key and value is read once for all of them). The
 * dot products: dot_llama in the layer's order; each position's step: online_step_llama, the same in
 * every order for heads under 128 values (ggml's AVX-512 FP16 steps of 128 leave them to its scalar
 * loop, which gcc contracts to the AVX2 build's fma per element). */
static void attend_llama_heads(int order, const float *const *q, int n, const float *kc, const float *vc,
                               const gk_kv *kv, int r, int j, int last, int nkv, int d, float scale, float *const *o) {
    float qh[GK_ATT_HEADS][512], qa[GK_ATT_HEADS][512], acc[GK_ATT_HEADS][512], M[GK_ATT_HEADS], S[GK_ATT_HEADS];
    for (int h = 0; h < n; h++) {
        for (int e = 0; e < d; e++) {
            qh[h][e] = round_f16(q[h][llama_index(e, d)]);
            qa[h][e] = round_f16(q[h][e]);
            acc[h][e] = 0.0f;
        }
        M[h] = -INFINITY;
        S[h] = 0.0f;
    }
    const float *kt = kc + kv_at(kv, r, j, 0, nkv, d), *vt = vc + kv_at(kv, r, j, 0, nkv, d);
    for (int t = 0; t <= last; t++) {
        const float *kn = kt, *vn = vt;
        if (t < last) {
            kn = kc + kv_at(kv, r, j, t + 1, nkv, d);
            vn = vc + kv_at(kv, r, j, t + 1, nkv, d);
        }
        if (t + GK_ATT_AHEAD <= last) {  /* a later position's key and value, on their way while this one is summed */
            const size_t at = kv_at(kv, r, j, t + GK_ATT_AHEAD, nkv, d);
            for (int e = 0; e < d; e += 16) {
                __builtin_prefetch(kc + at + e);
                __builtin_prefetch(vc + at + e);
            }
        }
        for (int h = 0; h < n; h++) {
            const float s = dot_llama(order, kt, qa[h], qh[h], d) * scale;
            online_step_llama(order, acc[h], &M[h], &S[h], s, vt, d);
        }
        kt = kn;
        vt = vn;
    }
    for (int h = 0; h < n; h++) {
        const float inv = S[h] == 0.0f ? 0.0f : 1.0f / S[h];
        for (int e = 0; e < d; e++) o[h][e] = acc[h][e] * inv;
    }
}

/* Attention is shared among threads in items of (row, K/V head, up to `per` of its query heads):
 * item w's row (returned), K/V head *j, its first query head *i0, and its heads' query and output
 * rows in q[0..*n-1], o[0..*n-1] */
static inline int head_item(const gk_layer *L, int w, int chunks, int per, const float *qkv, float *att,
                            const float **q, float **o, int *j, int *i0, int *n) {
    const int nq = L->num_heads, nkv = L->num_kv_heads, d = L->head_dim, nqkv = (nq + 2 * nkv) * d, group = nq / nkv;
    const int r = w / (nkv * chunks);
    *j = (w / chunks) % nkv;
    *i0 = *j * group + (w % chunks) * per;
    *n = *j * group + group - *i0 < per ? *j * group + group - *i0 : per;
    for (int h = 0; h < *n; h++) {
        q[h] = qkv + r * (size_t)nqkv + (size_t)(*i0 + h) * d;
        o[h] = att + r * (size_t)nq * d + (size_t)(*i0 + h) * d;
    }
    return r;
}

/* numerics="llama.cpp": each row's query heads over its positions 0..pos[r], up to GK_ATT_HEADS heads of one
 * K/V head at a time (attend_llama_heads; fewer where that leaves under 3 items per thread); the (row,
 * K/V head, heads) items shared among threads */
static void attend_llama(const gk_layer *L, const float *qkv, int rows, const int32_t *pos, const float *kc,
                         const float *vc, const gk_kv *kv, float *att, int threads) {
    const int nkv = L->num_kv_heads, d = L->head_dim, group = L->num_heads / nkv;
    int per = group < GK_ATT_HEADS ? group : GK_ATT_HEADS;  /* heads per item: fewer when the threads would idle */
    while (per > 1 && rows * nkv * ((group + per - 1) / per) < 3 * threads) per--;
    const int chunks = (group + per - 1) / per, work = rows * nkv * chunks;
    const float scale = score_scale(L);
#pragma omp parallel for num_threads(threads < work ? threads : work) schedule(static)
    for (int w = 0; w < work; w++) {
        const float *q[GK_ATT_HEADS];
        float *o[GK_ATT_HEADS];
        int j, i0, n;
        const int r = head_item(L, w, chunks, per, qkv, att, q, o, &j, &i0, &n);
        attend_llama_heads(L->llama, q, n, kc, vc, kv, r, j, pos[r], nkv, d, scale, o);
    }
}

/* ggml_v_expf (AVX2), one lane */
static __attribute__((unused)) float expf_llama(float x) {
    union { float f; uint32_t u; } z, k, one = {1.0f}, s1, s2;
    const float r = 0x1.8p23f;
    z.f = fmaf(x, 0x1.715476p+0f, r);
    const float n = z.f - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = z.u << 23;
    k.u = e + one.u;
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k.f, k.f);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    s1.u = g + 0x7f000000u;
    s2.u = e - g;
    if (fabsf(n) > 192.0f) return s1.f * s1.f;
    return fmaf(s2.f, j, s2.f) * s1.f;
}

#ifdef GK_LLAMA_VEC
/* ggml_v_expf on AVX2, instruction for instruction (vec.h) */
static inline __m256 expf_llama_avx2(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                                                        _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i dd = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                                                         _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(dd), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(_mm256_castsi256_ps(dd),
                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
#endif

/* ggml_v_expf (AVX-512: the polynomial's last step fma(c0, b, 1), then j scaled by 2^n with vscalefps
 * rather than built from the exponent bits; beyond |n| > 192, inf or 0), one lane; ldexpf rounds as
 * vscalefps does */
static __attribute__((unused)) float expf_llama512(float x) {
    const float r = 0x1.8p23f;
    const float n = fmaf(x, 0x1.715476p+0f, r) - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (isnan(n)) return n;
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return ldexpf(j, (int)n);
}

#ifdef GK_VNNI
/* ggml_v_expf on AVX-512, instruction for instruction (vec.h) */
static inline __m512 expf_llama512_vec(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r), r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (!big) return res;
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                            _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(big, res, alt);
}
#endif

/* ggml_vec_swiglu_f32 in the float order `order` (GK_LLAMA_*): silu(g) * u with ggml_v_silu
 * (x / (1 + ggml_v_expf(0 - x))) in steps of 8 (AVX2) or 16 (AVX-512, expf_llama512), the rest with
 * libm's expf; the vector build runs the steps as ggml does (the same instructions), the portable one
 * lane by lane (expf_llama / expf_llama512: the same operations, so the same bits) */
static void swiglu_llama(int order, const float *g, const float *up, float *a, int n) {
    const int wide = order >= GK_LLAMA_AVX512;
    int i = 0, nv = n & (wide ? ~15 : ~7);
#ifdef GK_VNNI
    const __m512 one16 = _mm512_set1_ps(1.0f);
    for (; wide && i < nv; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one16, expf_llama512_vec(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
#endif
#ifdef GK_LLAMA_VEC
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; !wide && i < nv; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, expf_llama_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
#endif
    float (*const exp_lane)(float) = wide ? expf_llama512 : expf_llama;
    for (; i < nv; i++) a[i] = g[i] / (1.0f + exp_lane(0.0f - g[i])) * up[i];
    for (; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * up[i];
}

/* v[t] = exp(v[t] - mx) for t < n (ggml's vector expf in steps of 8, expf_llama's same operations for
 * the rest: the same bits either way); returns their sum, added in order */
static float exp_shifted(float *v, int n, float mx) {
    int t = 0;
#ifdef GK_LLAMA_VEC
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(v + t, expf_llama_avx2(_mm256_sub_ps(_mm256_loadu_ps(v + t), _mm256_set1_ps(mx))));
#endif
    for (; t < n; t++) v[t] = expf_llama(v[t] - mx);
    float sum = 0.0f;
    for (t = 0; t < n; t++) sum += v[t];
    return sum;
}

/* rope on q and k of every row (its own position's cos/sin), after each head's RMSNorm where the layer
 * has them (Qwen3), the new key/value into the cache (rows shared among threads: each writes its own cells) */
static void rope_and_store(const gk_layer *L, float *qkv, int rows, const float *cos_, const float *sin_, int cs_stride,
                           const int32_t *pos, float *kc, float *vc, const gk_kv *kv, int threads) {
    int nq = L->num_heads, nkv = L->num_kv_heads, d = L->head_dim, nqkv = (nq + 2 * nkv) * d;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && threads > 1)
    for (int r = 0; r < rows; r++) {
        float *qr = qkv + r * (size_t)nqkv;
        for (int i = 0; i < nq + nkv; i++) {
            float *v = qr + (size_t)i * d;
            const float *w = i < nq ? L->q_norm : L->k_norm;
            if (w != NULL)  /* (in place: each element is read before it is written) */
                (L->llama ? rms_norm_llama : rms_norm)(v, w, i < nq ? L->q_eps : L->k_eps, d, v);
            if (L->no_rope) continue;  /* (GPT-2: no tables, cos_ and sin_ NULL) */
            const float *c = cos_ + (size_t)r * cs_stride, *sn = sin_ + (size_t)r * cs_stride;
            if (L->llama) rope_llama(v, c, sn, d); else rope(v, c, sn, d);
        }
        for (int j = 0; j < nkv; j++) {
            float *kt = kc + kv_at(kv, r, j, pos[r], nkv, d), *vt = vc + kv_at(kv, r, j, pos[r], nkv, d);
            memcpy(kt, qr + (size_t)(nq + j) * d, sizeof(float) * d);
            memcpy(vt, qr + (size_t)(nq + nkv + j) * d, sizeof(float) * d);
            if (L->llama)  /* llama.cpp's default float16 K/V cache: the values it keeps */
                for (int e = 0; e < d; e++) {
                    kt[e] = round_f16(kt[e]);
                    vt[e] = round_f16(vt[e]);
                }
        }
    }
}

#ifdef GK_LLAMA_VEC
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define GK_ATT_REGS 32 /* vector registers one head group's sums may take */
#else
#define GK_ATT_REGS 16
#endif
#ifndef GK_ATT_PREFETCH
#define GK_ATT_PREFETCH 16 /* positions between a key's or value's prefetch and its use (4 left the float32 path
                            * 10-15 % slower after 3000 positions on the Zen 5) */
#endif

/* Each of four 8-lane sums a[i] added up as one score is: its halves (lanes l + l+4), then lanes 0 + 2 and
 * 1 + 3 of that, then those two; the four results in one vector, position i in lane i */
static inline __attribute__((always_inline)) __m128 hsum_8x4(const __m256 *a) {
    __m128 s[4];
    for (int i = 0; i < 4; i++) s[i] = _mm_add_ps(_mm256_castps256_ps128(a[i]), _mm256_extractf128_ps(a[i], 1));
    const __m128 u0 = _mm_add_ps(_mm_unpacklo_ps(s[0], s[1]), _mm_unpackhi_ps(s[0], s[1]));
    const __m128 u1 = _mm_add_ps(_mm_unpacklo_ps(s[2], s[3]), _mm_unpackhi_ps(s[2], s[3]));
    return _mm_add_ps(_mm_movelh_ps(u0, u1), _mm_movehl_ps(u1, u0));
}

/* Scores of `got` positions (v: their 4-position groups' vectors, scaled here) into out, and their maximum
 * into *top */
static inline __attribute__((always_inline)) void scores_out(__m128 *v, int groups, int got, float scale, float *out,
                                                             __m128 *top) {
    for (int b = 0; b < groups; b++) {
        v[b] = _mm_mul_ps(v[b], _mm_set1_ps(scale));
        if (got >= 4 * (b + 1)) {
            _mm_storeu_ps(out + 4 * b, v[b]);
        } else {  /* the last group: the positions past `got` repeat the first and are not scores */
            float tmp[4];
            _mm_storeu_ps(tmp, v[b]);
            for (int i = 0; i < 4; i++) {
                if (4 * b + i < got) out[4 * b + i] = tmp[i];
                else tmp[i] = -INFINITY;
            }
            v[b] = _mm_loadu_ps(tmp);
        }
        *top = _mm_max_ps(*top, v[b]);
    }
}

/* Asks for the n floats from f (a key's or value's row, or a run of them) on their way to the caches */
static inline __attribute__((always_inline)) void prefetch_row(const float *f, int n) {
    for (int e = 0; e < n; e += 16) __builtin_prefetch(f + e);
}

/* Position t's row of K/V head j in cache c, and how many positions after it follow d floats apart (*left:
 * all of them in the KVCache, the rest of its block in the paged store) */
static inline __attribute__((always_inline)) const float *kv_run(const float *c, const gk_kv *kv, int r, int j, int t,
                                                                 int nkv, int d, int *left) {
    *left = kv->table == NULL ? INT32_MAX : kv->block_size - 1 - t % kv->block_size;
    return c + kv_at(kv, r, j, t, nkv, d);
}

/* Keys of positions t..t+n-1 (positions past last: t's, so that a partial group reads only cached keys),
 * and a prefetch of those GK_ATT_PREFETCH positions later: d floats apart in the KVCache and within a
 * paged block (kv_run), each looked up across blocks */
static inline __attribute__((always_inline)) void keys_at(const float **k, int n, const float *kc, const gk_kv *kv,
                                                          int r, int j, int t, int last, int nkv, int d) {
    const int ahead = t + GK_ATT_PREFETCH + n - 1 <= last;
    if (kv->table == NULL && t + n - 1 <= last) {  /* the KVCache: positions t.. d floats apart */
        k[0] = kc + kv_at(kv, r, j, t, nkv, d);
        for (int i = 1; i < n; i++) k[i] = k[0] + (size_t)i * d;
        if (ahead) prefetch_row(k[0] + (size_t)GK_ATT_PREFETCH * d, n * d);
        return;
    }
    int left;
    k[0] = kv_run(kc, kv, r, j, t, nkv, d, &left);
    for (int i = 1; i < n; i++)
        k[i] = t + i > last ? k[0] : i <= left ? k[0] + (size_t)i * d : kc + kv_at(kv, r, j, t + i, nkv, d);
    if (ahead) {
        const float *f = kv_run(kc, kv, r, j, t + GK_ATT_PREFETCH, nkv, d, &left);
        for (int i = 0; i < n; i++)
            prefetch_row(i <= left ? f + (size_t)i * d : kc + kv_at(kv, r, j, t + GK_ATT_PREFETCH + i, nkv, d), d);
    }
}

static inline __attribute__((always_inline)) void max_out(const __m128 *top, int NH, float *mx) {
    for (int h = 0; h < NH; h++) {
        float tmp[4];
        _mm_storeu_ps(tmp, top[h]);
        for (int i = 0; i < 4; i++)
            if (tmp[i] > mx[h]) mx[h] = tmp[i];
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* scores_heads for NH (a constant, <= 4) heads, eight positions at a time: two positions' 8-lane sums
 * in one 512-bit register (the query's 8 elements in both halves), so that each score is the same 8-lane
 * sum in the same order as with 256-bit vectors; all sums in registers, each key element loaded once */
static inline __attribute__((always_inline)) void scores_nh(const int NH, const float *const *q, const float *kc,
                                                            const gk_kv *kv, int r, int j, int t0, int last, int nkv,
                                                            int d, float scale, float *sc, int span, float *mx) {
    __m128 top[GK_ATT_HEADS];
    for (int h = 0; h < NH; h++) top[h] = _mm_set1_ps(-INFINITY);
    for (int t = t0; t <= last; t += 8) {
        const float *k[8];
        keys_at(k, 8, kc, kv, r, j, t, last, nkv, d);
        __m512 a[GK_ATT_HEADS][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) a[h][i] = _mm512_setzero_ps();
        for (int e = 0; e < d; e += 8) {
            __m512 kk[4];
            for (int i = 0; i < 4; i++)
                kk[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k[2 * i] + e)),
                                           _mm256_loadu_ps(k[2 * i + 1] + e), 1);
            for (int h = 0; h < NH; h++) {
                const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[h] + e));
                for (int i = 0; i < 4; i++) a[h][i] = _mm512_fmadd_ps(qv, kk[i], a[h][i]);
            }
        }
        for (int h = 0; h < NH; h++) {
            __m256 y[8];
            for (int i = 0; i < 4; i++) {
                y[2 * i] = _mm512_castps512_ps256(a[h][i]);
                y[2 * i + 1] = _mm512_extractf32x8_ps(a[h][i], 1);
            }
            __m128 v[2] = {hsum_8x4(y), hsum_8x4(y + 4)};
            scores_out(v, 2, last + 1 - t, scale, sc + (size_t)h * span + t - t0, &top[h]);
        }
    }
    max_out(top, NH, mx);
}
#else
/* scores_heads for NH (a constant) heads, four positions at a time: all sums in registers, each key element
 * loaded once for the NH heads */
static inline __attribute__((always_inline)) void scores_nh(const int NH, const float *const *q, const float *kc,
                                                            const gk_kv *kv, int r, int j, int t0, int last, int nkv,
                                                            int d, float scale, float *sc, int span, float *mx) {
    __m128 top[GK_ATT_HEADS];
    for (int h = 0; h < NH; h++) top[h] = _mm_set1_ps(-INFINITY);
    for (int t = t0; t <= last; t += 4) {
        const float *k[4];
        keys_at(k, 4, kc, kv, r, j, t, last, nkv, d);
        __m256 a[GK_ATT_HEADS][4];
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < 4; i++) a[h][i] = _mm256_setzero_ps();
        for (int e = 0; e < d; e += 8) {
            __m256 kk[4];
            for (int i = 0; i < 4; i++) kk[i] = _mm256_loadu_ps(k[i] + e);
            for (int h = 0; h < NH; h++) {
                const __m256 qv = _mm256_loadu_ps(q[h] + e);
                for (int i = 0; i < 4; i++) a[h][i] = _mm256_fmadd_ps(qv, kk[i], a[h][i]);
            }
        }
        for (int h = 0; h < NH; h++) {
            __m128 v = hsum_8x4(a[h]);
            scores_out(&v, 1, last + 1 - t, scale, sc + (size_t)h * span + t - t0, &top[h]);
        }
    }
    max_out(top, NH, mx);
}
#endif

/* Scores sc[h * span + t - t0] = q[h] . k_t * scale of n query heads sharing K/V head j, t = t0..last,
 * and each head's maximum (mx[h], raised from what it holds): each score one 8-lane sum in element
 * order, added up as hsum_8x4 says; as many heads at a time as the registers hold (16: two) */
static void scores_heads(const float *const *q, int n, const float *kc, const gk_kv *kv, int r, int j, int t0,
                         int last, int nkv, int d, float scale, float *sc, int span, float *mx) {
    for (int h = 0; h < n;) {
        const int left = n - h, take = GK_ATT_REGS >= 32 ? left : (left > 2 ? 2 : left);
        float *s = sc + (size_t)h * span;
        if (take == 4) scores_nh(4, q + h, kc, kv, r, j, t0, last, nkv, d, scale, s, span, mx + h);
        else if (take == 3) scores_nh(3, q + h, kc, kv, r, j, t0, last, nkv, d, scale, s, span, mx + h);
        else if (take == 2) scores_nh(2, q + h, kc, kv, r, j, t0, last, nkv, d, scale, s, span, mx + h);
        else scores_nh(1, q + h, kc, kv, r, j, t0, last, nkv, d, scale, s, span, mx + h);
        h += take;
    }
}

/* exp_shifted for NH (a constant) heads' scores (sc + h * span, n each) at once, inv[h] = 1 / their sum:
 * the same bits, the heads' in-order sums interleaved */
static inline __attribute__((always_inline)) void exp_nh(const int NH, float *sc, int span, int n, const float *mx,
                                                         float *inv) {
    float sum[GK_ATT_HEADS];
    for (int h = 0; h < NH; h++) sum[h] = 0.0f;
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        float e[GK_ATT_HEADS][8];
        for (int h = 0; h < NH; h++) {
            float *v = sc + (size_t)h * span + t;
            const __m256 x = expf_llama_avx2(_mm256_sub_ps(_mm256_loadu_ps(v), _mm256_set1_ps(mx[h])));
            _mm256_storeu_ps(v, x);
            _mm256_storeu_ps(e[h], x);
        }
        for (int i = 0; i < 8; i++)
            for (int h = 0; h < NH; h++) sum[h] += e[h][i];
    }
    for (; t < n; t++)
        for (int h = 0; h < NH; h++) {
            float *v = sc + (size_t)h * span + t;
            *v = expf_llama(*v - mx[h]);
            sum[h] += *v;
        }
    for (int h = 0; h < NH; h++) inv[h] = 1.0f / sum[h];
}

static void exp_heads(float *sc, int span, int heads, int n, const float *mx, float *inv) {
    if (heads == 4) exp_nh(4, sc, span, n, mx, inv);
    else if (heads == 3) exp_nh(3, sc, span, n, mx, inv);
    else if (heads == 2) exp_nh(2, sc, span, n, mx, inv);
    else exp_nh(1, sc, span, n, mx, inv);
}

/* The positions a head attends to, in order: 0..sink-1, then from..last (sink = last + 1: all of them) */
#define GK_FOR_TAKEN(t, i, sink, from, last) \
    for (int t = (sink) > 0 ? 0 : (from), i = 0; t <= (last); t = t + 1 == (sink) ? (from) : t + 1, i++)

/* The values' vectors: 16 floats on AVX-512, else 8 (each lane's fused multiply-adds the same either way) */
#if defined(__AVX512F__)
typedef __m512 gk_vf;
#define GK_VALUE_LANES 16
#define gk_vf_zero _mm512_setzero_ps
#define gk_vf_set1 _mm512_set1_ps
#define gk_vf_load _mm512_loadu_ps
#define gk_vf_store _mm512_storeu_ps
#define gk_vf_fmadd _mm512_fmadd_ps
#else
typedef __m256 gk_vf;
#define GK_VALUE_LANES 8
#define gk_vf_zero _mm256_setzero_ps
#define gk_vf_set1 _mm256_set1_ps
#define gk_vf_load _mm256_loadu_ps
#define gk_vf_store _mm256_storeu_ps
#define gk_vf_fmadd _mm256_fmadd_ps
#endif

/* One position's value row vt (from element e0) weighted into the NH heads' W vectors of sums */
static inline __attribute__((always_inline)) void values_add(const int NH, const int W, gk_vf (*acc)[4],
                                                             const float *vt, const float *sc, int span,
                                                             const float *inv, int i) {
    for (int h = 0; h < NH; h++) {
        const gk_vf p = gk_vf_set1(sc[(size_t)h * span + i] * inv[h]);
        for (int c = 0; c < W; c++) acc[h][c] = gk_vf_fmadd(p, gk_vf_load(vt + GK_VALUE_LANES * c), acc[h][c]);
    }
}

/* values_heads for NH heads (a constant) over W vectors (a constant) from element e0, the sums in registers;
 * the KVCache's rows a run of d floats apart, the paged store's (PAGED, a constant) within a block (kv_run) */
static inline __attribute__((always_inline)) void values_nw(const int NH, const int W, const int PAGED,
                                                            const float *vc, const gk_kv *kv, int r, int j, int last,
                                                            int nkv, int d, int e0, const float *sc, int span,
                                                            const float *inv, float *const *o, int sink, int from) {
    gk_vf acc[GK_ATT_HEADS][4];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < W; c++) acc[h][c] = gk_vf_zero();
    if (!PAGED) {
        const float *run = vc + kv_at(kv, r, j, 0, nkv, d); /* position t at t * d */
        GK_FOR_TAKEN(t, i, sink, from, last) {
            if (e0 == 0 && t + GK_ATT_PREFETCH <= last) prefetch_row(run + (size_t)(t + GK_ATT_PREFETCH) * d, d);
            values_add(NH, W, acc, run + (size_t)t * d + e0, sc, span, inv, i);
        }
    } else {
        const float *row = NULL, *f = NULL;  /* the last position's row and the last prefetched, with their runs */
        int left = 0, f_left = 0, row_t = -2, f_t = -2;
        GK_FOR_TAKEN(t, i, sink, from, last) {
            if (t == row_t + 1 && left > 0) row += d, left--;
            else row = kv_run(vc, kv, r, j, t, nkv, d, &left);
            row_t = t;
            if (e0 == 0 && t + GK_ATT_PREFETCH <= last) {
                if (t + GK_ATT_PREFETCH == f_t + 1 && f_left > 0) f += d, f_left--;
                else f = kv_run(vc, kv, r, j, t + GK_ATT_PREFETCH, nkv, d, &f_left);
                f_t = t + GK_ATT_PREFETCH;
                prefetch_row(f, d);
            }
            values_add(NH, W, acc, row + e0, sc, span, inv, i);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < W; c++) gk_vf_store(o[h] + e0 + GK_VALUE_LANES * c, acc[h][c]);
}

/* values_heads for NH heads (a constant): up to 4 vectors of each head's output at a time (fewer where
 * their sums would not fit the registers), then 256-bit vectors for what is left */
static inline __attribute__((always_inline)) void values_nh(const int NH, const int PAGED, const float *vc,
                                                            const gk_kv *kv, int r, int j, int last, int nkv, int d,
                                                            const float *sc, int span, const float *inv,
                                                            float *const *o, int sink, int from) {
    const int wide = NH * 4 + NH <= GK_ATT_REGS ? 4 : 2, lanes = GK_VALUE_LANES;
    int e0 = 0;
    for (; wide == 4 && e0 + 4 * lanes <= d; e0 += 4 * lanes)
        values_nw(NH, 4, PAGED, vc, kv, r, j, last, nkv, d, e0, sc, span, inv, o, sink, from);
    for (; e0 + 2 * lanes <= d; e0 += 2 * lanes)
        values_nw(NH, 2, PAGED, vc, kv, r, j, last, nkv, d, e0, sc, span, inv, o, sink, from);
    for (; e0 + lanes <= d; e0 += lanes)
        values_nw(NH, 1, PAGED, vc, kv, r, j, last, nkv, d, e0, sc, span, inv, o, sink, from);
    for (; e0 < d; e0 += 8) {  /* 8 elements left of 16-lane vectors */
        __m256 acc[GK_ATT_HEADS];
        for (int h = 0; h < NH; h++) acc[h] = _mm256_setzero_ps();
        GK_FOR_TAKEN(t, i, sink, from, last) {
            const __m256 v = _mm256_loadu_ps(vc + kv_at(kv, r, j, t, nkv, d) + e0);
            for (int h = 0; h < NH; h++)
                acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(sc[(size_t)h * span + i] * inv[h]), v, acc[h]);
        }
        for (int h = 0; h < NH; h++) _mm256_storeu_ps(o[h] + e0, acc[h]);
    }
}

/* o[h] = sum_t w[h][t] v_t for the n heads (weights sc[h * span + i] * inv[h], i counting the positions
 * t taken, GK_FOR_TAKEN), each element one sum in position order: every value read once for the n heads */
static void values_heads(int n, const float *vc, const gk_kv *kv, int r, int j, int last, int nkv, int d,
                         const float *sc, int span, const float *inv, float *const *o, int sink, int from) {
#define GK_VALUES(NH, PAGED) values_nh(NH, PAGED, vc, kv, r, j, last, nkv, d, sc, span, inv, o, sink, from)
    const int paged = kv->table != NULL;
    if (n == 4) paged ? GK_VALUES(4, 1) : GK_VALUES(4, 0);
    else if (n == 3) paged ? GK_VALUES(3, 1) : GK_VALUES(3, 0);
    else if (n == 2) paged ? GK_VALUES(2, 1) : GK_VALUES(2, 0);
    else paged ? GK_VALUES(1, 1) : GK_VALUES(1, 0);
#undef GK_VALUES
}

/* attend for head_dim a multiple of 8: up to GK_ATT_HEADS query heads of one K/V head per item (all
 * of them, even where that leaves a thread idle: splitting a group reads its keys and values twice,
 * and the step is memory-bound); per item scores_heads, softmax, values_heads */
static void attend_vec(const gk_layer *L, const float *qkv, int rows, const int32_t *pos, const float *kc,
                       const float *vc, const gk_kv *kv, float *scores, int span, float *att, int threads) {
    const int nq = L->num_heads, nkv = L->num_kv_heads, d = L->head_dim, group = nq / nkv;
    const int per = group < GK_ATT_HEADS ? group : GK_ATT_HEADS;  /* not fewer for idle threads: each K/V read once */
    const int chunks = (group + per - 1) / per, work = rows * nkv * chunks;
    const float scale = score_scale(L);
#pragma omp parallel for num_threads(threads < work ? threads : work) schedule(static)
    for (int w = 0; w < work; w++) {
        const float *q[GK_ATT_HEADS];
        float *o[GK_ATT_HEADS], mx[GK_ATT_HEADS], inv[GK_ATT_HEADS];
        int j, i0, n;
        const int r = head_item(L, w, chunks, per, qkv, att, q, o, &j, &i0, &n), last = pos[r];
        float *sc = scores + (size_t)(r * nq + i0) * span;
        /* positions 0..sink-1 and from..last (every one without a window) */
        const int windowed = L->window > 0 && last + 1 > L->sink + L->window;
        const int sink = windowed ? L->sink : last + 1, from = windowed ? last + 1 - L->window : last + 1;
        for (int h = 0; h < n; h++) mx[h] = -INFINITY;
        if (sink > 0) scores_heads(q, n, kc, kv, r, j, 0, sink - 1, nkv, d, scale, sc, span, mx);
        if (from <= last) scores_heads(q, n, kc, kv, r, j, from, last, nkv, d, scale, sc + sink, span, mx);
        const int taken = sink + (last + 1 - from);
        exp_heads(sc, span, n, taken, mx, inv);
        values_heads(n, vc, kv, r, j, last, nkv, d, sc, span, inv, o, sink, from);
    }
}
#endif

/* each row's query heads over its positions 0..pos[r] (grouped heads), into att */
static void attend(const gk_layer *L, const float *qkv, int rows, const int32_t *pos, const float *kc, const float *vc,
                   const gk_kv *kv, float *scores, int span, float *att, int threads) {
    int nq = L->num_heads, nkv = L->num_kv_heads, d = L->head_dim, nqkv = (nq + 2 * nkv) * d, group = nq / nkv;
#ifdef GK_LLAMA_VEC
    if (d % 8 == 0) {
        attend_vec(L, qkv, rows, pos, kc, vc, kv, scores, span, att, threads);
        return;
    }
#endif
    const float scale = score_scale(L);
    int work = rows * nq, nthreads = threads < work ? threads : work;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int ri = 0; ri < work; ri++) {
        int r = ri / nq, i = ri % nq, j = i / group, last = pos[r];
        const float *q = qkv + r * (size_t)nqkv + (size_t)i * d;
        float *sc = scores + (size_t)ri * span, *o = att + r * (size_t)nq * d + (size_t)i * d;
        float mx = -INFINITY;
        for (int t = 0; t <= last; t++) {
            sc[t] = dot(q, kc + kv_at(kv, r, j, t, nkv, d), d) * scale;
            if (sc[t] > mx) mx = sc[t];
        }
        float inv = 1.0f / exp_shifted(sc, last + 1, mx);
        for (int e = 0; e < d; e++) o[e] = 0.0f;
        for (int t = 0; t <= last; t++) {
            float p = sc[t] * inv;
            const float *vt = vc + kv_at(kv, r, j, t, nkv, d);
            for (int e = 0; e < d; e++) o[e] += p * vt[e];
        }
    }
}


/* the RMSNorm (weight w, eps; as ggml computes it with llama) of each row of x into h, or with a bias b
 * (GPT-2's; NULL: none) the LayerNorm; rows are independent, so they are shared among threads */
static void norm_rows(int llama, float eps, const float *w, const float *b, const float *x, float *h, int rows,
                      int hidden, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && threads > 1)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * (size_t)hidden;
        float *hr = h + r * (size_t)hidden;
        if (b != NULL)
            layer_norm(xr, w, b, eps, hidden, hr);
        else
            (llama ? rms_norm_llama : rms_norm)(xr, w, eps, hidden, hr);
    }
}

/* GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), as x / (1 + exp(-2u)) (the
 * same function; no cancellation where x is negative), ggml's vector expf in steps of 8 */
static void gelu_tanh(const float *x, float *a, int n) {
    const float c = 1.5957691216057308f, k = 0.044715f; /* 2 sqrt(2 / pi) */
    int i = 0;
#ifdef GK_LLAMA_VEC
    const __m256 one = _mm256_set1_ps(1.0f), mc = _mm256_set1_ps(-c), vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 u = _mm256_mul_ps(mc, _mm256_fmadd_ps(_mm256_mul_ps(vk, v), _mm256_mul_ps(v, v), v));
        _mm256_storeu_ps(a + i, _mm256_div_ps(v, _mm256_add_ps(one, expf_llama_avx2(u))));
    }
#endif
    for (; i < n; i++) a[i] = x[i] / (1.0f + expf(-c * (k * x[i] * (x[i] * x[i]) + x[i])));
}

/* the MLP's activation of each row into act, rows shared among threads: silu(gate) * up (gu: gate then up per
 * row), or GPT-2's GELU (gu: the `intermediate` outputs per row) */
static void activation_rows(const gk_layer *L, const float *gu, float *act, int rows, int threads) {
    const int inter = L->intermediate;
    if (L->gelu) { /* GPT-2: un-gated, gu holds the MLP's `intermediate` outputs per row */
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && threads > 1)
        for (int r = 0; r < rows; r++) gelu_tanh(gu + (size_t)r * inter, act + (size_t)r * inter, inter);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && threads > 1)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + 2 * (size_t)r * inter;
        float *a = act + (size_t)r * inter;
        /* genkit's numerics too, in the AVX2 order: ggml's vector silu (libm's expf was 5 ns a value) */
        swiglu_llama(L->llama >= GK_LLAMA_AVX512 ? L->llama : GK_LLAMA_AVX2, g, g + inter, a, inter);
    }
}

/* One decode step of `rows` tokens, row r at position pos[r] (cos/sin rows cs_stride apart; 0: shared). */
static int decode_rows(int num_layers, const gk_layer *layers, float *x, int rows, int hidden, const float *cos_,
                       const float *sin_, int cs_stride, const int32_t *pos, float *const *kcache,
                       float *const *vcache, const gk_kv *kv, int threads) {
    int maxq = 0, maxi = 0, heads_max = 0, span = 0;
    for (int r = 0; r < rows; r++) span = pos[r] + 1 > span ? pos[r] + 1 : span;
    for (int l = 0; l < num_layers; l++) {
        const gk_layer *L = &layers[l];
        int nqkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
        if (nqkv > maxq) maxq = nqkv;
        if (L->intermediate > maxi) maxi = L->intermediate;
        if (L->num_heads > heads_max && !L->llama) heads_max = L->num_heads;  /* attend_llama keeps no scores */
        if (L->head_dim > 512 || L->head_dim % 2) return -2;
    }
    size_t R = (size_t)rows;
    size_t need = R * (2 * (size_t)hidden + 2 * (size_t)maxq + 3 * (size_t)maxi + (size_t)heads_max * span);
    float *buf = (float *)malloc(sizeof(float) * need);
    if (buf == NULL) return -1;
    float *h = buf, *tmp = h + R * hidden, *qkv = tmp + R * hidden, *att = qkv + R * maxq, *gu = att + R * maxq,
          *act = gu + 2 * R * maxi, *scores = act + R * maxi;
    int rc = 0;
    for (int l = 0; l < num_layers && rc == 0; l++) {
        const gk_layer *L = &layers[l];
        int nq = L->num_heads, nkv = L->num_kv_heads, d = L->head_dim, inter = L->intermediate;
        int nqkv = (nq + 2 * nkv) * d;
        GK_T0;
        norm_rows(L->llama, L->eps, L->norm1, L->norm1_b, x, h, rows, hidden, threads);
        GK_T(GK_P_NORM);
        GK_CAT(GK_P_QKV);
        if ((rc = layer_product(L, GK_W_QKV, h, qkv, rows, nqkv, hidden, threads))) break;
        GK_T0;
        rope_and_store(L, qkv, rows, cos_, sin_, cs_stride, pos, kcache[l], vcache[l], kv, threads);
        GK_T(GK_P_ROPE);
        if (L->llama)
            attend_llama(L, qkv, rows, pos, kcache[l], vcache[l], kv, att, threads);
        else
            attend(L, qkv, rows, pos, kcache[l], vcache[l], kv, scores, span, att, threads);
        GK_T(GK_P_ATTEND);
        GK_CAT(GK_P_O);
        if ((rc = layer_product(L, GK_W_O, att, tmp, rows, hidden, nq * d, threads))) break;
        GK_T0;
        for (size_t i = 0; i < R * hidden; i++) x[i] += tmp[i];
        GK_T(GK_P_RESID);
        norm_rows(L->llama, L->eps, L->norm2, L->norm2_b, x, h, rows, hidden, threads);
        GK_T(GK_P_NORM);
        GK_CAT(GK_P_GU);
        if ((rc = layer_product(L, GK_W_GU, h, gu, rows, L->gelu ? inter : 2 * inter, hidden, threads))) break;
        GK_T0;
        activation_rows(L, gu, act, rows, threads);
        GK_T(GK_P_SILU);
        GK_CAT(GK_P_DOWN);
        if ((rc = layer_product(L, GK_W_D, act, tmp, rows, hidden, inter, threads))) break;
        GK_T0;
        for (size_t i = 0; i < R * hidden; i++) x[i] += tmp[i];
        GK_T(GK_P_RESID);
    }
    free(buf);
    return rc ? -1 : 0;
}

/* `tokens` tokens of each cache row of genkit's KVCache (per row [kv_heads][capacity][head_dim]) at
 * positions pos..pos+tokens-1: step row r is token r % tokens of cache row r / tokens (rows = cache
 * rows x tokens); cos/sin: one head_dim row shared by all rows (tokens 1), else one per step row. */
int gk_decode(int num_layers, const gk_layer *layers, float *x, int rows, int hidden, const float *cos_,
              const float *sin_, int pos, int tokens, float *const *kcache, float *const *vcache, int capacity,
              int threads) {
    if (tokens < 1 || rows % tokens) return -2;
    int32_t *positions = (int32_t *)malloc(sizeof(int32_t) * (rows > 0 ? rows : 1));
    if (positions == NULL) return -1;
    for (int r = 0; r < rows; r++) positions[r] = pos + r % tokens;
    gk_kv kv = {capacity, NULL, 0, 0, tokens};
    int rc = decode_rows(num_layers, layers, x, rows, hidden, cos_, sin_, tokens > 1 ? layers[0].head_dim : 0, positions,
                         kcache, vcache, &kv, threads);
    free(positions);
    return rc;
}

/* Continuous batching's decode step: row r (one token of its own request) at position pos[r], its
 * keys and values in the paged store (per layer [num_blocks][block_size][kv_heads][head_dim]) at the
 * blocks table[r][0..width-1]; cos/sin: one head_dim row per token. */
int gk_decode_paged(int num_layers, const gk_layer *layers, float *x, int rows, int hidden, const float *cos_,
                    const float *sin_, const int32_t *pos, float *const *kcache, float *const *vcache,
                    const int32_t *table, int width, int block_size, int threads) {
    gk_kv kv = {0, table, width, block_size, 1};
    return decode_rows(num_layers, layers, x, rows, hidden, cos_, sin_, layers[0].head_dim, pos, kcache, vcache, &kv,
                       threads);
}

/* Attention alone over one layer of the paged store, for continuous batching's torch path (a step
 * whose products run in torch): row r's nq query heads q[r] ((rows, nq, d), after rotary embedding)
 * at position pos[r] over its positions 0..pos[r] in blocks table[r][0..width-1] of keys kc and values
 * vc (as gk_decode_paged), into out (rows, nq, d), the scores times scale (0: 1 / sqrt(d), as
 * gk_layer.scale); as gk_decode_paged attends, without gathering the blocks. scratch: rows * (nq + 2 * nkv)
 * * d + rows * nq * (max pos + 1) floats. */
int gk_attend_paged(const float *q, int rows, int nq, int nkv, int d, const int32_t *pos, const float *kc,
                    const float *vc, const int32_t *table, int width, int block_size, float scale, float *scratch,
                    float *out, int threads) {
    if (rows < 1 || nkv < 1 || nq % nkv || d < 1 || d > 512 || d % 2) return -2;
    gk_layer L;
    memset(&L, 0, sizeof L);
    L.num_heads = nq, L.num_kv_heads = nkv, L.head_dim = d, L.scale = scale;
    const size_t nqkv = (size_t)(nq + 2 * nkv) * d;
    int span = 0;
    for (int r = 0; r < rows; r++) span = pos[r] + 1 > span ? pos[r] + 1 : span;
    float *qkv = scratch, *scores = scratch + rows * nqkv;  /* each row's query heads where attend reads them */
    for (int r = 0; r < rows; r++) memcpy(qkv + r * nqkv, q + (size_t)r * nq * d, sizeof(float) * nq * d);
    gk_kv kv = {0, table, width, block_size, 1};
    attend(&L, qkv, rows, pos, kc, vc, &kv, scores, span, out, threads);
    return 0;
}

/* ---- the ends of a decode step: the token embeddings in, the final norm and the LM head out ----
 * With them a batch-1 step is one call from Python: what runs between two calls does so with the
 * caches cold (the layers stream the weights through them), and a handful of small torch operations
 * there cost more than they do hot. */
typedef struct {
    const float *embed;    /* a float32 table (vocab, hidden), element (i, j) at embed[i * s0 + j * s1] */
    long long s0, s1;      /* (a tied LM head's column-major layout included), or NULL and the next two: */
    const int8_t *codes;   /* int8 codes (vocab, hidden), each GK_GROUP of them */
    const float *scales;   /* times their float scale (vocab, hidden / GK_GROUP) */
    long long vocab;       /* the table's rows */
    const float *norm;     /* the final RMSNorm's weight (hidden) */
    float eps;
    int llama;             /* the norm as ggml computes it (rms_norm_llama); 0: rms_norm */
    const void *head;      /* the LM head, `outputs` rows: block weights, or with gemv a float32 weight */
    int head_bits, head_act, outputs;
    /* a float32 head: the dense kernel's product (as gk_layer.gemv) on its weight of leading dimension
     * head_ld; NULL: block weights */
    int (*gemv)(const float *x, int ldx, const float *w, long ldw, float *y, int M, int N, int K, int threads);
    long head_ld;
    /* greedy and top-k steps of a float32 head (gk_decode_top): its 8-bit copy (gk_head_proxy: proxy_rows rows of
     * block weights) with each row's bound, and the dense kernel's gk_gemv_t_cols for the exact logits of the
     * rows that can hold the argmax; NULL: every logit is computed */
    const uint8_t *proxy;
    const float *bound;
    int proxy_rows;
    int (*gemv_cols)(const float *x, const float *w, long ldw, float *y, int N, int K, int threads, const int *blocks,
                     int n);
    /* a self-speculative draft's greedy steps (genkit/models/self_speculation.py) on a block head: the 16-row
     * blocks of its `rescore` largest logits computed again by gemv_cols on the model's float32 head (rescore_w,
     * column-major, leading dimension rescore_ld), the token the first maximum of those; 0: the block head's */
    const float *rescore_w;
    long rescore_ld;
    int rescore;
    /* GPT-2: the final norm a LayerNorm with this bias (NULL: an RMSNorm), and learned positions added to each
     * embedding row (a float32 table of position_rows rows, element (p, j) at positions[p * p0 + j * p1]; NULL:
     * none) */
    const float *norm_b;
    const float *positions;
    long long p0, p1, position_rows;
    /* a head whose rows were padded to a multiple of 16 with rows of zeros (a block head of GPT-2's 50,257, a
     * draft's): greedy steps choose among the first `live` rows only (0: all `outputs`; live_rows) */
    int live;
    int amx_rows; /* the block head's and the 8-bit copy's gk_matmul amx_rows (as gk_layer.amx_rows) */
} gk_ends;

/* the embedding rows of ids into x (ids checked by the caller), row r at position pos + r % tokens: plus that
 * position's row of e's learned positions where it has them (GPT-2; checked by ends_fit) */
static void embed_rows(const gk_ends *e, const int64_t *ids, int rows, int hidden, float *x, int pos, int tokens) {
    for (int r = 0; r < rows; r++) {
        float *out = x + (size_t)r * hidden;
        if (e->embed != NULL) {
            const float *row = e->embed + (size_t)ids[r] * (size_t)e->s0;
            if (e->s1 == 1)
                memcpy(out, row, sizeof(float) * hidden);
            else
                for (int i = 0; i < hidden; i++) out[i] = row[(size_t)i * (size_t)e->s1];
        } else {
            const int8_t *q = e->codes + (size_t)ids[r] * hidden;
            const float *s = e->scales + (size_t)ids[r] * (hidden / GK_GROUP);
            for (int i = 0; i < hidden; i++) out[i] = (float)q[i] * s[i / GK_GROUP];
        }
        if (e->positions != NULL) {
            const float *p = e->positions + (size_t)(pos + r % tokens) * (size_t)e->p0;
            for (int i = 0; i < hidden; i++) out[i] += p[(size_t)i * (size_t)e->p1];
        }
    }
}

/* whether a step's ids and positions fit the ends: every id in the table, positions pos..pos+tokens-1 in the
 * learned positions' table where there is one (-5 for the caller otherwise: nothing written) */
static int ends_fit(const gk_ends *e, const int64_t *ids, int rows, int pos, int tokens) {
    for (int r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= e->vocab) return 0;
    return e->positions == NULL || (pos >= 0 && (long long)pos + tokens <= e->position_rows);
}

/* logits (rows, outputs) of the final-normed hidden states h (rows, hidden): the LM head */
static int head_product(const gk_ends *e, const float *h, int rows, int hidden, float *logits, int threads) {
    return e->gemv != NULL
               ? e->gemv(h, hidden, (const float *)e->head, e->head_ld, logits, rows, e->outputs, hidden, threads)
               : gk_matmul(e->head_bits, (const uint8_t *)e->head, h, logits, rows, e->outputs, hidden, threads,
                           e->head_act, e->amx_rows);
}

/* logits (rows, outputs) of the hidden states x (rows, hidden): the final norm, then the LM head */
int gk_logits(const gk_ends *e, const float *x, int rows, int hidden, float *logits, int threads) {
    float *h = (float *)malloc(sizeof(float) * (size_t)(rows > 0 ? rows : 1) * hidden);
    if (h == NULL) return -1;
    norm_rows(e->llama, e->eps, e->norm, e->norm_b, x, h, rows, hidden, threads);
    int rc = head_product(e, h, rows, hidden, logits, threads);
    free(h);
    return rc;
}

int gk_decode_top(int num_layers, const gk_layer *layers, const gk_ends *e, const int64_t *ids, int rows, int hidden,
                  const float *cos_, const float *sin_, int pos, float *const *kcache, float *const *vcache,
                  int capacity, int threads, float *logits, int top, int64_t *tokens);

/* A decode step of one token per cache row from token ids to logits (rows, outputs): the embedding,
 * gk_decode (tokens 1), the final norm and the LM head as gk_logits computes them (gk_decode_top with
 * every logit). -5, with nothing written, when an id lies outside the table. */
int gk_decode_logits(int num_layers, const gk_layer *layers, const gk_ends *e, const int64_t *ids, int rows,
                     int hidden, const float *cos_, const float *sin_, int pos, float *const *kcache,
                     float *const *vcache, int capacity, int threads, float *logits) {
    return gk_decode_top(num_layers, layers, e, ids, rows, hidden, cos_, sin_, pos, kcache, vcache, capacity, threads,
                         logits, 0, NULL);
}

/* ---- greedy steps: the argmax of the logits, computed from a few of them ----
 * A float32 LM head is a fifth of the bytes a small model's decode step reads (SmolLM2-135M: 113 of
 * 540 MB). A greedy step needs only the index of the largest logit, so it reads an 8-bit copy of the
 * head instead (a quarter of the bytes), bounds how far each row's exact logit can be from its copy's,
 * and computes exactly only the rows whose bound reaches the largest lower bound: the exact argmax is
 * among them, and the token is the one the whole head gives (the first maximum; numpy's argmax).
 *
 * The bound of row r, for a final-normed hidden state h with X = ||h||_2 (exact logit l_r, the
 * copy's logit p_r, the copy's weights w~_r, h~ the copy's product's rounding of h into two int8
 * digits per 32 values): |l_r - p_r| <= ||w_r - w~_r|| X (the copy's rounding) + ||w~_r|| ||h - h~||
 * (h's rounding: each value within max|block| / 21505, so ||h - h~|| <= 2.7e-4 X) + the float
 * rounding of either product (gamma(K + 8) ||w_r|| X for the exact one; gamma(3 K / 32 + 40) times
 * the magnitudes of the copy's block terms, 383 |d_b| for codes of 0..255 and m = -128 d, times
 * ||h~_b||_1 <= 6 ||h_b||_2: 2300 ||d_r|| X). gk_head_proxy stores bound_r = that over X, rounded up
 * and widened by 0.1 %. */
#define GK_PROXY_BLOCKS 512 /* at most this many 16-row blocks computed exactly (an eighth for an argmax) */

static inline double gamma_n(int n) { return n * 0x1p-24 / (1.0 - n * 0x1p-24); }

/* float16 bits of f, a value float16 holds exactly (round_f16's) */
static uint16_t f16_bits(float f) {
#if defined(GK_VNNI) || defined(GK_AVX2)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    float a = fabsf(f);
    if (a == 0.0f) return sign;
    if (a < 6.103515625e-05f) return sign | (uint16_t)(a * 16777216.0f); /* subnormal: a multiple of 2^-24 */
    int e;
    float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    return sign | (uint16_t)((e + 14) << 10) | (uint16_t)(m * 2048.0f - 1024.0f);
#endif
}

/* Row r of a panel block blk (gk_matmul's layout): its 32 codes, and its scale and offset (float16; 6-bit: two float32 scales).
 * Returns 0 where an offset is -2^(bits-1) times the scale (a symmetric block), 1 where it is not, -6 where a
 * scale or offset leaves float16's range. */
static int put_group(int bits, uint8_t *blk, int r, const uint8_t *codes, const float *scale, float minimum) {
    if (bits == 4) {
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 4; j++) blk[c * 64 + r * 4 + j] = codes[8 * c + j] | (uint8_t)(codes[8 * c + 4 + j] << 4);
    } else {
        for (int c = 0; c < 8; c++) memcpy(blk + c * 64 + r * 4, codes + 4 * c, 4);
    }
    if (bits == 6) {
        memcpy(blk + 512 + 4 * r, &scale[0], 4);
        memcpy(blk + 576 + 4 * r, &scale[1], 4);
        return 0;
    }
    float d = round_f16(scale[0]), m = round_f16(minimum);
    if (!isfinite(d) || !isfinite(m)) return -6;
    uint16_t dh = f16_bits(d), mh = f16_bits(m);
    memcpy(blk + 16 * bits * 4 + 2 * r, &dh, 2);
    memcpy(blk + 16 * bits * 4 + 32 + 2 * r, &mh, 2);
    return minimum != -(float)(1 << (bits - 1)) * scale[0];
}

/* One panel (rows n0.., GK_ROWS of them, those past N zero) of the copy: codes, scales, and per row
 * the sums of squares of the rounding error, the copy's weights, the weights and the scales.
 * Returns -6 when a weight is not finite or a scale leaves float16's range. */
static int proxy_panel(const float *w, long ldw, int N, int K, int n0, uint8_t *out, double (*sums)[4]) {
    const int nb = K / GK_GROUP;
    memset(sums, 0, sizeof(double) * 4 * GK_ROWS);
    for (int b = 0; b < nb; b++) {
        uint8_t *blk = out + (size_t)b * block_bytes(8);
        for (int r = 0; r < GK_ROWS; r++) {
            float v[GK_GROUP], amax = 0.0f;
            for (int k = 0; k < GK_GROUP; k++) {
                v[k] = n0 + r < N ? w[(size_t)(b * GK_GROUP + k) * (size_t)ldw + (size_t)(n0 + r)] : 0.0f;
                if (!isfinite(v[k])) return -6;
                amax = fmaxf(amax, fabsf(v[k]));
            }
            float d = round_f16(amax / 127.0f), inv = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(d < 511.0f)) return -6; /* m = -128 d must be a float16 too */
            uint8_t codes[GK_GROUP];
            for (int k = 0; k < GK_GROUP; k++) {
                float c = fminf(fmaxf(nearbyintf(v[k] * inv), -128.0f), 127.0f);
                codes[k] = (uint8_t)(c + 128.0f);
                double wt = (double)d * c, dw = (double)v[k] - wt;
                sums[r][0] += dw * dw;
                sums[r][1] += wt * wt;
                sums[r][2] += (double)v[k] * v[k];
            }
            sums[r][3] += (double)d * d;
            put_group(8, blk, r, codes, &d, -128.0f * d);
        }
    }
    return 0;
}

/* The 8-bit copy of a float32 head w (N, K) stored column-major (element (n, k) at w[k * ldw + n]) for
 * gk_decode_top: out in gk_matmul's block layout for bits 8 (N rounded up to GK_ROWS rows, the extra
 * ones zero; K a multiple of GK_GROUP), bound (N) as the comment above says. Returns 0, or -6 (see
 * proxy_panel). */
int gk_head_proxy(const float *w, long ldw, int N, int K, uint8_t *out, float *bound, int threads) {
    const int panels = (N + GK_ROWS - 1) / GK_ROWS;
    const size_t pbytes = (size_t)(K / GK_GROUP) * block_bytes(8);
    const double gk = gamma_n(K + 8), gn = gamma_n(3 * (K / GK_GROUP) + 40);
    int rc = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(min : rc)
    for (int p = 0; p < panels; p++) {
        double sums[GK_ROWS][4];
        int prc = proxy_panel(w, ldw, N, K, p * GK_ROWS, out + (size_t)p * pbytes, sums);
        if (prc < rc) rc = prc;
        for (int r = 0; r < GK_ROWS && p * GK_ROWS + r < N; r++) {
            double c = (sqrt(sums[r][0]) + 2.7e-4 * sqrt(sums[r][1]) + gk * sqrt(sums[r][2]) +
                        gn * 2300.0 * sqrt(sums[r][3])) * 1.001;
            float f = (float)c;
            bound[p * GK_ROWS + r] = (double)f < c ? nextafterf(f, INFINITY) : f;
        }
    }
    return rc;
}

/* GGUF blocks straight into gk_matmul's layout (gk_pack_gguf), the same bytes as block_kernel.py's pack() of
 * gguf_blocks.py's int4 parts: each 32 weights of a row as codes, a scale and an offset (6-bit codes: a float32
 * scale per 16, offsets -32 d). GGUF types as gguf_blocks.py's GGUF_PACK numbers them. */
enum { GK_Q4_0, GK_Q4_1, GK_Q8_0, GK_Q4_K, GK_Q6_K, GK_GGUF_TYPES };
static const int gguf_block_weights[GK_GGUF_TYPES] = {32, 32, 32, 256, 256};
static const int gguf_block_bytes[GK_GGUF_TYPES] = {18, 20, 34, 144, 210};
static const int gguf_bits[GK_GGUF_TYPES] = {4, 4, 8, 4, 6};

static inline float gguf_f16(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* Q4_K's 6-bit scale and offset of sub-block j (0-7) from the 12 bytes s */
static void q4_k_scale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q6_K's 6-bit codes of weights 32 t .. 32 t + 31 of the super-block blk (t 0-7): low nibbles from ql, two
 * high bits from qh; its scales d * sc for the two 16-weight halves */
static void q6_k_group(const uint8_t *blk, int t, uint8_t *codes, float *scale) {
    const int h = t / 4, k = t % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (k % 2), *qh = blk + 128 + 32 * h;
    for (int i = 0; i < GK_GROUP; i++)
        codes[i] = (uint8_t)((k < 2 ? ql[i] & 0x0F : ql[i] >> 4) | (((qh[i] >> (2 * k)) & 3) << 4));
    const float d = gguf_f16(blk + 208);
    for (int u = 0; u < 2; u++) scale[u] = d * (float)(int8_t)blk[192 + 2 * t + u];
}

/* Weights 32 b .. 32 b + 31 of a GGUF row as codes with w = scale[0] * code + minimum (6-bit: scale[0], scale[1]
 * per 16 weights, minimum -32 scale) */
static void gguf_group(int type, const uint8_t *row, int b, uint8_t *codes, float *scale, float *minimum) {
    const uint8_t *blk = row + (size_t)(b / (gguf_block_weights[type] / GK_GROUP)) * gguf_block_bytes[type];
    switch (type) {
    case GK_Q4_0:
    case GK_Q4_1: {
        const uint8_t *qs = blk + (type == GK_Q4_0 ? 2 : 4);
        for (int j = 0; j < 16; j++) codes[j] = qs[j] & 0x0F, codes[j + 16] = qs[j] >> 4;
        scale[0] = gguf_f16(blk);
        *minimum = type == GK_Q4_0 ? -8.0f * scale[0] : gguf_f16(blk + 2);
        break;
    }
    case GK_Q8_0:  /* q = 16 (hi - 8) + lo as one code q + 128 */
        for (int j = 0; j < GK_GROUP; j++) codes[j] = blk[2 + j] ^ 0x80;
        scale[0] = gguf_f16(blk);
        *minimum = -128.0f * scale[0];
        break;
    case GK_Q4_K: {
        const int j = b % 8;
        const uint8_t *qs = blk + 16 + 32 * (j / 2);
        int sc, mn;
        for (int i = 0; i < GK_GROUP; i++) codes[i] = j % 2 ? qs[i] >> 4 : qs[i] & 0x0F;
        q4_k_scale(blk + 4, j, &sc, &mn);
        scale[0] = gguf_f16(blk) * (float)sc;
        *minimum = -gguf_f16(blk + 2) * (float)mn;
        break;
    }
    default:
        q6_k_group(blk, b % 8, codes, scale);
        *minimum = -32.0f * scale[0];
    }
}

/* The N x K weight of GGUF `type` (rows of K / weights-per-block blocks, from src) in gk_matmul's layout
 * (out: N rounded up to GK_ROWS rows, the rows past N zero). *symmetric: whether every offset is
 * -2^(bits-1) times its scale (block_kernel.act_mode). Returns 0; -3 for an unknown type or a K the blocks
 * do not divide; -6 where a scale or offset leaves float16's range. */
int gk_pack_gguf(int type, const uint8_t *src, int N, int K, uint8_t *out, int *symmetric, int threads) {
    if (type < 0 || type >= GK_GGUF_TYPES || K <= 0 || K % gguf_block_weights[type]) return -3;
    const int bits = gguf_bits[type], nb = K / GK_GROUP, panels = (N + GK_ROWS - 1) / GK_ROWS;
    const size_t row_bytes = (size_t)(K / gguf_block_weights[type]) * gguf_block_bytes[type];
    const size_t pbytes = (size_t)nb * block_bytes(bits);
    int rc = 0, asym = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(min : rc) reduction(max : asym)
    for (int p = 0; p < panels; p++) {
        memset(out + (size_t)p * pbytes, 0, pbytes);
        for (int r = 0; r < GK_ROWS && p * GK_ROWS + r < N; r++) {
            const uint8_t *row = src + (size_t)(p * GK_ROWS + r) * row_bytes;
            for (int b = 0; b < nb; b++) {
                uint8_t codes[GK_GROUP];
                float scale[2] = {0.0f, 0.0f}, minimum = 0.0f;
                gguf_group(type, row, b, codes, scale, &minimum);
                int put = put_group(bits, out + (size_t)p * pbytes + (size_t)b * block_bytes(bits), r, codes, scale, minimum);
                if (put < rc) rc = put;
                if (put > asym) asym = put;
            }
        }
    }
    *symmetric = !asym;
    return rc;
}

/* the first index of the largest of v[0..n-1], a NaN counting as the largest (numpy's argmax) */
static int64_t first_max(const float *v, int n) {
    int64_t best = 0;
    for (int i = 0; i < n; i++) {
        if (v[i] != v[i]) return i;
        if (v[i] > v[best]) best = i;
    }
    return best;
}

/* The k-th largest of v[0..n-1] (1 <= k <= n), reordering v (quickselect) */
static double kth_largest(double *v, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        double pivot = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                double t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return v[want];
}

/* The 16-row blocks of e's head that hold every row whose exact logit can reach the k-th largest (see
 * above), from the copy's logits p (e->proxy_rows) of a final-normed hidden state of norm X (lo: scratch
 * of e->outputs doubles for k > 1, unused for k = 1), into blocks (ascending, at most cap): their number, or -2 when
 * the whole head must be computed (a value not finite, more than cap blocks, a k-th largest lower bound
 * L outside 1e-30..1e30 in size). The cut is L less 2^-20 of its size: a row left out is below the cut,
 * and the cut below L (so below the k-th largest logit) by 2^-20 of it, so the row stays below the k-th
 * largest logit when the scores are divided by a temperature of 1e-3..1e3 (each quotient rounded to a
 * normal float: strictly monotone across such a gap). */
static int proxy_select(const gk_ends *e, const float *p, double X, int k, int *blocks, int cap, double *lo) {
    const int N = e->outputs;
    if (!isfinite(X) || k > N) return -2;
    double cut;
    if (k == 1) { /* the largest lower bound: four running maxima (no chain of dependent compares); chk turns NaN
                   * at a value not finite */
        double m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, chk[4] = {0.0, 0.0, 0.0, 0.0};
        int r = 0;
        for (; r + 4 <= N; r += 4)
            for (int j = 0; j < 4; j++) {
                double v = (double)p[r + j] - (double)e->bound[r + j] * X;
                chk[j] += v * 0.0;
                m[j] = v > m[j] ? v : m[j];
            }
        for (; r < N; r++) {
            double v = (double)p[r] - (double)e->bound[r] * X;
            chk[0] += v * 0.0;
            m[0] = v > m[0] ? v : m[0];
        }
        if (isnan(chk[0] + chk[1] + chk[2] + chk[3])) return -2;
        cut = fmax(fmax(m[0], m[1]), fmax(m[2], m[3]));
    } else {
        for (int r = 0; r < N; r++) {
            lo[r] = (double)p[r] - (double)e->bound[r] * X;
            if (!isfinite(lo[r])) return -2;
        }
        cut = kth_largest(lo, N, k);
    }
    if (!(fabs(cut) >= 1e-30 && fabs(cut) <= 1e30)) return -2; /* a quotient could leave float's range */
    cut -= 0x1p-20 * fabs(cut);
    int n = 0;
    for (int r = 0; r < N; r++) {
        double hi = (double)p[r] + (double)e->bound[r] * X;
        if (hi < cut - 1e-12 * (fabs(cut) + fabs(hi)) || (n > 0 && blocks[n - 1] == r / 16)) continue;
        if (n == cap) return -2;
        blocks[n++] = r / 16;
    }
    return n;
}

/* ||h||_2 of a row of K values, in double */
static double row_norm(const float *h, int K) {
    double ss = 0.0;
    for (int i = 0; i < K; i++) ss += (double)h[i] * h[i];
    return sqrt(ss);
}

/* proxy_select for the final-normed hidden state h (K values) of a batch-1 step: the copy's product
 * of h, then the blocks; -1 when memory cannot be had */
static int proxy_blocks(const gk_ends *e, const float *h, int K, int k, int *blocks, int cap, int threads) {
    float *p = (float *)malloc(sizeof(float) * (size_t)e->proxy_rows);
    double *lo = k > 1 ? (double *)malloc(sizeof(double) * (size_t)e->outputs) : NULL;
    int rc = p == NULL || (k > 1 && lo == NULL) ? -1 : 0;
    if (rc == 0 && gk_matmul(8, e->proxy, h, p, 1, e->proxy_rows, K, threads, GK_ACT_TWO, e->amx_rows) != 0) rc = -1;
    if (rc == 0) rc = proxy_select(e, p, row_norm(h, K), k, blocks, cap, lo);
    free(p);
    free(lo);
    return rc;
}

/* The exact logits of the blocks (see proxy_blocks) into logits (with fill, the other rows -inf; else
 * left as they are): 1, or 0 when a value is not finite (the whole head must be computed) */
static int proxy_logits(const gk_ends *e, const float *h, int K, const int *blocks, int n, int fill, float *logits,
                        int threads) {
    const int N = e->outputs;
    for (int r = 0; fill && r < N; r++) logits[r] = -INFINITY;
    e->gemv_cols(h, (const float *)e->head, e->head_ld, logits, N, K, threads, blocks, n);
    for (int i = 0; i < n; i++)
        for (int r = 16 * blocks[i]; r < N && r < 16 * blocks[i] + 16; r++)
            if (!isfinite(logits[r])) return 0;
    return 1;
}

/* the first maximum of the logits of the blocks' rows: every row that can hold the largest logit is there */
static int64_t blocks_first_max(const float *logits, int N, const int *blocks, int n) {
    int64_t best = -1;
    for (int i = 0; i < n; i++)
        for (int r = 16 * blocks[i]; r < N && r < 16 * blocks[i] + 16; r++)
            if (best < 0 || logits[r] > logits[best]) best = r;
    return best;
}

/* The rows of e's head that are logits: `live` of a head whose last panel is padded with rows of zeros
 * (a block head of a vocabulary not a multiple of 16, a padded draft head), else all `outputs` */
static int live_rows(const gk_ends *e) {
    return e->live > 0 && e->live < e->outputs ? e->live : e->outputs;
}

/* The first maximum of each of the `rows` rows of logits of final-normed hidden states h (rows, hidden)
 * through e's 8-bit copy of a float32 head (a greedy step of gk_decode_top, a check of gk_decode_verify):
 * the copy read once for all rows (the block product gives each row the bits of that row alone), then
 * per row the exact logits of the blocks that can hold its largest (into that row of `logits`, the
 * scratch), or where the copy does not serve, the whole row. -1 when memory cannot be had. */
static int argmax_rows(const gk_ends *e, const float *h, int rows, int hidden, float *logits, int64_t *out,
                       int threads) {
    float *p = (float *)malloc(sizeof(float) * (size_t)rows * (size_t)e->proxy_rows);
    int rc = p == NULL ? -1 : 0;
    if (rc == 0 && gk_matmul(8, e->proxy, h, p, rows, e->proxy_rows, hidden, threads, GK_ACT_TWO, e->amx_rows) != 0)
        rc = -1;
    for (int r = 0; rc == 0 && r < rows; r++) {
        const float *hr = h + (size_t)r * hidden;
        float *lr = logits + (size_t)r * e->outputs;
        int blocks[GK_PROXY_BLOCKS / 8];
        int nb = proxy_select(e, p + (size_t)r * e->proxy_rows, row_norm(hr, hidden), 1, blocks, GK_PROXY_BLOCKS / 8,
                              NULL);
        if (nb >= 0 && proxy_logits(e, hr, hidden, blocks, nb, 0, lr, threads)) {
            out[r] = blocks_first_max(lr, e->outputs, blocks, nb);
            continue;
        }
        rc = head_product(e, hr, 1, hidden, lr, threads);
        if (rc == 0) out[r] = first_max(lr, e->outputs);
    }
    free(p);
    return rc;
}

/* The 16-row blocks (ascending, at most GK_RESCORE_MAX) of the e->rescore largest of logits[0..N-1], a
 * value that is not a number never among them (a draft's guess: a NaN only makes it a poor one) */
#define GK_RESCORE_MAX 16
static int rescore_blocks(const gk_ends *e, const float *logits, int N, int *blocks) {
    const int R = e->rescore < GK_RESCORE_MAX ? e->rescore : GK_RESCORE_MAX;
    float best[GK_RESCORE_MAX];
    int at[GK_RESCORE_MAX], have = 0;
    for (int r = 0; r < N; r++) {
        const float v = logits[r];
        if (have == R && !(v > best[R - 1])) continue; /* (a NaN: never taken) */
        if (v != v) continue;
        int i = have < R ? have++ : R - 1;
        for (; i > 0 && best[i - 1] < v; i--) {
            best[i] = best[i - 1];
            at[i] = at[i - 1];
        }
        best[i] = v;
        at[i] = r;
    }
    int n = 0;
    for (int i = 0; i < have; i++) {
        int b = at[i] / 16, k = n;
        while (k > 0 && blocks[k - 1] > b) k--;
        if (k > 0 && blocks[k - 1] == b) continue;
        memmove(blocks + k + 1, blocks + k, sizeof(int) * (size_t)(n - k));
        blocks[k] = b;
        n++;
    }
    return n;
}

/* Greedy tokens of hidden states x (rows, hidden) that came out of the decoder layers (continuous
 * batching's fused step): the first maximum of each row's logits, the final norm and LM head as
 * gk_logits computes them. With a float32 head's 8-bit copy filled in (e->proxy, e->gemv_cols), through
 * it as gk_decode_top's greedy step: the copy's product for all rows at once, then per row the exact
 * logits of the 16-row blocks that can hold its maximum (argmax_rows); else every logit. */
int gk_argmax(const gk_ends *e, const float *x, int rows, int hidden, int64_t *tokens, int threads) {
    const size_t n = (size_t)(rows > 0 ? rows : 1);
    float *h = (float *)malloc(sizeof(float) * n * ((size_t)hidden + (size_t)e->outputs));
    if (h == NULL) return -1;
    float *logits = h + n * hidden;  /* only the blocks computed are written (and touched) on the copy's way */
    norm_rows(e->llama, e->eps, e->norm, e->norm_b, x, h, rows, hidden, threads);
    int rc;
    if (e->proxy != NULL && e->gemv_cols != NULL) {
        rc = argmax_rows(e, h, rows, hidden, logits, tokens, threads);
    } else {
        rc = head_product(e, h, rows, hidden, logits, threads);
        for (int r = 0; rc == 0 && r < rows; r++) tokens[r] = first_max(logits + (size_t)r * e->outputs, live_rows(e));
    }
    free(h);
    return rc;
}

/* A decode step of one token per cache row from token ids (gk_decode_logits' step; -5 the same way) to
 * logits whose rows `top` needs: with top = 0 every logit; with 0 < top, for a batch-1 step on e's 8-bit copy, the
 * exact logit of every row that can be among the `top` largest (proxy_blocks; ties included) and -inf
 * for the others, which a filter to the `top` largest (after a temperature) removes anyway; and for
 * top < 0, only tokens: the first maximum of each row's logits (a NaN counting as the largest, as
 * numpy's argmax), into `tokens`. Where the copy does not serve, every logit is computed. A draft's
 * batch-1 greedy step with e->rescore takes the first maximum over its rescored blocks instead. */
int gk_decode_top(int num_layers, const gk_layer *layers, const gk_ends *e, const int64_t *ids, int rows, int hidden,
                  const float *cos_, const float *sin_, int pos, float *const *kcache, float *const *vcache,
                  int capacity, int threads, float *logits, int top, int64_t *tokens) {
    if (!ends_fit(e, ids, rows, pos, 1)) return -5;
    const size_t n = (size_t)(rows > 0 ? rows : 1);
    float *x = (float *)malloc(sizeof(float) * n * (2 * (size_t)hidden + (top < 0 ? (size_t)e->outputs : 0)));
    if (x == NULL) return -1;
    float *h = x + n * hidden, *out = top < 0 ? h + n * hidden : logits;
    embed_rows(e, ids, rows, hidden, x, pos, 1);
    int rc = gk_decode(num_layers, layers, x, rows, hidden, cos_, sin_, pos, 1, kcache, vcache, capacity, threads);
    int blocks[GK_PROXY_BLOCKS], nb = -2, done = 0;
    const int copy = e->proxy != NULL && e->gemv_cols != NULL && rows == 1;
    if (rc == 0) {
        norm_rows(e->llama, e->eps, e->norm, e->norm_b, x, h, rows, hidden, threads);
        if (copy && top < 0) {
            rc = argmax_rows(e, h, 1, hidden, out, tokens, threads);
            free(x);
            return rc;
        }
        if (copy && top > 0) nb = proxy_blocks(e, h, hidden, top, blocks, GK_PROXY_BLOCKS, threads);
        rc = nb == -1 ? -1 : 0;
        done = nb >= 0 && proxy_logits(e, h, hidden, blocks, nb, 1, out, threads);
    }
    if (rc == 0 && !done) rc = head_product(e, h, rows, hidden, out, threads);
    const int live = live_rows(e);
    if (rc == 0 && !done && top < 0 && rows == 1 && e->rescore > 0 && e->rescore_w != NULL && e->gemv_cols != NULL) {
        nb = rescore_blocks(e, out, live, blocks);
        e->gemv_cols(h, e->rescore_w, e->rescore_ld, out, live, hidden, threads, blocks, nb);
        done = nb > 0;
    }
    if (rc == 0 && done && top < 0) tokens[0] = blocks_first_max(out, live, blocks, nb);
    for (int r = 0; rc == 0 && !done && top < 0 && r < rows; r++)
        tokens[r] = first_max(out + (size_t)r * e->outputs, live);
    free(x);
    return rc;
}

/* A speculative step's check (genkit/models/self_speculation.py): `tokens` token ids of one cache row at
 * positions pos..pos+tokens-1 (cos/sin: one head_dim row per token) through every layer, the final norm
 * and the LM head as rows of one step, into the first maximum of each token's logits (out[t]: the token
 * greedy search picks after token t). Each row is computed as a one-token step computes it (per-row
 * norms, rotary embedding, SwiGLU and attention over the row's own positions; on the dense kernel's
 * product, which gives a row of up to 16 the same bits as alone), so out[t] is the token a step of
 * ids[t] alone gives once ids[0..t-1] are in the cache. With `logits` (tokens, outputs) not NULL the
 * logits are left there too; without, a float32 head with its 8-bit copy in e is read through the copy
 * (argmax_rows). -5, with nothing written, when an id lies outside the table; -2 for more
 * than 16 tokens. */
int gk_decode_verify(int num_layers, const gk_layer *layers, const gk_ends *e, const int64_t *ids, int tokens,
                     int hidden, const float *cos_, const float *sin_, int pos, float *const *kcache,
                     float *const *vcache, int capacity, int threads, int64_t *out, float *logits) {
    if (tokens < 1 || tokens > 16) return -2;
    if (!ends_fit(e, ids, tokens, pos, tokens)) return -5;
    const size_t n = (size_t)tokens;
    const int keep = logits != NULL;
    float *x = (float *)malloc(sizeof(float) * n * (2 * (size_t)hidden + (keep ? 0 : (size_t)e->outputs)));
    if (x == NULL) return -1;
    float *h = x + n * hidden;
    if (!keep) logits = h + n * hidden;
    embed_rows(e, ids, tokens, hidden, x, pos, tokens);
    int rc = gk_decode(num_layers, layers, x, tokens, hidden, cos_, sin_, pos, tokens, kcache, vcache, capacity,
                       threads);
    if (rc == 0) {
        norm_rows(e->llama, e->eps, e->norm, e->norm_b, x, h, tokens, hidden, threads);
        if (keep || e->proxy == NULL || e->gemv_cols == NULL) {
            rc = head_product(e, h, tokens, hidden, logits, threads);
            for (int r = 0; rc == 0 && r < tokens; r++)
                out[r] = first_max(logits + (size_t)r * e->outputs, live_rows(e));
        } else {
            rc = argmax_rows(e, h, tokens, hidden, logits, out, threads);
        }
    }
    free(x);
    return rc;
}

/* numerics="llama.cpp": rotary tables for positions start..start+n-1 as ggml_rope_cache_init builds
 * them (theta_scale = powf(base, -2/dims), the angle multiplied by it pair after pair in float32,
 * cosf/sinf), in genkit's layout: cos (n, d) with both halves equal, sin (n, d) holding -s, s. */
void gk_rope_table_llama(float base, int d, int start, int n, float *cos_, float *sin_) {
    const int half = d / 2;
    const float theta_scale = powf(base, -2.0f / (float)d);
    for (int p = 0; p < n; p++) {
        float theta = (float)(start + p);
        for (int i = 0; i < half; i++) {
            float c = cosf(theta), sn = sinf(theta);
            cos_[(size_t)p * d + i] = cos_[(size_t)p * d + half + i] = c;
            sin_[(size_t)p * d + i] = -sn;
            sin_[(size_t)p * d + half + i] = sn;
            theta *= theta_scale;
        }
    }
}

/* numerics="llama.cpp": RMSNorm of `rows` rows of n (rms_norm_llama), for the model's final norm */
void gk_rms_norm_llama(const float *x, const float *w, float eps, int rows, int n, float *out) {
    norm_rows(1, eps, w, NULL, x, out, rows, n, 1);
}

/* numerics="llama.cpp-avx512-fp16": out = x v + y of float16 values rounded once to float16 (fma_f16, the
 * portable form of ggml's float16 steps; exported for its test) */
void gk_fma_f16(const float *x, const float *v, const float *y, float *out, int n) {
    for (int i = 0; i < n; i++) out[i] = fma_f16(x[i], v[i], y[i]);
}

/* numerics="llama.cpp": silu(g) * u over n values as ggml_vec_swiglu_f32 computes it in the float order
 * `order` (GK_LLAMA_*: swiglu_llama) */
void gk_swiglu_llama(const float *g, const float *u, float *out, int n, int order) {
    swiglu_llama(order, g, u, out, n);
}
