/* types.c - ggml type table and the scalar reference conversions. */
#include "moetax/types.h"

#include <math.h>
#include <string.h>
#include <strings.h>

struct type_traits {
    const char *name;
    int64_t blck;
    size_t size;
};

/* ggml's numbering; holes (removed types) have blck 0. */
static const struct type_traits k_traits[MOETAX_TYPE_COUNT] = {
    [MOETAX_TYPE_F32] = {"f32", 1, 4},
    [MOETAX_TYPE_F16] = {"f16", 1, 2},
    [MOETAX_TYPE_Q4_0] = {"q4_0", 32, 18},
    [MOETAX_TYPE_Q4_1] = {"q4_1", 32, 20},
    [MOETAX_TYPE_Q5_0] = {"q5_0", 32, 22},
    [MOETAX_TYPE_Q5_1] = {"q5_1", 32, 24},
    [MOETAX_TYPE_Q8_0] = {"q8_0", 32, 34},
    [MOETAX_TYPE_Q8_1] = {"q8_1", 32, 36},
    [MOETAX_TYPE_Q2_K] = {"q2_k", 256, 84},
    [MOETAX_TYPE_Q3_K] = {"q3_k", 256, 110},
    [MOETAX_TYPE_Q4_K] = {"q4_k", 256, 144},
    [MOETAX_TYPE_Q5_K] = {"q5_k", 256, 176},
    [MOETAX_TYPE_Q6_K] = {"q6_k", 256, 210},
    [MOETAX_TYPE_Q8_K] = {"q8_k", 256, 292},
    [MOETAX_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66},
    [MOETAX_TYPE_IQ2_XS] = {"iq2_xs", 256, 74},
    [MOETAX_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98},
    [MOETAX_TYPE_IQ1_S] = {"iq1_s", 256, 50},
    [MOETAX_TYPE_IQ4_NL] = {"iq4_nl", 32, 18},
    [MOETAX_TYPE_IQ3_S] = {"iq3_s", 256, 110},
    [MOETAX_TYPE_IQ2_S] = {"iq2_s", 256, 82},
    [MOETAX_TYPE_IQ4_XS] = {"iq4_xs", 256, 136},
    [MOETAX_TYPE_I8] = {"i8", 1, 1},
    [MOETAX_TYPE_I16] = {"i16", 1, 2},
    [MOETAX_TYPE_I32] = {"i32", 1, 4},
    [MOETAX_TYPE_I64] = {"i64", 1, 8},
    [MOETAX_TYPE_F64] = {"f64", 1, 8},
    [MOETAX_TYPE_IQ1_M] = {"iq1_m", 256, 56},
    [MOETAX_TYPE_BF16] = {"bf16", 1, 2},
    [MOETAX_TYPE_TQ1_0] = {"tq1_0", 256, 54},
    [MOETAX_TYPE_TQ2_0] = {"tq2_0", 256, 66},
    [MOETAX_TYPE_MXFP4] = {"mxfp4", 32, 17},
};

bool moetax_type_valid(uint32_t t) { return t < MOETAX_TYPE_COUNT && k_traits[t].blck != 0; }

int64_t moetax_type_blck_size(enum moetax_type t) {
    return moetax_type_valid((uint32_t)t) ? k_traits[t].blck : 0;
}

size_t moetax_type_size(enum moetax_type t) {
    return moetax_type_valid((uint32_t)t) ? k_traits[t].size : 0;
}

const char *moetax_type_name(enum moetax_type t) {
    return moetax_type_valid((uint32_t)t) ? k_traits[t].name : "unknown";
}

bool moetax_type_from_name(const char *name, enum moetax_type *out) {
    for (int i = 0; i < MOETAX_TYPE_COUNT; i++) {
        if (k_traits[i].blck && strcasecmp(k_traits[i].name, name) == 0) {
            *out = (enum moetax_type)i;
            return true;
        }
    }
    return false;
}

bool moetax_type_supported(enum moetax_type t) {
    return t == MOETAX_TYPE_F32 || t == MOETAX_TYPE_F16 || t == MOETAX_TYPE_BF16 ||
           t == MOETAX_TYPE_Q8_0 || t == MOETAX_TYPE_Q4_0;
}

