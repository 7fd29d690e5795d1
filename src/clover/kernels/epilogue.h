/* What a matrix kernel may do to a finished 32-column row besides rounding it (shared by the bf16
 * panel kernels, panel_gemm.c, and the quantized ones, quant_gemm.c). */
#ifndef CLOVER_EPILOGUE_H
#define CLOVER_EPILOGUE_H
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

/* What the grouped (experts) form may do to a finished row besides rounding it, so the MoE needs no
 * separate passes over the routed rows (each a tensor op over up to 8192 × 2048 values in prefill):
 *   swiglu: the panels hold 16 gate columns then the 16 matching up columns (Experts.pack interleaves
 *           them); store the 16 values bf16(bf16(silu(bf16 gate)) · bf16 up) at column 16·panel;
 *   scale:  store bf16(bf16(value) · scale[row]) (the routing weight of the row's slot).
 * Both round exactly where `F.silu(gate) * up` and `ys * w` round on bf16 tensors. */
typedef struct { int swiglu; const float *scale; } Epilogue;

static inline void store_row(char *c, int ncols, int c_fp32, __m512 lo, __m512 hi, const Epilogue *ep, long row) {
    if (ep && ep->swiglu) {
        __m512 up = round_bf16_16(hi);
        store_bf16_16((uint16_t *)c, 0xFFFF, _mm512_mul_ps(round_bf16_16(silu16(round_bf16_16(lo))), up));
        return;
    }
    if (ep && ep->scale) {
        __m512 w = _mm512_set1_ps(ep->scale[row]);
        lo = _mm512_mul_ps(round_bf16_16(lo), w);
        hi = _mm512_mul_ps(round_bf16_16(hi), w);
    }
    __mmask16 mlo = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    __mmask16 mhi = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    if (c_fp32) {
        _mm512_mask_storeu_ps((float *)c, mlo, lo);
        _mm512_mask_storeu_ps((float *)c + 16, mhi, hi);
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)c, mlo, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_mask_storeu_epi16((uint16_t *)c + 16, mhi, (__m256i)_mm512_cvtneps_pbh(hi));
    }
}

#endif
