/* matmul_ref.c - scalar reference: activation preparation and matrix x
 * vector(s) for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K weights. Plain C11, one output at
 * a time, double accumulation: slow and obviously right. */
#include "kernels_impl.h"

#include <math.h>
#include <string.h>

#include "moetax/types.h"

/* ggml's quantize_row_q8_0 for one block, with the scale stored widened (the SIMD tables take it for
 * blocks that hold a NaN or an infinity, or whose 1 / d overflows: kernels_impl.h). */
void moetax_k_quantize_block_q8_ref(const float *x, int8_t *qs, float *d_out) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) qs[j] = moetax_q8_round(x[j] * id);
    *d_out = moetax_fp16_to_fp32(moetax_fp32_to_fp16(d));
}

void moetax_k_quantize_act_ref(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols,
                               int64_t n_batch, void *xq) {
    const size_t row_bytes = moetax_k_act_row_bytes(wtype, ncols);
    const int64_t nb = ncols / 32;
    for (int64_t b = 0; b < n_batch; b++) {
        const float *xr = x + b * ldx;
        uint8_t *out = (uint8_t *)xq + (size_t)b * row_bytes;
        if (moetax_k_act_is_q(wtype)) {
            float *d = (float *)(out + moetax_k_act_d_off(wtype, nb));
            for (int64_t i = 0; i < nb; i++) moetax_k_quantize_block_q8_ref(xr + i * 32, (int8_t *)out + i * 32, &d[i]);
            if (moetax_act_is_q4_0(wtype)) { /* s = 8 * sum of each block's quants (kernels.h) */
                int32_t *s = (int32_t *)(out + moetax_k_act_s_off(nb));
                for (int64_t i = 0; i < nb; i++) {
                    int32_t sum = 0;
                    for (int j = 0; j < 32; j++) sum += ((const int8_t *)out)[i * 32 + j];
                    s[i] = 8 * sum;
                }
            }
        } else if (moetax_k_act_is_k(wtype)) {
            moetax_quantize_row_q8_k_ref(xr, (moetax_block_q8_k *)out, ncols);
        } else {
            memcpy(out, xr, (size_t)ncols * sizeof(float));
        }
    }
}

static double dot_f32(const float *w, const float *x, int64_t n) {
    double acc = 0.0;
    for (int64_t k = 0; k < n; k++) acc += (double)w[k] * (double)x[k];
    return acc;
}

static double dot_f16(const uint16_t *w, const float *x, int64_t n) {
    double acc = 0.0;
    for (int64_t k = 0; k < n; k++) acc += (double)moetax_fp16_to_fp32(w[k]) * (double)x[k];
    return acc;
}

static double dot_bf16(const uint16_t *w, const float *x, int64_t n) {
    double acc = 0.0;
    for (int64_t k = 0; k < n; k++) acc += (double)moetax_bf16_to_fp32(w[k]) * (double)x[k];
    return acc;
}

/* Q8_0 x Q8_0: exact integer block sums, float block scale (d_w * d_x). */
static double dot_q8(const moetax_block_q8_0 *w, const int8_t *qs, const float *d, int64_t nb) {
    double acc = 0.0;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 32; j++) isum += (int32_t)w[i].qs[j] * (int32_t)qs[i * 32 + j];
        acc += (double)(moetax_fp16_to_fp32(w[i].d) * d[i]) * (double)isum;
    }
    return acc;
}

/* Q4_0 x Q8_0: (q - 8) per nibble, as stored (byte j = values j and j + 16);
 * the activations' s is not used here (kernels.h). */
static double dot_q4(const moetax_block_q4_0 *w, const int8_t *qs, const float *d, int64_t nb) {
    double acc = 0.0;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += ((int32_t)(w[i].qs[j] & 0x0f) - 8) * (int32_t)qs[i * 32 + j];
            isum += ((int32_t)(w[i].qs[j] >> 4) - 8) * (int32_t)qs[i * 32 + 16 + j];
        }
        acc += (double)(moetax_fp16_to_fp32(w[i].d) * d[i]) * (double)isum;
    }
    return acc;
}

/* Q5_0 x Q8_0: the nibble plus bit j of qh times 16, minus 16; IQ4_NL x Q8_0: the table's
 * level at the nibble. Both as stored (byte j: values j and j + 16). */
