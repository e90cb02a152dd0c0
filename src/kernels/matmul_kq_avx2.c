/* matmul_kq_avx2.c - AVX2 matrix x vector(s) for the k-quant weights (Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K) against block_q8_K activations (kernels.h): in their
 * x8r layouts (8 rows interleaved, repacked at load; below), and a unit's plain
 * tail of n_rows % 8 rows as stored (first).
 *
 * The plain tail: per weight super-block of 256 values the weights are decoded once into
 * eight 32-byte vectors of unsigned levels (Q2_K 0..3, Q3_K 0..7 i.e. q + 4,
 * Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) and eight int16 scale vectors (the low 128 bits hold the scale of a
 * vector's first 16 values, the high 128 bits of its last 16), then reused
 * for up to KQ_BT batch rows: maddubs (level x int8 activation, pairs; at
 * most 63 * 127 * 2, no saturation) and madd with the scales give exact int32
 * sums. The offsets (Q2_K/Q4_K/Q5_K mins, Q3_K's 4, Q6_K's 32) come from the
 * activations' bsums (Q3_K and Q6_K subtract them from the integer sum, Q2_K/Q4_K/
 * Q5_K scale them by dmin). Each output keeps one float chain over the super-blocks in order,
 * whatever n_batch or the row split: results are batch-invariant. */
#include <immintrin.h>
#include <string.h>

#include "kernels_impl.h"
#include "kq_rows.h"
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

/* The 16 Q3_K scales minus 32 (-32..31, byte j: scale j) from ggml's packed scales[12]
 * (moetax_q3k_scales), four at a time in 32-bit words as ggml's dequantize_row_q3_K does. */
static inline __m128i q3k_scales_v(const uint8_t *p) {
    uint32_t a[3];
    memcpy(a, p, 12);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u, t = a[2];
    const uint32_t u0 = (a[0] & m4) | ((t & m2) << 4), u1 = (a[1] & m4) | (((t >> 2) & m2) << 4);
    const uint32_t u2 = ((a[0] >> 4) & m4) | (((t >> 4) & m2) << 4), u3 = ((a[1] >> 4) & m4) | (((t >> 6) & m2) << 4);
    return _mm_sub_epi8(_mm_set_epi32((int)u3, (int)u2, (int)u1, (int)u0), _mm_set1_epi8(32));
}

static inline void q3k_scales_i8(const uint8_t *p, int8_t out[16]) { _mm_storeu_si128((__m128i *)out, q3k_scales_v(p)); }

/* Vector j (values 32j..32j+31) of a Q2_K / Q3_K super-block: bits 2(j%4).. of qs[32(j/4)..]. */
static inline __m256i q2bits(const uint8_t *qs, int j) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(raw, 2 * (j % 4)), _mm256_set1_epi8(3));
}

/* Q3_K: q + 4 = low 2 bits | hmask bit j of byte l << 2. */
static inline __m256i q3level(const uint8_t *bp, __m256i hm, int j) {
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, j), _mm256_set1_epi8(1));
    return _mm256_or_si256(q2bits(bp + offsetof(moetax_block_q3_k, qs), j), _mm256_slli_epi16(hb, 2));
}

static inline void decode_q2k(const uint8_t *bp, struct kq_blk *k) {
    const uint8_t *sc = bp;
    k->d = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q2_k, d))];
    k->dmin = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q2_k, dmin))];
    for (int j = 0; j < 8; j++) {
        k->q[j] = q2bits(bp + offsetof(moetax_block_q2_k, qs), j);
        k->sc[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1] & 0xf), _mm_set1_epi16(sc[2 * j] & 0xf));
    }
    k->c16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)sc), 4), _mm_set1_epi8(0x0f)));
}

static inline void decode_q3k(const uint8_t *bp, struct kq_blk *k) {
    int8_t sc[16];
    q3k_scales_i8(bp + offsetof(moetax_block_q3_k, scales), sc);
    k->d = moetax_k_fp16_table[ld16(bp + offsetof(moetax_block_q3_k, d))];
    k->dmin = 0.0f;
    const __m256i hm = _mm256_loadu_si256((const __m256i *)bp);
    for (int j = 0; j < 8; j++) {
        k->q[j] = q3level(bp, hm, j);
        k->sc[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    }
    int16_t c[16];
    for (int j = 0; j < 16; j++) c[j] = (int16_t)(4 * sc[j]);
    k->c16 = _mm256_loadu_si256((const __m256i *)c);
}

/* ---- decode (one batch row): 4 weight rows side by side ----
 * The scales/mins of a Q4_K/Q5_K super-block are unpacked once per block with
 * ggml's 32-bit mask trick (8 scale bytes, 8 min bytes) and widened to int16
 * in one vector; each 32-value chunk's scale is a byte shuffle of it. The 4
 * rows' int32 block sums are reduced together (hadd transpose) into one
 * vector, and the float steps run on 4 lanes: the same operations, in the
 * same order, as the batch path's scalar chain above (no contraction: ISO C,
 * -ffp-contract=off), so the bits match it for every row. */

#define KQ_INLINE static inline __attribute__((always_inline))

KQ_INLINE __m256i kq_scale_shuf(int j) { /* int16 element j of a 128-bit vector, broadcast */
    return _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8)));
}

/* Sum over a Q4_K/Q5_K super-block of sc_j * q * x (int32 x 8) and the mins'
 * products m_j * (bsums[2j] + bsums[2j+1]) (int32 x 4). */
