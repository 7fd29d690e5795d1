/* bf16-weight matrix products summed in fp32 (clover/kernels/build.py says why and which kernels).
 *
 * C[M, N] = A[M, K] . W[N, K]^T with A in bf16 or fp32, W in bf16 "panels", C in bf16 (rounded to
 * nearest even, as torch rounds) or fp32. A panel is 32 output columns: for each k one 64-byte line whose
 * 16-bit slot 2j holds column j and slot 2j+1 column 16+j, so one shift and one mask turn a line
 * into two fp32 vectors. Two kernel families read it: fp32 FMAs (one per k, every input type) and,
 * for bf16 inputs where the process chose them, `vdpbf16ps` pairs (one per two k). Every output
 * element is one fp32 accumulator summed over k in order, whatever M, the row blocking or the thread
 * count: a row's result does not depend on which other rows share the call. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "team.h"

#define PANEL 32
#ifdef __AVX512F__
#define MAX_ROWS 12         /* 2 accumulators per row + 2 weight vectors + 1 broadcast <= 32 zmm */
#else
#define MAX_ROWS AVX2_MAX_ROWS  /* the AVX2 build (avx2_compat.h): each vector is two of 16 ymm registers */
#endif
#define KERNEL_VARIANTS 12  /* kernels defined for 1..12 rows; the build uses 1..MAX_ROWS */
#define PREFETCH_AHEAD 64   /* lines ahead in the one-row kernel (measured: 16 < 64 on DRAM streams) */
#define PREFETCH_AHEAD_ROWS 16  /* with several rows, into L1 from L2 (in-process A/B: +3-7%) */

