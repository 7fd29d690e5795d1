/* A few tokens through gated attention over a K/V cache, between the input and output projections:
 * a decode token, a block-denoising step (every block token sees the cached prefix and the whole
 * block), a commit (causal), or a commit followed by a block. Per token: q/k RMSNorm per head, rotary
 * embedding on the first R dims, its K/V written into the cache, attention over the keys it may see
 * (grouped-query heads), times the sigmoid output gate. clover/layers/attention.py is the definition;
 * tests/test_kernels.py compares the two.
 *
 * In PyTorch a block step's attention is ~60 small tensor ops (norms, rotary halves and concatenations,
 * the cache write, fp32 copies for the CPU flash kernel, the gate) around one scaled-dot-product call:
 * ~1 ms of dispatch beside ~1 ms of attention on the small bench model. Roundings follow the PyTorch
 * path (bf16 after the norms, each rotary product and sum, the gate) except inside the attention
 * itself: decoding tokens (`stepwise`) run it in fp32 and round the output once (as PyTorch's fp32 path
 * for 32 queries or more does); a block's or a prompt's tokens, on AVX-512 BF16 with heads a multiple
 * of 32 wide, in bf16 pair products with the probabilities rounded to bf16 (as PyTorch's bf16 path
 * does below 32 queries). See attend_fp32 and attend_pairs. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "team.h"

void clover_rmsnorm_row(int H, const uint16_t *h, const uint16_t *delta, const float *scale, float eps,
                        uint16_t *out_h, uint16_t *out_x);

/* x [D] bf16 → RMSNorm(x)·scale rounded to bf16 (rmsnorm.c's row norm), then rotary on the first
 * R dims (rotate-half; each product and the sum rounded to bf16, as bf16 tensors compute it), into
 * dst [D] as fp32 values. */
static void norm_rope(const uint16_t *x, int D, int R, const float *scale, float eps, const uint16_t *cos,
                      const uint16_t *sin, float *dst) {
    uint16_t normed[512];
    clover_rmsnorm_row(D, x, 0, scale, eps, 0, normed);
    for (int j = 0; j < D; j++) dst[j] = bf16_to_f32(normed[j]);
    int half = R / 2;
    float rot[512];
    for (int j = 0; j < R; j++) {
        float other = j < half ? -dst[j + half] : dst[j - half];
        rot[j] = round_bf16(round_bf16(dst[j] * bf16_to_f32(cos[j])) + round_bf16(other * bf16_to_f32(sin[j])));
    }
    for (int j = 0; j < R; j++) dst[j] = rot[j];
}

static __thread float *scores;
static __thread long score_floats;

#define MAX_GROUP 16        /* query heads per K/V head, and query rows a work item */
#define PV_CHUNK 32         /* output dims per pass over a tile of keys: 2 vectors × group accumulators */
#define V_TILE 8            /* keys per tile of the Σ p·v (8 value rows stay in L1 without conflicts) */

/* 16 bf16 values widened to fp32 with a plain load (masked loads are much slower on this machine) */
static inline __m512 widen16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* The D bf16 values of one key or value row towards L1, ahead of their use: the rows a head reads are
 * `ld` apart and cross pages, which the hardware prefetchers do not follow (a 16k-token decode's
 * attention read its cache at a fifth of the read bandwidth without this). */
#define prefetch_row(row, D)                                                                           \
    for (int b_ = 0; b_ < (D) * 2; b_ += 64) _mm_prefetch((const char *)(row) + b_, _MM_HINT_T0)
/* (a macro: GCC deletes calls to a function whose only effect is a prefetch, as if it did nothing) */

/* Scores q·k / √D of N consecutive key rows (`ld` apart) for G query heads into p[g·stride + n], with
 * each key row widened once for all G heads; mx[g] keeps the running maximum. */