size_t moetax_row_size(enum moetax_type t, int64_t n) {
    uint64_t nb;
    if (n == 0) return 0;
    if (moetax_tensor_nbytes(t, 1, &n, &nb, NULL) != MOETAX_NBYTES_OK || nb > SIZE_MAX) return 0;
    return (size_t)nb;
}

enum moetax_nbytes_err moetax_tensor_nbytes(enum moetax_type t, int n_dims, const int64_t *ne, uint64_t *nbytes,
                                            int64_t *nel) {
    if (!moetax_type_valid((uint32_t)t)) return MOETAX_NBYTES_BAD_TYPE;
    const int64_t blck = k_traits[t].blck;
    int64_t count = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] < 1) return MOETAX_NBYTES_BAD_DIM;
        if (__builtin_mul_overflow(count, ne[d], &count)) return MOETAX_NBYTES_OVERFLOW;
    }
    if (n_dims > 0 && ne[0] % blck != 0) return MOETAX_NBYTES_NOT_BLOCKS;
    /* blocks of the first dimension, times the block size, times every other dimension, all checked */
    uint64_t bytes;
    if (__builtin_mul_overflow((uint64_t)(n_dims > 0 ? ne[0] / blck : 1), (uint64_t)k_traits[t].size, &bytes))
        return MOETAX_NBYTES_OVERFLOW;
    for (int d = 1; d < n_dims; d++)
        if (__builtin_mul_overflow(bytes, (uint64_t)ne[d], &bytes)) return MOETAX_NBYTES_OVERFLOW;
    if (bytes > (uint64_t)INT64_MAX) return MOETAX_NBYTES_OVERFLOW;
    *nbytes = bytes;
    if (nel) *nel = count;
    return MOETAX_NBYTES_OK;
}

const char *moetax_nbytes_err_str(enum moetax_nbytes_err e) {
    switch (e) {
    case MOETAX_NBYTES_OK: return "ok";
    case MOETAX_NBYTES_BAD_TYPE: return "unknown tensor type";
    case MOETAX_NBYTES_BAD_DIM: return "a dimension is < 1";
    case MOETAX_NBYTES_NOT_BLOCKS: return "first dimension is not a multiple of the block size";
    case MOETAX_NBYTES_OVERFLOW: return "byte size overflows";
    }
    return "bad size";
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float moetax_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t moetax_fp32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* overflow to inf (>= 65520) */
    if (ax < 0x38800000u) {
        /* subnormal or zero in half: round(|f| * 2^24) with ties to even */
        float af = bits_f32(ax);
        float v = af * 16777216.0f; /* exact scaling */
        uint32_t m = (uint32_t)nearbyintf(v); /* default rounding mode: ties to even */
        return (uint16_t)(sign | m);
    }
    /* normal: rebias exponent, round mantissa to 10 bits, ties to even */
    uint32_t mant = ax & 0x7fffff;
    uint32_t exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

float moetax_bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t moetax_fp32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000u) return (uint16_t)((x >> 16) | 64); /* quiet NaN */
    return (uint16_t)((x + (0x7fff + ((x >> 16) & 1))) >> 16);
}

void moetax_quantize_row_q8_0_ref(const float *x, moetax_block_q8_0 *y, int64_t n) {
    const int64_t nb = n / MOETAX_QK8_0;
    for (int64_t i = 0; i < nb; i++) {
        const float *xb = x + i * MOETAX_QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < MOETAX_QK8_0; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = moetax_fp32_to_fp16(d);
        for (int j = 0; j < MOETAX_QK8_0; j++) y[i].qs[j] = (int8_t)roundf(xb[j] * id);
    }
}

void moetax_dequantize_row_q8_0_ref(const moetax_block_q8_0 *x, float *y, int64_t n) {
    const int64_t nb = n / MOETAX_QK8_0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = moetax_fp16_to_fp32(x[i].d);
        for (int j = 0; j < MOETAX_QK8_0; j++) y[i * MOETAX_QK8_0 + j] = (float)x[i].qs[j] * d;
    }
}

