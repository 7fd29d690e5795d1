/* Matrix products with int8 / int6 / int5 / int4 weights (group-wise scales) and int8-quantized inputs.
 *
 * Why integer dot products: dequantizing int4 weights to fp32 in registers costs ~4 vector
 * instructions per 16 weights before the fused multiply-add, which caps a one-row product (decode)
 * well below the machine's read bandwidth on two cores. With the inputs quantized too (int8 per group
 * of `group` inputs, absmax scaling, round to nearest even), AVX-512 VNNI's `vpdpbusd` multiplies 64
 * byte pairs and sums them in fours into 16 int32 lanes in one instruction: the weight codes are the
 * unsigned operand (int8 weights stored as q + 128, int4 codes 0…15), the input codes the signed one.
 * Per group and output column, with input codes a (scale α, sum Σa) and weight codes u:
 *     Σ_k w_k·x_k ≈ α·s·(Σ u·a − z·Σa) [+ α·m·Σa]
 * z = 128 for int8, 32 for symmetric int6, 16 for int5, 8 for int4, 0 with offsets (mins: w = s·u + m).
 * The integer part is exact; each group's term is added to an fp32 accumulator. The scales s (and m)
 * are fp16 per group, or with two-level scales (GGUF's K-quants held as loaded) an int8 code per group
 * times an fp16 super-scale per `super_group` inputs, multiplied here (exact in fp32).
 * tests/test_quantization.py has the reference (the same arithmetic in PyTorch) and the layout in PyTorch.
 *
 * Panel layout (32 output columns, two halves of 16; per group, in input order):
 *   int8: per 4 inputs 128 bytes: half h, column j, input i at byte 64h + 4j + i;
 *   int4: per 8 inputs 128 bytes: byte 64h + 4j + i holds input i (low nibble) and input 4 + i (high);
 *   int6: per 8 inputs the 128 bytes of int4 (the low 4 bits), then 64 bytes of top bits: byte 4j + i
 *         holds, in bit pairs from the lowest, those of half 0 input i, half 0 input 4 + i, half 1
 *         input i, half 1 input 4 + i;
 *   int5: per 8 inputs the 128 bytes of int4, then 32 bytes of fifth bits. AVX-512: for each of the 4
 *         nibble vectors in turn (half 0 inputs i, half 0 inputs 4 + i, half 1 …) a 64-bit mask, bit
 *         4j + i for its byte 4j + i (merged by a byte mask: no shifts, whose port the nibbles keep busy).
 *         AVX2, which has no byte masks: bit planes, byte p's bit v the fifth bit of byte p of the v-th
 *         32-byte vector (those 4 vectors' low then high halves), merged by a shift, an and and an or.
 * So one 64-byte load is 16 columns × 4 (or 8) inputs, and the input codes of those 4 inputs are one
 * broadcast 32-bit word. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "epilogue.h"
#include "team.h"
#include "weights.h"

#define PANEL 32
#ifdef __AVX512F__
#define QROWS 6             /* 4 zmm accumulators per row (two int32, two fp32) + weights + scales <= 32 */
#else
#define QROWS AVX2_QROWS    /* the AVX2 build (avx2_compat.h): each vector is two of 16 ymm registers */
#endif
#ifdef __AVX512F__
/* acc += u·s in place. Written as the intrinsic, GCC 12 gives each result a new register and copies
 * every accumulator back at the end of each k step (two moves per vpdpbusd in the hot loop); tied
 * in asm, the accumulators stay where they are. */
static inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
#else
#define dpbusd _mm512_dpbusd_epi32
#endif
#ifndef DPBUSD_NIBBLES       /* two vpdpbusd on codes below 16 (the AVX2 build has a cheaper form for them) */
#define DPBUSD_NIBBLES(acc, u, s, v, t) dpbusd(dpbusd(acc, u, s), v, t)
#endif
#define QKERNEL_VARIANTS 6  /* kernels defined for 1..6 rows; the build uses 1..QROWS */
/* int5: the fifth bits at `f` (the layout above) as 0x10 into the nibble vectors l0, h0, l1, h1 */
#ifdef __AVX512F__
static inline void or_fifths(__m512i *l0, __m512i *h0, __m512i *l1, __m512i *h1, const uint8_t *f) {
    const __m512i fifth = _mm512_set1_epi8(0x10);
    uint64_t m[4];
    memcpy(m, f, 32);
    *l0 = _mm512_or_si512(*l0, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[0]), fifth));
    *h0 = _mm512_or_si512(*h0, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[1]), fifth));
    *l1 = _mm512_or_si512(*l1, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[2]), fifth));
    *h1 = _mm512_or_si512(*h1, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[3]), fifth));
}
#else               /* plane v to bit 4 by a 16-bit shift of 4 − v: bit 4 of each byte comes from its own byte */
#define FIFTH_PLANE(v, shifted) _mm256_or_si256(v, _mm256_and_si256(shifted, _mm256_set1_epi8(0x10)))
static inline void or_fifths(__m512i *l0, __m512i *h0, __m512i *l1, __m512i *h1, const uint8_t *f) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)f);
    l0->lo = FIFTH_PLANE(l0->lo, _mm256_slli_epi16(x, 4)), l0->hi = FIFTH_PLANE(l0->hi, _mm256_slli_epi16(x, 3));
    h0->lo = FIFTH_PLANE(h0->lo, _mm256_slli_epi16(x, 2)), h0->hi = FIFTH_PLANE(h0->hi, _mm256_slli_epi16(x, 1));
    l1->lo = FIFTH_PLANE(l1->lo, x), l1->hi = FIFTH_PLANE(l1->hi, _mm256_srli_epi16(x, 1));
    h1->lo = FIFTH_PLANE(h1->lo, _mm256_srli_epi16(x, 2)), h1->hi = FIFTH_PLANE(h1->hi, _mm256_srli_epi16(x, 3));
}
#endif
#define AHEAD_ROWS 1024     /* prefetch distance in bytes for several rows (the panel is reused from L1/L2) */

