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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

typedef struct {
    int T, P, K, Kr;                  /* tokens, causal ones among them, left and right conv widths */
    const uint16_t *u; long ldt;      /* this row's pre-conv inputs, token stride ldt */
    const uint16_t *tail;             /* [C, K-1] */
    uint16_t *new_tail;               /* [C, K-1] or 0 */
    const float *conv_w, *right_w;    /* [C, K], [C, Kr] */
} ConvArgs;

/* x_conv of channel c for all T tokens into dst[t * stride]: the causal conv over [tail | u] in fp32
 * rounded to bf16, plus for block tokens the right conv over the following block tokens (rounded to
 * bf16, added in bf16), then SiLU rounded to bf16. Optionally writes the channel's new conv tail. */
static void conv_channel(const ConvArgs *a, int c, float *dst, int stride, int write_tail) {
    int K = a->K, T = a->T, P = a->P, L = T - P;
    float hist[64 + 8];                                       /* [tail (K-1) | u (T)] */
    const uint16_t *tail = a->tail + (long)c * (K - 1);
    for (int j = 0; j < K - 1; j++) hist[j] = bf16_to_f32(tail[j]);
    for (int t = 0; t < T; t++) hist[K - 1 + t] = bf16_to_f32(a->u[(long)t * a->ldt + c]);
    const float *w = a->conv_w + (long)c * K;
    for (int t = 0; t < T; t++) {
        float acc = hist[t] * w[0];
        for (int j = 1; j < K; j++) acc = acc + hist[t + j] * w[j];
        float left = round_bf16(acc);
        if (t >= P) {                                         /* block token: look-ahead inside the block */
            const float *wr = a->right_w + (long)c * a->Kr;
            int tb = t - P;
            float right = 0.0f;
            for (int j = 0; j < a->Kr; j++) {
                int s = tb + 1 + j;
                float x = s < L ? hist[K - 1 + P + s] : 0.0f;
                right = j == 0 ? x * wr[0] : right + x * wr[j];
            }
            left = round_bf16(left + round_bf16(right));
        }
        dst[(long)t * stride] = round_bf16(silu(left));
    }
    if (write_tail && a->new_tail)                            /* the last K-1 inputs after the causal part */
        for (int j = 0; j < K - 1; j++) {
            float x = hist[P + j];
            a->new_tail[(long)c * (K - 1) + j] = f32_to_bf16(x);   /* exact: x came from bf16 */
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

/* One delta-rule token on S [dk, dv] in place; o [dv] = S_newᵀ q. */
static void delta_step(float *S, int dk, int dv, const float *q, const float *k, const float *v,
                       float beta, float decay, float *o, float *tmp) {
    for (int j = 0; j < dv; j++) tmp[j] = 0.0f, o[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *row = S + (long)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] = row[j] * decay;
            tmp[j] = tmp[j] + k[i] * row[j];
        }
    }
    for (int j = 0; j < dv; j++) tmp[j] = (v[j] - tmp[j]) * beta;              /* the correction δ */
    for (int i = 0; i < dk; i++) {
        float *row = S + (long)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] = row[j] + k[i] * tmp[j];
            o[j] = o[j] + q[i] * row[j];
        }
    }
}

/* B rows of T tokens (P causal, then T-P block), value heads in parallel. Per row: u [T, C] (q | k | v
 * channels), z [T, Hv·dv], b_in and a_in [T, Hv] (bf16; row stride ld*, token stride ldt*);
 * tails[b] [C, K-1] bf16 and states[b] [Hv, dk, dv] fp32 are read; when P > 0 the state after the
 * causal tokens goes to new_tails[b] / new_states[b]. mix [Hv, 2]: the block readout's softmax
 * weights. out [B, T, Hv·dv] bf16: the gated RMSNorm's output. Returns 0, or -1 out of memory. */
