/* GGUF's quantized blocks → Clover's stored quantized rows (clover/quantization/format.py), for a
 * GGUF load. clover/gguf/blocks.py is the definition (its PyTorch decoders); tests/test_gguf.py
 * compares the two byte for byte. One pass over the file's bytes, rows in parallel, where the PyTorch
 * decoders take ~10 tensor passes each: they were most of a full-size load's conversion time.
 *
 * Each block is widened to one code per input (u, 0…63) and then packed as the stored form packs it:
 * int8 codes copied, int4 nibble pairs (input 2j low, 2j+1 high), int6 / int5 nibble pairs plus a
 * plane of top bits (row byte K/2 + j: inputs 4j…4j+3 at bits 2i, or 8j…8j+7 at bit i). Scales are the
 * file's own bits: fp16 per group for the legacy types; for the K-quants int8 sub-scale codes with the
 * block's fp16 super-scale (and −dmin as the mins' super-scale, a sign flip). */
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline int finite16(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

/* Clover's int4 bytes for n codes u[0..n) */
static void put_nibbles(uint8_t *dst, const uint8_t *u, int n) {
    for (int j = 0; j < n / 2; j++) dst[j] = (uint8_t)(u[2 * j] | (u[2 * j + 1] << 4));
}

/* Clover's int6 / int5 bytes for n codes at inputs k0…k0+n of a row of K: nibbles, then the top bits */
static void put_wide(uint8_t *row, int K, int bits, int k0, const uint8_t *u, int n) {
    uint8_t low[256];
    for (int i = 0; i < n; i++) low[i] = u[i] & 15;
    put_nibbles(row + k0 / 2, low, n);
    int extra = bits - 4, per = 8 / extra;
    uint8_t *tops = row + K / 2 + k0 / per;
    for (int j = 0; j < n / per; j++) {
        int byte = 0;
        for (int i = 0; i < per; i++) byte |= (u[per * j + i] >> 4) << (extra * i);
        tops[j] = (uint8_t)byte;
    }
}

/* 32 codes from 16 bytes whose low nibbles hold inputs 0…15 and high nibbles 16…31 (+ a fifth bit) */
static void split_nibbles(uint8_t *u, const uint8_t *qs, uint32_t qh, int fifth) {
    for (int i = 0; i < 16; i++) {
        u[i] = (uint8_t)(qs[i] & 15);
        u[16 + i] = (uint8_t)(qs[i] >> 4);
        if (fifth) u[i] |= (uint8_t)(((qh >> i) & 1) << 4), u[16 + i] |= (uint8_t)(((qh >> (16 + i)) & 1) << 4);
    }
}

/* Q4_K / Q5_K's 12 scale bytes → 8 six-bit scale codes and 8 mins */
static void k_scales(const uint8_t *s, int8_t *sc, int8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = (int8_t)(s[j] & 63);
        mn[j] = (int8_t)(s[j + 4] & 63);
        sc[j + 4] = (int8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (int8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* One row of K inputs. q: the stored codes' row; sc/mn: its per-group scales (fp16 bits for the legacy
 * types, int8 codes for the K-quants; mn NULL when the form has none); sup/supm: its fp16 super-scales.
 * Returns 0, or 1 when a block's fp16 scale is infinite or NaN (a corrupt file). */
static int decode_row(int type, const uint8_t *b, int K, uint8_t *q, void *sc, void *mn, uint16_t *sup,
                      uint16_t *supm) {
    uint8_t u[256];
    uint16_t *sc16 = sc, *mn16 = mn;
    int8_t *sc8 = sc, *mn8 = mn;
    int bad = 0;
    switch (type) {
    case Q8_0:
        for (int g = 0; g < K / 32; g++, b += 34) {
            sc16[g] = rd16(b), bad |= !finite16(sc16[g]);
            memcpy(q + 32 * g, b + 2, 32);
        }
        break;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        int mins = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
        int size = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : 24;
        for (int g = 0; g < K / 32; g++, b += size) {
            sc16[g] = rd16(b), bad |= !finite16(sc16[g]);
            if (mins) mn16[g] = rd16(b + 2), bad |= !finite16(mn16[g]);
            const uint8_t *p = b + 2 + 2 * mins;
            uint32_t qh = 0;
            if (five) qh = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24, p += 4;
            split_nibbles(u, p, qh, five);
            if (five) put_wide(q, K, 5, 32 * g, u, 32);
            else put_nibbles(q + 16 * g, u, 32);
        }
        break;
    }
    case Q4_K: case Q5_K:
        for (int s = 0; s < K / 256; s++, b += type == Q4_K ? 144 : 176) {
            sup[s] = rd16(b), supm[s] = rd16(b + 2) ^ 0x8000;      /* mins' super-scale: −dmin */
            bad |= !finite16(sup[s]) | !finite16(supm[s]);
            k_scales(b + 4, sc8 + 8 * s, mn8 + 8 * s);
            const uint8_t *qh = b + 16, *qs = b + (type == Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {                          /* sub-block j: run j/2, low or high nibbles */
                const uint8_t *run = qs + 32 * (j / 2);
                for (int l = 0; l < 32; l++) {
                    uint8_t v = (uint8_t)(j % 2 ? run[l] >> 4 : run[l] & 15);
                    if (type == Q5_K) v |= (uint8_t)(((qh[l] >> j) & 1) << 4);
                    u[32 * j + l] = v;
                }
            }
            if (type == Q4_K) put_nibbles(q + 128 * s, u, 256);
            else put_wide(q, K, 5, 256 * s, u, 256);
        }
        break;
    case Q6_K:
        for (int s = 0; s < K / 256; s++, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            memcpy(sc8 + 16 * s, b + 192, 16);
            sup[s] = rd16(b + 208), bad |= !finite16(sup[s]);
            for (int h = 0; h < 2; h++)            /* halves of 128: quarters from ql's runs, tops from qh */
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < 32; l++) {
                        uint8_t run = ql[64 * h + 32 * (t % 2) + l];
                        u[128 * h + 32 * t + l] = (uint8_t)((t < 2 ? run & 15 : run >> 4)
                                                            | (((qh[32 * h + l] >> (2 * t)) & 3) << 4));
                    }
            put_wide(q, K, 6, 256 * s, u, 256);
        }
        break;
    }
    return bad;
}

/* `rows` whole rows of K inputs from `raw` (row_bytes each) into destination rows dest[r] (NULL:
 * first + r) of the stored tensors: codes (qrow bytes a row), scales and mins (srow elements a row),
 * super-scales and their mins (suprow elements a row). Returns 0; −2 for an unknown type or a K that
 * is not whole blocks; 1 + r for the first row r holding a non-finite scale. */
int clover_gguf_decode(int type, const uint8_t *raw, long row_bytes, long rows, int K, const int64_t *dest,
                       long first, uint8_t *q, long qrow, uint8_t *scales, uint8_t *mins, long srow,
                       uint16_t *supers, uint16_t *super_mins, long suprow, int threads) {
    if (type < Q8_0 || type > Q6_K || K % (type >= Q4_K ? 256 : 32)) return -2;
    long elem = type >= Q4_K ? 1 : 2, bad = -1;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(max: bad)
    for (long r = 0; r < rows; r++) {
        long d = dest ? dest[r] : first + r;
        if (decode_row(type, raw + r * row_bytes, K, q + d * qrow, scales + d * srow * elem,
                       mins ? mins + d * srow * elem : 0, supers ? supers + d * suprow : 0,
                       super_mins ? super_mins + d * suprow : 0) && bad < 0)
            bad = r;
    }
    return bad < 0 ? 0 : (int)(1 + bad);
}

/* fp16 bits → fp32 (exact; subnormals, infinities and NaN kept) */
static float half_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    float f;
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        f = (float)man * 0x1p-24f;             /* a subnormal (or zero): exact in fp32 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* `rows` whole rows straight to values, [rows, K] bf16 (out_bf16) or fp32: what loading's stored form
 * dequantizes to (quantization/format.py `dequantize`, which tests compare with bit for bit): per group
 * s·(u − z), or s·u + m with mins, in fp32 with each product and sum rounded (the build's
 * -ffp-contract=off), then rounded once; a two-level scale is super · code (exact). For a token table
 * left in the file: a lookup's few rows in one call, where the PyTorch path takes ~10 tensor ops a row.
 * Returns as clover_gguf_decode does (0; −2; 1 + r for a row with a non-finite scale). */
int clover_gguf_dequantize(int type, const uint8_t *raw, long row_bytes, long rows, int K, void *out, int out_bf16) {
    if (type < Q8_0 || type > Q6_K || K % (type >= Q4_K ? 256 : 32)) return -2;
    int bits = type == Q8_0 ? 8 : (type == Q4_0 || type == Q4_1 || type == Q4_K) ? 4 : type == Q6_K ? 6 : 5;
    int has_mins = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K;
    int group = type == Q6_K ? 16 : 32, two_level = type >= Q4_K;
    int zero = has_mins || bits == 8 ? 0 : 1 << (bits - 1);
    uint8_t *q = malloc((size_t)K), *sc = malloc((size_t)K / 16 * 2), *mn = malloc((size_t)K / 16 * 2);
    uint16_t *sup = malloc((size_t)K / 256 * 2 + 2), *supm = malloc((size_t)K / 256 * 2 + 2);
    int status = 0;
    if (!q || !sc || !mn || !sup || !supm) status = -3;
    for (long r = 0; r < rows && !status; r++) {
        if (decode_row(type, raw + r * row_bytes, K, q, sc, has_mins ? mn : 0, sup, supm)) {
            status = (int)(1 + r);
            break;
        }
        for (int g = 0; g < K / group; g++) {
            float s, m = 0.0f;
            if (two_level) {
                s = half_value(sup[g * group / 256]) * (float)((int8_t *)sc)[g];
                if (has_mins) m = half_value(supm[g * group / 256]) * (float)((int8_t *)mn)[g];
            } else {
                s = half_value(((uint16_t *)sc)[g]);
                if (has_mins) m = half_value(((uint16_t *)mn)[g]);
            }
            for (int i = 0; i < group; i++) {
                int k = g * group + i, u;
                if (bits == 8) u = (int8_t)q[k];
                else if (bits == 4) u = k % 2 ? q[k / 2] >> 4 : q[k / 2] & 15;
                else {                                  /* int6 / int5: the nibble, then put_wide's top bits */
                    int extra = bits - 4, per = 8 / extra;
                    u = (k % 2 ? q[k / 2] >> 4 : q[k / 2] & 15)
                        | (((q[K / 2 + k / per] >> (extra * (k % per))) & ((1 << extra) - 1)) << 4);
                }
                float w = has_mins ? s * (float)u + m : s * (float)(u - zero);
                if (out_bf16) ((uint16_t *)out)[r * K + k] = f32_to_bf16(w);
                else ((float *)out)[r * K + k] = w;
            }
        }
    }
    free(q), free(sc), free(mn), free(sup), free(supm);
    return status;
}