typedef struct { int row, rows; long offset; } QBlock;    /* offset: bytes into the packed inputs */

/* A block of R rows, quantized and laid out for the kernel:
 *   words [K/4][R] int32 (4 input codes each), then per group [groups][R] of: the int32 start value
 *   −z·Σa, the fp32 scale α, the fp32 offset term α·Σa. */
static long block_bytes(int rows, int K, int group) {
    long b = (long)rows * K + (long)rows * (K / group) * 12;
    return (b + 63) / 64 * 64;
}

static inline __m512 load_input16(const char *src, int a_bf16, long k) {
    if (a_bf16) return load_bf16_16((const uint16_t *)src + k, 0xFFFF);
    return _mm512_loadu_ps((const float *)src + k);
}

static void pack_block_q(const void *A, long lda, int a_bf16, int K, int group, int zero, QBlock b, char *dst,
                         const int64_t *a_rows) {
    int R = b.rows, groups = K / group;
    int32_t *words = (int32_t *)dst;
    int32_t *start = (int32_t *)(dst + (long)R * K);
    float *alpha = (float *)(start + (long)groups * R), *offset = alpha + (long)groups * R;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int r = 0; r < R; r++) {
        long row = a_rows ? a_rows[b.row + r] : (long)(b.row + r);
        const char *src = (const char *)A + row * lda * (a_bf16 ? 2 : 4);
        for (int g = 0; g < groups; g++) {
            long k0 = (long)g * group;
            __m512 mx = _mm512_setzero_ps();
            for (int j = 0; j < group; j += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(load_input16(src, a_bf16, k0 + j), sign));
            float amax = _mm512_reduce_max_ps(mx);
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512 vinv = _mm512_set1_ps(inv);
            __m512i sum = _mm512_setzero_si512();
            for (int j = 0; j < group; j += 16) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_input16(src, a_bf16, k0 + j), vinv));
                sum = _mm512_add_epi32(sum, q);
                int32_t packed[4];
                _mm_storeu_si128((__m128i *)packed, _mm512_cvtsepi32_epi8(q));
                for (int w = 0; w < 4; w++) words[((k0 + j) / 4 + w) * R + r] = packed[w];
            }
            int total = _mm512_reduce_add_epi32(sum);
            float a = amax / 127.0f;
            start[g * R + r] = -zero * total;
            alpha[g * R + r] = a;
            offset[g * R + r] = a * (float)total;
        }
    }
}

/* How far ahead a one-row product (decode) prefetches its panel, in bytes; 0: not at all, the hardware
 * prefetchers alone. Set per process by the CPU (build.py): on AMD Zen 4 software prefetching 1–2 KB
 * ahead read slower than none; on Zen 5, 4 KB ahead made int4 / Q4_K_M decode steps 14–24% faster. */
static long one_row_ahead;

void clover_quant_set_one_row_ahead(int bytes) { one_row_ahead = bytes > 0 ? bytes : 0; }

static inline __m512 half_scales(const uint16_t *s) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s)); }

/* A panel's scales (or mins): fp16 per group and column, or int8 codes with fp16 super-scales. */
typedef struct { const void *values; const uint16_t *supers; int per_super; } QScales;

static inline void group_scales(const QScales *q, int g, __m512 *s0, __m512 *s1) {
    if (!q->supers) {
        const uint16_t *s = (const uint16_t *)q->values + g * PANEL;
        *s0 = half_scales(s);
        *s1 = half_scales(s + 16);
        return;
    }
    const int8_t *c = (const int8_t *)q->values + g * PANEL;
    const uint16_t *d = q->supers + (g / q->per_super) * PANEL;
    *s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))), half_scales(d));
    *s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)))),
                        half_scales(d + 16));
}

/* R rows times one panel of BITS-bit codes; with several rows, the lines pf … pf_end (of the panel to
 * come) go to L2 meanwhile, one a k step. */