KQ_INLINE void dot_q45k(const uint8_t *bp, bool five, const moetax_block_q8_k *a, __m128i q8s, __m256i *s_out,
                            __m128i *m_out) {
    uint32_t u[4];
    memcpy(u, bp + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t ux = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = ux;
    u[0] &= 0x3f3f3f3fu;
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
    *m_out = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const uint8_t *qs = bp + (five ? 48 : 16);
    __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(bp + 16)) : _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi8(1);
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a->qs + 64 * c));
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(a->qs + 64 * c + 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_shuffle_epi8(sc, kq_scale_shuf(2 * c)));
        const __m256i p1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), _mm256_shuffle_epi8(sc, kq_scale_shuf(2 * c + 1)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(p0, p1));
    }
    *s_out = s;
}

/* int16 scales of values 32j..32j+31 from the 16 int16 scales sc16: low 128 bits sc[2j], high
 * sc[2j+1]. One in-lane byte shuffle of the 128-bit half holding them, broadcast (the compiler
 * keeps the two broadcasts of a super-block), instead of a shuffle and a widening per vector. */
KQ_INLINE __m256i kq_sc_pair(__m256i sc16, int j) {
    /* two immediates, not one chosen at run time: an immediate must be one before unrolling (-O1) */
    const __m256i half = j < 4 ? _mm256_permute4x64_epi64(sc16, 0x44) : _mm256_permute4x64_epi64(sc16, 0xee);
    const int w0 = (2 * j) & 7, w1 = (2 * j + 1) & 7; /* words within the half */
    const __m256i idx = _mm256_setr_epi8(2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1,
                                         2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1, 2 * w0, 2 * w0 + 1,
                                         2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1,
                                         2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1, 2 * w1, 2 * w1 + 1);
    return _mm256_shuffle_epi8(half, idx);
}

/* Q6_K: sum of sc_j * (q - 32) * x over the super-block (int32 x 8). */
KQ_INLINE __m256i dot_q6k(const uint8_t *bp, const moetax_block_q8_k *a, __m256i bsums) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(bp + offsetof(moetax_block_q6_k, scales)));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    /* the offset 32: sum_j 32 sc_j bsums[j] */
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bsums, _mm256_slli_epi16(sc16, 5)));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = bp + 64 * h, *qh = bp + offsetof(moetax_block_q6_k, qh) + 32 * h;
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4));
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            const int j = 4 * h + v; /* values 32j..32j+31: scales 2j (low 128 bits), 2j+1 (high) */
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q[v], av), kq_sc_pair(sc16, j)));
        }
    }
    return s;
}


/* Q2_K: sum of sc_j * q * x (int32 x 8) and of the mins' m_j * bsums[j] (int32 x 8). */
KQ_INLINE void dot_q2k(const uint8_t *bp, const moetax_block_q8_k *a, __m256i bsums, __m256i *s_out,
                       __m256i *m_out) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)bp);
    const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0f)));
    *m_out = _mm256_madd_epi16(bsums, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f))));
    const uint8_t *qs = bp + offsetof(moetax_block_q2_k, qs);
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i raw_q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int j = 4 * h + k;
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw_q, 2 * k), m3);
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), kq_sc_pair(sc16, j)));
        }
    }
    *s_out = s;
}

/* Q3_K: sum of (s_j - 32) * q * x over the super-block, q = level - 4 (int32 x 8). */
KQ_INLINE __m256i dot_q3k(const uint8_t *bp, const moetax_block_q8_k *a, __m256i bsums) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(q3k_scales_v(bp + offsetof(moetax_block_q3_k, scales)));
    /* the offset 4: sum_j 4 sc_j bsums[j] */
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(bsums, _mm256_slli_epi16(sc16, 2)));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)bp);
    const uint8_t *qs = bp + offsetof(moetax_block_q3_k, qs);
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i raw_q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int j = 4 * h + k;
            const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, j), one);
            const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw_q, 2 * k), m3), _mm256_slli_epi16(hb, 2));
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qs + 32 * j));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), kq_sc_pair(sc16, j)));
        }
    }
    return s;
}

