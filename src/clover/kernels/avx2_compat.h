/* The AVX-512 intrinsics the kernels use, on pairs of AVX2 vectors, so the same sources build for
 * CPUs without AVX-512 (AMD Zen 2/3, Intel client cores) — most of the machines CPU users run
 * llama.cpp on. bf16.h includes this only when the compiler is not targeting AVX-512
 * (clover/kernels/build.py compiles the sources once per instruction set); the AVX-512 build never
 * sees it.
 *
 * A 512-bit vector becomes a struct of two 256-bit halves (lanes 0–7, 8–15) and each intrinsic does
 * the same arithmetic on both: fused multiply-adds, conversions and the horizontal sums (in GCC's
 * order) give the AVX-512 build's results bit for bit. The exceptions are stated where they occur:
 * `_mm512_scalef_ps` may round a denormal result twice, and `vdpbf16ps` has no equivalent (the pair
 * kernels are not built; bf16 inputs take the FMA kernels). Masked loads and stores never touch
 * masked-off memory, like the originals. VNNI's `vpdpbusd` is emulated exactly by 16-bit
 * multiply-adds of the even and odd bytes (`vpmaddwd` twice): no saturation, unlike `vpmaddubsw`. */
#ifndef CLOVER_AVX2_COMPAT_H
#define CLOVER_AVX2_COMPAT_H
#include <immintrin.h>
#include <stdint.h>

typedef struct { __m256 lo, hi; } clv_m512;
typedef struct { __m256i lo, hi; } clv_m512i;
typedef uint16_t clv_mmask16;
#define __m512 clv_m512
#define __m512i clv_m512i
#define __mmask16 clv_mmask16

#define CLV_F(name) static inline __m512 name
#define CLV_I(name) static inline __m512i name

/* eight lanes of an int32 mask vector from eight mask bits */
static inline __m256i clv_mask8(unsigned bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
}