#define DEFINE_QKERNEL(R, BITS)                                                                       \
static void qkernel_##BITS##_##R(const char *blk, int K, int group, const uint8_t *W, const QScales *S,  \
                                 const QScales *Mn, char *C, long ldc_bytes, int ncols, int c_fp32,       \
                                 const Epilogue *ep, long row0, const char *pf, const char *pf_end) {    \
    int groups = K / group;                                                                               \
    const long ahead = one_row_ahead;                                                                     \
    const int32_t *words = (const int32_t *)blk;                                                          \
    const int32_t *start = (const int32_t *)(blk + (long)R * K);                                          \
    const float *alpha = (const float *)(start + (long)groups * R), *offset = alpha + (long)groups * R;   \
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);                             \
    __m512 facc[2 * R];                                                                                   \
    for (int i = 0; i < 2 * R; i++) facc[i] = _mm512_setzero_ps();                                        \
    for (int g = 0; g < groups; g++) {                                                                    \
        __m512i iacc[2 * R];                                                                              \
        for (int r = 0; r < R; r++) iacc[2 * r] = iacc[2 * r + 1] = _mm512_set1_epi32(start[g * R + r]); \
        const int32_t *wg = words + (long)g * (group / 4) * R;                                            \
        if (BITS == 8) {                                                                                  \
            for (int t = 0; t < group / 4; t++) {                                                         \
                if (R == 1 && ahead) {                                                                    \
                    _mm_prefetch((const char *)W + ahead, _MM_HINT_T0);                                   \
                    _mm_prefetch((const char *)W + ahead + 64, _MM_HINT_T0);                              \
                }                                                                                         \
                if (R > 1) {                                                                              \
                    _mm_prefetch((const char *)W + AHEAD_ROWS, _MM_HINT_T0);                              \
                    _mm_prefetch((const char *)W + AHEAD_ROWS + 64, _MM_HINT_T0);                         \
                    if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T1), pf += 64;                             \
                }                                                                                         \
                __m512i w0 = _mm512_loadu_si512((const void *)W), w1 = _mm512_loadu_si512((const void *)(W + 64)); \
                W += 128;                                                                                 \
                _Pragma("GCC unroll 6")                                                                   \
                for (int r = 0; r < R; r++) {                                                             \
                    __m512i a = _mm512_set1_epi32(wg[t * R + r]);                                         \
                    iacc[2 * r] = dpbusd(iacc[2 * r], w0, a);                                             \
                    iacc[2 * r + 1] = dpbusd(iacc[2 * r + 1], w1, a);                                     \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (int o = 0; o < group / 8; o++) {                                                         \
                if (R == 1 && ahead) {                                                                    \
                    _mm_prefetch((const char *)W + ahead, _MM_HINT_T0);                                   \
                    _mm_prefetch((const char *)W + ahead + 64, _MM_HINT_T0);                              \
                    if (BITS != 4) _mm_prefetch((const char *)W + ahead + 128, _MM_HINT_T0);              \
                }                                                                                         \
                if (R > 1) {                                                                              \
                    _mm_prefetch((const char *)W + AHEAD_ROWS, _MM_HINT_T0);                              \
                    _mm_prefetch((const char *)W + AHEAD_ROWS + 64, _MM_HINT_T0);                         \
                    if (BITS != 4) _mm_prefetch((const char *)W + AHEAD_ROWS + 128, _MM_HINT_T0);         \
                    if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T1), pf += 64;                             \
                }                                                                                         \
                __m512i v0 = _mm512_loadu_si512((const void *)W), v1 = _mm512_loadu_si512((const void *)(W + 64)); \
                __m512i l0 = _mm512_and_si512(v0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low); \
                __m512i l1 = _mm512_and_si512(v1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low); \
                if (BITS == 6) {                                                                          \
                    __m512i x = _mm512_loadu_si512((const void *)(W + 128));                              \
                    l0 = _mm512_or_si512(l0, _mm512_and_si512(_mm512_slli_epi16(x, 4), top));             \
                    h0 = _mm512_or_si512(h0, _mm512_and_si512(_mm512_slli_epi16(x, 2), top));             \
                    l1 = _mm512_or_si512(l1, _mm512_and_si512(x, top));                                   \
                    h1 = _mm512_or_si512(h1, _mm512_and_si512(_mm512_srli_epi16(x, 2), top));             \
                }                                                                                         \
                if (BITS == 5) or_fifths(&l0, &h0, &l1, &h1, W + 128);                                   \
                W += BITS == 6 ? 192 : BITS == 5 ? 160 : 128;                                             \
                _Pragma("GCC unroll 6")                                                                   \
                for (int r = 0; r < R; r++) {                                                             \
                    __m512i alo = _mm512_set1_epi32(wg[(2 * o) * R + r]);                                 \
                    __m512i ahi = _mm512_set1_epi32(wg[(2 * o + 1) * R + r]);                             \
                    iacc[2 * r] = DPBUSD_NIBBLES(iacc[2 * r], l0, alo, h0, ahi);                             \
                    iacc[2 * r + 1] = DPBUSD_NIBBLES(iacc[2 * r + 1], l1, alo, h1, ahi);                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        __m512 s0, s1;                                                                                    \
        group_scales(S, g, &s0, &s1);                                                                     \
        for (int r = 0; r < R; r++) {                                                                     \
            __m512 a = _mm512_set1_ps(alpha[g * R + r]);                                                  \
            facc[2 * r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(iacc[2 * r]), a), s0, facc[2 * r]); \
            facc[2 * r + 1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(iacc[2 * r + 1]), a), s1,    \
                                              facc[2 * r + 1]);                                           \
        }                                                                                                 \
        if (Mn) {                                                                                         \
            __m512 m0, m1;                                                                                \
            group_scales(Mn, g, &m0, &m1);                                                                \
            for (int r = 0; r < R; r++) {                                                                 \
                __m512 t = _mm512_set1_ps(offset[g * R + r]);                                             \
                facc[2 * r] = _mm512_fmadd_ps(m0, t, facc[2 * r]);                                        \
                facc[2 * r + 1] = _mm512_fmadd_ps(m1, t, facc[2 * r + 1]);                                \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int r = 0; r < R; r++)                                                                           \
        store_row(C + r * ldc_bytes, ncols, c_fp32, facc[2 * r], facc[2 * r + 1], ep, row0 + r);          \
}
DEFINE_QKERNEL(1, 8) DEFINE_QKERNEL(2, 8) DEFINE_QKERNEL(3, 8) DEFINE_QKERNEL(4, 8) DEFINE_QKERNEL(5, 8)
DEFINE_QKERNEL(6, 8)
DEFINE_QKERNEL(1, 4) DEFINE_QKERNEL(2, 4) DEFINE_QKERNEL(3, 4) DEFINE_QKERNEL(4, 4) DEFINE_QKERNEL(5, 4)
DEFINE_QKERNEL(6, 4)
DEFINE_QKERNEL(1, 6) DEFINE_QKERNEL(2, 6) DEFINE_QKERNEL(3, 6) DEFINE_QKERNEL(4, 6) DEFINE_QKERNEL(5, 6)
DEFINE_QKERNEL(6, 6)
DEFINE_QKERNEL(1, 5) DEFINE_QKERNEL(2, 5) DEFINE_QKERNEL(3, 5) DEFINE_QKERNEL(4, 5) DEFINE_QKERNEL(5, 5)
DEFINE_QKERNEL(6, 5)

typedef void (*qkernel_fn)(const char *, int, int, const uint8_t *, const QScales *, const QScales *, char *, long,
                           int, int, const Epilogue *, long, const char *, const char *);
static const qkernel_fn QKERNELS8[QKERNEL_VARIANTS + 1] = {0, qkernel_8_1, qkernel_8_2, qkernel_8_3, qkernel_8_4, qkernel_8_5,
                                                qkernel_8_6};
static const qkernel_fn QKERNELS4[QKERNEL_VARIANTS + 1] = {0, qkernel_4_1, qkernel_4_2, qkernel_4_3, qkernel_4_4, qkernel_4_5,
                                                qkernel_4_6};
static const qkernel_fn QKERNELS6[QKERNEL_VARIANTS + 1] = {0, qkernel_6_1, qkernel_6_2, qkernel_6_3, qkernel_6_4, qkernel_6_5,
                                                qkernel_6_6};

static const qkernel_fn QKERNELS5[QKERNEL_VARIANTS + 1] = {0, qkernel_5_1, qkernel_5_2, qkernel_5_3, qkernel_5_4,
                                                            qkernel_5_5, qkernel_5_6};

static const qkernel_fn *kernels_for(int bits) {
    return bits == 8 ? QKERNELS8 : bits == 6 ? QKERNELS6 : bits == 5 ? QKERNELS5 : QKERNELS4;
}

static inline int imin(int a, int b) { return a < b ? a : b; }

/* Rows [m0, m1) in blocks of at most QROWS (a tail split evenly); returns the count (out NULL: the
 * count alone). */
static int plan_blocks(int m0, int m1, long *offset, int K, int group, QBlock *out) {
    int n = 0;
    for (int m = m0; m < m1;) {
        int rows = m1 - m;
        if (rows > QROWS) rows = rows >= 2 * QROWS ? QROWS : (rows + 1) / 2;
        if (out) out[n] = (QBlock){m, rows, *offset};
        n++;
        *offset += block_bytes(rows, K, group);
        m += rows;
    }
    return n;
}

/* Per thread, grown on demand (a fresh allocation per call would be fresh pages each time). The
 * packed inputs of a large call are thread 0's scratch, shared by the team (team.h); of a small one
 * each thread's own. The row blocks (and the grouped form's first block per group) are each thread's
 * own. */
static __thread char *qscratch;
static __thread long qscratch_bytes;
static __thread QBlock *qplan;
static __thread long qplan_blocks;
static __thread int *qplan_first;
static __thread long qplan_groups;

static char *qreserve_scratch(long bytes) {
    if (bytes > qscratch_bytes) {
        free(qscratch);
        qscratch = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        qscratch_bytes = qscratch ? bytes : 0;
    }
    return qscratch;
}

/* This thread's block plan of `blocks` blocks (and `groups` + 1 group starts), or NULL. */
static QBlock *qreserve_plan(long blocks, long groups) {
    if (blocks < 1) blocks = 1;
    if (blocks > qplan_blocks) {
        free(qplan);
        qplan = malloc((size_t)blocks * sizeof(QBlock));
        qplan_blocks = qplan ? blocks : 0;
    }
    if (groups + 1 > qplan_groups) {
        free(qplan_first);
        qplan_first = malloc((size_t)(groups + 1) * sizeof(int));
        qplan_groups = qplan_first ? groups + 1 : 0;
    }
    return qplan && qplan_first ? qplan : 0;
}

static inline int work_chunk(int items, int threads) {
    int chunk = items / (16 * (threads > 0 ? threads : 1));
    return chunk < 1 ? 1 : chunk;
}

/* One row (decode) reads each panel once, where the CPU wants it with no software prefetch (see
 * one_row_ahead): the hardware prefetchers find a stream again after each jump to another chunk, which
 * on a small matrix (16 chunks per thread of a 1 MB map: 32 KB each) cost a fifth of the call. So a
 * one-row chunk is at least 256 KB (at most half a thread's share, so both threads still balance): int4
 * maps of 0.6–4.7 MB 10–26% faster on Zen 4, cold, old and new builds alternating in one process
 * (docs/performance.md); larger maps unchanged. */
#define MIN_CHUNK_BYTES (256L << 10)
static inline int one_row_chunk(int items, int threads, long panel_bytes) {
    int chunk = work_chunk(items, threads), cap = items / (2 * (threads > 0 ? threads : 1));
    int least = (int)((MIN_CHUNK_BYTES + panel_bytes - 1) / panel_bytes);
    if (least > cap) least = cap;
    return chunk < least ? least : chunk;
}

static int zero_point(const Weights *w) { return w->bits == 8 ? 128 : w->mins ? 0 : 1 << (w->bits - 1); }

static int valid(const Weights *w, int K) {
    if (w->super_group && (w->super_group % w->group || K % w->super_group || !w->super_scales
                           || (w->mins && !w->super_mins)))
        return 0;
    return (w->bits == 8 || w->bits == 6 || w->bits == 5 || w->bits == 4) && w->group >= 16 && w->group % 16 == 0
           && K % w->group == 0;
}

/* Entry `e`, panel `p` of the scales (and mins) of `w`. */
static void panel_scales(const Weights *w, int K, long e, int p, QScales *s, QScales *m) {
    long groups = K / w->group, at = e * w->sstride + p * groups * PANEL, elem = w->super_group ? 1 : 2;
    long supers = w->super_group ? K / w->super_group : 0, sat = e * w->supstride + p * supers * PANEL;
    int per_super = w->super_group ? w->super_group / w->group : 0;
    *s = (QScales){(const char *)w->scales + at * elem, w->super_group ? w->super_scales + sat : 0, per_super};
    *m = (QScales){w->mins ? (const char *)w->mins + at * elem : 0, w->super_group && w->mins ? w->super_mins + sat : 0,
                   per_super};
}

#define SERIAL_PACK_BYTES (1L << 16)
#define ROW_CHUNK_BYTES (3L << 18)   /* packed inputs per chunk of rows: ~768 KB, beside a panel in L2 */

static void run_panel(const qkernel_fn *kernels, const QBlock *blk, int first, int last, const char *buf,
                      const Weights *w, const uint8_t *W, const QScales *S, const QScales *Mn, int K, char *C,
                      long ldc_bytes, int ncols, int c_fp32, const Epilogue *ep, const uint8_t *next,
                      long next_bytes) {
    int n = last - first;
    for (int i = first; i < last; i++) {
        /* each block prefetches its share of the next panel into L2, a line per step of its k loop
         * (the next in this thread's chunk only: the one after is often the other thread's) */
        const char *pf = 0, *pf_end = 0;
        if (next && n > 1) {
            pf = (const char *)next + (next_bytes * (i - first) / n & ~63L);
            pf_end = (const char *)next + next_bytes * (i - first + 1) / n;
        }
        kernels[blk[i].rows](buf + blk[i].offset, K, w->group, W, S, Mn->values ? Mn : 0, C + (long)blk[i].row * ldc_bytes,
                             ldc_bytes, ncols, c_fp32, ep, blk[i].row, pf, pf_end);
    }
}

static int quant_gemm_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int M, int K, int N,
                              void *C, long ldc, int c_fp32) {
    if (!valid(w, K)) return -2;
    const qkernel_fn *kernels = kernels_for(w->bits);
    int panels = (N + PANEL - 1) / PANEL, zero = zero_point(w), threads = omp_get_num_threads(), failed = 0;
    long esize = c_fp32 ? 4 : 2, ldc_bytes = ldc * esize;
    long panel_bytes = (long)K * PANEL * w->bits / 8;
    int chunk = M == 1 ? one_row_chunk(panels, threads, panel_bytes) : work_chunk(panels, threads);
    int mc = (int)(ROW_CHUNK_BYTES / K) / QROWS * QROWS;
    if (mc < QROWS) mc = QROWS;
    int rows = imin(mc, M);
    long bytes = block_bytes(QROWS, K, w->group) * ((rows + QROWS - 1) / QROWS + 1);
    /* the chunks of rows come in two sizes: the first (mc rows or all) and the remainder */
    long first_chunk = 0, last_chunk = 0;
    plan_blocks(0, rows, &first_chunk, K, w->group, 0);
    plan_blocks(0, M % mc, &last_chunk, K, w->group, 0);
    char *shared = 0;
    if ((first_chunk > SERIAL_PACK_BYTES || last_chunk > SERIAL_PACK_BYTES)
        && !(shared = team_share(team, qgemm, qreserve_scratch(bytes))))
        return -1;
    QBlock *blk = qreserve_plan(rows, 0);
    const uint8_t *W = (const uint8_t *)w->data;
    for (int m0 = 0; m0 < M; m0 += mc) {
        long offset = 0;
        int blocks = plan_blocks(m0, imin(M, m0 + mc), &offset, K, w->group, blk);
        for (int i = 0; blk && i < blocks; i++) blk[i].row -= m0;
        const char *A0 = (const char *)A + (long)m0 * lda * (a_bf16 ? 2 : 4);
        int serial = offset <= SERIAL_PACK_BYTES;
        char *buf = serial ? qreserve_scratch(bytes) : shared;
        if (!blk || !buf) failed = 1;                   /* this thread's work is skipped, reported below */
        if (serial && !failed) {
            for (int i = 0; i < blocks; i++) pack_block_q(A0, lda, a_bf16, K, w->group, zero, blk[i], buf + blk[i].offset, 0);
        } else if (!serial) {
            #pragma omp for schedule(static)
            for (int i = 0; i < blocks; i++)
                if (!failed) pack_block_q(A0, lda, a_bf16, K, w->group, zero, blk[i], buf + blk[i].offset, 0);
        }
        #pragma omp for schedule(dynamic, chunk)
        for (int p = 0; p < panels; p++) {
            if (failed) continue;
            char *Cp = (char *)C + (long)m0 * ldc_bytes + (long)p * PANEL * esize;
            QScales S, Mn;
            panel_scales(w, K, 0, p, &S, &Mn);
            const uint8_t *next = (p + 1) % chunk && p + 1 < panels ? W + (p + 1) * panel_bytes : 0;
            run_panel(kernels, blk, 0, blocks, buf, w, W + p * panel_bytes, &S, &Mn, K, Cp, ldc_bytes,
                      imin(PANEL, N - p * PANEL), c_fp32, 0, next, panel_bytes);
        }
    }
    return failed ? -1 : 0;
}

static int quant_gemm_grouped_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int G,
                                      const int64_t *offsets, const int64_t *ids, const int64_t *a_rows, int K, int N,
                                      void *C, long ldc, int c_fp32, int swiglu, const float *scale) {
    if (!valid(w, K) || ((swiglu || scale) && c_fp32) || (swiglu && N % PANEL)) return -2;
    const qkernel_fn *kernels = kernels_for(w->bits);
    Epilogue epilogue = {swiglu, scale}, *ep = (swiglu || scale) ? &epilogue : 0;
    int panels = (N + PANEL - 1) / PANEL, chunk = work_chunk(G * panels, omp_get_num_threads());
    int zero = zero_point(w), failed = 0;
    long esize = c_fp32 ? 4 : 2, ldc_bytes = ldc * esize;
    long panel_bytes = (long)K * PANEL * w->bits / 8;
    long rows = offsets[G] - offsets[0];
    /* blocks: at most rows/QROWS + 2 per group (each group's tail may split in two) */
    long bytes = block_bytes(QROWS, K, w->group) * (rows / QROWS + 2L * G + 1);
    QBlock *blk = qreserve_plan(rows + 2L * G, G);
    int *first = qplan_first;
    long offset = 0;
    int blocks = 0;
    for (int g = 0; g < G; g++) {
        if (blk) first[g] = blocks;
        blocks += plan_blocks((int)offsets[g], (int)offsets[g + 1], &offset, K, w->group, blk ? blk + blocks : 0);
    }
    if (blk) first[G] = blocks;
    int serial = offset <= SERIAL_PACK_BYTES;
    char *buf = 0;
    if (!serial && !(buf = team_share(team, qgemm, qreserve_scratch(bytes)))) return -1;
    if (serial) buf = qreserve_scratch(bytes);
    if (!blk || !buf) failed = 1;                       /* this thread's work is skipped, reported below */
    if (serial && !failed) {
        for (int i = 0; i < blocks; i++)
            pack_block_q(A, lda, a_bf16, K, w->group, zero, blk[i], buf + blk[i].offset, a_rows);
    } else if (!serial) {
        #pragma omp for schedule(static)
        for (int i = 0; i < blocks; i++)
            if (!failed) pack_block_q(A, lda, a_bf16, K, w->group, zero, blk[i], buf + blk[i].offset, a_rows);
    }
    const uint8_t *W = (const uint8_t *)w->data;
    #pragma omp for schedule(dynamic, chunk)
    for (int item = 0; item < G * panels; item++) {
        if (failed) continue;
        int g = item / panels, p = item % panels;
        const uint8_t *We = W + ids[g] * w->stride + p * panel_bytes;
        QScales Se, Me;
        panel_scales(w, K, ids[g], p, &Se, &Me);
        char *Cp = (char *)C + (long)p * (swiglu ? PANEL / 2 : PANEL) * esize;
        const uint8_t *next = (item + 1) % chunk && item + 1 < G * panels       /* within this thread's chunk */
                              ? W + ids[(item + 1) / panels] * w->stride + ((item + 1) % panels) * panel_bytes : 0;
        run_panel(kernels, blk, first[g], first[g + 1], buf, w, We, &Se, &Me, K, Cp, ldc_bytes,
                  imin(PANEL, N - p * PANEL), c_fp32, ep, next, panel_bytes);
    }
    return failed ? -1 : 0;
}

