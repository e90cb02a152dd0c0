/* types.c - ggml type table and the scalar reference conversions. */
#include "moetax/types.h"

#include <float.h>
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

bool moetax_type_is_kquant(enum moetax_type t) {
    return t == MOETAX_TYPE_Q2_K || t == MOETAX_TYPE_Q3_K || t == MOETAX_TYPE_Q4_K || t == MOETAX_TYPE_Q5_K ||
           t == MOETAX_TYPE_Q6_K;
}

bool moetax_type_supported(enum moetax_type t) {
    return t == MOETAX_TYPE_F32 || t == MOETAX_TYPE_F16 || t == MOETAX_TYPE_BF16 ||
           t == MOETAX_TYPE_Q8_0 || t == MOETAX_TYPE_Q4_0 || t == MOETAX_TYPE_Q5_0 || t == MOETAX_TYPE_IQ4_NL ||
           t == MOETAX_TYPE_Q4_1 || t == MOETAX_TYPE_Q5_1 ||
           t == MOETAX_TYPE_Q2_K || t == MOETAX_TYPE_Q3_K ||
           t == MOETAX_TYPE_Q4_K || t == MOETAX_TYPE_Q5_K || t == MOETAX_TYPE_Q6_K;
}

enum moetax_type moetax_type_fit(enum moetax_type t, int64_t ne0) {
    const int64_t bs = moetax_type_blck_size(t);
    if (bs > 0 && ne0 % bs == 0) return t;
    if (bs == 256 && ne0 % 32 == 0)
        return t == MOETAX_TYPE_Q4_K                              ? MOETAX_TYPE_Q5_0
             : t == MOETAX_TYPE_Q5_K                              ? MOETAX_TYPE_Q5_1
                                                                  : MOETAX_TYPE_Q8_0;
    return MOETAX_TYPE_F16;
}

uint32_t moetax_type_llama_ftype(enum moetax_type t) {
    switch (t) {
    case MOETAX_TYPE_F32: return 0;
    case MOETAX_TYPE_F16: return 1;
    case MOETAX_TYPE_Q4_0: return 2;
    case MOETAX_TYPE_Q8_0: return 7;
    case MOETAX_TYPE_Q5_0: return 8;
    case MOETAX_TYPE_Q4_1: return 3;
    case MOETAX_TYPE_Q5_1: return 9;
    case MOETAX_TYPE_IQ4_NL: return 25;
    case MOETAX_TYPE_Q2_K: return 10;
    case MOETAX_TYPE_Q3_K: return 12;
    case MOETAX_TYPE_Q4_K: return 15;
    case MOETAX_TYPE_Q5_K: return 17;
    case MOETAX_TYPE_Q6_K: return 18;
    default: return 32; /* BF16 */
    }
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

int8_t moetax_q8_round(float v) {
    if (v != v) return 0;
    const float r = roundf(v);
    return r >= 127.0f ? 127 : r <= -128.0f ? -128 : (int8_t)r;
}

int64_t moetax_nonfinite_at(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return -1;
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
        for (int j = 0; j < MOETAX_QK8_0; j++) y[i].qs[j] = moetax_q8_round(xb[j] * id);
    }
}

void moetax_dequantize_row_q8_0_ref(const moetax_block_q8_0 *x, float *y, int64_t n) {
    const int64_t nb = n / MOETAX_QK8_0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = moetax_fp16_to_fp32(x[i].d);
        for (int j = 0; j < MOETAX_QK8_0; j++) y[i * MOETAX_QK8_0 + j] = (float)x[i].qs[j] * d;
    }
}

/* Q4_0 (half 8) and Q5_0 (half 16), ggml's reference: d = (the value of largest magnitude, the
 * first of equals) / -half, q = min(2 half - 1, trunc(x / d + half + 0.5)); returns d. */
