/* A few tokens (at most 64) through a Gated DeltaNet mixer, between its input and output projections:
 * decode (one causal token), a block-denoising step (a block over the cached state) and a commit, or
 * both at once (P causal tokens, then a block of L). clover/layers/gated_deltanet.py is the
 * definition; tests/test_kernels.py compares the two.
 *
 * In PyTorch this is 70–150 small tensor ops per layer (conv, SiLU, L2 norms, head repeat, gates, the
 * chunked delta rule with its triangular solve, the block readout and mix, the gated RMSNorm),
 * 0.7–2 ms on 2 threads however small the heads; here it is one pass per (row, value head) in
 * parallel, the delta rule token by token. Arithmetic follows the PyTorch path's roundings (fp32 with
 * products and sums not fused — built with -ffp-contract=off — and bf16 where the model rounds),
 * except reduction order, libm's expf/log1pf, and the recurrent instead of the chunked delta rule for
 * more than two causal tokens. Committed state goes to new tensors: snapshots keep the old ones. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "team.h"

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }


/* x_conv for channels [c0, c0+16) ∩ [0, C) of one row, all T tokens, into xc [T, C] fp32: the causal
 * depthwise conv over [tail | u] in fp32 (products and sums in the PyTorch path's order) rounded to
 * bf16; for block tokens (t ≥ P) plus the right conv over the following block tokens, rounded to bf16
 * and added in bf16; then SiLU rounded to bf16. The block's [tail | u] history is widened to fp32
 * here, 16 channels at a time (a separate serial pass over all channels was ~15% of a prefill call).
 * tail [C, K-1] and u [T, ·] (token stride ldtu) are bf16. Writes the channels' new conv tails (the
 * last K-1 inputs after the causal tokens) when asked. */
#define MAX_CONV 16
static void conv_block(int c0, int C, int T, int P, int K, int Kr, const uint16_t *tail, const uint16_t *u,
                       long ldtu, const float *conv_wt, const float *right_wt, float *xc, uint16_t *new_tail) {
    __mmask16 m = lanes(C - c0);
    int L = T - P, width = C - c0 < 16 ? C - c0 : 16;
    float hist[(64 + MAX_CONV - 1) * 16];                      /* [T+K-1][16] */
    for (int j = 0; j < K - 1; j++)
        for (int x = 0; x < 16; x++) hist[j * 16 + x] = x < width ? bf16_to_f32(tail[(long)(c0 + x) * (K - 1) + j]) : 0.0f;
    for (int t = 0; t < T; t++) _mm512_storeu_ps(hist + (K - 1 + t) * 16, load_bf16_16(u + t * ldtu + c0, m));
    for (int t = 0; t < T; t++) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(hist + t * 16), _mm512_maskz_loadu_ps(m, conv_wt + c0));
        for (int j = 1; j < K; j++)
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(hist + (t + j) * 16),
                                                   _mm512_maskz_loadu_ps(m, conv_wt + (long)j * C + c0)));
        __m512 left = round_bf16_16(acc);
        if (t >= P) {
            int tb = t - P;
            __m512 right = _mm512_setzero_ps();
            for (int j = 0; j < Kr; j++) {
                int s = tb + 1 + j;
                __m512 x = s < L ? _mm512_loadu_ps(hist + (K - 1 + P + s) * 16) : _mm512_setzero_ps();
                __m512 prod = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(m, right_wt + (long)j * C + c0));
                right = j == 0 ? prod : _mm512_add_ps(right, prod);
            }
            left = round_bf16_16(_mm512_add_ps(left, round_bf16_16(right)));
        }
        _mm512_mask_storeu_ps(xc + (long)t * C + c0, m, round_bf16_16(silu16(left)));
    }
    if (new_tail)
        for (int x = 0; x < width; x++)
            for (int j = 0; j < K - 1; j++)
                new_tail[(long)(c0 + x) * (K - 1) + j] = f32_to_bf16(hist[(P + j) * 16 + x]);   /* exact */
}

/* dst[0..n) = src · rsqrt(Σ src² + 1e-6) (· scale), the sum over 16 lanes then across them */
static void l2_normalize(float *dst, const float *src, int n, float scale) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 x = _mm512_maskz_loadu_ps(lanes(n - i), src + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
    }
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) + 1e-6f)), sc = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), r);
        _mm512_mask_storeu_ps(dst + i, m, scale != 1.0f ? _mm512_mul_ps(x, sc) : x);
    }
}

