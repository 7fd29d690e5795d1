/* The residual add with the zero-centred RMSNorm that follows it, for any number of rows, for the
 * native-kernel model (the MoE block after it is moe_block.c). clover/layers/norms.py is the
 * definition; tests/test_kernels.py compares against it. F.rms_norm costs ~20 µs per call on a few
 * rows, and a decode step makes two per layer. Arithmetic follows the module's roundings (fp32, bf16
 * where it rounds; built with -ffp-contract=off) except the reduction order. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "team.h"

/* One row: out_x = x·rsqrt(mean(x²) + eps)·scale in fp32, rounded to bf16; x = h (+ delta, rounded
 * to bf16 and written to out_h). Also attention_cached.c's q/k norm, so every path rounds alike. */
void clover_rmsnorm_row(int H, const uint16_t *h, const uint16_t *delta, const float *scale, float eps,
                            uint16_t *out_h, uint16_t *out_x) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < H; j += 16) {
        __mmask16 m = lanes(H - j);
        __m512 x = load_bf16_16(h + j, m);
        if (delta) {
            x = round_bf16_16(_mm512_add_ps(x, load_bf16_16(delta + j, m)));
            store_bf16_16(out_h + j, m, x);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
    }
    float mean = _mm512_reduce_add_ps(acc) / (float)H;
    __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    const uint16_t *src = delta ? out_h : h;
    for (int j = 0; j < H; j += 16) {
        __mmask16 m = lanes(H - j);
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(load_bf16_16(src + j, m), rstd), _mm512_maskz_loadu_ps(m, scale + j));
        store_bf16_16(out_x + j, m, y);
    }
}

/* N rows of H (row strides ldh, ldd; outputs contiguous). delta may be NULL: the norm alone.
 * The rows split across the team (team.h). */
void add_rmsnorm_in_team(int N, int H, const uint16_t *h, long ldh, const uint16_t *delta, long ldd,
                         const float *scale, float eps, uint16_t *out_h, uint16_t *out_x) {
    #pragma omp for schedule(static)
    for (int i = 0; i < N; i++)
        clover_rmsnorm_row(H, h + i * ldh, delta ? delta + i * ldd : 0, scale, eps, out_h + (long)i * H,
                           out_x + (long)i * H);
}

void clover_add_rmsnorm(int N, int H, const uint16_t *h, long ldh, const uint16_t *delta, long ldd,
                        const float *scale, float eps, uint16_t *out_h, uint16_t *out_x, int threads) {
    if ((long)N * H < (1L << 15)) threads = 1;          /* a few rows: a parallel region costs more */
    #pragma omp parallel num_threads(threads)
    add_rmsnorm_in_team(N, H, h, ldh, delta, ldd, scale, eps, out_h, out_x);
}