static inline void convert(const uint16_t *src, __m512 *lo, __m512 *hi) {
    __m512i v = _mm512_loadu_si512((const void *)src);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

#include "epilogue.h"

/* A is repacked once per call, in fp32, block by block: a block of R rows is stored k-major ([K][R]),
 * so the kernel's R broadcasts for one k are R consecutive floats. Read in place, R rows K floats
 * apart (8 KB at K = 2048) fall into the same L1 set and evict each other: packing measured 5–30%
 * faster on 32–1024 rows. */
typedef struct { int row, rows; long offset; } Block;

/* R rows times one panel. Each row's input is broadcast straight from memory into both of its FMAs
 * (`vfmadd231ps m32{1to16}`), not loaded once into a register and used twice: with A read through a
 * second pointer (A2) the compiler cannot merge the two loads, and the loop issues 24 fused FMA+load
 * instructions per k instead of 12 broadcasts and 24 FMAs. Same FMAs in the same order (bit-identical).
 * Builds alternating: standalone (benchmarks/kernel_ceiling) whole products on 2 threads +3–12%
 * (192 × 2048 × 12352, 32 × 2048 × 65536 and × 248320, 1024 × 4096 × 2048; even on 1 thread); in the
 * engine (benchmarks.ab, full model, 16 rounds) prefill +1–2%, block step and decode 3% faster;
 * kernel_ab's single calls with the L3 flushed even to 2% slower (two runs of 24 rounds: +0.2 / +0.3 /
 * +0.6% and +0.3 / +1.9 / +2.3% for the 1- and 32-row vocabulary projection and a block step's MoE).
 *
 * The following panel is pulled towards L2 while this one computes, spread over all of the panel's
 * row blocks: block i of n prefetches lines i, i+n, i+2n, ... starting at `pf` (0: none), one every n
 * steps of k. Fetching it all during the first block asks DRAM for the whole panel in a third of the
 * time at 32 rows (lm_head of a block step: 271 → ~300 GFLOP/s). */
#define DEFINE_KERNEL(R)                                                                          \
static void kernel_##R(const float *A, const uint16_t *W, int K, char *C, long ldc_bytes,         \
                       int ncols, int c_fp32, const uint16_t *pf, int every, const Epilogue *ep,  \
                       long row0) {                                                               \
    __m512 acc[2 * R];                                                                            \
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm512_setzero_ps();                                 \
    int countdown = 1;                                                                            \
    const float *A2 = A;      /* the same inputs through a pointer the compiler cannot equate to A */ \
    __asm__("" : "+r"(A2));                                                                       \
    for (int k = 0; k < K; k++) {                                                                 \
        __m512 lo, hi;                                                                            \
        if (pf && --countdown == 0) {                                                             \
            _mm_prefetch((const char *)pf, _MM_HINT_T1);                                          \
            pf += (long)every * PANEL;                                                            \
            countdown = every;                                                                    \
        }                                                                                         \
        _mm_prefetch((const char *)(W + (long)(k + (R == 1 ? PREFETCH_AHEAD : PREFETCH_AHEAD_ROWS)) * PANEL), _MM_HINT_T0); \
        convert(W + (long)k * PANEL, &lo, &hi);                                                   \
        _Pragma("GCC unroll 12")                                                                  \
        for (int r = 0; r < R; r++) {                                                             \
            acc[2 * r] = _mm512_fmadd_ps(_mm512_set1_ps(A[(long)k * R + r]), lo, acc[2 * r]);     \
            acc[2 * r + 1] = _mm512_fmadd_ps(_mm512_set1_ps(A2[(long)k * R + r]), hi, acc[2 * r + 1]); \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++)                                                                   \
        store_row(C + r * ldc_bytes, ncols, c_fp32, acc[2 * r], acc[2 * r + 1], ep, row0 + r);    \
}
#ifdef __AVX512F__
DEFINE_KERNEL(1) DEFINE_KERNEL(2) DEFINE_KERNEL(3) DEFINE_KERNEL(4) DEFINE_KERNEL(5) DEFINE_KERNEL(6)
DEFINE_KERNEL(7) DEFINE_KERNEL(8) DEFINE_KERNEL(9) DEFINE_KERNEL(10) DEFINE_KERNEL(11) DEFINE_KERNEL(12)
#else
/* The AVX2 build. One or two rows take the kernel above (4 ymm accumulators per row fit). From three
 * rows on, 16 ymm registers cannot hold a whole panel's accumulators (the compiler spilled one per k
 * at three rows), so the panel goes in two passes, each over one 32-byte half of every line: columns
 * 8h..8h+7 and 16+8h..16+8h+7, two accumulators per row — up to 6 rows in 12 registers, the classic
 * 6×16 AVX2 tile. The second pass reads the panel from L2. Each output is still one fp32 FMA chain
 * over k in order: the AVX-512 build's bits. Blocks of 4 rows measured best (benchmarks.quant_kernels,
 * bf16, 16384 × 2048, 2 threads, AMD EPYC Zen 3, builds alternating): 512 rows 480 ms with the kernel
 * above at 3 rows, 391 at 4; in halves 310 ms at 4 rows, 320 at 5, 369 at 6; 32 rows 30.4 → 20.8 ms. */
DEFINE_KERNEL(1) DEFINE_KERNEL(2)
#define DEFINE_HALF_KERNEL(R)                                                                     \
static void kernel_##R(const float *A, const uint16_t *W, int K, char *C, long ldc_bytes,         \
                       int ncols, int c_fp32, const uint16_t *pf, int every, const Epilogue *ep,  \
                       long row0) {                                                               \
    __m256 part[2][2 * R];                                                                        \
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);                                     \
    int countdown = 1;                                                                            \
    for (int h = 0; h < 2; h++) {                                                                 \
        __m256 acc[2 * R];                                                                        \
        for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_ps();                             \
        const uint16_t *Wh = W + 16 * h;                                                          \
        for (int k = 0; k < K; k++) {                                                             \
            if (h == 0) {                                                                         \
                if (pf && --countdown == 0) {                                                     \
                    _mm_prefetch((const char *)pf, _MM_HINT_T1);                                  \
                    pf += (long)every * PANEL;                                                    \
                    countdown = every;                                                            \
                }                                                                                 \
                _mm_prefetch((const char *)(W + (long)(k + PREFETCH_AHEAD_ROWS) * PANEL), _MM_HINT_T0); \
            }                                                                                     \
            __m256i v = _mm256_loadu_si256((const __m256i *)(Wh + (long)k * PANEL));              \
            __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                            \
            __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));                           \
            _Pragma("GCC unroll 12")                                                              \
            for (int r = 0; r < R; r++) {                                                         \
                __m256 a = _mm256_broadcast_ss(A + (long)k * R + r);                              \
                acc[2 * r] = _mm256_fmadd_ps(a, lo, acc[2 * r]);                                  \
                acc[2 * r + 1] = _mm256_fmadd_ps(a, hi, acc[2 * r + 1]);                          \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < 2 * R; i++) part[h][i] = acc[i];                                      \
    }                                                                                             \
    for (int r = 0; r < R; r++)                                                                   \
        store_row(C + r * ldc_bytes, ncols, c_fp32, (__m512){part[0][2 * r], part[1][2 * r]},     \
                  (__m512){part[0][2 * r + 1], part[1][2 * r + 1]}, ep, row0 + r);               \
}
DEFINE_HALF_KERNEL(3) DEFINE_HALF_KERNEL(4) DEFINE_HALF_KERNEL(5) DEFINE_HALF_KERNEL(6) DEFINE_HALF_KERNEL(7)
DEFINE_HALF_KERNEL(8) DEFINE_HALF_KERNEL(9) DEFINE_HALF_KERNEL(10) DEFINE_HALF_KERNEL(11) DEFINE_HALF_KERNEL(12)
#endif

