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
 * itself, which runs in fp32 and rounds its output once (as PyTorch's fp32 path for 32 queries or
 * more does; for fewer it rounds the probabilities to bf16 before multiplying V). */
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

#define MAX_GROUP 16        /* query heads per K/V head */
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

/* One token's G query heads that share a K/V head (qg: the first head's query | gate, heads 2D apart):
 * q norm + rotary, scores over keys 0 … S−1 with each key row widened once for all G heads, softmax,
 * Σ p·v in tiles of keys, normalised, rounded, times the sigmoid gate, into out (heads D apart). p: G
 * rows of `stride` floats of scratch. Inlined with G constant (see the caller) so the accumulator
 * arrays live in registers. */
static inline __attribute__((always_inline)) void attend_group(
        const int G, int D, int R, long S, const uint16_t *qg, const float *q_scale, float eps, const uint16_t *cos,
        const uint16_t *sin, const uint16_t *K, const uint16_t *V, const int32_t *pages, int page, long ld, float *p,
        long stride, float scale, uint16_t *out) {
    float q[MAX_GROUP][512], acc[MAX_GROUP][512], mx[MAX_GROUP], inv[MAX_GROUP];
    for (long i = 0; i < S && i < page; i++) prefetch_row(K + ((long)pages[0] * page + i) * ld, D);
    for (int g = 0; g < G; g++) {
        norm_rope(qg + (long)g * 2 * D, D, R, q_scale, eps, cos, sin, q[g]);
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
    for (int g = 0; g < G; g++) {                        /* softmax numerators */
        float *pg = p + g * stride;
        __m512 vsum = _mm512_setzero_ps();
        for (long s = 0; s < S; s += 16) {
            __mmask16 m = lanes((int)(S - s < 16 ? S - s : 16));
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pg + s), _mm512_set1_ps(mx[g]))));
            _mm512_mask_storeu_ps(pg + s, m, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
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
            __m512 o = round_bf16_16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc[g] + d0), _mm512_set1_ps(inv[g])));
            __m512 gv = load_bf16_16(qg + (long)g * 2 * D + D + d0, m);
            gv = round_bf16_16(_mm512_div_ps(_mm512_set1_ps(1.0f),
                                             _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
            store_bf16_16(out + (long)g * D + d0, m, _mm512_mul_ps(o, gv));
        }
}

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
                             uint16_t *Vc, const int32_t *pages, int page, long start, uint16_t *out, long ldo) {
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
    if (G * stride > score_floats) {
        free(scores);
        scores = aligned_alloc(64, sizeof(float) * (size_t)(G * stride));
        score_floats = scores ? G * stride : 0;
    }
    float *p = scores;
    #pragma omp for schedule(static)
    for (int item = 0; item < T * Hkv; item++) {
        if (!p) { failed = 1; continue; }
        int t = item / Hkv, kvh = item % Hkv;
        long S = t < P ? start + t + 1 : S_max;
        const uint16_t *qgt = qg + t * ldq + (long)kvh * G * 2 * D;
        const uint16_t *K = Kc + (long)kvh * D, *V = Vc + (long)kvh * D;
        const uint16_t *ct = cos + (long)t * R, *st = sin + (long)t * R;
        uint16_t *ot = out + t * ldo + (long)kvh * G * D;
        switch (G) {                    /* a constant group size keeps the accumulators in registers */
        case 1: attend_group(1, D, R, S, qgt, q_scale, eps, ct, st, K, V, pages, page, ld, p, stride, scale, ot); break;
        case 2: attend_group(2, D, R, S, qgt, q_scale, eps, ct, st, K, V, pages, page, ld, p, stride, scale, ot); break;
        case 4: attend_group(4, D, R, S, qgt, q_scale, eps, ct, st, K, V, pages, page, ld, p, stride, scale, ot); break;
        case 8: attend_group(8, D, R, S, qgt, q_scale, eps, ct, st, K, V, pages, page, ld, p, stride, scale, ot); break;
        default: attend_group(G, D, R, S, qgt, q_scale, eps, ct, st, K, V, pages, page, ld, p, stride, scale, ot);
        }
    }
    return failed ? -1 : 0;
}

int clover_attention_cached(int Hq, int Hkv, int D, int R, int T, int P, const uint16_t *qg, long ldq,
                            const uint16_t *k, const uint16_t *v, long ldk, long ldv, const float *q_scale,
                            const float *k_scale, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *Kc,
                            uint16_t *Vc, const int32_t *pages, int page, long start, uint16_t *out, long ldo,
                            int threads) {
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, attention_cached_in_team(Hq, Hkv, D, R, T, P, qg, ldq, k, v, ldk, ldv, q_scale, k_scale, eps,
                                                       cos, sin, Kc, Vc, pages, page, start, out, ldo));
    return status;
}
