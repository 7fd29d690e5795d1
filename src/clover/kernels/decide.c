/* Greedy decisions over logits rows: each row's first maximum (optionally never the id `exclude`) and,
 * when asked, its softmax probability — what decoding/unmasking.py's `candidates` computes for greedy
 * rows, in one or two passes over the row instead of a dozen tensor ops with int64 temporaries (a
 * LowConfidence block step at a 248k vocabulary spent ~55 ms in them, a decode step ~1 ms).
 *
 * The token is exact: comparisons do not round, so it equals the reference's. The probability is
 * exp(x[tok] − max) / Σ exp(x − max) in fp32, each row summed in one fixed order (16 lanes, then
 * their sum), so a row's result never depends on the rows beside it or the thread count; it differs
 * from torch.softmax's in the last bits. Rows holding NaN or +inf, or only −inf, are not decided
 * here: they get token −1 and the caller decides them by the reference (which makes such logits safe
 * first). −inf entries (masked ids) are fine. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define SPAN 256        /* the row's maximum is kept per span, so the first maximum is found without a scalar scan */

static inline __m512 load16(const void *row, int bf16, long j, __mmask16 m) {
    return bf16 ? load_bf16_16((const uint16_t *)row + j, m) : _mm512_maskz_loadu_ps(m, (const float *)row + j);
}

static inline float at(const void *row, int bf16, long j) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[j]) : ((const float *)row)[j];
}

/* The row's maximum, the maximum of each SPAN-wide span into `spans`; 1 if a value is NaN or +inf. */
static int row_max(const void *row, int bf16, int V, float *spans, float *max_out) {
    const __m512 floor = _mm512_set1_ps(-FLT_MAX), zero = _mm512_setzero_ps(), none = _mm512_set1_ps(-INFINITY);
    __m512 bad = zero, best = none;
    for (int s = 0; s * SPAN < V; s++) {
        __m512 m = none;
        for (int j = s * SPAN; j < V && j < (s + 1) * SPAN; j += 16) {
            __mmask16 in = lanes(V - j);
            /* lanes past the row's end load 0: made −inf for the maximum (x + 0 = x on the others) */
            __m512 x = _mm512_add_ps(load16(row, bf16, j, in), _mm512_maskz_mov_ps((__mmask16)~in, none));
            m = _mm512_max_ps(m, x);
            /* max(−FLT_MAX, x) is x for NaN (MAXPS returns its second operand then) and finite for −inf:
             * times 0 it is NaN exactly for NaN and +inf */
            bad = _mm512_add_ps(bad, _mm512_mul_ps(_mm512_max_ps(floor, x), zero));
        }
        spans[s] = _mm512_reduce_max_ps(m);
        best = _mm512_max_ps(best, m);
    }
    *max_out = _mm512_reduce_max_ps(best);
    return isnan(_mm512_reduce_add_ps(bad));
}

/* The first j (≠ skip) with x[j] == target, in the first span whose maximum reaches it; -1 if none. */
static long first_equal(const void *row, int bf16, int V, const float *spans, float target, long skip) {
    for (int s = 0; s * SPAN < V; s++) {
        if (spans[s] < target) continue;
        for (long j = (long)s * SPAN; j < V && j < (long)(s + 1) * SPAN; j++)
            if (j != skip && at(row, bf16, j) == target) return j;
    }
    return -1;
}

/* Σ exp(x − max) over the row, in 16 lanes summed in order at the end. */
static float exp_sum(const void *row, int bf16, int V, float max) {
    const __m512 mx = _mm512_set1_ps(max), low = _mm512_set1_ps(-127.0f);   /* e^-127 rounds to 0 in fp32 */
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < V; j += 16) {
        __mmask16 m = lanes(V - j);
        __m512 e = exp16(_mm512_max_ps(_mm512_sub_ps(load16(row, bf16, j, m), mx), low));
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sum);
}

static int decide_row(const void *row, int bf16, int V, long exclude, float *spans, int64_t *token, float *confidence) {
    float max;
    if (row_max(row, bf16, V, spans, &max) || max == -INFINITY) return 1;
    long tok = first_equal(row, bf16, V, spans, max, -1);
    if (tok == exclude) {            /* the best other id: its maximum, then its first occurrence */
        float other = -INFINITY;
        for (int s = 0; s * SPAN < V; s++) {
            float m = -INFINITY;
            for (long j = (long)s * SPAN; j < V && j < (long)(s + 1) * SPAN; j++) {
                float x = j == exclude ? -INFINITY : at(row, bf16, j);
                m = x > m ? x : m;
            }
            spans[s] = m;
            other = m > other ? m : other;
        }
        /* every other id −inf: the reference's first argmax of an all −inf row, id 0 */
        tok = other == -INFINITY ? 0 : first_equal(row, bf16, V, spans, other, exclude);
    }
    *token = tok;
    if (confidence) {
        float e = _mm512_reduce_max_ps(exp16(_mm512_set1_ps(fmaxf(at(row, bf16, tok) - max, -127.0f))));
        *confidence = e / exp_sum(row, bf16, V, max);
    }
    return 0;
}

/* M rows of V logits (fp32, or bf16 when `bf16`), row r at x + r·ldx elements → tokens[M] and, when
 * `confidence` is not NULL, confidence[M]. `exclude` < 0: none. A row not decided here (see above)
 * gets token −1. Returns how many rows did. Rows are shared among `threads` threads. */
int clover_greedy(int M, int V, const void *x, long ldx, int bf16, long exclude, int64_t *tokens, float *confidence,
                  int threads) {
    int undecided = 0;
#pragma omp parallel num_threads(M > 1 ? threads : 1) reduction(+:undecided)
    {
        float spans[(V + SPAN - 1) / SPAN];
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++) {
            const void *row = bf16 ? (const void *)((const uint16_t *)x + (long)r * ldx)
                                   : (const void *)((const float *)x + (long)r * ldx);
            if (decide_row(row, bf16, V, exclude, spans, tokens + r, confidence ? confidence + r : NULL)) {
                tokens[r] = -1;
                undecided++;
            }
        }
    }
    return undecided;
}