typedef void (*kernel_fn)(const float *, const uint16_t *, int, char *, long, int, int, const uint16_t *, int,
                          const Epilogue *, long);
static const kernel_fn KERNELS[KERNEL_VARIANTS + 1] = {0, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6,
                                                kernel_7, kernel_8, kernel_9, kernel_10, kernel_11, kernel_12};

#ifdef __AVX512BF16__
/* The same products as bf16 pair dot products (`vdpbf16ps`), for bf16 inputs on CPUs where that
 * instruction outruns fp32 FMAs (AMD Zen 4: ~2× the FLOP rate; Intel without AMX: half, hence the
 * FMA kernels above stay the default; clover/kernels/build.py chooses per process). The weights keep
 * the panel layout: the lines of inputs k and k+1, interleaved 16 bits at a time
 * (`vpunpck{l,h}wd`), give 32-bit lanes holding one column's weights for k and k+1 — 32 columns in
 * two vectors, in the order COLUMNS_OF_PAIRS — and each row's inputs k, k+1 are one 32-bit
 * broadcast. The products are exact in fp32; each k pair is added to one fp32 accumulator per
 * output (the instruction's two roundings), in k order. The input block is stored as pairs, k-major:
 * [ceil(K/2)][R] 32-bit words (an odd K's last pair has a zero second half, and meets a zero line).
 * Like the FMA kernels, a row's result depends neither on the other rows nor on the threads. */
static const int32_t PAIR_LO[16] = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
static const int32_t PAIR_HI[16] = {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31};

static inline void pair_lines(const uint16_t *line0, const uint16_t *line1, __m512bh *p0, __m512bh *p1) {
    __m512i l0 = _mm512_loadu_si512((const void *)line0);
    __m512i l1 = line1 ? _mm512_loadu_si512((const void *)line1) : _mm512_setzero_si512();
    *p0 = (__m512bh)_mm512_unpacklo_epi16(l0, l1);
    *p1 = (__m512bh)_mm512_unpackhi_epi16(l0, l1);
}

#define PAIR_STEP(R, line1, k2)                                                                  \
    {                                                                                             \
        __m512bh p0, p1;                                                                          \
        pair_lines(W + 2L * (k2) * PANEL, line1, &p0, &p1);                                       \
        _Pragma("GCC unroll 12")                                                                  \
        for (int r = 0; r < R; r++) {                                                             \
            __m512bh a = (__m512bh)_mm512_set1_epi32(A[(long)(k2) * R + r]);                      \
            acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], p0, a);                                     \
            acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], p1, a);                             \
        }                                                                                         \
    }