static float quantize_block_x_0(const float *xb, int half, int q[MOETAX_QK4_0]) {
    float amax = 0.0f, max = 0.0f; /* max keeps the sign of the largest magnitude */
    for (int j = 0; j < MOETAX_QK4_0; j++) {
        if (amax < fabsf(xb[j])) { amax = fabsf(xb[j]); max = xb[j]; }
    }
    const float d = max / -(float)half;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const float bias = (float)half + 0.5f;
    for (int j = 0; j < MOETAX_QK4_0; j++) {
        const float v = xb[j] * id;
        const int qj = (int)(int8_t)(v + bias);
        q[j] = qj > 2 * half - 1 ? 2 * half - 1 : qj;
    }
    return d;
}

void moetax_quantize_row_q4_0_ref(const float *x, moetax_block_q4_0 *y, int64_t n) {
    for (int64_t i = 0; i < n / MOETAX_QK4_0; i++) {
        int q[MOETAX_QK4_0];
        y[i].d = moetax_fp32_to_fp16(quantize_block_x_0(x + i * MOETAX_QK4_0, 8, q));
        for (int j = 0; j < MOETAX_QK4_0 / 2; j++) y[i].qs[j] = (uint8_t)(q[j] | (q[j + MOETAX_QK4_0 / 2] << 4));
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

void moetax_quantize_row_q5_0_ref(const float *x, moetax_block_q5_0 *y, int64_t n) {
    for (int64_t i = 0; i < n / MOETAX_QK4_0; i++) {
        int q[MOETAX_QK4_0];
        y[i].d = moetax_fp32_to_fp16(quantize_block_x_0(x + i * MOETAX_QK4_0, 16, q));
        uint32_t qh = 0;
        for (int j = 0; j < MOETAX_QK4_0; j++) qh |= (uint32_t)(q[j] >> 4 & 1) << j;
        for (int j = 0; j < MOETAX_QK4_0 / 2; j++)
            y[i].qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + MOETAX_QK4_0 / 2] & 0x0f) << 4));
        for (int b = 0; b < 4; b++) y[i].qh[b] = (uint8_t)(qh >> (8 * b));
    }
}

/* Q4_1 (bits 4) and Q5_1 (bits 5): the block's min and (max - min) / (2^bits - 1); the nibbles
 * to qs, Q5_1's fifth bits to qh (NULL for Q4_1). */
static void quantize_block_x_1(const float *xb, int bits, uint16_t *d_out, uint16_t *m_out, uint8_t *qs, uint8_t *qh4) {
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < MOETAX_QK4_0; j++) {
        if (xb[j] < min) min = xb[j];
        if (xb[j] > max) max = xb[j];
    }
    const float d = (max - min) / (float)((1 << bits) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_out = moetax_fp32_to_fp16(d);
    *m_out = moetax_fp32_to_fp16(min);
    uint32_t qh = 0;
    for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
        const float x0 = (xb[j] - min) * id;
        const float x1 = (xb[j + MOETAX_QK4_0 / 2] - min) * id;
        int q0, q1;
        if (bits == 4) {
            q0 = (int)(int8_t)(x0 + 0.5f);
            q1 = (int)(int8_t)(x1 + 0.5f);
            if (q0 > 15) q0 = 15;
            if (q1 > 15) q1 = 15;
        } else {
            q0 = (int)(uint8_t)(x0 + 0.5f);
            q1 = (int)(uint8_t)(x1 + 0.5f);
        }
        qs[j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
        qh |= (uint32_t)(q0 >> 4 & 1) << j;
        qh |= (uint32_t)(q1 >> 4 & 1) << (j + MOETAX_QK4_0 / 2);
    }
    if (qh4)
        for (int b = 0; b < 4; b++) qh4[b] = (uint8_t)(qh >> (8 * b));
}

