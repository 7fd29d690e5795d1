/* The parts of a decoder layer around its mixer, for the native-kernel model: the residual add with
 * the zero-centred RMSNorm that follows it (any number of rows), and one token through the sparse
 * MoE block (decode). clover/layers/norms.py and clover/layers/moe.py are the definitions;
 * tests/test_kernels.py compares against them.
 *
 * In PyTorch one decode token's MoE block is ~40 small tensor ops (router softmax, top-k, renormalise,
 * sort by expert, SwiGLUs, weighting, sums, the shared expert's gate) around its four matrix calls:
 * 0.3–0.5 ms of dispatch per layer against ~0.6 ms of weight reading on the small bench model. Here
 * it is one call. Arithmetic follows the PyTorch path's roundings (fp32, bf16 where the model
 * rounds; built with -ffp-contract=off) except reduction order and the exponential (exp16). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

int clover_panel_gemm(const void *A, long lda, int a_bf16, int M, int K, const uint16_t *W, int N,
                      void *C, long ldc, int c_fp32, int threads);
int clover_panel_gemm_grouped(const void *A, long lda, int a_bf16, int G, const int64_t *offsets,
                              const int64_t *ids, const int64_t *a_rows, int K, const uint16_t *W, long wstride,
                              int N, void *C, long ldc, int c_fp32, int swiglu, const float *scale, int threads);

/* One row: out_x = x·rsqrt(mean(x²) + eps)·scale in fp32, rounded to bf16; x = h (+ delta, rounded
 * to bf16 and written to out_h). Also attention_decode.c's q/k norm, so every path rounds alike. */
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

/* N rows of H (row strides ldh, ldd; outputs contiguous). delta may be NULL: the norm alone. */
void clover_add_rmsnorm(int N, int H, const uint16_t *h, long ldh, const uint16_t *delta, long ldd,
                        const float *scale, float eps, uint16_t *out_h, uint16_t *out_x, int threads) {
    if ((long)N * H < (1L << 15)) threads = 1;          /* a few rows: a parallel region costs more */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < N; i++)
        clover_rmsnorm_row(H, h + i * ldh, delta ? delta + i * ldd : 0, scale, eps, out_h + (long)i * H,
                        out_x + (long)i * H);
}

/* out[i] = bf16(bf16(silu(gate[i])) · up[i]) for n values: F.silu(gate) * up on bf16 tensors */
static void swiglu(int n, const uint16_t *gate, const uint16_t *up, uint16_t *out) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = lanes(n - j);
        __m512 s = round_bf16_16(silu16(load_bf16_16(gate + j, m)));
        store_bf16_16(out + j, m, _mm512_mul_ps(s, load_bf16_16(up + j, m)));
    }
}

/* Softmax of E bf16 logits in fp32, then the k most probable experts (ties to the lower index),
 * their probabilities renormalised to sum 1 and rounded to bf16, ordered by ascending expert. */