#define DEFINE_PAIR_KERNEL(R)                                                                     \
static void pair_kernel_##R(const float *Af, const uint16_t *W, int K, char *C, long ldc_bytes,   \
                            int ncols, int c_fp32, const uint16_t *pf, int every, const Epilogue *ep, \
                            long row0) {                                                          \
    const int32_t *A = (const int32_t *)Af;                                                       \
    __m512 acc[2 * R];                                                                            \
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm512_setzero_ps();                                 \
    int countdown = 1, full = K / 2;                                                              \
    const long ahead = R == 1 ? PREFETCH_AHEAD : PREFETCH_AHEAD_ROWS;                             \
    for (int k2 = 0; k2 < full; k2++) {                                                           \
        for (int t = 0; t < 2; t++)                                                               \
            if (pf && --countdown == 0) {                                                         \
                _mm_prefetch((const char *)pf, _MM_HINT_T1);                                      \
                pf += (long)every * PANEL;                                                        \
                countdown = every;                                                                \
            }                                                                                     \
        _mm_prefetch((const char *)(W + (2L * k2 + ahead) * PANEL), _MM_HINT_T0);                 \
        _mm_prefetch((const char *)(W + (2L * k2 + 1 + ahead) * PANEL), _MM_HINT_T0);             \
        PAIR_STEP(R, W + (2L * k2 + 1) * PANEL, k2)                                               \
    }                                                                                             \
    if (K & 1) PAIR_STEP(R, 0, full)                                                              \
    const __m512i lo_idx = _mm512_loadu_si512((const void *)PAIR_LO);                             \
    const __m512i hi_idx = _mm512_loadu_si512((const void *)PAIR_HI);                             \
    for (int r = 0; r < R; r++)                                                                   \
        store_row(C + r * ldc_bytes, ncols, c_fp32, _mm512_permutex2var_ps(acc[2 * r], lo_idx, acc[2 * r + 1]), \
                  _mm512_permutex2var_ps(acc[2 * r], hi_idx, acc[2 * r + 1]), ep, row0 + r);     \
}
DEFINE_PAIR_KERNEL(1) DEFINE_PAIR_KERNEL(2) DEFINE_PAIR_KERNEL(3) DEFINE_PAIR_KERNEL(4) DEFINE_PAIR_KERNEL(5)
DEFINE_PAIR_KERNEL(6) DEFINE_PAIR_KERNEL(7) DEFINE_PAIR_KERNEL(8) DEFINE_PAIR_KERNEL(9) DEFINE_PAIR_KERNEL(10)
DEFINE_PAIR_KERNEL(11) DEFINE_PAIR_KERNEL(12)

static const kernel_fn PAIR_KERNELS[KERNEL_VARIANTS + 1] = {0, pair_kernel_1, pair_kernel_2, pair_kernel_3, pair_kernel_4,
                                                            pair_kernel_5, pair_kernel_6, pair_kernel_7, pair_kernel_8,
                                                            pair_kernel_9, pair_kernel_10, pair_kernel_11, pair_kernel_12};
#define HAVE_PAIRS 1
#else
#define HAVE_PAIRS 0        /* no `vdpbf16ps` in this build (AVX2): bf16 inputs take the FMA kernels */
#define PAIR_KERNELS KERNELS
#endif

/* Which kernels bf16 inputs take in this process (0: FMA, 1: pairs); fp32 inputs always take FMA. */
static int bf16_pairs;

void clover_panel_set_pairs(int on) { bf16_pairs = HAVE_PAIRS && on != 0; }
int clover_panel_pairs(void) { return bf16_pairs; }

/* Whether a one-row product also prefetches the next panel (into L2) while it streams one, besides
 * reading its own panel ahead. Set per process by the CPU (build.py): on Zen 4 and Intel it made
 * one-row products 6–14% faster; on Zen 5 dropping it made bf16 decode steps 15% faster on one thread. */
static int one_row_next_panel = 1;

void clover_panel_set_one_row_next(int on) { one_row_next_panel = on != 0; }

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* Split rows [m0, m1) into blocks of at most MAX_ROWS (a tail split evenly); returns the count (out
 * NULL: the count alone). */
static int plan_rows(int m0, int m1, long *offset, int K, Block *out) {
    int n = 0;
    for (int m = m0; m < m1;) {
        int rows = m1 - m;
        if (rows > MAX_ROWS) rows = rows >= 2 * MAX_ROWS ? MAX_ROWS : (rows + 1) / 2;
        if (out) out[n] = (Block){m, rows, *offset};
        n++;
        *offset += (long)rows * K;
        m += rows;
    }
    return n;
}

/* Up to this many floats every thread packs the inputs for itself: a parallel pass costs a barrier
 * (decode). */
#define SERIAL_PACK_FLOATS (1L << 16)

/* Where a block's packed floats outgrow L1 (PACK_L1_BYTES), K goes in tiles of PACK_TILE, all rows of
 * the block per tile, so the tile's destination stays in L1 while every row writes into it. Row after
 * row over the whole K, each row's pass touched K·rows·4 bytes (96 KB at K = 2048) and missed L1 on
 * every line. Old and new builds alternating: packing the routed rows of a 1024-token prefill chunk
 * (8192 × 2048, gathered) 21.5 → 17.8 ms, a 1024 × 4096 input 5.1 → 4.1 ms; at K = 512 (24 KB per
 * block) tiles were 14% slower, so small blocks go whole. */