void moetax_quantize_row_q4_1_ref(const float *x, moetax_block_q4_1 *y, int64_t n) {
    for (int64_t i = 0; i < n / MOETAX_QK4_0; i++)
        quantize_block_x_1(x + i * MOETAX_QK4_0, 4, &y[i].d, &y[i].m, y[i].qs, NULL);
}

void moetax_quantize_row_q5_1_ref(const float *x, moetax_block_q5_1 *y, int64_t n) {
    for (int64_t i = 0; i < n / MOETAX_QK4_0; i++)
        quantize_block_x_1(x + i * MOETAX_QK4_0, 5, &y[i].d, &y[i].m, y[i].qs, y[i].qh);
}

const int8_t moetax_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
/* A little-endian uint32 (Q5_0 / Q5_1's qh) at any address. */
static inline uint32_t load_le32(const uint8_t *h) { return (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24; }

/* ---- k-quants: ggml's reference algorithms (ggml-quants.c), re-derived ----
 * Float expressions keep ggml's operation order so the bytes match. */

#define KQ_GROUP_MAX_EPS 1e-15f

/* ggml's nearest_int: round to nearest, ties to even, via the 1.5 * 2^23 trick (|f| < 2^22). */
static inline int kq_nearest_int(float f) {
    float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int kq_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* make_qkx2_quants: an asymmetric (scale, min) fit of n values to 0..nmax, weighted, trying
 * nstep + 1 candidate scales around nmax / (max - min); the error is weighted squares, or
 * weighted absolute values with use_mad (Q2_K). Returns the scale; *the_min = -min. */
static float kq_make_qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                          uint8_t *Laux, float rmin, float rdelta, int nstep, bool use_mad) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *the_min = -min;
        return 0.0f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
        L[i] = (uint8_t)l;
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += w[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp(kq_nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += w[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* The 8 (scale, min) pairs of a Q4_K/Q5_K super-block: quantize them to 6 bits against the
 * largest of each, pack into scales[12], set d and dmin; then the values' levels L[256] in 0..nmax
 * against the stored scales. Q4_K: nmax 15, rmin -1, 20 steps; Q5_K: 31, -0.5, 15. */
static void kq_scales_mins(const float *x, int nmax, float rmin, int nstep, uint8_t scales_out[12], uint16_t *d_out, uint16_t *dmin_out,
                           uint8_t *L) {
    uint8_t Laux[32];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = kq_make_qkx2(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f, nstep, false);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(scales_out, 0, 12);
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)kq_nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)kq_nearest_int(inv_min * mins[j]);
        if (ls > 63) ls = 63;
        if (lm > 63) lm = 63;
        if (j < 4) {
            scales_out[j] = ls;
            scales_out[j + 4] = lm;
        } else {
            scales_out[j + 4] = (uint8_t)((ls & 0xf) | ((lm & 0xf) << 4));
            scales_out[j - 4] |= (uint8_t)((ls >> 4) << 6);
            scales_out[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *d_out = moetax_fp32_to_fp16(max_scale / 63.f);
    *dmin_out = moetax_fp32_to_fp16(max_min / 63.f);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        moetax_q4k_scale_min(j, scales_out, &sc, &m);
        const float d = moetax_fp16_to_fp32(*d_out) * sc;
        if (!d) continue;
        const float dm = moetax_fp16_to_fp32(*dmin_out) * m;
        for (int ii = 0; ii < 32; ii++) L[32 * j + ii] = (uint8_t)kq_clamp(kq_nearest_int((x[32 * j + ii] + dm) / d), 0, nmax);
    }
}

void moetax_quantize_row_q4_k_ref(const float *x, moetax_block_q4_k *y, int64_t n) {
    uint8_t L[MOETAX_QK_K];
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        kq_scales_mins(x, 15, -1.0f, 20, y[i].scales, &y[i].d, &y[i].dmin, L);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) y[i].qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    }
}

void moetax_quantize_row_q5_k_ref(const float *x, moetax_block_q5_k *y, int64_t n) {
    uint8_t L[MOETAX_QK_K];
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        kq_scales_mins(x, 31, -0.5f, 15, y[i].scales, &y[i].d, &y[i].dmin, L);
        memset(y[i].qh, 0, sizeof y[i].qh);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                int l1 = L[64 * c + l], l2 = L[64 * c + 32 + l];
                if (l1 > 15) { l1 -= 16; y[i].qh[l] |= (uint8_t)(1u << (2 * c)); }
                if (l2 > 15) { l2 -= 16; y[i].qh[l] |= (uint8_t)(1u << (2 * c + 1)); }
                y[i].qs[32 * c + l] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

/* The value of largest magnitude of x[0..n) (the first of ties) into *max; false, with L all
 * zero, when every value is below KQ_GROUP_MAX_EPS (the fits below start from it). */
static bool kq_signed_max(int n, const float *x, int8_t *L, float *max) {
    float amax = 0;
    *max = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; *max = x[i]; }
    }
    if (amax < KQ_GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return false;
    }
    return true;
}