/* The delta rule splits by value column: column j of the state only needs column j of v and the
 * shared k, q, β, decay. So the state goes in slabs of SLAB columns (dk × 64 fp32 = 32 KB at
 * dk = 128, inside L1) that see all T tokens before the next slab, instead of T passes over the
 * whole 64 KB state from L2. */
#define SLAB 64

/* Token t on slab S [dk, SLAB] (row stride SLAB; lanes past `width` stay 0): S ← decay·S;
 * δ = (v − Sᵀk)·β; S ← S + k δᵀ; o = Sᵀq (written to o[0..width)). */
static void slab_step(float *S, int dk, int width, const float *q, const float *k, const float *v,
                      float beta, float decay, float *o) {
    const int nv = SLAB / 16;
    __m512 pred[SLAB / 16], out[SLAB / 16], dec = _mm512_set1_ps(decay);
    for (int x = 0; x < nv; x++) pred[x] = _mm512_setzero_ps(), out[x] = _mm512_setzero_ps();
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]);
        for (int x = 0; x < nv; x++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(S + (long)i * SLAB + 16 * x), dec);
            _mm512_storeu_ps(S + (long)i * SLAB + 16 * x, s);
            pred[x] = _mm512_add_ps(pred[x], _mm512_mul_ps(ki, s));
        }
    }
    __m512 b = _mm512_set1_ps(beta);
    for (int x = 0; x < nv; x++) {
        __mmask16 m = lanes(width - 16 * x);
        pred[x] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + 16 * x), pred[x]), b);   /* δ */
    }
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int x = 0; x < nv; x++) {
            __m512 s = _mm512_add_ps(_mm512_loadu_ps(S + (long)i * SLAB + 16 * x), _mm512_mul_ps(ki, pred[x]));
            _mm512_storeu_ps(S + (long)i * SLAB + 16 * x, s);
            out[x] = _mm512_add_ps(out[x], _mm512_mul_ps(qi, s));
        }
    }
    for (int x = 0; x < nv; x++) _mm512_mask_storeu_ps(o + 16 * x, lanes(width - 16 * x), out[x]);
}

/* slab_step for a single token, reading the state's rows in place (row stride ld0) and writing the
 * updated rows to S1 (stride ld1; NULL: not kept): no copy of the slab in and out, which was most
 * of a decode call. The same operations in the same order as slab_step. */
static void slab_step_once(const float *S0, long ld0, float *S1, long ld1, int dk, int width, const float *q,
                           const float *k, const float *v, float beta, float decay, float *o) {
    const int nv = (width + 15) / 16;
    __m512 pred[SLAB / 16], out[SLAB / 16], dec = _mm512_set1_ps(decay);
    for (int x = 0; x < nv; x++) pred[x] = _mm512_setzero_ps(), out[x] = _mm512_setzero_ps();
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]);
        for (int x = 0; x < nv; x++) {
            __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(width - 16 * x), S0 + i * ld0 + 16 * x), dec);
            pred[x] = _mm512_add_ps(pred[x], _mm512_mul_ps(ki, s));
        }
    }
    __m512 b = _mm512_set1_ps(beta);
    for (int x = 0; x < nv; x++) {
        __mmask16 m = lanes(width - 16 * x);
        pred[x] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + 16 * x), pred[x]), b);   /* δ */
    }
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int x = 0; x < nv; x++) {
            __mmask16 m = lanes(width - 16 * x);
            __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, S0 + i * ld0 + 16 * x), dec);
            s = _mm512_add_ps(s, _mm512_mul_ps(ki, pred[x]));
            if (S1) _mm512_mask_storeu_ps(S1 + i * ld1 + 16 * x, m, s);
            out[x] = _mm512_add_ps(out[x], _mm512_mul_ps(qi, s));
        }
    }
    for (int x = 0; x < nv; x++) _mm512_mask_storeu_ps(o + 16 * x, lanes(width - 16 * x), out[x]);
}