/* lanes r of the result: the sum of v[r]'s 8 int32 */
KQ_INLINE __m128i hsum4_i32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static void kq_decode_rows(enum moetax_type wtype, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                           int64_t nb, const moetax_block_q8_k *x, float *y) {
    const size_t bsz = moetax_type_size(wtype);
    const bool six = wtype == MOETAX_TYPE_Q6_K, five = wtype == MOETAX_TYPE_Q5_K;
    const bool two = wtype == MOETAX_TYPE_Q2_K, three = wtype == MOETAX_TYPE_Q3_K;
    const size_t doff = six ? offsetof(moetax_block_q6_k, d)
                        : two ? offsetof(moetax_block_q2_k, d)
                        : three ? offsetof(moetax_block_q3_k, d)
                                : 0;
    const uint8_t *w0 = w + (size_t)row0 * row_bytes, *we = w + (size_t)row1 * row_bytes;
    kq_prefetch_span_l2(w0, we - w0 > 4 * (ptrdiff_t)row_bytes + KQ_ROWS_PFD ? w0 + 4 * row_bytes + KQ_ROWS_PFD : we);
    for (int64_t r = row0; r < row1; r += 4) {
        struct kq_rows4 g;
        kq_rows4_init(&g, w, row_bytes, r, row1);
        const uint8_t *const *wr = g.w;
        __m128 acc = _mm_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const moetax_block_q8_k *a = x + i;
            const size_t off = (size_t)i * bsz;
            kq_rows4_prefetch(&g, bsz);
            const __m128 ad = _mm_set1_ps(a->d);
            const __m128 dw = kq_rows4_f16(&g, off + doff);
            if (three) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
                const __m128i si = hsum4_i32(dot_q3k(wr[0] + off, a, bs), dot_q3k(wr[1] + off, a, bs),
                                             dot_q3k(wr[2] + off, a, bs), dot_q3k(wr[3] + off, a, bs));
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
            } else if (two) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
                __m256i s0, s1, s2, s3, m0, m1, m2, m3;
                dot_q2k(wr[0] + off, a, bs, &s0, &m0);
                dot_q2k(wr[1] + off, a, bs, &s1, &m1);
                dot_q2k(wr[2] + off, a, bs, &s2, &m2);
                dot_q2k(wr[3] + off, a, bs, &s3, &m3);
                const __m128i si = hsum4_i32(s0, s1, s2, s3), mi = hsum4_i32(m0, m1, m2, m3);
                const __m128 dm = kq_rows4_f16(&g, off + offsetof(moetax_block_q2_k, dmin));
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
                acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dm), _mm_cvtepi32_ps(mi)));
            } else if (six) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
                const __m128i si = hsum4_i32(dot_q6k(wr[0] + off, a, bs), dot_q6k(wr[1] + off, a, bs),
                                             dot_q6k(wr[2] + off, a, bs), dot_q6k(wr[3] + off, a, bs));
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
            } else {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
                const __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                __m256i s0, s1, s2, s3;
                __m128i m0, m1, m2, m3;
                dot_q45k(wr[0] + off, five, a, q8s, &s0, &m0);
                dot_q45k(wr[1] + off, five, a, q8s, &s1, &m1);
                dot_q45k(wr[2] + off, five, a, q8s, &s2, &m2);
                dot_q45k(wr[3] + off, five, a, q8s, &s3, &m3);
                const __m128i si = hsum4_i32(s0, s1, s2, s3);
                const __m128i mi = _mm_hadd_epi32(_mm_hadd_epi32(m0, m1), _mm_hadd_epi32(m2, m3));
                const __m128 dm = kq_rows4_f16(&g, off + 2);
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dw), _mm_cvtepi32_ps(si)));
                acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(ad, dm), _mm_cvtepi32_ps(mi)));
            }
        }
        kq_rows4_store(&g, acc, y + r);
    }
}

/* The x8r layouts' per-super-block steps that do not depend on how the levels are multiplied:
 * the scales' and mins' unpacking and the activations' bsums terms (exact integer work). */
#define KQ8R_INLINE static inline __attribute__((always_inline))

/* Q4_Kx8r / Q5_Kx8r: the 6-bit scales of sub-blocks 0..3 and 4..7 in the bytes of each lane
 * (ggml's 32-bit mask steps on one dword per row). */
KQ8R_INLINE void kq8r_q45_scales(const uint8_t *blk, __m256i *sc03, __m256i *sc47) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m2 = _mm256_set1_epi32(0x03030303);
    const __m256i m4d = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 64));
    *sc03 = _mm256_and_si256(u0, m6);
    *sc47 = _mm256_or_si256(_mm256_and_si256(u2, m4d), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4));
}

/* Q4_Kx8r / Q5_Kx8r: the mins as int16 pairs per lane: p[0] (m0, m2), p[1] (m1, m3), p[2]
 * (m4, m6), p[3] (m5, m7). */
KQ8R_INLINE void kq8r_q45_min_pairs(const uint8_t *blk, __m256i p[4]) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m2 = _mm256_set1_epi32(0x03030303);
    const __m256i m4d = _mm256_set1_epi32(0x0f0f0f0f), mw = _mm256_set1_epi32(0x00ff00ff);
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 32));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4KR8_SC_OFF + 64));
    const __m256i mn03 = _mm256_and_si256(u1, m6);
    const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4d),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4));
    p[0] = _mm256_and_si256(mn03, mw);
    p[1] = _mm256_and_si256(_mm256_srli_epi32(mn03, 8), mw);
    p[2] = _mm256_and_si256(mn47, mw);
    p[3] = _mm256_and_si256(_mm256_srli_epi32(mn47, 8), mw);
}

/* Q4_K / Q5_K: summ = sum_j m_j * (bsums[2j] + bsums[2j+1]) per lane, for the activation's
 * super-block a and the min pairs p (kq8r_q45_min_pairs). */
KQ8R_INLINE __m256i kq8r_q45_mins(const __m256i p[4], const moetax_block_q8_k *a) {
    const __m128i pairs = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
    /* q8s[j] = bsums[2j] + bsums[2j+1], as int16 pairs (q0, q2), (q1, q3), (q4, q6), (q5, q7) */
    const __m256i qp = _mm256_castsi128_si256(
        _mm_shuffle_epi8(_mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)), pairs));
    __m256i M = _mm256_madd_epi16(p[0], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(0)));
    M = _mm256_add_epi32(M, _mm256_madd_epi16(p[1], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(1))));
    M = _mm256_add_epi32(M, _mm256_madd_epi16(p[2], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(2))));
    return _mm256_add_epi32(M, _mm256_madd_epi16(p[3], _mm256_permutevar8x32_epi32(qp, _mm256_set1_epi32(3))));
}