/* make_qx_quants with rmse_type 1 and no importance weights: a symmetric fit of n values to
 * -nmax..nmax-1 (stored + nmax), weights x^2, trying 18 scales around -nmax / max. */
static float kq_make_qx(int n, int nmax, const float *x, int8_t *L) {
    float max;
    if (!kq_signed_max(n, x, L, &max)) return 0.f;
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

void moetax_quantize_row_q6_k_ref(const float *x, moetax_block_q6_k *y, int64_t n) {
    int8_t L[MOETAX_QK_K];
    float scales[16];
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            const float scale = kq_make_qx(16, 32, x + 16 * ib, L + 16 * ib);
            scales[ib] = scale;
            if (fabsf(scale) > max_abs_scale) { max_abs_scale = fabsf(scale); max_scale = scale; }
        }
        if (max_abs_scale < KQ_GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float iscale = -128.f / max_scale;
        y[i].d = moetax_fp32_to_fp16(1 / iscale);
        for (int ib = 0; ib < 16; ib++) {
            int v = kq_nearest_int(iscale * scales[ib]);
            y[i].scales[ib] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            float d = moetax_fp16_to_fp32(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++) L[16 * j + ii] = (int8_t)(kq_clamp(kq_nearest_int(x[16 * j + ii] / d), -32, 31) + 32);
        }
        for (int h = 0; h < 2; h++) {
            const int8_t *Lh = L + 128 * h;
            uint8_t *ql = y[i].ql + 64 * h, *qh = y[i].qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((Lh[l] & 0xf) | ((Lh[l + 64] & 0xf) << 4));
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xf) | ((Lh[l + 96] & 0xf) << 4));
                qh[l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
            }
        }
    }
}

/* Q2_K: each 16 values' (scale, min) by make_qkx2_quants (weights |x|, levels 0..3, absolute
 * error), both quantized to 4 bits against the largest of each, then the levels again against
 * the stored scales. */