int clover_gdn_short(int B, int T, int P, int Hk, int Hv, int dk, int dv, int K, int Kr,
                     const uint16_t *u, long ldu, long ldtu, const uint16_t *z, long ldz, long ldtz,
                     const uint16_t *b_in, const uint16_t *a_in, long ldba, long ldtba,
                     const int64_t *tails, const int64_t *new_tails, const float *conv_w, const float *right_w,
                     const float *A_log, const float *dt_bias, const float *mix,
                     const int64_t *states, const int64_t *new_states,
                     const float *norm_w, float norm_eps, float q_scale,
                     uint16_t *out, long ldo, long ldto, int threads) {
    if (T > 64 || T < 1 || K > 9 || K < 2) return -2;
    int rep = Hv / Hk, L = T - P, failed = 0;
    long key_dim = (long)Hk * dk;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:failed)
    for (int item = 0; item < B * Hv; item++) {
        int row = item / Hv, h = item % Hv, kh = h / rep;
        float *work = malloc(sizeof(float) * ((size_t)dk * dv + (size_t)T * (2 * dk + 2 * dv) + 2 * (size_t)dv));
        if (!work) { failed = 1; continue; }
        float *S = work, *q = S + (long)dk * dv, *k = q + (long)T * dk, *v = k + (long)T * dk;
        float *o = v + (long)T * dv, *tmp = o + (long)T * dv, *ob = tmp + dv;
        ConvArgs ca = {T, P, K, Kr, u + row * ldu, ldtu, (const uint16_t *)tails[row],
                       P > 0 ? (uint16_t *)new_tails[row] : 0, conv_w, right_w};
        /* q and k of this head's key head (every value head sharing it computes them; the first one
         * also writes their conv tails), then its own v */
        int first = h % rep == 0;
        for (int i = 0; i < dk; i++) conv_channel(&ca, (int)(kh * dk + i), q + i, dk, first);
        for (int i = 0; i < dk; i++) conv_channel(&ca, (int)(key_dim + kh * dk + i), k + i, dk, first);
        for (int j = 0; j < dv; j++) conv_channel(&ca, (int)(2 * key_dim + (long)h * dv + j), v + j, dv, 1);
        for (int t = 0; t < T; t++) {
            l2_normalize(q + (long)t * dk, dk, q_scale);
            l2_normalize(k + (long)t * dk, dk, 1.0f);
        }

        memcpy(S, (const float *)states[row] + (long)h * dk * dv, sizeof(float) * (size_t)dk * dv);
        for (int t = 0; t < T; t++) {
            float beta = 1.0f / (1.0f + expf(-bf16_to_f32(b_in[row * ldba + (long)t * ldtba + h])));
            float g = -expf(A_log[h]) * softplus(bf16_to_f32(a_in[row * ldba + (long)t * ldtba + h]) + dt_bias[h]);
            delta_step(S, dk, dv, q + (long)t * dk, k + (long)t * dk, v + (long)t * dv, beta, expf(g),
                       o + (long)t * dv, tmp);
            if (t == P - 1)                                   /* the committed state */
                memcpy((float *)new_states[row] + (long)h * dk * dv, S, sizeof(float) * (size_t)dk * dv);
        }
        if (L > 0) {                                          /* block readout of the end state, mixed */
            float w0 = mix[2 * h], w1 = mix[2 * h + 1];
            for (int t = P; t < T; t++) {
                for (int j = 0; j < dv; j++) ob[j] = 0.0f;
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) ob[j] = ob[j] + q[(long)t * dk + i] * S[(long)i * dv + j];
                for (int j = 0; j < dv; j++) o[(long)t * dv + j] = w0 * o[(long)t * dv + j] + w1 * ob[j];
            }
        }

        /* gated RMSNorm per token: rms_norm(o as bf16) → bf16, × weight in bf16, × SiLU(z) in fp32 → bf16 */
        for (int t = 0; t < T; t++) {
            float *ot = o + (long)t * dv, ss = 0.0f;
            for (int j = 0; j < dv; j++) {
                ot[j] = round_bf16(ot[j]);
                ss = ss + ot[j] * ot[j];
            }
            float r = 1.0f / sqrtf(ss / (float)dv + norm_eps);
            const uint16_t *zr = z + row * ldz + (long)t * ldtz + (long)h * dv;
            uint16_t *dst = out + row * ldo + (long)t * ldto + (long)h * dv;
            for (int j = 0; j < dv; j++) {
                float hn = round_bf16(round_bf16(ot[j] * r) * norm_w[j]);
                dst[j] = f32_to_bf16(hn * silu(bf16_to_f32(zr[j])));
            }
        }
        free(work);
    }
    return failed ? -1 : 0;
}