int weights_gemm_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int M, int K, int N,
                         void *C, long ldc, int c_fp32) {
    if (w->bits == 16)
        return panel_gemm_in_team(team, A, lda, a_bf16, M, K, (const uint16_t *)w->data, N, C, ldc, c_fp32);
    return quant_gemm_in_team(team, w, A, lda, a_bf16, M, K, N, C, ldc, c_fp32);
}

int weights_gemm_grouped_in_team(Team *team, const Weights *w, const void *A, long lda, int a_bf16, int G,
                                 const int64_t *offsets, const int64_t *ids, const int64_t *a_rows, int K, int N,
                                 void *C, long ldc, int c_fp32, int swiglu, const float *scale) {
    if (w->bits == 16)
        return panel_gemm_grouped_in_team(team, A, lda, a_bf16, G, offsets, ids, a_rows, K, (const uint16_t *)w->data,
                                          w->stride / 2, N, C, ldc, c_fp32, swiglu, scale);
    return quant_gemm_grouped_in_team(team, w, A, lda, a_bf16, G, offsets, ids, a_rows, K, N, C, ldc, c_fp32, swiglu,
                                      scale);
}

int clover_weights_gemm(const Weights *w, const void *A, long lda, int a_bf16, int M, int K, int N, void *C,
                        long ldc, int c_fp32, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, weights_gemm_in_team(&team, w, A, lda, a_bf16, M, K, N, C, ldc, c_fp32));
    return status;
}