void moetax_quantize_row_q2_k_ref(const float *x, moetax_block_q2_k *y, int64_t n) {
    uint8_t L[MOETAX_QK_K], Laux[16];
    float weights[16], mins[16], scales[16];
    const float q4scale = 15.f;
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            for (int l = 0; l < 16; l++) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = kq_make_qkx2(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f, 15, true);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = q4scale / max_scale;
            for (int j = 0; j < 16; j++) y[i].scales[j] = (uint8_t)kq_nearest_int(iscale * scales[j]);
            y[i].d = moetax_fp32_to_fp16(max_scale / q4scale);
        } else {
            memset(y[i].scales, 0, sizeof y[i].scales);
            y[i].d = moetax_fp32_to_fp16(0.f);
        }
        if (max_min > 0) {
            const float iscale = q4scale / max_min;
            for (int j = 0; j < 16; j++) y[i].scales[j] |= (uint8_t)(kq_nearest_int(iscale * mins[j]) << 4);
            y[i].dmin = moetax_fp32_to_fp16(max_min / q4scale);
        } else {
            y[i].dmin = moetax_fp32_to_fp16(0.f);
        }
        for (int j = 0; j < 16; j++) {
            const float d = moetax_fp16_to_fp32(y[i].d) * (y[i].scales[j] & 0xf);
            if (!d) continue;
            const float dm = moetax_fp16_to_fp32(y[i].dmin) * (y[i].scales[j] >> 4);
            for (int ii = 0; ii < 16; ii++) L[16 * j + ii] = (uint8_t)kq_clamp(kq_nearest_int((x[16 * j + ii] + dm) / d), 0, 3);
        }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *Lh = L + 128 * h;
                y[i].qs[32 * h + l] = (uint8_t)(Lh[l] | (Lh[l + 32] << 2) | (Lh[l + 64] << 4) | (Lh[l + 96] << 6));
            }
    }
}

/* make_q3_quants with do_rmse: a symmetric fit of n values to -nmax..nmax-1 (returned + nmax),
 * weights x^2, then up to 5 passes moving single levels while that improves sumlx^2 / suml2. */
static float kq_make_q3(int n, int nmax, const float *x, int8_t *L) {
    float max;
    if (!kq_signed_max(n, x, L, &max)) return 0.f;
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp(kq_nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = kq_clamp(kq_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Q3_K: each 16 values' scale by make_q3_quants, the scales quantized to 6 bits (-32..31)
 * against the one of largest magnitude, then the levels (-4..3) against the stored scales;
 * the levels' bit 2 goes to hmask (value v: bit v/32 of hmask[v%32]), bits 0-1 to qs. */
void moetax_quantize_row_q3_k_ref(const float *x, moetax_block_q3_k *y, int64_t n) {
    int8_t L[MOETAX_QK_K];
    float scales[16];
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = kq_make_q3(16, 4, x + 16 * j, L + 16 * j);
            const float scale = fabsf(scales[j]);
            if (scale > amax) { amax = scale; max_scale = scales[j]; }
        }
        memset(y[i].scales, 0, 12);
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; j++) {
                int8_t l = (int8_t)kq_nearest_int(iscale * scales[j]);
                l = (int8_t)(kq_clamp(l, -32, 31) + 32);
                if (j < 8) y[i].scales[j] = (uint8_t)(l & 0xf);
                else y[i].scales[j - 8] |= (uint8_t)((l & 0xf) << 4);
                l = (int8_t)(l >> 4);
                y[i].scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
            }
            y[i].d = moetax_fp32_to_fp16(1 / iscale);
        } else {
            y[i].d = moetax_fp32_to_fp16(0.f);
        }
        uint8_t s6[16];
        moetax_q3k_scales(y[i].scales, s6);
        for (int j = 0; j < 16; j++) {
            const float d = moetax_fp16_to_fp32(y[i].d) * (int8_t)(s6[j] - 32);
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++) L[16 * j + ii] = (int8_t)(kq_clamp(kq_nearest_int(x[16 * j + ii] / d), -4, 3) + 4);
        }
        memset(y[i].hmask, 0, sizeof y[i].hmask);
        for (int v = 0; v < MOETAX_QK_K; v++)
            if (L[v] > 3) {
                y[i].hmask[v % 32] |= (uint8_t)(1u << (v / 32));
                L[v] = (int8_t)(L[v] - 4);
            }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int8_t *Lh = L + 128 * h;
                y[i].qs[32 * h + l] = (uint8_t)(Lh[l] | (Lh[l + 32] << 2) | (Lh[l + 64] << 4) | (Lh[l + 96] << 6));
            }
    }
}