/* One token over a whole head of dv = 16·NV columns (NV ≤ 8, a compile-time constant at the call), rows
 * read in place from S0 and written to S1: the same operations in the same order as slab_step_once,
 * but the 2·NV accumulators stay in registers (slab_step_once's width-dependent count kept them on
 * the stack, each add a store-forwarding round trip) and each state row is one contiguous read. In a
 * decode step the state comes from memory (a whole step of weights streamed since it was written):
 * every line of the row PREFETCH_ROWS ahead is prefetched, and the new state is written with
 * streaming stores. Old and new builds alternating on the full bench model's mixer, caches swept
 * before each call: 663 → 429 µs per call (the first-line-only prefetch gave 541, no prefetch 694);
 * with the state hot in cache, even. */
#define PREFETCH_ROWS 8
static inline __attribute__((always_inline)) void head_step_once(const float *S0, float *S1, int dk, int NV,
                                                                 const float *q, const float *k, const float *v,
                                                                 float beta, float decay, float *o) {
    __m512 pred[8], out[8], dec = _mm512_set1_ps(decay);
    #pragma GCC unroll 8
    for (int x = 0; x < NV; x++) pred[x] = _mm512_setzero_ps(), out[x] = _mm512_setzero_ps();
    const long ld = 16L * NV;
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]);
        #pragma GCC unroll 8
        for (int x = 0; x < NV; x++) _mm_prefetch((const char *)(S0 + (i + PREFETCH_ROWS) * ld + 16 * x), _MM_HINT_T0);
        #pragma GCC unroll 8
        for (int x = 0; x < NV; x++)
            pred[x] = _mm512_add_ps(pred[x], _mm512_mul_ps(ki, _mm512_mul_ps(_mm512_loadu_ps(S0 + i * ld + 16 * x), dec)));
    }
    __m512 b = _mm512_set1_ps(beta);
    #pragma GCC unroll 8
    for (int x = 0; x < NV; x++) pred[x] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * x), pred[x]), b);   /* δ */
    /* the new state is next read a whole decode step later, long evicted: write it around the caches
     * (no read for ownership of its lines) */
    int stream = S1 && ((uintptr_t)S1 & 63) == 0;
    for (int i = 0; i < dk; i++) {
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        #pragma GCC unroll 8
        for (int x = 0; x < NV; x++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(S0 + i * ld + 16 * x), dec);
            s = _mm512_add_ps(s, _mm512_mul_ps(ki, pred[x]));
            if (stream) _mm512_stream_ps(S1 + i * ld + 16 * x, s);
            else if (S1) _mm512_storeu_ps(S1 + i * ld + 16 * x, s);
            out[x] = _mm512_add_ps(out[x], _mm512_mul_ps(qi, s));
        }
    }
    if (stream) _mm_sfence();
    #pragma GCC unroll 8
    for (int x = 0; x < NV; x++) _mm512_storeu_ps(o + 16 * x, out[x]);
}

/* o[0..width) = Sᵀq over a slab. */
static void slab_readout(const float *S, int dk, int width, const float *q, float *o) {
    const int nv = SLAB / 16;
    __m512 out[SLAB / 16];
    for (int x = 0; x < nv; x++) out[x] = _mm512_setzero_ps();
    for (int i = 0; i < dk; i++) {
        __m512 qi = _mm512_set1_ps(q[i]);
        for (int x = 0; x < nv; x++) out[x] = _mm512_add_ps(out[x], _mm512_mul_ps(qi, _mm512_loadu_ps(S + (long)i * SLAB + 16 * x)));
    }
    for (int x = 0; x < nv; x++) _mm512_mask_storeu_ps(o + 16 * x, lanes(width - 16 * x), out[x]);
}

/* dst[0..n) = src[0..width), zero past width. For rows of a few hundred bytes the compiler's inlined
 * memcpy (rep movsq) took 40% of a decode call (perf); vector moves do not. */
static inline void copy_floats(float *dst, const float *src, int width, int n) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = lanes(n - j);
        _mm512_mask_storeu_ps(dst + j, m, _mm512_maskz_loadu_ps(lanes(width - j > 0 ? width - j : 0), src + j));
    }
}

/* Per thread, grown on demand: a fresh allocation per call would be fresh pages (faults) every time. */
typedef struct { float *data; size_t floats; } Scratch;
static __thread Scratch shared_scratch, head_scratch;   /* the call's shared rows; one head's work */

static float *reserve(Scratch *s, size_t floats) {
    if (floats > s->floats) {
        free(s->data);
        s->data = malloc(floats * sizeof(float));
        s->floats = s->data ? floats : 0;
    }
    return s->data;
}

