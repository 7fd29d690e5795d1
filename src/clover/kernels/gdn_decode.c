/* One decode token through a Gated DeltaNet mixer, between its input and output projections
 * (clover/layers/gated_deltanet.py is the definition; tests/test_kernels.py compares the two).
 *
 * In PyTorch this is ~70 small tensor ops per layer (conv update, SiLU, L2 norms, head repeat,
 * gates, the delta-rule step, the gated RMSNorm), ~0.7 ms on 2 threads whatever the sizes; here it
 * is one pass per value head, in parallel over (row, value head). Arithmetic follows the PyTorch
 * path's roundings (fp32, products and sums not fused: build with -ffp-contract=off; bf16 where the
 * model rounds), except reduction order and libm's expf/log1pf. The state is written to a new
 * tensor: cache snapshots keep referring to the old one. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {     /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Causal depthwise conv output for one channel (tail of K-1 older inputs, then the new one), rounded
 * to bf16, then SiLU rounded to bf16: the model's x_conv value. */
static inline float conv_silu(const uint16_t *tail, float newest, const float *w, int K) {
    float acc = bf16_to_f32(tail[0]) * w[0];
    for (int j = 1; j < K - 1; j++) acc = acc + bf16_to_f32(tail[j]) * w[j];
    acc = acc + newest * w[K - 1];
    return round_bf16(silu(round_bf16(acc)));
}

/* `dst[i] = x_conv` of `n` channels starting at `c0`, optionally shifting their conv tails. */
static void channels(int c0, int n, const uint16_t *u, const uint16_t *tail, uint16_t *new_tail,
                     const float *conv_w, int K, float *dst) {
    for (int i = 0; i < n; i++) {
        int c = c0 + i;
        float newest = bf16_to_f32(u[c]);
        dst[i] = conv_silu(tail + (long)c * (K - 1), newest, conv_w + (long)c * K, K);
        if (new_tail) {
            for (int j = 0; j < K - 2; j++) new_tail[(long)c * (K - 1) + j] = tail[(long)c * (K - 1) + j + 1];
            new_tail[(long)c * (K - 1) + K - 2] = u[c];
        }
    }
}

static void l2_normalize(float *x, int n, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss = ss + x[i] * x[i];
    float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) x[i] = x[i] * r;
    if (scale != 1.0f)
        for (int i = 0; i < n; i++) x[i] = x[i] * scale;
}

/* Rows b, value heads h. Per row: u [C] (C = 2·Hk·dk + Hv·dv: q | k | v), z [Hv·dv], b_in and a_in
 * [Hv], each bf16 with the row strides given; tails[b] [C, K-1] bf16 → new_tails[b];
 * states[b] [Hv, dk, dv] fp32 → new_states[b]; out [B, Hv·dv] bf16 (the gated RMSNorm's output). */
int clover_gdn_decode(int B, int Hk, int Hv, int dk, int dv, int K,
                      const uint16_t *u, long ldu, const uint16_t *z, long ldz,
                      const uint16_t *b_in, const uint16_t *a_in, long ldba,
                      const int64_t *tails, const int64_t *new_tails, const float *conv_w,
                      const float *A_log, const float *dt_bias,
                      const int64_t *states, const int64_t *new_states,
                      const float *norm_w, float norm_eps, float q_scale,
                      uint16_t *out, long ldo, int threads) {
    int rep = Hv / Hk;
    long key_dim = (long)Hk * dk;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int item = 0; item < B * Hv; item++) {
        int row = item / Hv, h = item % Hv, kh = h / rep;
        const uint16_t *ur = u + row * ldu;
        const uint16_t *tail = (const uint16_t *)tails[row];
        uint16_t *new_tail = (uint16_t *)new_tails[row];
        float q[dk], k[dk], v[dv], pred[dv], o[dv];
        /* q and k channels of this head's key head: every value head sharing it computes them, the
         * first one also shifts their conv tails */
        uint16_t *qk_tail = h % rep == 0 ? new_tail : 0;
        channels((int)(kh * dk), dk, ur, tail, qk_tail, conv_w, K, q);
        channels((int)(key_dim + kh * dk), dk, ur, tail, qk_tail, conv_w, K, k);
        channels((int)(2 * key_dim + (long)h * dv), dv, ur, tail, new_tail, conv_w, K, v);
        l2_normalize(q, dk, q_scale);
        l2_normalize(k, dk, 1.0f);

        float beta = 1.0f / (1.0f + expf(-bf16_to_f32(b_in[row * ldba + h])));
        float g = -expf(A_log[h]) * softplus(bf16_to_f32(a_in[row * ldba + h]) + dt_bias[h]);
        float decay = expf(g);

        const float *S = (const float *)states[row] + (long)h * dk * dv;
        float *NS = (float *)new_states[row] + (long)h * dk * dv;
        for (int j = 0; j < dv; j++) pred[j] = 0.0f, o[j] = 0.0f;
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++) pred[j] = pred[j] + k[i] * (S[(long)i * dv + j] * decay);
        for (int j = 0; j < dv; j++) pred[j] = (v[j] - pred[j]) * beta;           /* the correction δ */
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++) {
                float s = S[(long)i * dv + j] * decay + k[i] * pred[j];
                NS[(long)i * dv + j] = s;
                o[j] = o[j] + q[i] * s;
            }

        /* gated RMSNorm: rms_norm(o as bf16) → bf16, × weight in bf16, × SiLU(z) in fp32 → bf16 */
        float ss = 0.0f;
        for (int j = 0; j < dv; j++) {
            o[j] = round_bf16(o[j]);
            ss = ss + o[j] * o[j];
        }
        float r = 1.0f / sqrtf(ss / (float)dv + norm_eps);
        const uint16_t *zr = z + row * ldz + (long)h * dv;
        uint16_t *dst = out + row * ldo + (long)h * dv;
        for (int j = 0; j < dv; j++) {
            float hn = round_bf16(round_bf16(o[j] * r) * norm_w[j]);
            float zf = bf16_to_f32(zr[j]);
            dst[j] = f32_to_bf16(hn * silu(zf));
        }
    }
    return 0;
}