void moetax_quantize_row_q8_k_ref(const float *x, moetax_block_q8_k *y, int64_t n) {
    for (int64_t i = 0; i < n / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        float max = 0, amax = 0;
        for (int j = 0; j < MOETAX_QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < MOETAX_QK_K; j++) {
            int v = kq_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int ii = 0; ii < 16; ii++) sum += y[i].qs[16 * j + ii];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

/* Dequantize one block of each k-quant from possibly unaligned bytes p into y[256]. */
static void kq_dequant_q2k(const uint8_t *p, float *y) {
    const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q2_k, d)));
    const float dmin = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q2_k, dmin)));
    const uint8_t *sc = p, *qs = p + offsetof(moetax_block_q2_k, qs);
    for (int v = 0; v < MOETAX_QK_K; v++) {
        const int h = v / 128, k = (v % 128) / 32, l = v % 32, s = sc[v / 16];
        const float dl = d * (s & 0xf), ml = dmin * (s >> 4);
        y[v] = dl * ((qs[32 * h + l] >> (2 * k)) & 3) - ml;
    }
}

static void kq_dequant_q3k(const uint8_t *p, float *y) {
    const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q3_k, d)));
    const uint8_t *hm = p, *qs = p + offsetof(moetax_block_q3_k, qs);
    uint8_t s6[16];
    moetax_q3k_scales(p + offsetof(moetax_block_q3_k, scales), s6);
    for (int v = 0; v < MOETAX_QK_K; v++) {
        const int h = v / 128, k = (v % 128) / 32, l = v % 32;
        const int q = ((qs[32 * h + l] >> (2 * k)) & 3) - ((hm[l] >> (4 * h + k) & 1) ? 0 : 4);
        y[v] = (d * (s6[v / 16] - 32)) * q;
    }
}

static void kq_dequant_q4k5k(const uint8_t *p, float *y, bool five) {
    const float d = moetax_fp16_to_fp32(load_u16(p)), dmin = moetax_fp16_to_fp32(load_u16(p + 2));
    const uint8_t *scales = p + 4;
    const uint8_t *qh = five ? p + 16 : NULL;
    const uint8_t *qs = five ? p + 48 : p + 16;
    for (int c = 0; c < 4; c++) {
        uint8_t sc0, m0, sc1, m1;
        moetax_q4k_scale_min(2 * c, scales, &sc0, &m0);
        moetax_q4k_scale_min(2 * c + 1, scales, &sc1, &m1);
        const float d1 = d * sc0, mm1 = dmin * m0, d2 = d * sc1, mm2 = dmin * m1;
        for (int l = 0; l < 32; l++) {
            int q0 = qs[32 * c + l] & 0xf, q1 = qs[32 * c + l] >> 4;
            if (five) {
                q0 += (qh[l] >> (2 * c) & 1) << 4;
                q1 += (qh[l] >> (2 * c + 1) & 1) << 4;
            }
            y[64 * c + l] = d1 * q0 - mm1;
            y[64 * c + 32 + l] = d2 * q1 - mm2;
        }
    }
}