static double dot_q5_0(const moetax_block_q5_0 *w, const int8_t *qs, const float *d, int64_t nb) {
    double acc = 0.0;
    for (int64_t i = 0; i < nb; i++) {
        const uint32_t qh = moetax_k_le32(w[i].qh);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += ((int32_t)(w[i].qs[j] & 0x0f) + 16 * (int32_t)(qh >> j & 1) - 16) * (int32_t)qs[i * 32 + j];
            isum += ((int32_t)(w[i].qs[j] >> 4) + 16 * (int32_t)(qh >> (j + 16) & 1) - 16) * (int32_t)qs[i * 32 + 16 + j];
        }
        acc += (double)(moetax_fp16_to_fp32(w[i].d) * d[i]) * (double)isum;
    }
    return acc;
}

/* Q4_1 / Q5_1 x the Q4_0 row: q * d + m per value; the min's term from the row's block sums. */
static double dot_x_1(bool five, const uint8_t *w, const int8_t *qs, const float *d, const int32_t *s, int64_t nb) {
    const size_t bs = five ? sizeof(moetax_block_q5_1) : sizeof(moetax_block_q4_1);
    double acc = 0.0;
    for (int64_t i = 0; i < nb; i++, w += bs) {
        uint16_t dh, mh;
        memcpy(&dh, w, 2);
        memcpy(&mh, w + 2, 2);
        const uint8_t *q = w + (five ? 8 : 4), *h = w + 4;
        const uint32_t qh = five ? moetax_k_le32(h) : 0;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += ((int32_t)(q[j] & 0x0f) + 16 * (int32_t)(qh >> j & 1)) * (int32_t)qs[i * 32 + j];
            isum += ((int32_t)(q[j] >> 4) + 16 * (int32_t)(qh >> (j + 16) & 1)) * (int32_t)qs[i * 32 + 16 + j];
        }
        acc += (double)(moetax_fp16_to_fp32(dh) * d[i]) * (double)isum +
               (double)(moetax_fp16_to_fp32(mh) * d[i]) * (double)(s[i] / 8);
    }
    return acc;
}

static double dot_iq4nl(const moetax_block_iq4_nl *w, const int8_t *qs, const float *d, int64_t nb) {
    double acc = 0.0;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += (int32_t)moetax_iq4nl_values[w[i].qs[j] & 0x0f] * (int32_t)qs[i * 32 + j];
            isum += (int32_t)moetax_iq4nl_values[w[i].qs[j] >> 4] * (int32_t)qs[i * 32 + 16 + j];
        }
        acc += (double)(moetax_fp16_to_fp32(w[i].d) * d[i]) * (double)isum;
    }
    return acc;
}

/* k-quants x Q8_K, one super-block at a time: the levels q (Q2_K 0..3, Q3_K -4..3, Q4_K 0..15,
 * Q5_K 0..31, Q6_K 0..63) and each 16 values' scale sc16 and offset term, decoded plainly from
 * the stored bytes; exact integer sums sumi = sum sc * q * a and summ (Q2_K/Q4_K/Q5_K: sum m_j *
 * the activations' sums of sub-block j; Q6_K: 32 * sum sc_j * bsums_j, subtracted from sumi;
 * Q3_K: none, its levels are signed). */
