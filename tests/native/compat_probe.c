/* Entry points into kernels/avx2_compat.h for tests/test_avx2_compat.py, built with AVX2 flags: each
 * applies one emulated AVX-512 intrinsic to 16-lane inputs so Python can check it against the
 * instruction's definition. */
#include "bf16.h"

void probe_cvtneps_pbh(const float *x, uint16_t *out) {
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
}

float probe_reduce_add(const float *x) { return _mm512_reduce_add_ps(_mm512_loadu_ps(x)); }

void probe_dpbusd(const int32_t *acc, const uint8_t *u, const int8_t *s, int nibbles, int32_t *out) {
    __m512i a = _mm512_loadu_si512(acc), uu = _mm512_loadu_si512(u), ss = _mm512_loadu_si512(s);
    __m512i r = nibbles ? DPBUSD_NIBBLES(a, uu, ss, uu, ss) : _mm512_dpbusd_epi32(a, uu, ss);
    _mm256_storeu_si256((__m256i *)out, r.lo);
    _mm256_storeu_si256((__m256i *)out + 1, r.hi);
}

void probe_exp(const float *x, float *out) { _mm512_storeu_ps(out, exp16(_mm512_loadu_ps(x))); }

void probe_saturate(const int32_t *x, int8_t *out) {
    _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(_mm512_loadu_si512(x)));
}

/* masked load of `n` lanes from the end of a buffer (the rest must not be read), added to 1, stored
 * masked: lanes ≥ n of out keep their values */
void probe_masked(const float *x, int n, float *out) {
    __mmask16 m = lanes(n);
    _mm512_mask_storeu_ps(out, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, x), _mm512_set1_ps(1.0f)));
}

void probe_masked_bf16(const uint16_t *x, int n, uint16_t *out) {
    __mmask16 m = lanes(n);
    store_bf16_16(out, m, load_bf16_16(x, m));
}

/* the int6 kernel's bit moves: 16-bit lane shifts by n (left when n > 0), or, and sign extension */
void probe_shift16(const uint8_t *x, int n, uint8_t *out) {
    __m512i v = _mm512_loadu_si512(x);
    __m512i r = n > 0 ? _mm512_slli_epi16(v, n) : _mm512_srli_epi16(v, -n);
    _mm256_storeu_si256((__m256i *)out, r.lo);
    _mm256_storeu_si256((__m256i *)out + 1, r.hi);
}

void probe_or(const uint8_t *a, const uint8_t *b, uint8_t *out) {
    __m512i r = _mm512_or_si512(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
    _mm256_storeu_si256((__m256i *)out, r.lo);
    _mm256_storeu_si256((__m256i *)out + 1, r.hi);
}

void probe_cvtepi8_epi32(const int8_t *x, int32_t *out) {
    __m512i r = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x));
    _mm256_storeu_si256((__m256i *)out, r.lo);
    _mm256_storeu_si256((__m256i *)out + 1, r.hi);
}