static void route(int E, int k, const uint16_t *logits, float *probs, int64_t *ids, float *weights) {
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, bf16_to_f32(logits[e]));
    __m512 vsum = _mm512_setzero_ps();
    for (int e = 0; e < E; e += 16) {
        __mmask16 m = lanes(E - e);
        __m512 p = exp16(_mm512_sub_ps(load_bf16_16(logits + e, m), _mm512_set1_ps(mx)));
        p = _mm512_maskz_mov_ps(m, p);
        _mm512_mask_storeu_ps(probs + e, m, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (int e = 0; e < E; e++) probs[e] *= inv;
    float total = 0.0f;
    int64_t chosen[64];
    for (int j = 0; j < k; j++) {          /* k passes of a strict '>' scan: ties keep the lower index */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        chosen[j] = best;
        total += probs[best];
    }
    /* ascending expert order (insertion sort of k ≤ 64) with each weight renormalised */
    for (int j = 0; j < k; j++) {
        int64_t e = chosen[j];
        float w = round_bf16(probs[e] / total);
        int i = j;
        while (i > 0 && ids[i - 1] > e) {
            ids[i] = ids[i - 1];
            weights[i] = weights[i - 1];
            i--;
        }
        ids[i] = e;
        weights[i] = w;
    }
}

static __thread void *moe_scratch;
static __thread size_t moe_scratch_bytes;

/* One token x [H] (bf16, normalised) through the MoE block, added to the residual h [H]:
 *   out_h = h + (Σ_j w_j·expert_j(x) + sigmoid(g·x)·shared(x))
 * w_in: panels of the stacked input maps [router E | shared gate Is | shared up Is | shared gate 1] × H;
 * gate_up / down: the experts' stacked panels (entry strides in elements); shared_down: [H, Is] panels.
 * Returns 0, -1 out of memory, -2 bad k. */
int clover_moe_decode(int H, int E, int k, int I, int Is, const uint16_t *x, const uint16_t *h,
                      const uint16_t *w_in, const uint16_t *gate_up, long gate_up_stride, const uint16_t *down,
                      long down_stride, const uint16_t *shared_down, uint16_t *out_h,
                      int threads) {
    if (k < 1 || k > 64 || k > E) return -2;
    int n_in = E + 2 * Is + 1;
    size_t bytes = sizeof(float) * E + 2 * ((size_t)n_in + (size_t)k * I + (size_t)k * H + Is + H) + 64 * 64;
    if (bytes > moe_scratch_bytes) {
        free(moe_scratch);
        moe_scratch = malloc(bytes);
        moe_scratch_bytes = moe_scratch ? bytes : 0;
        if (!moe_scratch) return -1;
    }
    float *probs = moe_scratch;
    uint16_t *y_in = (uint16_t *)(probs + E), *act = y_in + n_in;
    uint16_t *ys = act + (size_t)k * I, *act_s = ys + (size_t)k * H, *shared = act_s + Is;
    int64_t ids[64], offsets[65];
    float weights[64];

    if (clover_panel_gemm(x, H, 1, 1, H, w_in, n_in, y_in, n_in, 0, threads)) return -1;
    route(E, k, y_in, probs, ids, weights);
    for (int j = 0; j <= k; j++) offsets[j] = j;
    /* the experts' SwiGLU and routing weights happen in the grouped kernels' epilogues */
    if (clover_panel_gemm_grouped(x, 0, 1, k, offsets, ids, 0, H, gate_up, gate_up_stride, 2 * I, act, I, 0, 1, 0,
                                  threads))
        return -1;
    if (clover_panel_gemm_grouped(act, I, 1, k, offsets, ids, 0, I, down, down_stride, H, ys, H, 0, 0, weights,
                                  threads))
        return -1;
    swiglu(Is, y_in + E, y_in + E + Is, act_s);
    if (clover_panel_gemm(act_s, Is, 1, 1, Is, shared_down, H, shared, H, 0, threads)) return -1;

    float g = bf16_to_f32(y_in[E + 2 * Is]);
    float gate = round_bf16(1.0f / (1.0f + expf(-g)));          /* torch.sigmoid on a bf16 value */
    __m512 vgate = _mm512_set1_ps(gate);
    for (int c = 0; c < H; c += 16) {
        __mmask16 m = lanes(H - c);
        __m512 acc = _mm512_setzero_ps();                        /* Σ_j bf16(y_j · w_j), then bf16 */
        for (int j = 0; j < k; j++) acc = _mm512_add_ps(acc, load_bf16_16(ys + (size_t)j * H + c, m));
        __m512 routed = round_bf16_16(acc);
        __m512 moe = round_bf16_16(_mm512_add_ps(routed, round_bf16_16(_mm512_mul_ps(vgate, load_bf16_16(shared + c, m)))));
        store_bf16_16(out_h + c, m, _mm512_add_ps(load_bf16_16(h + c, m), moe));
    }
    return 0;
}