void moetax_quantize_row_q4_0_ref(const float *x, moetax_block_q4_0 *y, int64_t n) {
    const int64_t nb = n / MOETAX_QK4_0;
    for (int64_t i = 0; i < nb; i++) {
        const float *xb = x + i * MOETAX_QK4_0;
        float amax = 0.0f, max = 0.0f; /* max keeps the sign of the largest magnitude */
        for (int j = 0; j < MOETAX_QK4_0; j++) {
            if (amax < fabsf(xb[j])) { amax = fabsf(xb[j]); max = xb[j]; }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = moetax_fp32_to_fp16(d);
        for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
            const float x0 = xb[j] * id;
            const float x1 = xb[j + MOETAX_QK4_0 / 2] * id;
            int q0 = (int)(int8_t)(x0 + 8.5f);
            int q1 = (int)(int8_t)(x1 + 8.5f);
            if (q0 > 15) q0 = 15;
            if (q1 > 15) q1 = 15;
            y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

void moetax_dequantize_row_q4_0_ref(const moetax_block_q4_0 *x, float *y, int64_t n) {
    const int64_t nb = n / MOETAX_QK4_0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = moetax_fp16_to_fp32(x[i].d);
        for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
            y[i * MOETAX_QK4_0 + j] = (float)((x[i].qs[j] & 0x0f) - 8) * d;
            y[i * MOETAX_QK4_0 + j + MOETAX_QK4_0 / 2] = (float)((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

bool moetax_from_float(enum moetax_type t, const float *x, void *y, int64_t n) {
    if (moetax_row_size(t, n) == 0 && n != 0) return false;
    switch (t) {
    case MOETAX_TYPE_F32: memmove(y, x, (size_t)n * 4); return true;
    case MOETAX_TYPE_F16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)y)[i] = moetax_fp32_to_fp16(x[i]);
        return true;
    case MOETAX_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)y)[i] = moetax_fp32_to_bf16(x[i]);
        return true;
    case MOETAX_TYPE_Q8_0: moetax_quantize_row_q8_0_ref(x, y, n); return true;
    case MOETAX_TYPE_Q4_0: moetax_quantize_row_q4_0_ref(x, y, n); return true;
    default: return false;
    }
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* x may be at any address (a tensor of a file with general.alignment 1): every
 * element and block header is read with memcpy, never through a typed pointer. */
bool moetax_to_float(enum moetax_type t, const void *x, float *y, int64_t n) {
    if (moetax_row_size(t, n) == 0 && n != 0) return false;
    const uint8_t *p = x;
    switch (t) {
    case MOETAX_TYPE_F32: memmove(y, x, (size_t)n * 4); return true;
    case MOETAX_TYPE_F16:
        for (int64_t i = 0; i < n; i++) y[i] = moetax_fp16_to_fp32(load_u16(p + 2 * i));
        return true;
    case MOETAX_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) y[i] = moetax_bf16_to_fp32(load_u16(p + 2 * i));
        return true;
    case MOETAX_TYPE_Q8_0:
        for (int64_t b = 0; b < n / MOETAX_QK8_0; b++, p += sizeof(moetax_block_q8_0)) {
            const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q8_0, d)));
            const int8_t *q = (const int8_t *)(p + offsetof(moetax_block_q8_0, qs));
            for (int j = 0; j < MOETAX_QK8_0; j++) y[b * MOETAX_QK8_0 + j] = (float)q[j] * d;
        }
        return true;
    case MOETAX_TYPE_Q4_0:
        for (int64_t b = 0; b < n / MOETAX_QK4_0; b++, p += sizeof(moetax_block_q4_0)) {
            const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q4_0, d)));
            const uint8_t *q = p + offsetof(moetax_block_q4_0, qs);
            for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
                y[b * MOETAX_QK4_0 + j] = (float)((q[j] & 0x0f) - 8) * d;
                y[b * MOETAX_QK4_0 + j + MOETAX_QK4_0 / 2] = (float)((q[j] >> 4) - 8) * d;
            }
        }
        return true;
    default: return false;
    }
}