int clover_weights_gemm_grouped(const Weights *w, const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                                const int64_t *ids, const int64_t *a_rows, int K, int N, void *C, long ldc,
                                int c_fp32, int swiglu, const float *scale, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, weights_gemm_grouped_in_team(&team, w, A, lda, a_bf16, G, offsets, ids, a_rows, K, N, C,
                                                           ldc, c_fp32, swiglu, scale));
    return status;
}

#ifdef __AVX512F__
/* The dwords at byte `at` of 16 columns' rows (`cols`: their addresses, 8 a vector; `valid`: which exist,
 * a padding row reading as zero): lane j, column j. */
static inline __m512i column_dwords(const __m512i *cols, const __mmask8 *valid, long at) {
    const void *base = (const void *)(intptr_t)at;
    __m256i lo = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), valid[0], cols[0], base, 1);
    __m256i hi = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), valid[1], cols[1], base, 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 16 columns' stored bytes b0 … b3 (codes k … k + 7, low nibble first) → their panel dwords: bytes
 * (b0 lo | b2 lo << 4, b0 hi | b2 hi << 4, b1 lo | b3 lo << 4, b1 hi | b3 hi << 4): the scalar loop's
 * d[0 … 3]. */
static inline __m512i nibble_dwords(__m512i x) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i first = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13,
                                                                13));
    const __m512i second = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14,
                                                                 15, 15));
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAULL;
    __m512i lo = _mm512_and_si512(x, low), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    __m512i p = _mm512_mask_blend_epi8(odd, _mm512_shuffle_epi8(lo, first), _mm512_shuffle_epi8(hi, first));
    __m512i q = _mm512_mask_blend_epi8(odd, _mm512_shuffle_epi8(lo, second), _mm512_shuffle_epi8(hi, second));
    return _mm512_or_si512(p, _mm512_slli_epi16(q, 4));
}
#endif