/* The activation's bsums as int16 pairs: dword 2k (bs[4k], bs[4k+2]), dword 2k+1 (bs[4k+1],
 * bs[4k+3]), in both 128-bit halves' order. */
KQ8R_INLINE __m256i kq8r_bsum_pairs(const moetax_block_q8_k *a) {
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7,
                                           8, 9, 12, 13, 10, 11, 14, 15);
    return _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)a->bsums), pairs);
}

/* sum over k of ev[k] . (bsum pair 2k) + od[k] . (bsum pair 2k + 1) per lane: sum_j c_j * bsums_j
 * for the rows' int16 coefficient pairs ev / od (dword 2k, 2k + 1 of kq8r_bsum_pairs). */
KQ8R_INLINE __m256i kq8r_bsum_dot(const __m256i ev[4], const __m256i od[4], __m256i bsp) {
    __m256i c = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        c = _mm256_add_epi32(c, _mm256_madd_epi16(ev[k], _mm256_permutevar8x32_epi32(bsp, _mm256_set1_epi32(2 * k))));
        c = _mm256_add_epi32(c, _mm256_madd_epi16(od[k], _mm256_permutevar8x32_epi32(bsp, _mm256_set1_epi32(2 * k + 1))));
    }
    return c;
}

/* Q6_Kx8r: the rows' int8 scales as int16 pairs (kq8r_bsum_dot's ev / od). */
KQ8R_INLINE void kq8r_q6_coefs(const uint8_t *blk, __m256i ev[4], __m256i od[4]) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m256i sk = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q6KR8_SC_OFF + 32 * k));
        ev[k] = _mm256_srai_epi16(_mm256_slli_epi16(sk, 8), 8);
        od[k] = _mm256_srai_epi16(sk, 8);
    }
}

/* Q6_Kx8r, half h, 4-byte group p (values l = 4p..4p+3 of the half): the four 6-bit level
 * vectors of values 128h + 32k + l (k = 0..3: ql group p low nibbles, ql group p + 8 low,
 * then their high nibbles, each with qh group p's bits 2k, 2k + 1 above them). */
KQ8R_INLINE void kq8r_q6_levels(const uint8_t *blk, int h, int p, __m256i v[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const uint8_t *ql = blk + MOETAX_K_Q6KR8_QL_OFF + 512 * h + 32 * p;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 256));
    const __m256i hq = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q6KR8_QH_OFF + 256 * h + 32 * p));
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 4), m30));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 2), m30));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hq, m30));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hq, 2), m30));
}

/* Q6_K: acc + (d_x * d_w) * (float)sumi for one activation super-block a, where sumi = S minus
 * the offset of 32 (32 * sum_j sc_j * bsums_j, the rows' scales as kq8r_q6_coefs' pairs). */
KQ8R_INLINE __m256 kq8r_q6_acc(__m256 acc, __m256i S, const __m256i ev[4], const __m256i od[4],
                               const moetax_block_q8_k *a, __m256 dw) {
    const __m256i off = kq8r_bsum_dot(ev, od, kq8r_bsum_pairs(a));
    const __m256i sumi = _mm256_sub_epi32(S, _mm256_slli_epi32(off, 5));
    const __m256 ad = _mm256_set1_ps(a->d);
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(ad, dw), _mm256_cvtepi32_ps(sumi)));
}

/* Q2_Kx8r / Q3_Kx8r: U[k], scales 4k..4k+3 in the bytes of each lane; Q2_K as stored (low
 * nibble: scale, high: min), Q3_K unpacked (ggml's 32-bit mask steps) minus 32, signed. */
KQ8R_INLINE void kq8r_q23_scales(const bool three, const uint8_t *blk, __m256i U[4]) {
    if (!three) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) U[k] = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q2KR8_SC_OFF + 32 * k));
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF));
    const __m256i a1 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF + 32));
    const __m256i a2 = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_SC_OFF + 64));
    U[0] = _mm256_or_si256(_mm256_and_si256(a0, m4), _mm256_and_si256(_mm256_slli_epi32(a2, 4), m30));
    U[1] = _mm256_or_si256(_mm256_and_si256(a1, m4), _mm256_and_si256(_mm256_slli_epi32(a2, 2), m30));
    U[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a0, 4), m4), _mm256_and_si256(a2, m30));
    U[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a1, 4), m4), _mm256_and_si256(_mm256_srli_epi32(a2, 2), m30));
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) U[k] = _mm256_sub_epi8(U[k], c32);
}

/* Q2_Kx8r / Q3_Kx8r: the rows' int16 coefficient pairs of the bsums (kq8r_bsum_dot's ev / od):
 * Q2_K the mins, Q3_K the signed scales. */
KQ8R_INLINE void kq8r_q23_coefs(const bool three, const __m256i U[4], __m256i ev[4], __m256i od[4]) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (three) {
            ev[k] = _mm256_srai_epi16(_mm256_slli_epi16(U[k], 8), 8);
            od[k] = _mm256_srai_epi16(U[k], 8);
        } else {
            ev[k] = _mm256_and_si256(_mm256_srli_epi32(U[k], 4), _mm256_set1_epi32(0x000f000f));
            od[k] = _mm256_and_si256(_mm256_srli_epi32(U[k], 12), _mm256_set1_epi32(0x000f000f));
        }
    }
}