#define PACK_TILE 64
#define PACK_L1_BYTES (32L << 10)

static void pack_block(const void *A, long lda, int a_bf16, int K, Block b, float *dst, const int64_t *a_rows) {
    const char *src[MAX_ROWS];
    for (int r = 0; r < b.rows; r++) {
        /* lda 0: every row is row 0; a_rows: the row's input is A row a_rows[row] (routed tokens) */
        long row = (a_rows ? a_rows[b.row + r] : (long)(b.row + r)) * lda;
        src[r] = (const char *)A + row * (a_bf16 ? 2 : 4);
    }
    int tile = (long)K * b.rows * 4 <= PACK_L1_BYTES ? K : PACK_TILE;
    for (int k0 = 0; k0 < K; k0 += tile) {
        int k1 = min_int(K, k0 + tile);
        for (int r = 0; r < b.rows; r++) {
            if (a_bf16) {
                const uint16_t *s = (const uint16_t *)src[r];
                for (int k = k0; k < k1; k++) {
                    uint32_t bits = (uint32_t)s[k] << 16;
                    float v;
                    __builtin_memcpy(&v, &bits, 4);
                    dst[(long)k * b.rows + r] = v;
                }
            } else {
                const float *s = (const float *)src[r];
                for (int k = k0; k < k1; k++) dst[(long)k * b.rows + r] = s[k];
            }
        }
    }
}

/* The pair kernels' input block (bf16 inputs only): row r's inputs k, k+1 as one 32-bit word at
 * [k/2][R] (a 16-bit zero after an odd K's last input). Tiled over K like pack_block. */
static void pack_block_pairs(const void *A, long lda, int K, Block b, float *dst, const int64_t *a_rows) {
    int32_t *out = (int32_t *)dst;
    int pairs = (K + 1) / 2;
    int tile = (long)pairs * b.rows * 4 <= PACK_L1_BYTES ? pairs : PACK_TILE;
    for (int p0 = 0; p0 < pairs; p0 += tile) {
        int p1 = min_int(pairs, p0 + tile);
        for (int r = 0; r < b.rows; r++) {
            long row = (a_rows ? a_rows[b.row + r] : (long)(b.row + r)) * lda;
            const uint16_t *s = (const uint16_t *)A + row;
            for (int p = p0; p < p1; p++) {
                uint32_t lo = s[2 * p], hi = 2 * p + 1 < K ? s[2 * p + 1] : 0;
                out[(long)p * b.rows + r] = (int32_t)(lo | hi << 16);
            }
        }
    }
}

static void pack_any(const void *A, long lda, int a_bf16, int pairs, int K, Block b, float *dst, const int64_t *a_rows) {
    if (pairs) pack_block_pairs(A, lda, K, b, dst, a_rows);
    else pack_block(A, lda, a_bf16, K, b, dst, a_rows);
}

/* Per thread, grown on demand: a fresh allocation per call would be fresh pages (faults) each time.
 * The packed inputs of a large call are thread 0's scratch, shared by the team (team.h); of a small
 * one each thread's own. The row blocks (and the grouped form's first block per group) are each
 * thread's own. */
static __thread float *scratch;
static __thread long scratch_floats;
static __thread Block *plan;
static __thread long plan_blocks;
static __thread int *plan_first;
static __thread long plan_groups;

static float *reserve_scratch(long floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((floats + 15) / 16 * 64));
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

/* This thread's block plan of `blocks` blocks (and `groups` + 1 group starts), or NULL. */
static Block *reserve_plan(long blocks, long groups) {
    if (blocks < 1) blocks = 1;
    if (blocks > plan_blocks) {
        free(plan);
        plan = malloc((size_t)blocks * sizeof(Block));
        plan_blocks = plan ? blocks : 0;
    }
    if (groups + 1 > plan_groups) {
        free(plan_first);
        plan_first = malloc((size_t)(groups + 1) * sizeof(int));
        plan_groups = plan_first ? groups + 1 : 0;
    }
    return plan && plan_first ? plan : 0;
}

/* Blocks [first, last) of one panel; `next` is the following panel (0: none) to prefetch meanwhile. */
static void run_blocks(const kernel_fn *kernels, const Block *blk, int first, int last, const float *packed,
                       const uint16_t *W, int K, const uint16_t *next, char *C, long ldc_bytes, int ncols, int c_fp32,
                       const Epilogue *ep) {
    int n = last - first;
    for (int i = first; i < last; i++) {
        const uint16_t *pf = next && (blk[i].rows > 1 || one_row_next_panel) ? next + (long)(i - first) * PANEL : 0;
        kernels[blk[i].rows](packed + blk[i].offset, W, K, C + (long)blk[i].row * ldc_bytes, ldc_bytes, ncols,
                             c_fp32, pf, n, ep, blk[i].row);
    }
}