/* B rows of T tokens (P causal, then T-P block). Per row: u [T, C] (q | k | v channels), z [T, Hv·dv],
 * b_in and a_in [T, Hv] (bf16; row stride ld*, token stride ldt*); tails[b] [C, K-1] bf16 and
 * states[b] [Hv, dk, dv] fp32 are read; when P > 0 the state after the causal tokens goes to
 * new_tails[b] / new_states[b]. conv_wt [K, C] and right_wt [Kr, C]: the conv weights transposed.
 * mix [Hv, 2]: the block readout's softmax weights. out [B, T, Hv·dv] bf16: the gated RMSNorm's
 * output. Returns 0, -1 out of memory, -2 unsupported sizes. */
int gdn_short_in_team(Team *team, int B, int T, int P, int Hk, int Hv, int dk, int dv, int K, int Kr,
                      const uint16_t *u, long ldu, long ldtu, const uint16_t *z, long ldz, long ldtz,
                      const uint16_t *b_in, const uint16_t *a_in, long ldba, long ldtba,
                      const int64_t *tails, const int64_t *new_tails, const float *conv_wt, const float *right_wt,
                      const float *A_log, const float *dt_bias, const float *mix,
                      const int64_t *states, const int64_t *new_states,
                      const float *norm_w, float norm_eps, float q_scale, uint16_t *out, long ldo, long ldto) {
    if (T > 64 || T < 1 || K < 2 || K > MAX_CONV) return -2;
    int rep = Hv / Hk, failed = 0;
    long key_dim = (long)Hk * dk, C = 2 * key_dim + (long)Hv * dv;
    int cblocks = (int)((C + 15) / 16);
    /* one shared buffer (thread 0's, team.h): per row x_conv [T, C] fp32 */
    long row_size = (long)T * C;
    float *shared = team_share(team, gdn, reserve(&shared_scratch, (size_t)B * row_size));
    if (!shared) return -1;
    #pragma omp for schedule(static)
    for (int item = 0; item < B * cblocks; item++) {
        int r = item / cblocks;
        conv_block((item % cblocks) * 16, (int)C, T, P, K, Kr, (const uint16_t *)tails[r], u + r * ldu, ldtu,
                   conv_wt, right_wt, shared + r * row_size, P > 0 ? (uint16_t *)new_tails[r] : 0);
    }
    #pragma omp for schedule(static)
    for (int item = 0; item < B * Hv; item++) {
        int row = item / Hv, h = item % Hv, kh = h / rep;
        const float *xc = shared + row * row_size;            /* x_conv [T, C] */
        float *work = reserve(&head_scratch, (size_t)dk * SLAB + (size_t)T * (2 * dk + 2 * dv) + SLAB);
        if (!work) { failed = 1; continue; }
        float *S = work, *q = S + (long)dk * SLAB, *k = q + (long)T * dk, *v = k + (long)T * dk;
        float *o = v + (long)T * dv, *ob = o + (long)T * dv;
        for (int t = 0; t < T; t++) {
            l2_normalize(q + (long)t * dk, xc + t * C + kh * dk, dk, q_scale);
            l2_normalize(k + (long)t * dk, xc + t * C + key_dim + kh * dk, dk, 1.0f);
            copy_floats(v + (long)t * dv, xc + t * C + 2 * key_dim + (long)h * dv, dv, dv);
        }
        float beta[64], decay[64];
        for (int t = 0; t < T; t++) {
            beta[t] = 1.0f / (1.0f + expf(-bf16_to_f32(b_in[row * ldba + (long)t * ldtba + h])));
            float g = -expf(A_log[h]) * softplus(bf16_to_f32(a_in[row * ldba + (long)t * ldtba + h]) + dt_bias[h]);
            decay[t] = expf(g);
        }
        const float *S0 = (const float *)states[row] + (long)h * dk * dv;
        float *S1 = P > 0 ? (float *)new_states[row] + (long)h * dk * dv : 0;
        float w0 = mix[2 * h], w1 = mix[2 * h + 1];
        if (T == 1 && dv == 128) {                        /* one token, the real head size */
            head_step_once(S0, S1, dk, 8, q, k, v, beta[0], decay[0], o);
            if (P == 0)
                for (int j = 0; j < dv; j++) o[j] = w0 * o[j] + w1 * o[j];
        }
        for (int j0 = 0; T == 1 && dv != 128 && j0 < dv; j0 += SLAB) {    /* one token: straight from the state */
            int width = dv - j0 < SLAB ? dv - j0 : SLAB;
            slab_step_once(S0 + j0, dv, S1 ? S1 + j0 : 0, dv, dk, width, q, k, v + j0, beta[0], decay[0], o + j0);
            if (P == 0)                                   /* a one-token block: its end state is S1 */
                for (int j = 0; j < width; j++) o[j0 + j] = w0 * o[j0 + j] + w1 * o[j0 + j];
        }
        for (int j0 = 0; T > 1 && j0 < dv; j0 += SLAB) {
            int width = dv - j0 < SLAB ? dv - j0 : SLAB;
            for (int i = 0; i < dk; i++)                  /* the slab, zero-padded past dv */
                copy_floats(S + (long)i * SLAB, S0 + (long)i * dv + j0, width, SLAB);
            for (int t = 0; t < T; t++) {
                slab_step(S, dk, width, q + (long)t * dk, k + (long)t * dk, v + (long)t * dv + j0, beta[t],
                          decay[t], o + (long)t * dv + j0);
                if (t == P - 1)                           /* the committed state */
                    for (int i = 0; i < dk; i++)
                        copy_floats(S1 + (long)i * dv + j0, S + (long)i * SLAB, width, width);
            }
            for (int t = P; t < T; t++) {                 /* block readout of the end state, mixed */
                slab_readout(S, dk, width, q + (long)t * dk, ob);
                for (int j = 0; j < width; j++)
                    o[(long)t * dv + j0 + j] = w0 * o[(long)t * dv + j0 + j] + w1 * ob[j];
            }
        }
        /* gated RMSNorm per token: rms_norm(o as bf16) → bf16, × weight in bf16, × SiLU(z) in fp32 → bf16 */
        for (int t = 0; t < T; t++) {
            float *ot = o + (long)t * dv;
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < dv; j += 16) {
                __mmask16 m = lanes(dv - j);
                __m512 x = round_bf16_16(_mm512_maskz_loadu_ps(m, ot + j));
                _mm512_mask_storeu_ps(ot + j, m, x);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
            }
            __m512 rr = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dv + norm_eps));
            const uint16_t *zr = z + row * ldz + (long)t * ldtz + (long)h * dv;
            uint16_t *dst = out + row * ldo + (long)t * ldto + (long)h * dv;
            for (int j = 0; j < dv; j += 16) {
                __mmask16 m = lanes(dv - j);
                __m512 hn = round_bf16_16(_mm512_mul_ps(round_bf16_16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, ot + j), rr)),
                                                        _mm512_maskz_loadu_ps(m, norm_w + j)));
                __m512 zf = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, zr + j)), 16));
                _mm256_mask_storeu_epi16(dst + j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(hn, silu16(zf))));
            }
        }
    }
    return failed ? -1 : 0;
}

/* B rows of T tokens (the arguments of gdn_short_in_team) in a region of their own. */
int clover_gdn_short(int B, int T, int P, int Hk, int Hv, int dk, int dv, int K, int Kr,
                     const uint16_t *u, long ldu, long ldtu, const uint16_t *z, long ldz, long ldtz,
                     const uint16_t *b_in, const uint16_t *a_in, long ldba, long ldtba,
                     const int64_t *tails, const int64_t *new_tails, const float *conv_wt, const float *right_wt,
                     const float *A_log, const float *dt_bias, const float *mix,
                     const int64_t *states, const int64_t *new_states,
                     const float *norm_w, float norm_eps, float q_scale,
                     uint16_t *out, long ldo, long ldto, int threads) {
    Team team = {0};
    int status = 0;
    #pragma omp parallel num_threads(threads) reduction(min:status)
    status = team_min(status, gdn_short_in_team(&team, B, T, P, Hk, Hv, dk, dv, K, Kr, u, ldu, ldtu, z, ldz, ldtz, b_in,
                                                a_in, ldba, ldtba, tails, new_tails, conv_wt, right_wt, A_log, dt_bias,
                                                mix, states, new_states, norm_w, norm_eps, q_scale, out, ldo, ldto));
    return status;
}