/* The four 2-bit fields of a byte, one to each byte of the result (field i in byte i). */
static inline uint32_t spread_pairs(uint32_t v) {
    return (v & 3) | ((v >> 2) & 3) << 8 | ((v >> 4) & 3) << 16 | ((v >> 6) & 3) << 24;
}

/* The panel layout above, from the stored codes (quantization/format.py: int8 [N, K], int4 nibbles
 * [N, K/2], int6 / int5 nibbles then top-bit pairs / fifth bits [N, 3K/4] / [N, 5K/8]; `qrow` bytes per
 * stored row). Output panels take stored rows `rows[0 .. 32·panels)` in order, −1 a padding row (codes
 * of zero weight; its scales are zero too). One pass over the codes, where the PyTorch reordering took
 * ~10 passes: most of a GGUF load's time. Per column and 8 inputs the stored nibble bytes b0..b3
 * hold inputs (0,1) (2,3) (4,5) (6,7), low nibble first; the panel wants inputs (i, 4 + i) per byte.
 * `entries` stacked matrices (an expert slab: qentry / oentry bytes apart) in one call: a parallel
 * region per expert cost more than the packing on a busy machine. */
int clover_quant_pack_panels(const uint8_t *q, long qrow, long qentry, int entries, int bits, int K,
                             const int64_t *rows, int panels, uint8_t *out, long oentry, int threads) {
    if (!(bits == 8 || bits == 6 || bits == 5 || bits == 4) || K % 8) return -2;
    long panel_bytes = (long)K * PANEL * bits / 8, step = bits == 8 ? 256 : (long)PANEL * bits;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long ep = 0; ep < (long)entries * panels; ep++) {
        long e = ep / panels, p = ep % panels;
        const uint8_t *src[PANEL];
        for (int c = 0; c < PANEL; c++) {
            int64_t r = rows[p * PANEL + c];
            src[c] = r < 0 ? 0 : q + e * qentry + r * qrow;
        }
        uint8_t *o = out + e * oentry + p * panel_bytes;
#ifdef __AVX512F__
        __m512i cols[4];                                /* the columns' row addresses, 8 a vector */
        __mmask8 valid[4];
        for (int v = 0; v < 4; v++) {
            int64_t at[8];
            unsigned m = 0;
            for (int j = 0; j < 8; j++) {
                at[j] = (int64_t)(intptr_t)src[8 * v + j];
                m |= (unsigned)(src[8 * v + j] != 0) << j;
            }
            cols[v] = _mm512_loadu_si512((const void *)at);
            valid[v] = (__mmask8)m;
        }
#endif
        for (long k = 0; k < K; k += 8, o += step) {
#ifdef __AVX512F__                                      /* a half's 16 columns at once: bytes, or nibbles */
            for (int h = 0; h < 2; h++) {
                if (bits == 8) {
                    const __m512i flip = _mm512_set1_epi8((char)0x80);
                    __m512i first = column_dwords(cols + 2 * h, valid + 2 * h, k);          /* inputs 0-3 */
                    __m512i second = column_dwords(cols + 2 * h, valid + 2 * h, k + 4);     /* inputs 4-7 */
                    _mm512_storeu_si512((void *)(o + 64 * h), _mm512_xor_si512(first, flip));
                    _mm512_storeu_si512((void *)(o + 128 + 64 * h), _mm512_xor_si512(second, flip));
                } else {
                    __m512i stored = column_dwords(cols + 2 * h, valid + 2 * h, k / 2);
                    _mm512_storeu_si512((void *)(o + 64 * h), nibble_dwords(stored));
                }
            }
#else
            for (int c = 0; c < PANEL; c++) {
                uint8_t *d = o + 4 * c;                 /* column c: half c/16, byte 64·half + 4·(c%16) */
                if (bits == 8) {                        /* two blocks of 4 inputs, 128 bytes apart */
                    for (int i = 0; i < 8; i++)
                        d[(i / 4) * 128 + i % 4] = src[c] ? (uint8_t)(src[c][k + i] ^ 0x80) : 128;
                } else if (!src[c]) {
                    d[0] = d[1] = d[2] = d[3] = 0;
                } else {
                    const uint8_t *b = src[c] + k / 2;
                    d[0] = (uint8_t)((b[0] & 15) | (b[2] << 4));
                    d[1] = (uint8_t)((b[0] >> 4) | (b[2] & 0xF0));
                    d[2] = (uint8_t)((b[1] & 15) | (b[3] << 4));
                    d[3] = (uint8_t)((b[1] >> 4) | (b[3] & 0xF0));
                }
            }
#endif
            if (bits == 5) {                            /* fifths: per half, the masks of inputs 0-3 and 4-7, */
                uint64_t m[4];                          /* column j's bits at 4j … 4j + 3 */
                for (int h = 0; h < 2; h++) {
                    m[2 * h] = m[2 * h + 1] = 0;
                    for (int j = 0; j < 16; j++) {
                        const uint8_t *row = src[16 * h + j];
                        uint64_t fifths = row ? row[K / 2 + k / 8] : 0;
                        m[2 * h] |= (fifths & 15) << (4 * j);
                        m[2 * h + 1] |= (fifths >> 4) << (4 * j);
                    }
                }
#ifdef __AVX512F__
                memcpy(o + 128, m, 32);
#else                                           /* as bit planes: mask t's bit b to byte b % 32, bit 2t + b / 32 */
                for (int b = 0; b < 32; b++) {
                    unsigned plane = 0;
                    for (int t = 0; t < 4; t++)
                        plane |= (unsigned)((m[t] >> b) & 1) << (2 * t) | (unsigned)((m[t] >> (32 + b)) & 1) << (2 * t + 1);
                    o[128 + b] = (uint8_t)plane;
                }
#endif
            }
            if (bits == 6) {                            /* tops: byte 4j + i, column j's pair (input i, 4 + i), */
                for (int j = 0; j < 16; j++) {          /* column 16 + j's in the high nibble */
                    uint32_t word = 0;
                    for (int h = 0; h < 2; h++) {
                        const uint8_t *t = src[16 * h + j] ? src[16 * h + j] + K / 2 + k / 4 : 0;
                        word |= (t ? spread_pairs(t[0]) | spread_pairs(t[1]) << 2 : 0) << (4 * h);
                    }
                    memcpy(o + 128 + 4 * j, &word, 4);
                }
            }
        }
    }
    return 0;
}