/* Panels are handed out in chunks as threads ask for them (OpenMP dynamic schedule), not split in
 * equal halves: the two cores here stream at different speeds from minute to minute, and with a
 * static split the faster one waited at the barrier for ~11% of a decode step (perf, full bench
 * model). About 16 chunks per thread. The next panel is prefetched only within a chunk: the panel
 * after a chunk's last belongs to another chunk, often the other thread's, and fetching it too read
 * up to half as many bytes again for a 64-panel matrix (one row, K = 4096: 18.0 → 19.2 GB/s, old and
 * new builds alternating with the L3 flushed; bit-identical). */
static inline int work_chunk(int items, int threads) {
    int chunk = items / (16 * (threads > 0 ? threads : 1));
    return chunk < 1 ? 1 : chunk;
}

/* Rows go in chunks whose packed fp32 inputs fit in L2 beside a panel (about 1.5 MB; 192 rows at
 * K = 2048), each chunk over all panels: at 1024 rows and K = 4096 that is 250 against 207 GFLOP/s
 * for all rows at once. */
#define ROW_CHUNK_BYTES (3L << 19)

/* C[M, N] = A[M, K] . W^T; W is [ceil(N/32), K, 32]; lda and ldc in elements. The panels split
 * across the team (team.h). Returns 0, or -1 when out of memory. */
int panel_gemm_in_team(Team *team, const void *A, long lda, int a_bf16, int M, int K, const uint16_t *W, int N,
                       void *C, long ldc, int c_fp32) {
    int panels = (N + PANEL - 1) / PANEL, chunk = work_chunk(panels, omp_get_num_threads());
    int pairs = bf16_pairs && a_bf16, failed = 0;
    const kernel_fn *kernels = pairs ? PAIR_KERNELS : KERNELS;
    long esize = c_fp32 ? 4 : 2, ldc_bytes = ldc * esize, panel_size = (long)K * PANEL;
    int mc = (int)(ROW_CHUNK_BYTES / (4L * K)) / MAX_ROWS * MAX_ROWS;
    if (mc < MAX_ROWS) mc = MAX_ROWS;
    long most = (long)min_int(mc, M) * K;              /* the first chunk of rows is the largest */
    float *shared = 0;
    if (most > SERIAL_PACK_FLOATS && !(shared = team_share(team, gemm, reserve_scratch(most)))) return -1;
    Block *blk = reserve_plan(min_int(mc, M), 0);
    for (int m0 = 0; m0 < M; m0 += mc) {
        long offset = 0;
        int m1 = min_int(M, m0 + mc), blocks = plan_rows(m0, m1, &offset, K, blk);
        for (int i = 0; blk && i < blocks; i++) blk[i].row -= m0;
        const char *A0 = a_bf16 ? (const char *)A + m0 * lda * 2 : (const char *)A + m0 * lda * 4;
        int serial = offset <= SERIAL_PACK_FLOATS;
        float *buf = serial ? reserve_scratch(offset) : shared;
        if (!blk || !buf) failed = 1;                   /* this thread's work is skipped, reported below */
        if (serial && !failed) {
            for (int i = 0; i < blocks; i++) pack_any(A0, lda, a_bf16, pairs, K, blk[i], buf + blk[i].offset, 0);
        } else if (!serial) {
            #pragma omp for schedule(static)
            for (int i = 0; i < blocks; i++)
                if (!failed) pack_any(A0, lda, a_bf16, pairs, K, blk[i], buf + blk[i].offset, 0);
        }
        #pragma omp for schedule(dynamic, chunk)
        for (int p = 0; p < panels; p++) {
            if (failed) continue;
            const uint16_t *next = p + 1 < panels && (p + 1) % chunk ? W + (p + 1) * panel_size : 0;
            char *Cp = (char *)C + m0 * ldc_bytes + (long)p * PANEL * esize;
            run_blocks(kernels, blk, 0, blocks, buf, W + p * panel_size, K, next, Cp, ldc_bytes,
                       min_int(PANEL, N - p * PANEL), c_fp32, 0);
        }
    }
    return failed ? -1 : 0;
}