CLV_F(clv_setzero_ps)(void) { return (__m512){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
CLV_F(clv_set1_ps)(float x) { return (__m512){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
CLV_F(clv_add_ps)(__m512 a, __m512 b) { return (__m512){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
CLV_F(clv_sub_ps)(__m512 a, __m512 b) { return (__m512){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
CLV_F(clv_mul_ps)(__m512 a, __m512 b) { return (__m512){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
CLV_F(clv_div_ps)(__m512 a, __m512 b) { return (__m512){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
CLV_F(clv_max_ps)(__m512 a, __m512 b) { return (__m512){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
CLV_F(clv_and_ps)(__m512 a, __m512 b) { return (__m512){_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
CLV_F(clv_fmadd_ps)(__m512 a, __m512 b, __m512 c) {
    return (__m512){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
CLV_F(clv_fnmadd_ps)(__m512 a, __m512 b, __m512 c) {
    return (__m512){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
CLV_F(clv_loadu_ps)(const void *p) { return (__m512){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)}; }
static inline void clv_storeu_ps(void *p, __m512 x) {
    _mm256_storeu_ps((float *)p, x.lo);
    _mm256_storeu_ps((float *)p + 8, x.hi);
}
static inline void clv_stream_ps(void *p, __m512 x) {
    _mm256_stream_ps((float *)p, x.lo);
    _mm256_stream_ps((float *)p + 8, x.hi);
}
CLV_F(clv_maskz_loadu_ps)(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return clv_loadu_ps(p);
    return (__m512){_mm256_maskload_ps((const float *)p, clv_mask8(m & 0xFF)),
                    _mm256_maskload_ps((const float *)p + 8, clv_mask8(m >> 8))};
}
static inline void clv_mask_storeu_ps(void *p, __mmask16 m, __m512 x) {
    if (m == 0xFFFF) {
        clv_storeu_ps(p, x);
        return;
    }
    _mm256_maskstore_ps((float *)p, clv_mask8(m & 0xFF), x.lo);
    _mm256_maskstore_ps((float *)p + 8, clv_mask8(m >> 8), x.hi);
}
CLV_F(clv_maskz_mov_ps)(__mmask16 m, __m512 x) {
    return (__m512){_mm256_and_ps(x.lo, _mm256_castsi256_ps(clv_mask8(m & 0xFF))),
                    _mm256_and_ps(x.hi, _mm256_castsi256_ps(clv_mask8(m >> 8)))};
}
/* GCC's order: halves added, then quarters, then pairs */
static inline float clv_reduce_add_ps(__m512 a) {
    __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
static inline float clv_reduce_max_ps(__m512 a) {
    __m256 t3 = _mm256_max_ps(a.hi, a.lo);
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    float x = _mm_cvtss_f32(t8), y = _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
    return x > y ? x : y;
}
CLV_F(clv_roundscale_ps)(__m512 x, int imm) {
    (void)imm;     /* the kernels only round to the nearest integer */
    return (__m512){_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                    _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* 2^n for integral n in [-126, 127], as a float */
static inline __m256 clv_pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
/* a · 2^floor(b), in two exact power-of-two steps (the second rounds when the result is denormal) */
static inline __m256 clv_scalef8(__m256 a, __m256 b) {
    __m256 n = _mm256_floor_ps(_mm256_max_ps(_mm256_min_ps(b, _mm256_set1_ps(254.0f)), _mm256_set1_ps(-252.0f)));
    __m256 n1 = _mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-126.0f));
    return _mm256_mul_ps(_mm256_mul_ps(a, clv_pow2(n1)), clv_pow2(_mm256_sub_ps(n, n1)));
}
CLV_F(clv_scalef_ps)(__m512 a, __m512 b) { return (__m512){clv_scalef8(a.lo, b.lo), clv_scalef8(a.hi, b.hi)}; }

/* integers */
CLV_I(clv_setzero_si512)(void) { return (__m512i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
CLV_I(clv_set1_epi32)(int x) { return (__m512i){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
CLV_I(clv_set1_epi8)(char x) { return (__m512i){_mm256_set1_epi8(x), _mm256_set1_epi8(x)}; }
CLV_I(clv_loadu_si512)(const void *p) {
    return (__m512i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
CLV_I(clv_and_si512)(__m512i a, __m512i b) { return (__m512i){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
CLV_I(clv_add_epi32)(__m512i a, __m512i b) { return (__m512i){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
CLV_I(clv_slli_epi32)(__m512i a, int n) { return (__m512i){_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
CLV_I(clv_srli_epi16)(__m512i a, int n) { return (__m512i){_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
CLV_I(clv_slli_epi16)(__m512i a, int n) { return (__m512i){_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
CLV_I(clv_or_si512)(__m512i a, __m512i b) { return (__m512i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline int clv_reduce_add_epi32(__m512i a) {
    __m256i t3 = _mm256_add_epi32(a.hi, a.lo);
    __m128i t6 = _mm_add_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
    __m128i t8 = _mm_add_epi32(t6, _mm_shuffle_epi32(t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(t8) + _mm_extract_epi32(t8, 1);
}
/* Σ over each 32-bit lane's four bytes of unsigned u · signed s, added to acc, exactly */
static inline __m256i clv_dpbusd8(__m256i acc, __m256i u, __m256i s) {
    __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
    __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
CLV_I(clv_dpbusd_epi32)(__m512i acc, __m512i u, __m512i s) {
    return (__m512i){clv_dpbusd8(acc.lo, u.lo, s.lo), clv_dpbusd8(acc.hi, u.hi, s.hi)};
}
/* Two such sums where every u is below 64 (int4 and int6 codes) and every s above −128 (the kernels'
 * input codes): `vpmaddubsw` sums byte pairs into 16 bits without saturating (each pair within
 * ±2·63·127, both sums within ±32004), `vpmaddwd` by ones sums those into the 32-bit lanes — five
 * instructions where the general form takes fourteen */
static inline __m256i clv_dpbusd_nibbles8(__m256i acc, __m256i u, __m256i s, __m256i v, __m256i t) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
CLV_I(clv_dpbusd_nibbles_epi32)(__m512i acc, __m512i u, __m512i s, __m512i v, __m512i t) {
    return (__m512i){clv_dpbusd_nibbles8(acc.lo, u.lo, s.lo, v.lo, t.lo), clv_dpbusd_nibbles8(acc.hi, u.hi, s.hi, v.hi, t.hi)};
}
#define DPBUSD_NIBBLES clv_dpbusd_nibbles_epi32

/* conversions */
static inline __m512 clv_castsi512_ps(__m512i a) { return (__m512){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
CLV_F(clv_cvtepi32_ps)(__m512i a) { return (__m512){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
CLV_I(clv_cvtps_epi32)(__m512 a) { return (__m512i){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
CLV_I(clv_cvtepu16_epi32)(__m256i a) {
    return (__m512i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
CLV_I(clv_cvtepi8_epi32)(__m128i a) {
    return (__m512i){_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))};
}
CLV_F(clv_cvtph_ps)(__m256i h) {
    return (__m512){_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
/* 16 int32 lanes to int8 with signed saturation (two saturating packs compose to one) */
static inline __m128i clv_cvtsepi32_epi8(__m512i a) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), _MM_SHUFFLE(3, 1, 2, 0));
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
/* fp32 to bf16 as vcvtneps2bf16 does: NaN stays a quiet NaN, denormals become a signed zero, the rest
 * rounds to nearest even; the eight results in the low 16 bits of each lane */
static inline __m256i clv_bf16_bits8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i exponent = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    __m256i zero = _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u)), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    __m256i out = _mm256_blendv_epi8(rounded, zero, _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
    return _mm256_blendv_epi8(out, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
static inline __m256i clv_cvtneps_pbh(__m512 x) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(clv_bf16_bits8(x.lo), clv_bf16_bits8(x.hi)), _MM_SHUFFLE(3, 1, 2, 0));
}

/* 16-bit masked loads and stores of 256 bits (AVX-512 BW/VL): whole vectors directly, tails lane by lane */
static inline __m256i clv_maskz_loadu_epi16(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t tmp[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) tmp[i] = ((const uint16_t *)p)[i];
    return _mm256_loadu_si256((const __m256i *)tmp);
}
static inline void clv_mask_storeu_epi16(void *p, __mmask16 m, __m256i x) {
    if (m == 0xFFFF) {
        _mm256_storeu_si256((__m256i *)p, x);
        return;
    }
    uint16_t tmp[16];
    _mm256_storeu_si256((__m256i *)tmp, x);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((uint16_t *)p)[i] = tmp[i];
}

#define _mm512_setzero_ps clv_setzero_ps
#define _mm512_set1_ps clv_set1_ps
#define _mm512_add_ps clv_add_ps
#define _mm512_sub_ps clv_sub_ps
#define _mm512_mul_ps clv_mul_ps
#define _mm512_div_ps clv_div_ps
#define _mm512_max_ps clv_max_ps
#define _mm512_and_ps clv_and_ps
#define _mm512_fmadd_ps clv_fmadd_ps
#define _mm512_fnmadd_ps clv_fnmadd_ps
#define _mm512_loadu_ps clv_loadu_ps
#define _mm512_storeu_ps clv_storeu_ps
#define _mm512_stream_ps clv_stream_ps
#define _mm512_maskz_loadu_ps clv_maskz_loadu_ps
#define _mm512_mask_storeu_ps clv_mask_storeu_ps
#define _mm512_maskz_mov_ps clv_maskz_mov_ps
#define _mm512_reduce_add_ps clv_reduce_add_ps
#define _mm512_reduce_max_ps clv_reduce_max_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps clv_roundscale_ps
#define _mm512_scalef_ps clv_scalef_ps
#define _mm512_setzero_si512 clv_setzero_si512
#define _mm512_set1_epi32 clv_set1_epi32
#define _mm512_set1_epi8 clv_set1_epi8
#define _mm512_loadu_si512 clv_loadu_si512
#define _mm512_and_si512 clv_and_si512
#define _mm512_add_epi32 clv_add_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 clv_slli_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 clv_srli_epi16
#define _mm512_slli_epi16 clv_slli_epi16
#define _mm512_or_si512 clv_or_si512
#define _mm512_cvtepi8_epi32 clv_cvtepi8_epi32
#define _mm512_reduce_add_epi32 clv_reduce_add_epi32
#define _mm512_dpbusd_epi32 clv_dpbusd_epi32
#define _mm512_castsi512_ps clv_castsi512_ps
#define _mm512_cvtepi32_ps clv_cvtepi32_ps
#define _mm512_cvtps_epi32 clv_cvtps_epi32
#define _mm512_cvtepu16_epi32 clv_cvtepu16_epi32
#define _mm512_cvtph_ps clv_cvtph_ps
#define _mm512_cvtsepi32_epi8 clv_cvtsepi32_epi8
#define _mm512_cvtneps_pbh clv_cvtneps_pbh
#define _mm256_maskz_loadu_epi16 clv_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 clv_mask_storeu_epi16

#endif