/* Per-row scales (or mins, super-scales: `width` values of `elem` bytes a row, row stride srow bytes)
 * into panel order [panels, width, 32]: out[p][g][c] = s[rows[32p + c]][g], zero for a padding row
 * (−1). The PyTorch gather-and-transpose it replaced (now tests/test_quantization.py's) took as long as
 * packing the codes. One thread: 1/16 of the codes' bytes, less work than a parallel region costs. */
int clover_quant_pack_scales(const uint8_t *s, long srow, long sentry, int entries, int elem, int width,
                             const int64_t *rows, int panels, uint8_t *out, long oentry) {
    if (!(elem == 1 || elem == 2)) return -2;
    for (long ep = 0; ep < (long)entries * panels; ep++) {
        long e = ep / panels, p = ep % panels;
        uint8_t *o = out + e * oentry + p * width * PANEL * elem;
        for (int c = 0; c < PANEL; c++) {
            int64_t r = rows[p * PANEL + c];
            const uint8_t *src = r < 0 ? 0 : s + e * sentry + r * srow;
            for (int g = 0; g < width; g++)
                if (elem == 1) o[(long)g * PANEL + c] = src ? src[g] : 0;
                else ((uint16_t *)o)[(long)g * PANEL + c] = src ? ((const uint16_t *)src)[g] : 0;
        }
    }
    return 0;
}