static inline __attribute__((always_inline)) void score_keys(
        const int G, const int N, int D, const uint16_t *Ks, long ld, float q[][512], float scale, float *p,
        long stride, float *mx) {
    __m512 acc[2][MAX_GROUP];
    for (int n = 0; n < N; n++)
        for (int g = 0; g < G; g++) acc[n][g] = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 16) {
        __mmask16 m = lanes(D - j);
        __m512 kj[2];
        for (int n = 0; n < N; n++) kj[n] = D - j >= 16 ? widen16(Ks + n * ld + j) : load_bf16_16(Ks + n * ld + j, m);
        for (int g = 0; g < G; g++) {
            __m512 qg = D - j >= 16 ? _mm512_loadu_ps(q[g] + j) : _mm512_maskz_loadu_ps(m, q[g] + j);
            for (int n = 0; n < N; n++) acc[n][g] = _mm512_fmadd_ps(qg, kj[n], acc[n][g]);
        }
    }
    for (int n = 0; n < N; n++)
        for (int g = 0; g < G; g++) {
            float x = _mm512_reduce_add_ps(acc[n][g]) * scale;
            p[g * stride + n] = x;
            mx[g] = x > mx[g] ? x : mx[g];                /* fmaxf, NaN kept out, without a libm call */
        }
}

/* The query rows one work item computes, all over the same keys: per row its query | gate (2D bf16),
 * its token's rotary cos / sin and where its D outputs go. */
typedef struct {
    const uint16_t *q[MAX_GROUP], *cos[MAX_GROUP], *sin[MAX_GROUP];
    uint16_t *out[MAX_GROUP];
    long keys[MAX_GROUP];           /* the keys a row sees, 0 … keys−1 (causal rows of a run: fewer than S) */
} Rows;