int clover_panel_gemm(const void *A, long lda, int a_bf16, int M, int K, const uint16_t *W, int N,
                      void *C, long ldc, int c_fp32, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, panel_gemm_in_team(&team, A, lda, a_bf16, M, K, W, N, C, ldc, c_fp32));
    return status;
}

/* Grouped (mixture-of-experts): rows [offsets[g], offsets[g+1]) of A times stacked weight ids[g],
 * for all G groups in one parallel loop over (group, panel), so a token's experts share one call.
 * Stack entry e starts at W + e * wstride (elements). lda may be 0: every row is the same input
 * (then it is packed once per group, still a handful of floats). a_rows (nullable): row r's input is
 * A row a_rows[r] (the gather of routed tokens happens in the packing). swiglu / scale: see Epilogue
 * (bf16 output only; with swiglu, C has N/2 columns). Returns 0, -1 when out of memory, -2 bad shape. */
int panel_gemm_grouped_in_team(Team *team, const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                               const int64_t *ids, const int64_t *a_rows, int K, const uint16_t *W, long wstride,
                               int N, void *C, long ldc, int c_fp32, int swiglu, const float *scale) {
    if ((swiglu || scale) && c_fp32) return -2;
    if (swiglu && N % PANEL) return -2;
    Epilogue epilogue = {swiglu, scale}, *ep = (swiglu || scale) ? &epilogue : 0;
    int panels = (N + PANEL - 1) / PANEL, chunk = work_chunk(G * panels, omp_get_num_threads());
    int pairs = bf16_pairs && a_bf16, failed = 0;
    const kernel_fn *kernels = pairs ? PAIR_KERNELS : KERNELS;
    long esize = c_fp32 ? 4 : 2, ldc_bytes = ldc * esize, panel_size = (long)K * PANEL;
    long rows = offsets[G] - offsets[0];
    int serial = rows * K <= SERIAL_PACK_FLOATS;
    float *buf = 0;
    if (!serial && !(buf = team_share(team, gemm, reserve_scratch(rows * K)))) return -1;
    Block *blk = reserve_plan(rows + G, G);
    int *first = plan_first;                 /* the first block of each group, so (group, panel) items find theirs */
    long offset = 0;
    int blocks = 0;
    for (int g = 0; g < G; g++) {
        if (blk) first[g] = blocks;
        blocks += plan_rows((int)offsets[g], (int)offsets[g + 1], &offset, K, blk ? blk + blocks : 0);
    }
    if (blk) first[G] = blocks;
    if (serial) buf = reserve_scratch(rows * K);
    if (!blk || !buf) failed = 1;                       /* this thread's work is skipped, reported below */
    if (serial && !failed) {
        for (int i = 0; i < blocks; i++) pack_any(A, lda, a_bf16, pairs, K, blk[i], buf + blk[i].offset, a_rows);
    } else if (!serial) {
        #pragma omp for schedule(static)
        for (int i = 0; i < blocks; i++)
            if (!failed) pack_any(A, lda, a_bf16, pairs, K, blk[i], buf + blk[i].offset, a_rows);
    }
    #pragma omp for schedule(dynamic, chunk)
    for (int item = 0; item < G * panels; item++) {
        if (failed) continue;
        int g = item / panels, p = item % panels;
        const uint16_t *w = W + ids[g] * wstride + p * panel_size;
        /* the next item's panel, when it is this expert's next one in this thread's chunk */
        const uint16_t *next = p + 1 < panels && (item + 1) % chunk ? w + panel_size : 0;
        char *Cp = (char *)C + (long)p * (swiglu ? PANEL / 2 : PANEL) * esize;
        run_blocks(kernels, blk, first[g], first[g + 1], buf, w, K, next, Cp, ldc_bytes, min_int(PANEL, N - p * PANEL),
                   c_fp32, ep);
    }
    return failed ? -1 : 0;
}

int clover_panel_gemm_grouped(const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                              const int64_t *ids, const int64_t *a_rows, int K, const uint16_t *W, long wstride,
                              int N, void *C, long ldc, int c_fp32, int swiglu, const float *scale, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, panel_gemm_grouped_in_team(&team, A, lda, a_bf16, G, offsets, ids, a_rows, K, W, wstride,
                                                         N, C, ldc, c_fp32, swiglu, scale));
    return status;
}
