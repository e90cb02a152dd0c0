/* matmul_kq_avx2.c - AVX2 matrix x vector(s) for the k-quant weights (Q4_K,
 * Q5_K, Q6_K, as stored) against block_q8_K activations (kernels.h).
 *
 * Per weight super-block of 256 values the weights are decoded once into
 * eight 32-byte vectors of unsigned levels (Q4_K 0..15, Q5_K 0..31, Q6_K
 * 0..63) and eight int16 scale vectors (the low 128 bits hold the scale of a
 * vector's first 16 values, the high 128 bits of its last 16), then reused
 * for up to KQ_BT batch rows: maddubs (level x int8 activation, pairs; at
 * most 63 * 127 * 2, no saturation) and madd with the scales give exact int32
 * sums. The offsets (Q4_K/Q5_K mins, Q6_K's 32) come from the activations'
 * bsums. Each output keeps one float chain over the super-blocks in order,
 * whatever n_batch or the row split: results are batch-invariant. */
#include <immintrin.h>
#include <string.h>

#include "kernels_impl.h"
#include "moetax/types.h"

#define KQ_BT 4 /* batch rows per pass over a row's decoded blocks */

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* One decoded super-block. */
struct kq_blk {
    __m256i q[8];   /* levels of values 32k..32k+31 */
    __m256i sc[8];  /* int16 scales for q[k] (low lanes: values 0-15, high: 16-31) */
    __m256i c16;    /* int16 coefficients of the activations' bsums[16] */
    float d, dmin;  /* Q6_K: dmin unused (its offset is folded into the integer sum) */
};

static inline void decode_q45k(const uint8_t *bp, bool five, struct kq_blk *k) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    k->d = moetax_k_fp16_table[ld16(bp)];
    k->dmin = moetax_k_fp16_table[ld16(bp + 2)];
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++) moetax_q4k_scale_min(j, bp + 4, &sc[j], &m[j]);
    const uint8_t *qs = bp + (five ? 48 : 16);
    __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(bp + 16)) : _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if (five) { /* bit 2c of qh[l] adds 16 to value 64c+l, bit 2c+1 to value 64c+32+l */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        k->q[2 * c] = lo;
        k->q[2 * c + 1] = hi;
    }
    for (int j = 0; j < 8; j++) k->sc[j] = _mm256_set1_epi16(sc[j]);
    k->c16 = _mm256_setr_epi16(m[0], m[0], m[1], m[1], m[2], m[2], m[3], m[3], m[4], m[4], m[5], m[5], m[6], m[6],
                               m[7], m[7]);
}

static inline void decode_q6k(const uint8_t *bp, struct kq_blk *k) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03);
    const int8_t *sc = (const int8_t *)(bp + offsetof(moetax_block_q6_k, scales));
    k->d = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q6_k, d))];
    k->dmin = 0.0f;
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = bp + 64 * h, *qh = bp + offsetof(moetax_block_q6_k, qh) + 32 * h;
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
        __m256i *q = k->q + 4 * h;
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4));
    }
    for (int j = 0; j < 8; j++) /* vector j holds values 32j..32j+31: scales 2j, 2j+1 */
        k->sc[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    int16_t c[16];
    for (int j = 0; j < 16; j++) c[j] = (int16_t)(32 * sc[j]);
    k->c16 = _mm256_loadu_si256((const __m256i *)c);
}

void moetax_k_matmul_kq_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                             int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    const int64_t nb = ncols / MOETAX_QK_K;
    const size_t bsz = moetax_type_size(wtype);
    const size_t act_row = moetax_k_act_row_bytes(wtype, ncols);
    const bool six = wtype == MOETAX_TYPE_Q6_K, five = wtype == MOETAX_TYPE_Q5_K;
    for (int64_t r = row0; r < row1; r++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)r * row_bytes;
        for (int64_t b0 = 0; b0 < n_batch; b0 += KQ_BT) {
            const int nbt = n_batch - b0 < KQ_BT ? (int)(n_batch - b0) : KQ_BT;
            float acc[KQ_BT] = {0};
            for (int64_t i = 0; i < nb; i++) {
                const uint8_t *bp = wr + (size_t)i * bsz;
                _mm_prefetch((const char *)bp + 4 * bsz, _MM_HINT_T0);
                struct kq_blk k;
                if (six) decode_q6k(bp, &k);
                else decode_q45k(bp, five, &k);
                for (int t = 0; t < nbt; t++) {
                    const moetax_block_q8_k *a =
                        (const moetax_block_q8_k *)((const uint8_t *)xq + (size_t)(b0 + t) * act_row) + i;
                    __m256i s = _mm256_setzero_si256();
                    for (int j = 0; j < 8; j++) {
                        const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(k.q[j], av), k.sc[j]));
                    }
                    const __m256i corr = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), k.c16);
                    if (six) {
                        const int32_t sumi = hsum_i32(_mm256_sub_epi32(s, corr));
                        acc[t] += (a->d * k.d) * (float)sumi;
                    } else {
                        const int32_t sumi = hsum_i32(s), summ = hsum_i32(corr);
                        acc[t] += (a->d * k.d) * (float)sumi;
                        acc[t] -= (a->d * k.dmin) * (float)summ;
                    }
                }
            }
            for (int t = 0; t < nbt; t++) y[(b0 + t) * ldy + r] = acc[t];
        }
    }
}