/* ---- the x8r layouts (kernels.h, WEIGHT LAYOUTS): 8 rows in the 8 int32 lanes ----
 * As Q4_0x8r (matmul_avx2.c): a 32-byte load holds 4 bytes of each of 8 rows, so pmaddubsw
 * against 4 activation quants broadcast to every lane gives each row's two pair sums in its
 * own lane, with no horizontal sums. A sub-block's products sum in int16 as long as they
 * cannot overflow, then pmaddwd against the rows' scale (the same in both int16 halves of a
 * lane) adds scale x sum into int32. The offsets (mins, Q3_K's 4, Q6_K's 32) are pmaddwd of
 * the rows' int16 pairs with the activation's bsum pairs (above). The integer sums are
 * exact, and per lane the float steps are the plain decode's above, in its order:
 *   acc += (d_x * d_w) * (float)sumi;  (Q2_K, Q4_K, Q5_K:) acc -= (d_x * dmin_w) * (float)summ
 * so every batch size and row split gives the plain path's bits (and the avx512 table's). A
 * tile is G groups (1, or 2 for decode: two streams sharing the broadcasts) x JB (1..KQ_BT)
 * batch rows, the groups' decoded levels serving every batch row. */

/* Decode's prefetch distance for weights streamed from memory (far: matmul_stream), bytes
 * ahead of each stream, into L2 (as the avx512 table's; no L1 prefetch besides:
 * kq8r_prefetch_dec); cached weights go without */
#ifndef KQ8R_PFD
#define KQ8R_PFD 4096
#endif
/* Batch tiles, for weights streamed from memory (the first tile of a group's batch rows: the
 * rest find them in L2): bytes ahead into L2, as decode's. With an L1 prefetch two super-blocks
 * ahead alone, as they had, Q6_K's tile of 2 batch rows waited on the memory's latency and took
 * a multiple of decode's time for the same bytes; 8 KiB ahead without the L1 prefetch came
 * nearest it of the distances tried (commit message: measurements). */
#ifndef KQ8R_BPFD
#define KQ8R_BPFD 8192
#endif

/* pmaddubsw of levels v against the 4 activation quants at x, broadcast, added to s (int16) */
KQ_INLINE __m256i kq8r_dot16(__m256i s, __m256i v, const int8_t *x) {
    int32_t xv;
    memcpy(&xv, x, 4);
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(v, _mm256_set1_epi32(xv)));
}

/* Byte b of each dword of v as int16 in both halves of the dword: zero-extended (hi8 false),
 * or times 256 (hi8: in the high byte of each half, for an arithmetic shift down). */
KQ_INLINE __m256i kq8r_byte16(__m256i v, int b, bool hi8) {
    uint32_t e[4]; /* dword j of a 128-bit lane: its byte 4j + b into bytes 0 and 2 (hi8: 1 and 3) */
    for (int j = 0; j < 4; j++)
        e[j] = hi8 ? (uint32_t)(4 * j + b) * 0x01000100u | 0x00800080u : (uint32_t)(4 * j + b) * 0x00010001u | 0x80008000u;
    return _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(_mm_setr_epi32((int)e[0], (int)e[1], (int)e[2], (int)e[3])));
}

/* Q4_K / Q5_K (five): sub-blocks of 32 values, the low (chunk c's sub-block 2c) and high
 * nibbles (2c + 1) of 8 groups; their products sum in int16 8 groups at a time (|.| <= 8 * 2 *
 * 15 * 128 = 30720), Q5_K's, whose qh bits add 16 to a level, 4 at a time (4 * 2 * 31 * 128). */
KQ_INLINE void q45r8_blk_avx2(const bool five, const int JB, const uint8_t *blk, const moetax_block_q8_k *const *a,
                              __m256 *acc) {
    const size_t qs_off = five ? MOETAX_K_Q5KR8_QS_OFF : MOETAX_K_Q4KR8_QS_OFF;
    const int qn = five ? 4 : 8;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m10 = _mm256_set1_epi8(0x10);
    __m256i sc03, sc47;
    kq8r_q45_scales(blk, &sc03, &sc47);
    __m256i S[KQ_BT];
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) S[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m256i scA = kq8r_byte16(c < 2 ? sc03 : sc47, (2 * c) & 3, false);
        const __m256i scB = kq8r_byte16(c < 2 ? sc03 : sc47, (2 * c + 1) & 3, false);
#pragma GCC unroll 2
        for (int q0 = 0; q0 < 8; q0 += qn) {
            __m256i sA[KQ_BT], sB[KQ_BT];
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++) sA[t] = sB[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int q = q0; q < q0 + qn; q++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 256 * c + 32 * q));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) { /* bit 2c (lo) and 2c + 1 (hi) of each qh byte to bit 4 (16-bit shifts; the mask
                             * drops what crosses bytes) */
                    const __m256i hq = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q5KR8_QH_OFF + 32 * q));
                    const int k0 = 2 * c, k1 = 2 * c + 1;
                    lo = _mm256_or_si256(lo, _mm256_and_si256(k0 <= 4 ? _mm256_slli_epi16(hq, 4 - k0)
                                                                      : _mm256_srli_epi16(hq, k0 - 4), m10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(k1 <= 4 ? _mm256_slli_epi16(hq, 4 - k1)
                                                                      : _mm256_srli_epi16(hq, k1 - 4), m10));
                }
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++) {
                    sA[t] = kq8r_dot16(sA[t], lo, a[t]->qs + 64 * c + 4 * q);
                    sB[t] = kq8r_dot16(sB[t], hi, a[t]->qs + 64 * c + 32 + 4 * q);
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++)
                S[t] = _mm256_add_epi32(S[t], _mm256_add_epi32(_mm256_madd_epi16(sA[t], scA), _mm256_madd_epi16(sB[t], scB)));
        }
    }
    __m256i mp[4];
    kq8r_q45_min_pairs(blk, mp);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + MOETAX_K_Q4KR8_DMIN_OFF)));
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) {
        const __m256i M = kq8r_q45_mins(mp, a[t]);
        const __m256 ad = _mm256_set1_ps(a[t]->d);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(ad, dw), _mm256_cvtepi32_ps(S[t])));
        acc[t] = _mm256_sub_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(ad, dm), _mm256_cvtepi32_ps(M)));
    }
}

