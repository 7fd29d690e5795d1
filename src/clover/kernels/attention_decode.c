/* One decode token through gated attention, between its input and output projections: q/k RMSNorm
 * per head, rotary embedding on the first R dims, the new K/V written into the cache, attention over
 * the cached prefix and itself (grouped-query heads), times the sigmoid output gate.
 * clover/layers/attention.py is the definition; tests/test_kernels.py compares the two.
 *
 * In PyTorch this is ~45 small tensor ops (0.3 ms of dispatch on 2 threads) around a scaled-dot-product
 * call made for many queries. Roundings follow the PyTorch path (bf16 after the norms, each rotary
 * product and sum, the gate) except inside the attention itself, which runs in fp32 and rounds its
 * output once (PyTorch's CPU kernel also rounds the probabilities to bf16 before multiplying V). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

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

/* qg [Hq, 2D] (query | gate per head), k and v [Hkv, D]: the projections of one token (bf16).
 * Kc / Vc: the layer's cache [Hkv, cap, D] bf16; the token's K/V go to position `pos`, and it
 * attends to positions 0..pos. cos / sin [R] bf16. out [Hq·D] bf16: attention output × sigmoid(gate).
 * Returns 0, -1 out of memory, -2 unsupported sizes. */
int clover_attention_decode(int Hq, int Hkv, int D, int R, const uint16_t *qg, const uint16_t *k, const uint16_t *v,
                            const float *q_scale, const float *k_scale, float eps, const uint16_t *cos,
                            const uint16_t *sin, uint16_t *Kc, uint16_t *Vc, long cap, long pos, uint16_t *out,
                            int threads) {
    if (D > 512 || R > D || R % 2 || Hq % Hkv || pos >= cap) return -2;
    long S = pos + 1;
    int failed = 0;
    for (int h = 0; h < Hkv; h++) {                     /* the new K (normalised, rotated) and V */
        float kr[512];
        norm_rope(k + (long)h * D, D, R, k_scale, eps, cos, sin, kr);
        uint16_t *kd = Kc + ((long)h * cap + pos) * D, *vd = Vc + ((long)h * cap + pos) * D;
        for (int j = 0; j < D; j++) kd[j] = f32_to_bf16(kr[j]), vd[j] = v[(long)h * D + j];
    }
    float scale = 1.0f / sqrtf((float)D);
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:failed)
    for (int h = 0; h < Hq; h++) {
        int kvh = h / (Hq / Hkv);
        float q[512];
        float *p = malloc(sizeof(float) * (size_t)(S + 16));
        if (!p) { failed = 1; continue; }
        norm_rope(qg + (long)h * 2 * D, D, R, q_scale, eps, cos, sin, q);
        const uint16_t *K = Kc + (long)kvh * cap * D, *V = Vc + (long)kvh * cap * D;
        float mx = -INFINITY;
        for (long s = 0; s < S; s++) {                   /* scores q·k_s / √D */
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < D; j += 16) {
                __mmask16 m = lanes(D - j);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + j), load_bf16_16(K + s * D + j, m), acc);
            }
            p[s] = _mm512_reduce_add_ps(acc) * scale;
            mx = fmaxf(mx, p[s]);
        }
        __m512 vsum = _mm512_setzero_ps();
        for (long s = 0; s < S; s += 16) {               /* softmax numerators */
            __mmask16 m = lanes((int)(S - s < 16 ? S - s : 16));
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + s), _mm512_set1_ps(mx))));
            _mm512_mask_storeu_ps(p + s, m, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        float acc[512];                                  /* Σ_s p_s·v_s over contiguous V rows */
        for (int j = 0; j < D; j++) acc[j] = 0.0f;
        for (long s = 0; s < S; s++) {
            __m512 ps = _mm512_set1_ps(p[s]);
            for (int j = 0; j < D; j += 16) {
                __mmask16 m = lanes(D - j);
                _mm512_mask_storeu_ps(acc + j, m, _mm512_fmadd_ps(ps, load_bf16_16(V + s * D + j, m),
                                                                  _mm512_maskz_loadu_ps(m, acc + j)));
            }
        }
        for (int j = 0; j < D; j += 16) {                /* normalised, rounded; × gate */
            __mmask16 m = lanes(D - j);
            __m512 o = round_bf16_16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + j), _mm512_set1_ps(inv)));
            __m512 g = load_bf16_16(qg + (long)h * 2 * D + D + j, m);
            g = round_bf16_16(_mm512_div_ps(_mm512_set1_ps(1.0f),
                                            _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16_16(out + (long)h * D + j, m, _mm512_mul_ps(o, g));
        }
        free(p);
    }
    return failed ? -1 : 0;
}