static void kq_dequant_q6k(const uint8_t *p, float *y) {
    const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q6_k, d)));
    const int8_t *sc = (const int8_t *)(p + offsetof(moetax_block_q6_k, scales));
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = p + 64 * h, *qh = p + offsetof(moetax_block_q6_k, qh) + 32 * h;
        float *yh = y + 128 * h;
        for (int l = 0; l < 32; l++) {
            const int q1 = ((ql[l] & 0xf) | ((qh[l] >> 0 & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xf) | ((qh[l] >> 2 & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
            yh[l] = d * sc[8 * h + l / 16] * q1;
            yh[l + 32] = d * sc[8 * h + 2 + l / 16] * q2;
            yh[l + 64] = d * sc[8 * h + 4 + l / 16] * q3;
            yh[l + 96] = d * sc[8 * h + 6 + l / 16] * q4;
        }
    }
}

/* The index of the IQ4_NL level nearest x (ggml's best_index_int8: ties to the upper one). */
static int iq4nl_best_index(float x) {
    const int8_t *v = moetax_iq4nl_values;
    if (x <= v[0]) return 0;
    if (x >= v[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < v[mid]) hi = mid;
        else lo = mid;
    }
    return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

/* ggml's quantize_iq4_nl without importance weights (what llama-quantize writes): per block of 32
 * the scale that maximizes sum(w q x)^2 / sum(w q^2), weights x^2, over the first guess max / 127
 * and 15 more from (t - 127) / max, t = -7..7; the levels again from the chosen scale, which is
 * stored as F16. */
void moetax_quantize_row_iq4_nl_ref(const float *x, moetax_block_iq4_nl *y, int64_t n) {
    const int8_t *v = moetax_iq4nl_values;
    for (int64_t i = 0; i < n / MOETAX_QK4_0; i++) {
        const float *xb = x + i * MOETAX_QK4_0;
        uint8_t L[MOETAX_QK4_0];
        float w[MOETAX_QK4_0], amax = 0.0f, max = 0.0f, d = 0.0f;
        for (int j = 0; j < MOETAX_QK4_0; j++) {
            w[j] = xb[j] * xb[j];
            const float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        if (amax >= KQ_GROUP_MAX_EPS) {
            d = -max / v[0];
            float id = 1 / d, sumqx = 0, sumq2 = 0;
            for (int j = 0; j < MOETAX_QK4_0; j++) {
                const float q = v[iq4nl_best_index(id * xb[j])];
                sumqx += w[j] * q * xb[j];
                sumq2 += w[j] * q * q;
            }
            d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
            float best = d * sumqx;
            for (int itry = -7; itry <= 7; itry++) {
                id = (float)(itry + v[0]) / max;
                sumqx = sumq2 = 0;
                for (int j = 0; j < MOETAX_QK4_0; j++) {
                    const float q = v[iq4nl_best_index(id * xb[j])];
                    sumqx += w[j] * q * xb[j];
                    sumq2 += w[j] * q * q;
                }
                if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                    d = sumqx / sumq2;
                    best = d * sumqx;
                }
            }
        }
        y[i].d = moetax_fp32_to_fp16(d);
        const float id = d != 0.0f ? 1 / d : 0.0f;
        for (int j = 0; j < MOETAX_QK4_0; j++) L[j] = (uint8_t)iq4nl_best_index(id * xb[j]);
        for (int j = 0; j < MOETAX_QK4_0 / 2; j++) y[i].qs[j] = (uint8_t)(L[j] | (L[j + MOETAX_QK4_0 / 2] << 4));
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
    case MOETAX_TYPE_Q5_0: moetax_quantize_row_q5_0_ref(x, y, n); return true;
    case MOETAX_TYPE_Q4_1: moetax_quantize_row_q4_1_ref(x, y, n); return true;
    case MOETAX_TYPE_Q5_1: moetax_quantize_row_q5_1_ref(x, y, n); return true;
    case MOETAX_TYPE_IQ4_NL: moetax_quantize_row_iq4_nl_ref(x, y, n); return true;
    case MOETAX_TYPE_Q2_K: moetax_quantize_row_q2_k_ref(x, y, n); return true;
    case MOETAX_TYPE_Q3_K: moetax_quantize_row_q3_k_ref(x, y, n); return true;
    case MOETAX_TYPE_Q4_K: moetax_quantize_row_q4_k_ref(x, y, n); return true;
    case MOETAX_TYPE_Q5_K: moetax_quantize_row_q5_k_ref(x, y, n); return true;
    case MOETAX_TYPE_Q6_K: moetax_quantize_row_q6_k_ref(x, y, n); return true;
    default: return false;
    }
}


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
    case MOETAX_TYPE_Q5_0:
        for (int64_t b = 0; b < n / MOETAX_QK4_0; b++, p += sizeof(moetax_block_q5_0)) {
            const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_q5_0, d)));
            const uint8_t *h = p + offsetof(moetax_block_q5_0, qh), *q = p + offsetof(moetax_block_q5_0, qs);
            const uint32_t qh = load_le32(h);
            for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
                const int q0 = (q[j] & 0x0f) | (int)(qh >> j & 1) << 4;
                const int q1 = (q[j] >> 4) | (int)(qh >> (j + 16) & 1) << 4;
                y[b * MOETAX_QK4_0 + j] = (float)(q0 - 16) * d;
                y[b * MOETAX_QK4_0 + j + MOETAX_QK4_0 / 2] = (float)(q1 - 16) * d;
            }
        }
        return true;
    case MOETAX_TYPE_Q4_1:
    case MOETAX_TYPE_Q5_1: {
        const bool five = t == MOETAX_TYPE_Q5_1;
        const size_t bs = five ? sizeof(moetax_block_q5_1) : sizeof(moetax_block_q4_1);
        const size_t qo = five ? offsetof(moetax_block_q5_1, qs) : offsetof(moetax_block_q4_1, qs);
        for (int64_t b = 0; b < n / MOETAX_QK4_0; b++, p += bs) {
            const float d = moetax_fp16_to_fp32(load_u16(p)), m = moetax_fp16_to_fp32(load_u16(p + 2));
            const uint8_t *h = p + 4, *q = p + qo;
            const uint32_t qh = five ? load_le32(h) : 0;
            for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
                const int q0 = (q[j] & 0x0f) | (int)(qh >> j & 1) << 4;
                const int q1 = (q[j] >> 4) | (int)(qh >> (j + 16) & 1) << 4;
                y[b * MOETAX_QK4_0 + j] = (float)q0 * d + m;
                y[b * MOETAX_QK4_0 + j + MOETAX_QK4_0 / 2] = (float)q1 * d + m;
            }
        }
        return true;
    }
    case MOETAX_TYPE_IQ4_NL:
        for (int64_t b = 0; b < n / MOETAX_QK4_0; b++, p += sizeof(moetax_block_iq4_nl)) {
            const float d = moetax_fp16_to_fp32(load_u16(p + offsetof(moetax_block_iq4_nl, d)));
            const uint8_t *q = p + offsetof(moetax_block_iq4_nl, qs);
            for (int j = 0; j < MOETAX_QK4_0 / 2; j++) {
                y[b * MOETAX_QK4_0 + j] = d * (float)moetax_iq4nl_values[q[j] & 0x0f];
                y[b * MOETAX_QK4_0 + j + MOETAX_QK4_0 / 2] = d * (float)moetax_iq4nl_values[q[j] >> 4];
            }
        }
        return true;
    case MOETAX_TYPE_Q2_K:
        for (int64_t b = 0; b < n / MOETAX_QK_K; b++, p += sizeof(moetax_block_q2_k)) kq_dequant_q2k(p, y + b * MOETAX_QK_K);
        return true;
    case MOETAX_TYPE_Q3_K:
        for (int64_t b = 0; b < n / MOETAX_QK_K; b++, p += sizeof(moetax_block_q3_k)) kq_dequant_q3k(p, y + b * MOETAX_QK_K);
        return true;
    case MOETAX_TYPE_Q4_K:
    case MOETAX_TYPE_Q5_K:
        for (int64_t b = 0; b < n / MOETAX_QK_K; b++, p += moetax_type_size(t))
            kq_dequant_q4k5k(p, y + b * MOETAX_QK_K, t == MOETAX_TYPE_Q5_K);
        return true;
    case MOETAX_TYPE_Q6_K:
        for (int64_t b = 0; b < n / MOETAX_QK_K; b++, p += sizeof(moetax_block_q6_k)) kq_dequant_q6k(p, y + b * MOETAX_QK_K);
        return true;
    default: return false;
    }
}