/* Q6_K: per half h and 4-byte group p (values l = 4p..4p+3 of the half) one load each of ql
 * groups p and p + 8 and qh group p gives the four 6-bit level vectors of values 128h + 32k +
 * l (k = 0..3: ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high nibbles, with qh bits 2k,
 * 2k + 1 above them); sub-block 8h + 2k + p / 4 sums in int16 two groups at a time (2 * 2 *
 * 63 * 128), then pmaddwd against the rows' int8 scale, sign-extended; the offset of 32 once
 * per super-block. */
KQ_INLINE void q6r8_blk_avx2(const int JB, const uint8_t *blk, const moetax_block_q8_k *const *a, __m256 *acc) {
    __m256i S[KQ_BT];
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) S[t] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
        for (int p0 = 0; p0 < 8; p0 += 2) { /* two groups: half of sub-block 8h + 2k + p0 / 4 */
            __m256i cs[KQ_BT][4];
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++)
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) cs[t][k] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int p = p0; p < p0 + 2; p++) {
                __m256i v[4];
                kq8r_q6_levels(blk, h, p, v);
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++)
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) cs[t][k] = kq8r_dot16(cs[t][k], v[k], a[t]->qs + 128 * h + 32 * k + 4 * p);
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 8 * h + 2 * k + p0 / 4; /* the sub-block */
                const __m256i scj = _mm256_srai_epi16(
                    kq8r_byte16(_mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q6KR8_SC_OFF + 32 * (j >> 2))), j & 3, true),
                    8);
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++) S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(cs[t][k], scj));
            }
        }
    __m256i ev[4], od[4];
    kq8r_q6_coefs(blk, ev, od);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) acc[t] = kq8r_q6_acc(acc[t], S[t], ev, od, a[t], dw);
}

/* Q2_K / Q3_K (three): a 4-byte group g of qs (half h = g / 8, values l = 4p..4p+3 with p = g
 * % 8) holds the 2-bit levels of values 128h + 32k + l at bits 2k, 2k+1 (k = 0..3); Q3_K's
 * hmask group p adds 4 where bit 4h + k is set (its levels are q + 4, 0..7). Level vectors
 * k = 0, 2 are taken at bits 0-1 (k = 2 from the group shifted down by 4), k = 1, 3 in place
 * at bits 2-3, times 4 (Q3_K: the hmask bit ORed in above them), so that pmaddubsw never
 * saturates and a sub-block's 4 groups sum in int16 (|.| <= 4 * 2 * 28 * 128); pmaddwd
 * against its scale times 4 / that factor adds 4 * scale x sum, and sumi is S >> 2. */
KQ_INLINE void q23r8_blk_avx2(const bool three, const int JB, const uint8_t *blk, const moetax_block_q8_k *const *a,
                              __m256 *acc) {
    const size_t qs_off = three ? MOETAX_K_Q3KR8_QS_OFF : MOETAX_K_Q2KR8_QS_OFF;
    const __m256i m3 = _mm256_set1_epi8(0x03), mc = _mm256_set1_epi8(0x0c);
    __m256i U[4];
    kq8r_q23_scales(three, blk, U);
    __m256i S[KQ_BT];
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) S[t] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int sb = 0; sb < 2; sb++) {
            __m256i cs[KQ_BT][4];
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++)
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) cs[t][k] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int pp = 0; pp < 4; pp++) {
                const int p = 4 * sb + pp;
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 32 * (8 * h + p)));
                const __m256i v4 = _mm256_srli_epi16(v, 4);
                __m256i L[4] = {_mm256_and_si256(v, m3), _mm256_and_si256(v, mc), _mm256_and_si256(v4, m3),
                                _mm256_and_si256(v4, mc)};
                if (three) { /* hmask bit 4h + k to bit 2 (k = 0, 2) or 4 (k = 1, 3) */
                    const __m256i hq = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q3KR8_HM_OFF + 32 * p));
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) {
                        const int d = (k & 1 ? 4 : 2) - (4 * h + k);
                        const __m256i hs = d > 0 ? _mm256_slli_epi16(hq, d) : d < 0 ? _mm256_srli_epi16(hq, -d) : hq;
                        L[k] = _mm256_or_si256(L[k], _mm256_and_si256(hs, _mm256_set1_epi8((char)(k & 1 ? 0x10 : 0x04))));
                    }
                }
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++)
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) cs[t][k] = kq8r_dot16(cs[t][k], L[k], a[t]->qs + 128 * h + 32 * k + 4 * p);
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 8 * h + 2 * k + sb; /* the sub-block; its scale is byte j & 3 of U[j / 4] */
                const __m256i hi8 = kq8r_byte16(U[j >> 2], j & 3, true);
                /* the scale times 4 / the levels' factor (4 for k odd), int16 in both halves */
                const __m256i scj = three ? _mm256_srai_epi16(hi8, k & 1 ? 8 : 6)
                                          : _mm256_srli_epi16(_mm256_slli_epi16(hi8, 4), k & 1 ? 12 : 10);
