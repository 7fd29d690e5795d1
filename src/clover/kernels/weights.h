/* One packed weight matrix (or a stack of them: the routed experts) as the matrix kernels read it,
 * whatever its precision, so callers such as moe_block.c take any of them.
 *   bits 16: bf16 panels [ceil(N/32), K, 32] (panel_gemm.c);
 *   bits 8 / 4: quantized panels (quant_gemm.c): per 32-column panel and group of `group` inputs the
 *   codes, with fp16 scales (and optional fp16 offsets, `mins`) [ceil(N/32), K/group, 32];
 *   bits 6 / 5: the same with 6- or 5-bit codes;
 *   two-level scales (`super_group` > 0): `scales` / `mins` are int8 codes of that shape, times the
 *   fp16 `super_scales` / `super_mins` [ceil(N/32), K/super_group, 32].
 * `stride` (bytes), `sstride` (scale elements) and `supstride` (super-scale elements) step from one
 * stacked entry to the next. */
#ifndef CLOVER_WEIGHTS_H
#define CLOVER_WEIGHTS_H
#include <stdint.h>

typedef struct {
    int bits;
    int group;
    const void *data;
    const void *scales;
    const void *mins;
    long stride;
    long sstride;
    int super_group;
    const uint16_t *super_scales;
    const uint16_t *super_mins;
    long supstride;
} Weights;

/* C[M, N] = A[M, K] . W^T (see clover_panel_gemm for the arguments); 0, -1 out of memory, -2 bad shape. */
int clover_weights_gemm(const Weights *w, const void *A, long lda, int a_bf16, int M, int K, int N, void *C,
                        long ldc, int c_fp32, int threads);

/* The grouped (experts) form of clover_panel_gemm_grouped for any Weights. */
int clover_weights_gemm_grouped(const Weights *w, const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                                const int64_t *ids, const int64_t *a_rows, int K, int N, void *C, long ldc,
                                int c_fp32, int swiglu, const float *scale, int threads);

#endif