static double dot_kq(enum moetax_type t, const uint8_t *w, const moetax_block_q8_k *a, int64_t nb) {
    double acc = 0.0;
    const size_t bsz = moetax_type_size(t);
    for (int64_t i = 0; i < nb; i++, w += bsz) {
        int q[256], sc16[16];
        int64_t sumi = 0, summ = 0;
        float d, dmin = 0.0f;
        uint16_t h;
        if (t == MOETAX_TYPE_Q2_K) {
            const moetax_block_q2_k *b = (const moetax_block_q2_k *)w;
            memcpy(&h, &b->d, 2);
            d = moetax_fp16_to_fp32(h);
            memcpy(&h, &b->dmin, 2);
            dmin = moetax_fp16_to_fp32(h);
            for (int v = 0; v < 256; v++) q[v] = (b->qs[32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3;
            for (int j = 0; j < 16; j++) {
                sc16[j] = b->scales[j] & 0xf;
                summ += (int64_t)(b->scales[j] >> 4) * a[i].bsums[j];
            }
        } else if (t == MOETAX_TYPE_Q3_K) {
            const moetax_block_q3_k *b = (const moetax_block_q3_k *)w;
            uint8_t s6[16];
            memcpy(&h, &b->d, 2);
            d = moetax_fp16_to_fp32(h);
            for (int v = 0; v < 256; v++) {
                const int hf = v / 128, k = (v % 128) / 32, l = v % 32;
                q[v] = ((b->qs[32 * hf + l] >> (2 * k)) & 3) - ((b->hmask[l] >> (4 * hf + k) & 1) ? 0 : 4);
            }
            moetax_q3k_scales(b->scales, s6);
            for (int j = 0; j < 16; j++) sc16[j] = s6[j] - 32;
        } else if (t == MOETAX_TYPE_Q6_K) {
            const moetax_block_q6_k *b = (const moetax_block_q6_k *)w;
            memcpy(&h, &b->d, 2);
            d = moetax_fp16_to_fp32(h);
            for (int v = 0; v < 256; v++) {
                const int hf = v / 128, k = (v % 128) / 32, l = v % 32;
                const uint8_t lo = b->ql[64 * hf + l + (k & 1) * 32];
                const int low4 = (k & 2) ? lo >> 4 : lo & 0xf;
                q[v] = low4 | ((b->qh[32 * hf + l] >> (2 * k) & 3) << 4);
            }
            for (int j = 0; j < 16; j++) {
                sc16[j] = b->scales[j];
                summ += 32 * (int64_t)b->scales[j] * a[i].bsums[j];
            }
        } else {
            const bool five = t == MOETAX_TYPE_Q5_K;
            const uint8_t *scales = w + 4, *qh = w + 16, *qs = w + (five ? 48 : 16);
            memcpy(&h, w, 2);
            d = moetax_fp16_to_fp32(h);
            memcpy(&h, w + 2, 2);
            dmin = moetax_fp16_to_fp32(h);
            for (int v = 0; v < 256; v++) {
                const int c = v / 64, hi = (v % 64) / 32, l = v % 32;
                q[v] = hi ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xf;
                if (five) q[v] += (qh[l] >> (2 * c + hi) & 1) << 4;
            }
            for (int j = 0; j < 8; j++) {
                uint8_t s, m;
                moetax_q4k_scale_min(j, scales, &s, &m);
                sc16[2 * j] = sc16[2 * j + 1] = s;
                summ += (int64_t)m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
            }
        }
        for (int v = 0; v < 256; v++) sumi += (int64_t)sc16[v / 16] * q[v] * a[i].qs[v];
        if (t == MOETAX_TYPE_Q6_K || t == MOETAX_TYPE_Q3_K) acc += (double)(a[i].d * d) * (double)(sumi - summ);
        else acc += (double)(a[i].d * d) * (double)sumi - (double)(a[i].d * dmin) * (double)summ;
    }
    return acc;
}

void moetax_k_matmul_ref(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                         int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    const size_t act_row = moetax_k_act_row_bytes(wtype, ncols);
    const int64_t nb = ncols / 32;
    for (int64_t r = row0; r < row1; r++) {
        const void *wr = (const uint8_t *)w + (size_t)r * row_bytes;
        for (int64_t b = 0; b < n_batch; b++) {
            const uint8_t *a = (const uint8_t *)xq + (size_t)b * act_row;
            double v = 0.0;
            switch (wtype) {
            case MOETAX_TYPE_F32: v = dot_f32(wr, (const float *)a, ncols); break;
            case MOETAX_TYPE_F16: v = dot_f16(wr, (const float *)a, ncols); break;
            case MOETAX_TYPE_BF16: v = dot_bf16(wr, (const float *)a, ncols); break;
            case MOETAX_TYPE_Q8_0:
                v = dot_q8(wr, (const int8_t *)a, (const float *)(a + moetax_k_act_d_off(wtype, nb)), nb);
                break;
            case MOETAX_TYPE_Q4_0:
                v = dot_q4(wr, (const int8_t *)a, (const float *)(a + moetax_k_act_d_off(wtype, nb)), nb);
                break;
            case MOETAX_TYPE_Q5_0:
                v = dot_q5_0(wr, (const int8_t *)a, (const float *)(a + moetax_k_act_d_off(wtype, nb)), nb);
                break;
            case MOETAX_TYPE_IQ4_NL:
                v = dot_iq4nl(wr, (const int8_t *)a, (const float *)(a + moetax_k_act_d_off(wtype, nb)), nb);
                break;
            case MOETAX_TYPE_Q4_1: case MOETAX_TYPE_Q5_1:
                v = dot_x_1(wtype == MOETAX_TYPE_Q5_1, wr, (const int8_t *)a,
                            (const float *)(a + moetax_k_act_d_off(wtype, nb)), (const int32_t *)(a + moetax_k_act_s_off(nb)),
                            nb);
                break;
            case MOETAX_TYPE_Q2_K: case MOETAX_TYPE_Q3_K:
            case MOETAX_TYPE_Q4_K: case MOETAX_TYPE_Q5_K: case MOETAX_TYPE_Q6_K:
                v = dot_kq(wtype, wr, (const moetax_block_q8_k *)a, ncols / 256);
                break;
            default: break;
            }
            y[b * ldy + r] = (float)v;
        }
    }
}