#pragma GCC unroll 4
                for (int t = 0; t < JB; t++) S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(cs[t][k], scj));
            }
        }
    __m256i ev[4], od[4];
    kq8r_q23_coefs(three, U, ev, od);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 dm =
        three ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + MOETAX_K_Q2KR8_DMIN_OFF)));
#pragma GCC unroll 4
    for (int t = 0; t < JB; t++) {
        const __m256i c = kq8r_bsum_dot(ev, od, kq8r_bsum_pairs(a[t]));
        const __m256i sumi = three ? _mm256_sub_epi32(_mm256_srai_epi32(S[t], 2), _mm256_slli_epi32(c, 2))
                                   : _mm256_srai_epi32(S[t], 2);
        const __m256 ad = _mm256_set1_ps(a[t]->d);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(ad, dw), _mm256_cvtepi32_ps(sumi)));
        if (!three) acc[t] = _mm256_sub_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(ad, dm), _mm256_cvtepi32_ps(c)));
    }
}

enum { KQ8R_Q2, KQ8R_Q3, KQ8R_Q4, KQ8R_Q5, KQ8R_Q6 };

/* G groups (g[0], g[1]) x JB batch rows (act_row apart from xq) over nb super-blocks of kind
 * kt; y[gi][t * ldy + 0..7]. Decode (JB = 1) prefetches KQ8R_PFD ahead into L2, never past pfe;
 * batch tiles KQ8R_BPFD ahead into L2. */
KQ_INLINE void kqr8_tile_avx2(const int kt, const int G, const int JB, const uint8_t *const *g, const uint8_t *xq,
                              size_t act_row, int64_t nb, float *const *y, int64_t ldy, const uint8_t *pfe) {
    const size_t bbytes = kt == KQ8R_Q2   ? MOETAX_K_Q2KR8_BLOCK_BYTES
                          : kt == KQ8R_Q3 ? MOETAX_K_Q3KR8_BLOCK_BYTES
                          : kt == KQ8R_Q4 ? MOETAX_K_Q4KR8_BLOCK_BYTES
                          : kt == KQ8R_Q5 ? MOETAX_K_Q5KR8_BLOCK_BYTES
                                          : MOETAX_K_Q6KR8_BLOCK_BYTES;
    __m256 acc[2][KQ_BT];
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int t = 0; t < JB; t++) acc[gi][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const moetax_block_q8_k *a[KQ_BT];
#pragma GCC unroll 4
        for (int t = 0; t < JB; t++) a[t] = (const moetax_block_q8_k *)(xq + (size_t)t * act_row) + i;
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)i * bbytes;
            if (JB == 1) kq8r_prefetch_dec(blk, KQ8R_PFD, 0, bbytes, pfe);
            else kq8r_prefetch_dec(blk, KQ8R_BPFD, 0, bbytes, pfe);
            __m256 ac[KQ_BT]; /* a local copy: the compiler keeps it in registers */
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++) ac[t] = acc[gi][t];
            if (kt == KQ8R_Q2 || kt == KQ8R_Q3) q23r8_blk_avx2(kt == KQ8R_Q3, JB, blk, a, ac);
            else if (kt == KQ8R_Q6) q6r8_blk_avx2(JB, blk, a, ac);
            else q45r8_blk_avx2(kt == KQ8R_Q5, JB, blk, a, ac);
#pragma GCC unroll 4
            for (int t = 0; t < JB; t++) acc[gi][t] = ac[t];
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int t = 0; t < JB; t++) _mm256_storeu_ps(y[gi] + t * ldy, acc[gi][t]);
}

typedef void (*kqr8_avx2_fn)(const uint8_t *const *g, const uint8_t *xq, size_t act_row, int64_t nb, float *const *y,
                             int64_t ldy, const uint8_t *pfe);
#define KQR8_AVX2(KT, G, JB)                                                                                     \
    static void kqr8_avx2_##KT##_##G##x##JB(const uint8_t *const *g, const uint8_t *xq, size_t act_row,          \
                                            int64_t nb, float *const *y, int64_t ldy, const uint8_t *pfe) {       \
        kqr8_tile_avx2(KT, G, JB, g, xq, act_row, nb, y, ldy, pfe);                                               \
    }