/* 16 outputs o (fp32, normalised) rounded to bf16, times the sigmoid of their gate (rounded), to dst. */
static inline void gate_out(__m512 o, const uint16_t *gate, uint16_t *dst, __mmask16 m) {
    __m512 gv = load_bf16_16(gate, m);
    gv = round_bf16_16(_mm512_div_ps(_mm512_set1_ps(1.0f),
                                     _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
    store_bf16_16(dst, m, _mm512_mul_ps(round_bf16_16(o), gv));
}

/* Softmax numerators in place over the scores p[g·stride + 0 … S−1] of G rows, row g's over its keys
 * 0 … keys[g]−1 (exact zeros past them), less its maximum top[g]; inv[g] = 1 / their sum. */
static void softmax_rows(int G, float *p, long stride, long S, const long *keys, const float *top, float *inv) {
    for (int g = 0; g < G; g++) {
        float *pg = p + g * stride;
        __m512 vsum = _mm512_setzero_ps();
        for (long s = 0; s < S; s += 16) {
            __mmask16 m = s < keys[g] ? lanes((int)(keys[g] - s < 16 ? keys[g] - s : 16)) : 0;
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pg + s), _mm512_set1_ps(top[g]))));
            _mm512_mask_storeu_ps(pg + s, lanes((int)(S - s < 16 ? S - s : 16)), e);
            vsum = _mm512_add_ps(vsum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
}

/* G query rows that see the same keys 0 … S−1 of one K/V head (`Rows`): q norm + rotary, scores over the
 * keys with each key row widened once for all G rows, softmax, Σ p·v in tiles of keys, normalised,
 * rounded, times the sigmoid gate, all in fp32. p: G rows of `stride` floats of scratch. Inlined with G
 * constant (see the caller) so the accumulator arrays live in registers. */
static inline __attribute__((always_inline)) void attend_fp32(
        const int G, int D, int R, long S, const Rows *rows, const float *q_scale, float eps, const uint16_t *K,
        const uint16_t *V, const int32_t *pages, int page, long ld, float *p, long stride, float scale) {
    float q[MAX_GROUP][512], acc[MAX_GROUP][512], mx[MAX_GROUP], inv[MAX_GROUP];
    for (long i = 0; i < S && i < page; i++) prefetch_row(K + ((long)pages[0] * page + i) * ld, D);
    for (int g = 0; g < G; g++) {
        norm_rope(rows->q[g], D, R, q_scale, eps, rows->cos[g], rows->sin[g], q[g]);
        mx[g] = -INFINITY;
    }
    /* keys page by page (one page-table lookup per page, rows `ld` apart inside it), two at a time
     * while both keys' accumulators fit in registers: two independent chains of FMAs, each key's in
     * the order of one alone */
    for (long s0 = 0; s0 < S; s0 += page) {
        const uint16_t *Kp = K + (long)pages[s0 / page] * page * ld;
        long s = s0, s_end = S - s0 < page ? S : s0 + page;
        const uint16_t *Kn = s0 + page < S ? K + (long)pages[s0 / page + 1] * page * ld : 0;   /* fetched ahead */
        for (; G <= 8 && s + 1 < s_end; s += 2) {
            for (long i = s; i < s + 2 && i + page < S && Kn; i++) prefetch_row(Kn + (i - s0) * ld, D);
            score_keys(G, 2, D, Kp + (s - s0) * ld, ld, q, scale, p + s, stride, mx);
        }
        for (; s < s_end; s++) {
            if (Kn && s + page < S) prefetch_row(Kn + (s - s0) * ld, D);
            score_keys(G, 1, D, Kp + (s - s0) * ld, ld, q, scale, p + s, stride, mx);
        }
    }
    for (long s = 0; s < S && s < 2 * V_TILE; s++) prefetch_row(V + ((long)pages[s / page] * page + s % page) * ld, D);
    softmax_rows(G, p, stride, S, rows->keys, mx, inv);
    /* Σ_s p_s·v_s in tiles of V_TILE keys, 32 output dims at a time in registers (their sums kept in
     * `acc` between tiles): a tile's value rows come from L1 once per 32 dims, the rows two tiles on
     * fetched meanwhile. Each output still adds its terms in key order. */
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
    for (long s0 = 0; s0 < S; s0 += page) {
        const uint16_t *Vp = V + (long)pages[s0 / page] * page * ld;
        long n = S - s0 < page ? S - s0 : page;
        for (long t0 = 0; t0 < n; t0 += V_TILE) {
            long t1 = n - t0 < V_TILE ? n : t0 + V_TILE;
            for (long s = s0 + t0 + 2 * V_TILE; s < s0 + t1 + 2 * V_TILE && s < S; s++)
                prefetch_row(V + ((long)pages[s / page] * page + s % page) * ld, D);
            for (int d0 = 0; d0 < D; d0 += PV_CHUNK) {
                __m512 lo[MAX_GROUP], hi[MAX_GROUP];
                __mmask16 mlo = lanes(D - d0), mhi = D - d0 > 16 ? lanes(D - d0 - 16) : 0;
                int whole = D - d0 >= PV_CHUNK;
                for (int g = 0; g < G; g++) {
                    lo[g] = _mm512_maskz_loadu_ps(mlo, acc[g] + d0);
                    hi[g] = _mm512_maskz_loadu_ps(mhi, acc[g] + d0 + 16);
                }
                for (long i = t0; i < t1; i++) {
                    const uint16_t *Vs = Vp + i * ld + d0;
                    __m512 vl = whole ? widen16(Vs) : load_bf16_16(Vs, mlo);
                    __m512 vh = whole ? widen16(Vs + 16) : load_bf16_16(Vs + 16, mhi);
                    for (int g = 0; g < G; g++) {
                        __m512 ps = _mm512_set1_ps(p[g * stride + s0 + i]);
                        lo[g] = _mm512_fmadd_ps(ps, vl, lo[g]);
                        hi[g] = _mm512_fmadd_ps(ps, vh, hi[g]);
                    }
                }
                for (int g = 0; g < G; g++) {
                    _mm512_mask_storeu_ps(acc[g] + d0, mlo, lo[g]);
                    _mm512_mask_storeu_ps(acc[g] + d0 + 16, mhi, hi[g]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++)                          /* normalised, rounded; × gate */
        for (int d0 = 0; d0 < D; d0 += 16) {
            __mmask16 m = lanes(D - d0);
            gate_out(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc[g] + d0), _mm512_set1_ps(inv[g])),
                     rows->q[g] + D + d0, rows->out[g] + d0, m);
        }
}

#ifdef __AVX512BF16__
/* With AVX-512 BF16, a block's rows over heads a multiple of 32 wide take `vdpbf16ps`, two bf16
 * products per fp32 lane, and no horizontal sums: a tile of up to 32 keys is transposed once into words
 * of two dims, 16 keys a vector, for all the item's rows (up to 16); a row's 32 scores of the tile are
 * then D/2 pair products with its query's words broadcast. The probabilities are rounded to bf16 for
 * Σ p·v (as PyTorch's bf16 attention does), two keys a word, against two value rows interleaved by 16
 * bits. Each row's sums run in a fixed order whatever the other rows of its item or the page size: a
 * score over pairs of dims, the even and the odd pairs in two chains added at the end; Σ p·v over pairs
 * of keys at even positions, in key order. */
#define PAIR_TILE 32        /* keys per tile: two vectors of 16 */
#define PAIR_ROWS 4         /* rows a pass of the scores: 4 × 2 vectors × 2 chains = 16 accumulators */
#define PV_ROWS 8           /* rows a pass of Σ p·v: 8 × 2 vectors, one chain each */

/* 16 rows of 16 32-bit words (`ld` words apart; rows from n on read as zero) transposed: out[j] holds
 * word j of the 16 rows, row i in lane i. Unpacks by 32 and 64 bits, then two rounds of 128-bit moves. */
static inline void transpose_words(const uint32_t *src, long ld, int n, __m512i *out) {
    __m512i r[16], t[16];
    if (n >= 16)
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * ld);
    else
        for (int i = 0; i < 16; i++) r[i] = i < n ? _mm512_loadu_si512(src + i * ld) : _mm512_setzero_si512();
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {             /* r[4i + c]: word 4L + c of rows 4i … 4i+3 in 128-bit lane L */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        out[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        out[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* Scores of NR rows (query words qw[r], D/2 each) against a transposed tile kt[2][D/2] (keys 0–15,
 * 16–31 of n, the first at position `first`) into p[r·stride + 0 … n−1]; mx[r] (16 lanes) keeps the
 * running maximum over the keys row r sees (below keys[r]). */
static inline __attribute__((always_inline)) void score_tile(
        const int NR, int D, const uint32_t (*qw)[256], const __m512i (*kt)[256], int n, long first,
        const long *keys, float scale, float *p, long stride, __m512 *mx) {
    __m512 acc[PAIR_ROWS][2][2];
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) acc[r][h][0] = acc[r][h][1] = _mm512_setzero_ps();
    for (int w = 0; w < D / 2; w += 2)
        for (int e = 0; e < 2; e++)
            for (int r = 0; r < NR; r++) {
                __m512bh q = (__m512bh)_mm512_set1_epi32((int)qw[r][w + e]);
                for (int h = 0; h < 2; h++) acc[r][h][e] = _mm512_dpbf16_ps(acc[r][h][e], (__m512bh)kt[h][w + e], q);
            }
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) {
            long seen = keys[r] - first < n ? keys[r] - first : n;      /* the row's keys in the tile */
            __mmask16 m = seen > 16 * h ? lanes((int)(seen - 16 * h)) : 0;
            __m512 x = _mm512_mul_ps(_mm512_add_ps(acc[r][h][0], acc[r][h][1]), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(p + r * stride + 16 * h, m, x);
            mx[r] = _mm512_mask_max_ps(mx[r], m, mx[r], x);
        }
}

/* Σ p·v over a tile's n keys for NR rows, output dims d0 … d0+31: pb[r] holds each row's bf16
 * probabilities of the tile (two keys a word, zero past n); the running sums (dims in the order of an
 * unpack of 16-bit pairs) are kept between tiles in acc. */
static inline __attribute__((always_inline)) void pv_tile(
        const int NR, const uint32_t (*pb)[PAIR_TILE / 2], const uint16_t *Vt, long ld, int n, int d0, float (*acc)[512]) {
    __m512 sum[PV_ROWS][2];
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) sum[r][h] = _mm512_loadu_ps(acc[r] + d0 + 16 * h);
#define PAIR_STEP(i, second)                                                                                \
    {                                                                                                       \
        __m512i l0 = _mm512_loadu_si512((const void *)(Vt + 2L * (i) * ld + d0));                           \
        __m512i l1 = (second) ? _mm512_loadu_si512((const void *)(Vt + (2L * (i) + 1) * ld + d0))            \
                              : _mm512_setzero_si512();                                                     \
        __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(l0, l1), hi = (__m512bh)_mm512_unpackhi_epi16(l0, l1); \
        for (int r = 0; r < NR; r++) {                                                                      \
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)pb[r][i]);                                        \
            sum[r][0] = _mm512_dpbf16_ps(sum[r][0], lo, b);                                                 \
            sum[r][1] = _mm512_dpbf16_ps(sum[r][1], hi, b);                                                 \
        }                                                                                                   \
    }
    if (n == PAIR_TILE)                          /* a whole tile: no key past its end */
        for (int i = 0; i < PAIR_TILE / 2; i++) PAIR_STEP(i, 1)
    else
        for (int i = 0; 2 * i < n; i++) PAIR_STEP(i, 2 * i + 1 < n)
#undef PAIR_STEP
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) _mm512_storeu_ps(acc[r] + d0 + 16 * h, sum[r][h]);
}

/* The dims of an unpack of 16-bit pairs back in order: of 32 dims, lanes of (lo, hi) */
static const int32_t UNPACKED_LO[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
static const int32_t UNPACKED_HI[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

/* attend_fp32's computation through `vdpbf16ps` (see above) for any number G of rows; D a multiple of
 * 32, the page size even (a pair of keys never straddles pages). */
static void attend_pairs(int G, int D, int R, long S, const Rows *rows, const float *q_scale, float eps,
                         const uint16_t *K, const uint16_t *V, const int32_t *pages, int page, long ld, float *p,
                         long stride, float scale) {
    uint32_t qw[MAX_GROUP][256];                 /* each row's query, two dims a word */
    float sums[MAX_GROUP][512];                  /* Σ p·v */
    __m512i kt[2][256];                          /* a tile's keys 0–15 and 16–31, transposed */
    __m512 mx[MAX_GROUP];
    float inv[MAX_GROUP];
    for (long i = 0; i < S && i < page; i++) prefetch_row(K + ((long)pages[0] * page + i) * ld, D);
    for (int g = 0; g < G; g++) {
        float q[512];
        norm_rope(rows->q[g], D, R, q_scale, eps, rows->cos[g], rows->sin[g], q);     /* bf16 values: exact */
        for (int w = 0; w < D / 2; w++) qw[g][w] = f32_to_bf16(q[2 * w]) | (uint32_t)f32_to_bf16(q[2 * w + 1]) << 16;
        mx[g] = _mm512_set1_ps(-INFINITY);
    }
    for (long s0 = 0; s0 < S; s0 += page) {
        const uint16_t *Kp = K + (long)pages[s0 / page] * page * ld;
        const uint16_t *Kn = s0 + page < S ? K + (long)pages[s0 / page + 1] * page * ld : 0;   /* fetched ahead */
        long n = S - s0 < page ? S - s0 : page;
        for (long t0 = 0; t0 < n; t0 += PAIR_TILE) {
            int nt = n - t0 < PAIR_TILE ? (int)(n - t0) : PAIR_TILE;
            for (int i = 0; Kn && i < nt && s0 + page + t0 + i < S; i++) prefetch_row(Kn + (t0 + i) * ld, D);
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < D / 32; b++)
                    transpose_words((const uint32_t *)(Kp + (t0 + 16 * h) * ld) + 16 * b, ld / 2, nt - 16 * h,
                                    kt[h] + 16 * b);
            float *pt = p + s0 + t0;
            int g = 0;
            for (; g + PAIR_ROWS <= G; g += PAIR_ROWS)
                score_tile(PAIR_ROWS, D, qw + g, kt, nt, s0 + t0, rows->keys + g, scale, pt + g * stride, stride, mx + g);
            switch (G - g) {
            case 1: score_tile(1, D, qw + g, kt, nt, s0 + t0, rows->keys + g, scale, pt + g * stride, stride, mx + g); break;
            case 2: score_tile(2, D, qw + g, kt, nt, s0 + t0, rows->keys + g, scale, pt + g * stride, stride, mx + g); break;
            case 3: score_tile(3, D, qw + g, kt, nt, s0 + t0, rows->keys + g, scale, pt + g * stride, stride, mx + g); break;
            }
        }
    }
    for (long s = 0; s < S && s < 2 * PAIR_TILE; s++) prefetch_row(V + ((long)pages[s / page] * page + s % page) * ld, D);
    float top[MAX_GROUP] = {0};
    for (int g = 0; g < G; g++) {
        top[g] = _mm512_reduce_max_ps(mx[g]);
        for (int d = 0; d < D; d++) sums[g][d] = 0.0f;
    }
    softmax_rows(G, p, stride, S, rows->keys, top, inv);
    for (long s0 = 0; s0 < S; s0 += page) {
        const uint16_t *Vp = V + (long)pages[s0 / page] * page * ld;
        long n = S - s0 < page ? S - s0 : page;
        for (long t0 = 0; t0 < n; t0 += PAIR_TILE) {
            int nt = n - t0 < PAIR_TILE ? (int)(n - t0) : PAIR_TILE;
            for (long s = s0 + t0 + PAIR_TILE; s < s0 + t0 + nt + PAIR_TILE && s < S; s++)
                prefetch_row(V + ((long)pages[s / page] * page + s % page) * ld, D);
            uint32_t pb[MAX_GROUP][PAIR_TILE / 2];           /* the tile's probabilities in bf16, two keys a word */
            for (int g = 0; g < G; g++) {
                const float *pg = p + g * stride + s0 + t0;
                __m512 lo = _mm512_maskz_loadu_ps(lanes(nt), pg), hi = _mm512_maskz_loadu_ps(nt > 16 ? lanes(nt - 16) : 0, pg + 16);
                _mm512_storeu_si512((void *)pb[g], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            for (int d0 = 0; d0 < D; d0 += 32) {
                int g = 0;
                for (; g + PV_ROWS <= G; g += PV_ROWS) pv_tile(PV_ROWS, pb + g, Vp + t0 * ld, ld, nt, d0, sums + g);
                switch (G - g) {
#define PV(nr) pv_tile(nr, pb + g, Vp + t0 * ld, ld, nt, d0, sums + g)
                case 1: PV(1); break;
                case 2: PV(2); break;
                case 3: PV(3); break;
                case 4: PV(4); break;
                case 5: PV(5); break;
                case 6: PV(6); break;
                case 7: PV(7); break;
#undef PV
                }
            }
        }
    }
    const __m512i lo_idx = _mm512_loadu_si512((const void *)UNPACKED_LO), hi_idx = _mm512_loadu_si512((const void *)UNPACKED_HI);
    for (int g = 0; g < G; g++)                          /* normalised, rounded; × gate */
        for (int d0 = 0; d0 < D; d0 += 32) {
            __m512 lo = _mm512_loadu_ps(sums[g] + d0), hi = _mm512_loadu_ps(sums[g] + d0 + 16);
            __m512 scale_g = _mm512_set1_ps(inv[g]);
            gate_out(_mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), scale_g), rows->q[g] + D + d0,
                     rows->out[g] + d0, 0xFFFF);
            gate_out(_mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), scale_g), rows->q[g] + D + d0 + 16,
                     rows->out[g] + d0 + 16, 0xFFFF);
        }
}
#endif