#define KQR8_AVX2_KIND(KT) KQR8_AVX2(KT, 2, 1) KQR8_AVX2(KT, 1, 1) KQR8_AVX2(KT, 1, 2) KQR8_AVX2(KT, 1, 3) KQR8_AVX2(KT, 1, 4)
KQR8_AVX2_KIND(KQ8R_Q2) KQR8_AVX2_KIND(KQ8R_Q3) KQR8_AVX2_KIND(KQ8R_Q4) KQR8_AVX2_KIND(KQ8R_Q5) KQR8_AVX2_KIND(KQ8R_Q6)
#define KQR8_AVX2_ROW(KT)                                                                                          \
    {kqr8_avx2_##KT##_2x1, kqr8_avx2_##KT##_1x1, kqr8_avx2_##KT##_1x2, kqr8_avx2_##KT##_1x3, kqr8_avx2_##KT##_1x4}
/* [kind][0]: decode's two groups, [kind][jb]: one group x jb batch rows */
static const kqr8_avx2_fn k_kqr8_avx2[5][1 + KQ_BT] = {KQR8_AVX2_ROW(KQ8R_Q2), KQR8_AVX2_ROW(KQ8R_Q3),
                                                       KQR8_AVX2_ROW(KQ8R_Q4), KQR8_AVX2_ROW(KQ8R_Q5),
                                                       KQR8_AVX2_ROW(KQ8R_Q6)};

/* Rows [row0, gend) of x8r groups (gend - row0 a multiple of 8): decode pairs group i of
 * the range's first half with group i of its second (two streams), an odd last group alone;
 * batches take tiles of up to KQ_BT batch rows, of even size, over each group. */
static void kqr8_rows_avx2(const kqr8_avx2_fn *tiles, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t gend,
                           int64_t nb, const uint8_t *xq, size_t act_row, int64_t n_batch, float *y, int64_t ldy,
                           const uint8_t *pfe) {
    enum { R = MOETAX_K_Q4KR8_ROWS };
    _Static_assert(MOETAX_K_Q6KR8_ROWS == R && MOETAX_K_Q2KR8_ROWS == R && MOETAX_K_Q3KR8_ROWS == R, "one row group");
    int64_t r = row0;
    if (n_batch == 1) {
        const int64_t np = (gend - r) / R / 2;
        const uint8_t *w0 = w + (size_t)r * row_bytes, *wh = w0 + (size_t)(np * R) * row_bytes;
        kq_prefetch_span_l2(w0, pfe - w0 > KQ8R_PFD ? w0 + KQ8R_PFD : pfe);
        if (np > 0) kq_prefetch_span_l2(wh, pfe - wh > KQ8R_PFD ? wh + KQ8R_PFD : pfe);
        for (int64_t i = 0; i < np; i++) {
            const int64_t ra = r + i * R, rb = ra + np * R;
            const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
            float *yy[2] = {y + ra, y + rb};
            tiles[0](gg, xq, act_row, nb, yy, ldy, pfe);
        }
        r += 2 * np * R;
    }
    const uint8_t *none = w + (size_t)row0 * row_bytes, *wr = w + (size_t)r * row_bytes; /* none: no L2 prefetch */
    if (n_batch > 1 && r < gend) /* the first group's first KQ8R_BPFD bytes at once, as decode's */
        kq_prefetch_span_l2(wr, pfe - wr > KQ8R_BPFD ? wr + KQ8R_BPFD : pfe);
    for (; r < gend; r += R)
        for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
            const int64_t left = n_batch - j0, n_tiles = (left + KQ_BT - 1) / KQ_BT;
            jb = (left + n_tiles - 1) / n_tiles;
            const uint8_t *gg[1] = {w + (size_t)r * row_bytes};
            float *yy[1] = {y + j0 * ldy + r};
            /* the group's later tiles find it in L2 */
            tiles[jb](gg, xq + (size_t)j0 * act_row, act_row, nb, yy, ldy, j0 ? none : pfe);
        }
}

void moetax_k_matmul_kq_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                             int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    const int64_t nb = ncols / MOETAX_QK_K;
    const size_t bsz = moetax_type_size(wtype);
    const size_t act_row = moetax_k_act_row_bytes(wtype, ncols);
    const bool six = wtype == MOETAX_TYPE_Q6_K, five = wtype == MOETAX_TYPE_Q5_K;
    const bool two = wtype == MOETAX_TYPE_Q2_K, three = wtype == MOETAX_TYPE_Q3_K;
    const bool sub = six || three; /* the offset is in the integer sum; else dmin's term */
    { /* x8r groups, then the unit's plain tail (n_rows % 8 rows) */
        const int64_t gend = row1 - (row1 - row0) % MOETAX_K_Q4KR8_ROWS;
        const int kt = two ? KQ8R_Q2 : three ? KQ8R_Q3 : five ? KQ8R_Q5 : six ? KQ8R_Q6 : KQ8R_Q4;
        /* cached weights: the decode's prefetch end at the range's start, so none is issued */
        kqr8_rows_avx2(k_kqr8_avx2[kt], (const uint8_t *)w, row_bytes, row0, gend, nb,
                       (const uint8_t *)xq, act_row, n_batch, y, ldy,
                       (const uint8_t *)w + (size_t)(far ? row1 : row0) * row_bytes);
        row0 = gend;
        if (row0 == row1) return;
    }
    if (n_batch == 1) {
        kq_decode_rows(wtype, (const uint8_t *)w, row_bytes, row0, row1, nb, (const moetax_block_q8_k *)xq, y);
        return;
    }
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
                else if (three) decode_q3k(bp, &k);
                else if (two) decode_q2k(bp, &k);
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
                    if (sub) {
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