/* T tokens at positions start … start+T−1 of one sequence: the first P causal (token t sees keys
 * 0 … start+t), the rest a block (each sees keys 0 … start+T−1). qg [T, Hq·2D] (query | gate per
 * head; token stride ldq), k and v [T, Hkv·D] (token strides ldk, ldv): the projections (bf16).
 * Kc / Vc: the layer's K/V pages [pages, page, Hkv, D] bf16, the sequence's position s in page
 * pages[s / page], row s % page; the tokens' K/V go to positions start … (their pages must exist).
 * cos / sin [T, R] bf16. out [T, Hq·D] (token stride ldo) bf16: attention output × sigmoid(gate).
 * Work goes by (K/V head, token): the query heads that share a K/V head read and widen each key and
 * value row once between them; the items split across the team (team.h). Returns 0, -1 out of memory,
 * -2 unsupported sizes. */
int attention_cached_in_team(int Hq, int Hkv, int D, int R, int T, int P, const uint16_t *qg, long ldq,
                             const uint16_t *k, const uint16_t *v, long ldk, long ldv, const float *q_scale,
                             const float *k_scale, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *Kc,
                             uint16_t *Vc, const int32_t *pages, int page, long start, uint16_t *out, long ldo,
                             int stepwise) {
    if (D > 512 || R > D || R % 2 || Hq % Hkv || Hq / Hkv > MAX_GROUP || T < 1 || P < 0 || P > T
        || start < 0 || page < 1)
        return -2;
    long ld = (long)Hkv * D;
    int failed = 0, G = Hq / Hkv;
    float scale = 1.0f / sqrtf((float)D);
    long S_max = start + T, stride = (S_max + 15) / 16 * 16;
    #pragma omp for schedule(static)
    for (int item = 0; item < T * Hkv; item++) {         /* the new K (normalised, rotated) and V */
        int t = item / Hkv, h = item % Hkv;
        float kr[512];
        norm_rope(k + t * ldk + (long)h * D, D, R, k_scale, eps, cos + (long)t * R, sin + (long)t * R, kr);
        long pos = start + t, row = ((long)pages[pos / page] * page + pos % page) * ld + (long)h * D;
        uint16_t *kd = Kc + row, *vd = Vc + row;
        for (int j = 0; j < D; j++) kd[j] = f32_to_bf16(kr[j]), vd[j] = v[t * ldv + (long)h * D + j];
    }
#ifdef __AVX512BF16__
    int pairs = D % 32 == 0 && page % 2 == 0;
#else
    int pairs = 0;
#endif
    /* Work items: (K/V head, causal token), then (K/V head, run of up to `per` block tokens, which all
     * see keys 0 … start+T−1): a run's query rows share each key and value row read (and transposed).
     * Block runs take the pair products where they can (compute-bound: up to 16 rows a key); a causal
     * token's G rows take the fp32 path, whose transposes are not repaid by so few rows. */
    int per = pairs ? MAX_GROUP / G : 1, cper = stepwise ? 1 : per;       /* tokens a run: block, causal */
    int cruns = (P + cper - 1) / cper, runs = (T - P + per - 1) / per, rows_max = G * (T > 1 ? per : 1);
    if (rows_max * stride > score_floats) {
        free(scores);
        scores = aligned_alloc(64, sizeof(float) * (size_t)(rows_max * stride));
        score_floats = scores ? rows_max * stride : 0;
    }
    float *p = scores;
    #pragma omp for schedule(static)
    for (int item = 0; item < (cruns + runs) * Hkv; item++) {
        if (!p) { failed = 1; continue; }
        int u = item / Hkv, kvh = item % Hkv;
        int causal = u < cruns, t0 = causal ? u * cper : P + (u - cruns) * per;
        int nt = causal ? (P - t0 < cper ? P - t0 : cper) : (T - t0 < per ? T - t0 : per);
        long S = causal ? start + t0 + nt : S_max;
        Rows rows;
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < G; g++) {
                rows.q[t * G + g] = qg + (t0 + t) * ldq + (long)(kvh * G + g) * 2 * D;
                rows.cos[t * G + g] = cos + (long)(t0 + t) * R;
                rows.sin[t * G + g] = sin + (long)(t0 + t) * R;
                rows.out[t * G + g] = out + (t0 + t) * ldo + (long)(kvh * G + g) * D;
                rows.keys[t * G + g] = causal ? start + t0 + t + 1 : S_max;
            }
        const uint16_t *K = Kc + (long)kvh * D, *V = Vc + (long)kvh * D;
#ifdef __AVX512BF16__
        if (pairs && !(causal && stepwise)) {
            attend_pairs(nt * G, D, R, S, &rows, q_scale, eps, K, V, pages, page, ld, p, stride, scale);
            continue;
        }
#endif
        switch (G) {                    /* a constant group size keeps the accumulators in registers */
#define ATTEND(n) attend_fp32(n, D, R, S, &rows, q_scale, eps, K, V, pages, page, ld, p, stride, scale)
        case 1: ATTEND(1); break;
        case 2: ATTEND(2); break;
        case 4: ATTEND(4); break;
        case 8: ATTEND(8); break;
        default: ATTEND(G);
#undef ATTEND
        }
    }
    return failed ? -1 : 0;
}

int clover_attention_cached(int Hq, int Hkv, int D, int R, int T, int P, const uint16_t *qg, long ldq,
                            const uint16_t *k, const uint16_t *v, long ldk, long ldv, const float *q_scale,
                            const float *k_scale, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *Kc,
                            uint16_t *Vc, const int32_t *pages, int page, long start, uint16_t *out, long ldo,
                            int stepwise, int threads) {
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, attention_cached_in_team(Hq, Hkv, D, R, T, P, qg, ldq, k, v, ldk, ldv, q_scale, k_scale, eps,
                                                       cos, sin, Kc, Vc, pages, page, start, out, ldo, stepwise));
    return status;
}
