/* matmul_avx2.c - AVX2/FMA/F16C activation preparation and matrix x
 * vector(s). Compiled with -mavx2 -mfma -mf16c; only reached through the
 * table when cpuid says the CPU has all three.
 *
 * Shape of every kernel: a tile of RB weight rows x BB batch rows is computed
 * in registers (RB*BB accumulators), so each weight vector loaded from memory
 * is used BB times and each activation vector RB times. Decode (n_batch == 1)
 * reads F32/F16/BF16 rows of 0.5-8 KiB two at a time from the two halves of
 * the row range (two contiguous streams per core, rows1_f), other rows 4 at a
 * time; Q8_0 pairs its groups of 4 rows the same way. Weights are
 * software-prefetched QPF bytes ahead (short rows defeat the hardware
 * prefetcher), with the activation loads shared. F32/F16/BF16 with more batch
 * rows than one tile cut the columns into L1-sized chunks so the weights come
 * from memory once per call.
 *
 * Q8_0 / Q4_0 weights are multiplied in int8 with pmaddubsw (u8 x s8 -> i16
 * pairs), pmaddwd (-> i32), then converted to float and accumulated with the
 * block scale d_w * d_x:
 *   Q8_0: |w| x sign(x, w) (ggml's trick), one block per step; repacked at
 *         load (Q8_0x4r, kernels.h): 4 rows' blocks side by side, so a
 *         4-row tile reads one sequential stream and its 4 scales with one
 *         cvtph.
 *   Q4_0: repacked at load (Q4_0x8r, kernels.h): 8 rows interleaved, so
 *         each 32-bit lane of a nibble vector belongs to one row and meets a
 *         broadcast 4-byte group of the activation quants (pmaddubsw of the
 *         unsigned nibbles); 4 such vectors (a block of 8 rows) sum in int16,
 *         one pmaddwd gives the 8 rows' block sums, minus the prepared
 *         s = 8 * sum(x) for the -8 offset, and one cvt / fma per block
 *         applies the 8 rows' scales (one cvtph) times d_x.
 * Other d_w (F16) are read through the shared 64 Ki-entry fp16 -> fp32 table.
 *
 * Q8_0 with QB_MIN or more batch rows (prefill) takes another path, with
 * weight rows in the lanes of int16 pmaddwd (see "batched Q8_0" below),
 * with bit-identical results. */
#include "kernels_impl.h"

#include <assert.h>
#include <math.h>
#include <float.h>
#include <immintrin.h>
#include <string.h>

#include "moetax/types.h"
#include "simd_avx2.h"


/* ------------------------------------------------------------------------ */
/* activation preparation                                                   */
/* ------------------------------------------------------------------------ */

/* roundf (ties away from zero), exactly, for |v| < 2^23. */
ALWAYS_INLINE __m256 round_away(__m256 v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(sign, v));
    const __m256 adj = _mm256_and_ps(_mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one);
    return _mm256_add_ps(t, adj);
}

/* The 32 quants of the floats at xb times vid (1 / d), rounded away from zero, natural order. */
ALWAYS_INLINE __m256i quants_block(const float *xb, __m256 vid) {
    __m256i i0 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(_mm256_loadu_ps(xb), vid)));
    __m256i i1 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), vid)));
    __m256i i2 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), vid)));
    __m256i i3 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), vid)));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* ggml's Q8_0 quantization of 32 floats: the quants (natural order) and d. A block with a NaN or an
 * infinity, or whose 1 / d overflows, takes the reference's scalar steps (vcvttps2dq would make
 * -128 of what moetax_q8_round makes 0 or 127; vmaxps can drop a NaN). */
ALWAYS_INLINE __m256i quantize_block(const float *xb, float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb)), a1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8));
    const __m256 a2 = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 16)), a3 = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 24));
    const __m256 m = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    /* the magnitudes' sum keeps a NaN (and an infinity) that vmaxps may drop; one that overflows only sends a
     * finite block the reference's way, which gives the same bytes */
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    if (!(id <= FLT_MAX) || _mm256_movemask_ps(_mm256_cmp_ps(sum, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ))) {
        _Alignas(32) int8_t qs[32];
        moetax_k_quantize_block_q8_ref(xb, qs, d_out);
        return _mm256_load_si256((const __m256i *)qs);
    }
    *d_out = moetax_k_fp16_table[moetax_fp32_to_fp16(dd)];
    return quants_block(xb, _mm256_set1_ps(id));
}

/* The 8 lanes of m[0..7] each reduced to their max: lane j of the result is max(m[j]). Max is
 * exact, so the order does not matter (NaN aside: quantize_8blocks leaves such groups to
 * quantize_block). */
ALWAYS_INLINE __m256 hmax8x8(const __m256 *m) {
    const __m256 a01 = _mm256_max_ps(_mm256_unpacklo_ps(m[0], m[1]), _mm256_unpackhi_ps(m[0], m[1]));
    const __m256 a23 = _mm256_max_ps(_mm256_unpacklo_ps(m[2], m[3]), _mm256_unpackhi_ps(m[2], m[3]));
    const __m256 a45 = _mm256_max_ps(_mm256_unpacklo_ps(m[4], m[5]), _mm256_unpackhi_ps(m[4], m[5]));
    const __m256 a67 = _mm256_max_ps(_mm256_unpacklo_ps(m[6], m[7]), _mm256_unpackhi_ps(m[6], m[7]));
    /* per 128-bit half: [m0 m1 m2 m3] and [m4 m5 m6 m7], each over that half's lanes */
    const __m256 b03 = _mm256_max_ps(_mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 b47 = _mm256_max_ps(_mm256_shuffle_ps(a45, a67, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(a45, a67, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_max_ps(_mm256_permute2f128_ps(b03, b47, 0x20), _mm256_permute2f128_ps(b03, b47, 0x31));
}

/* Eight Q8_0 blocks (the floats at src[j], quants to q[j], d to d[j]), 8 at a time: their 8
 * maxima in one vector, then d = amax / 127, 1 / d, the F16 rounding of d (vcvtps2ph, ties to
 * even: the bits of moetax_fp32_to_fp16 for every number) and back, each once for the 8 blocks.
 * quantize_block's steps one block at a time had a chain of two divisions and a call per block.
 * The same bytes (test_kernels against the reference). */
ALWAYS_INLINE void quantize_8blocks(const float *const *src, uint8_t *const *q, float *const *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 m[8], sum = zero;
    for (int j = 0; j < 8; j++) {
        const float *b = src[j];
        const __m256 a0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b)), a1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 8));
        const __m256 a2 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 16)), a3 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 24));
        m[j] = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
        sum = _mm256_add_ps(sum, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))); /* NaN stays NaN */
    }
    const __m256 amax = hmax8x8(m);
    const __m256 dd = _mm256_div_ps(amax, _mm256_set1_ps(127.0f));
    const __m256 nz = _mm256_cmp_ps(dd, zero, _CMP_NEQ_OQ);
    const __m256 id = _mm256_and_ps(nz, _mm256_div_ps(_mm256_set1_ps(1.0f), dd));
    /* a maximum or a 1 / d that is not finite (an infinity, a scale too small to invert), or a NaN that
     * vmaxps dropped (the sum of the magnitudes keeps it; a sum that overflows only sends finite blocks
     * the same way): block by block (quantize_block gives such a block the reference's steps) */
    const __m256 big = _mm256_set1_ps(FLT_MAX);
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_max_ps(amax, id), big, _CMP_NLE_UQ),
                                        _mm256_cmp_ps(sum, big, _CMP_NLE_UQ)))) {
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)q[j], quantize_block(src[j], d[j]));
        return;
    }
    float dv[8], idv[8];
    _mm256_storeu_ps(dv, _mm256_cvtph_ps(_mm256_cvtps_ph(dd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm256_storeu_ps(idv, id);
    for (int j = 0; j < 8; j++) {
        *d[j] = dv[j];
        _mm256_storeu_si256((__m256i *)q[j], quants_block(src[j], _mm256_set1_ps(idv[j])));
    }
}

/* Q8_0 rows of nb blocks each (row b's floats at x + b ldx, its prepared row at out + b row_bytes:
 * kernels.h), 8 blocks at a time (quantize_8blocks), across rows where a row has fewer (the
 * per-head rows of attention, experts' hidden rows), the last few one by one. */
static void quantize_rows_q8(const float *x, int64_t ldx, int64_t nb, int64_t n_rows, uint8_t *out,
                             size_t row_bytes) {
    const size_t doff = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    int64_t left = nb * n_rows, b = 0, i = 0; /* blocks left; the next one: row b, block i */
    for (; left >= 8; left -= 8) {
        const float *src[8];
        uint8_t *q[8];
        float *d[8];
        for (int j = 0; j < 8; j++) {
            uint8_t *row = out + (size_t)b * row_bytes;
            src[j] = x + b * ldx + i * 32;
            q[j] = row + i * 32;
            d[j] = (float *)(row + doff) + i;
            if (++i == nb) { i = 0; b++; }
        }
        quantize_8blocks(src, q, d);
    }
    for (; left > 0; left--) {
        uint8_t *row = out + (size_t)b * row_bytes;
        _mm256_storeu_si256((__m256i *)(row + i * 32), quantize_block(x + b * ldx + i * 32, (float *)(row + doff) + i));
        if (++i == nb) { i = 0; b++; }
    }
}

/* Q4_0 rows (kernels.h): the Q8_0 row (made by quantize_rows_q8), then s[i] = 8 * sum of block i's
 * quants. */
static void sums_row_q4(int64_t nb, uint8_t *out) {
    int32_t *s = (int32_t *)(out + moetax_k_act_s_off(nb));
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(out + i * 32));
        /* maddubs(1, q): adjacent quants summed in int16, then pmaddwd: in int32 */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, q), one16);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        s[i] = 8 * _mm_cvtsi128_si32(t);
    }
}

/* block_q8_K rows (k-quant weights): the bytes of moetax_quantize_row_q8_k_ref. Per super-block
 * the largest |x| is found by vmaxps, then its first occurrence (the scalar scan keeps the first
 * of equal magnitudes, so a tie of +a and -a takes the earlier sign) by a compare. iscale and d
 * are the scalar's float expressions; each level is round-to-nearest-even of iscale * x (the
 * scalar's 1.5 * 2^23 trick is that rounding for |v| < 2^22; here |v| <= 127 and a bit) by
 * vcvtps2dq, capped at 127 as the scalar does; bsums are exact integer sums. A block with a NaN
 * or an infinity, or whose iscale overflows (tiny values), is outside what these steps reproduce
 * and takes the scalar code. */
static void quantize_row_q8k(const float *x, moetax_block_q8_k *y, int64_t ncols) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < ncols / MOETAX_QK_K; i++, x += MOETAX_QK_K) {
        __m256 am = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int j = 0; j < MOETAX_QK_K; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = _mm_cvtss_f32(m4);
        if (_mm256_movemask_ps(bad) || !(amax <= 3.0e38f)) { /* NaN or inf: the scalar code */
            moetax_quantize_row_q8_k_ref(x, y + i, MOETAX_QK_K);
            continue;
        }
        if (!amax) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float max = amax;
        const __m256 amv = _mm256_set1_ps(amax);
        for (int j = 0; j < MOETAX_QK_K; j += 8) {
            const int mk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), amv, _CMP_EQ_OQ));
            if (mk) {
                max = x[j + __builtin_ctz((unsigned)mk)];
                break;
            }
        }
        const float iscale = -127.f / max;
        if (!(fabsf(iscale) <= 3.0e38f)) { /* max below ~4e-37: iscale overflows, the scalar code */
            moetax_quantize_row_q8_k_ref(x, y + i, MOETAX_QK_K);
            continue;
        }
        const __m256 is = _mm256_set1_ps(iscale);
        const __m256i cap = _mm256_set1_epi32(127), one = _mm256_set1_epi16(1);
        for (int j = 0; j < MOETAX_QK_K; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++)
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + j + 8 * k))), cap);
            /* packs work per 128-bit lane: words (0 1 | 2 3 of q0/q1 lanes), then bytes; fix the order */
            const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
            const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), b);
            /* bsums of values j..j+15 and j+16..j+31: sum of the int16 words of each 16 */
            const __m256i w = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
            const __m256i w2 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
            __m256i s2 = _mm256_hadd_epi32(_mm256_madd_epi16(w, one), _mm256_madd_epi16(w2, one));
            /* dwords: (w lane0: 2 sums, w2 lane0: 2 | w lane1: 2, w2 lane1: 2) */
            s2 = _mm256_hadd_epi32(s2, s2);
            /* dwords 0, 1: w lane 0, w2 lane 0; 4, 5: w lane 1, w2 lane 1 */
            const int32_t a0 = _mm256_extract_epi32(s2, 0), a1 = _mm256_extract_epi32(s2, 1);
            const int32_t c0 = _mm256_extract_epi32(s2, 4), c1 = _mm256_extract_epi32(s2, 5);
            y[i].bsums[j / 16] = (int16_t)(a0 + c0);
            y[i].bsums[j / 16 + 1] = (int16_t)(a1 + c1);
        }
        y[i].d = 1 / iscale;
    }
}

void moetax_k_quantize_act_avx2(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols,
                                int64_t n_batch, void *xq) {
    const size_t row_bytes = moetax_k_act_row_bytes(wtype, ncols);
    if (moetax_k_act_is_q(wtype)) { /* Q5_0 and IQ4_NL weights take the Q8_0 row */
        quantize_rows_q8(x, ldx, ncols / 32, n_batch, (uint8_t *)xq, row_bytes);
        if (moetax_act_is_q4_0(wtype))
            for (int64_t b = 0; b < n_batch; b++) sums_row_q4(ncols / 32, (uint8_t *)xq + (size_t)b * row_bytes);
        return;
    }
    for (int64_t b = 0; b < n_batch; b++) {
        const float *xr = x + b * ldx;
        uint8_t *out = (uint8_t *)xq + (size_t)b * row_bytes;
        if (moetax_k_act_is_k(wtype)) quantize_row_q8k(xr, (moetax_block_q8_k *)out, ncols);
        else memcpy(out, xr, (size_t)ncols * sizeof(float));
    }
}

/* Prefetch distance (bytes ahead in each weight row). A tile reads RB rows as
 * RB interleaved streams; rows of Q weights (2-5 KiB for 4096 columns) and of
 * expert-sized matrices are short streams that the hardware prefetcher barely
 * ramps up on, so each row is fetched QPF bytes ahead, continuing into the
 * same row of the next tile of RB rows (prefetches past the matrix are
 * harmless: they never fault). */
#ifndef QPF
#define QPF 1024
#endif
#ifndef QPF_HINT
#define QPF_HINT _MM_HINT_T0
#endif

/* Weights streamed from memory (moetax_k_matmul_avx2_stream: a model larger than the
 * last-level cache, kernels.h) are also fetched PF_FAR bytes ahead into L2 by the decode
 * (Q8_0, Q4_0, and F32/F16/BF16 one or two rows at a time), so that the L1 prefetches QPF ahead find their lines there. Weights that
 * stay in the caches between tokens go without it: for them the prefetch instructions
 * are only added work (commit messages have the figures). */
#ifndef PF_FAR
#define PF_FAR 4096
#endif

/* F32/F16/BF16 rows are fetched the same number of columns ahead: QPF bytes of
 * 2-byte weights, half as many bytes of F32. Measured on `small` F32 decode (2
 * threads, 6 alternating pairs): 512 bytes ahead instead of 1024 gave a median
 * TPOT ratio of 0.93; the same change for F16 and Q8_0 was 3-6% slower. */
#define FPF(esz) ((size_t)QPF * 2 / (esz))

/* Prefetch position pos + dist of each of the RB rows of a tile (the same
 * offset in every row, so one base address serves all of them). */
ALWAYS_INLINE void prefetch_tile(const uint8_t *w, size_t rb, int RB, size_t pos, size_t dist) {
    const size_t off = pos + dist;
    const char *base = (const char *)w + off + (off >= rb ? (size_t)(RB - 1) * rb : 0);
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) _mm_prefetch(base + r * rb, QPF_HINT);
}

/* ------------------------------------------------------------------------ */
/* F32 / F16 / BF16 weights                                                 */
/* ------------------------------------------------------------------------ */

ALWAYS_INLINE __m256 load_w8(enum moetax_type t, const uint8_t *w, int64_t k) {
    if (t == MOETAX_TYPE_F32) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    if (t == MOETAX_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE float load_w1(enum moetax_type t, const uint8_t *w, int64_t k) {
    if (t == MOETAX_TYPE_F32) return ((const float *)w)[k];
    uint16_t h;
    memcpy(&h, w + 2 * k, 2);
    if (t == MOETAX_TYPE_F16) return moetax_k_fp16_table[h];
    return moetax_bf16_to_fp32(h);
}

/* Each tile also prefetches the rows TF_PF_ROWS below its own (the tile after next: tiles go down
 * a column chunk's rows) into L2, at the columns it reads: the distance above is too near to hide
 * the memory's latency where rows are short, as the KV cache's rows that attention reads. */
enum { TF_PF_ROWS = 8 };

/* RB rows starting at w (stride rb) x BB batch rows starting at x (stride ldx),
 * over columns [k0, k1); y[j * ldy + r] = (or +=, if add) the partial dots. */
ALWAYS_INLINE void tile_f(enum moetax_type t, const int RB, const int BB, const uint8_t *w, size_t rb,
                          const float *x, int64_t ldx, int64_t k0, int64_t k1, float *y, int64_t ldy, bool add) {
    const size_t esz = t == MOETAX_TYPE_F32 ? 4 : 2;
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        prefetch_tile(w, rb, RB, (size_t)k * esz, FPF(esz));
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) _mm_prefetch((const char *)w + (r + TF_PF_ROWS) * rb + (size_t)k * esz, _MM_HINT_T1);
#pragma GCC unroll 2
        for (int h = 0; h < 16; h += 8) {
            __m256 xv[4];
#pragma GCC unroll 4
            for (int j = 0; j < BB; j++) xv[j] = _mm256_loadu_ps(x + j * ldx + k + h);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) {
                const __m256 wv = load_w8(t, w + r * rb, k + h);
#pragma GCC unroll 4
                for (int j = 0; j < BB; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
            }
        }
    }
    for (; k + 8 <= k1; k += 8) {
        __m256 xv[4];
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) xv[j] = _mm256_loadu_ps(x + j * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const __m256 wv = load_w8(t, w + r * rb, k);
#pragma GCC unroll 4
            for (int j = 0; j < BB; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) {
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) {
            float s = hsum_ps(acc[r][j]);
            for (int64_t kk = k; kk < k1; kk++) s += load_w1(t, w + r * rb, kk) * x[j * ldx + kk];
            y[j * ldy + r] = add ? y[j * ldy + r] + s : s;
        }
    }
}

typedef void (*tile_f_fn)(const uint8_t *w, size_t rb, const float *x, int64_t ldx, int64_t k0, int64_t k1,
                          float *y, int64_t ldy, bool add);

#define TILE_F(T, RB, BB, tag)                                                                               \
    static void tile_##tag##_##RB##x##BB(const uint8_t *w, size_t rb, const float *x, int64_t ldx, int64_t k0, \
                                         int64_t k1, float *y, int64_t ldy, bool add) {                     \
        tile_f(T, RB, BB, w, rb, x, ldx, k0, k1, y, ldy, add);                                              \
    }
#define TILES_F(T, tag)                                                                                    \
    TILE_F(T, 4, 1, tag) TILE_F(T, 4, 2, tag) TILE_F(T, 4, 3, tag)                                        \
    TILE_F(T, 1, 1, tag) TILE_F(T, 1, 2, tag) TILE_F(T, 1, 3, tag)
TILES_F(MOETAX_TYPE_F32, f32)
TILES_F(MOETAX_TYPE_F16, f16)
TILES_F(MOETAX_TYPE_BF16, bf16)

/* [type][rb == 4][bb - 1] */
static const tile_f_fn k_tiles_f[3][2][3] = {
    {{tile_f32_1x1, tile_f32_1x2, tile_f32_1x3}, {tile_f32_4x1, tile_f32_4x2, tile_f32_4x3}},
    {{tile_f16_1x1, tile_f16_1x2, tile_f16_1x3}, {tile_f16_4x1, tile_f16_4x2, tile_f16_4x3}},
    {{tile_bf16_1x1, tile_bf16_1x2, tile_bf16_1x3}, {tile_bf16_4x1, tile_bf16_4x2, tile_bf16_4x3}},
};

/* Decode (one batch row): 4 rows at a time share each activation load but read
 * 4 interleaved streams; rows of a few KiB are too short for the hardware
 * prefetcher to train on 4 streams before they end, while 4 rows together are
 * not yet one contiguous run. Between the bounds, rows go two at a time instead:
 * row i of the range's first half with row i of its second half, so each core
 * reads two streams that stay contiguous across rows (rows1_f). Bounds in bytes
 * per row. AMD Zen 3 VM, `small` decode with 2 threads, alternating builds:
 * two contiguous streams against one row at a time, F16: 89-104 against 80-87
 * t/s (6 of 6 pairs); F32 (4 KiB rows, before on the 4-row tiles): 53-58
 * against 37-53 t/s (6 of 6); a stand-alone F16 matvec read 10.5 against 8.6
 * GB/s on one core. Earlier, on the same machine: F16 1024 x 256 (512-byte
 * rows) read at 9-10 GB/s 4 rows at a time and 12.5-15 GB/s one at a time.
 * 16 KiB as the upper bound (the dense FFN's down rows too): no difference
 * within the noise. Moving the bound from 4 to 8 KiB changed how rows of 4-8
 * KiB are summed (4 accumulators instead of a tile's one), so their results
 * moved by rounding: F32 with 1024-2047 columns, F16/BF16 with 2048-4095
 * (within the kernels' tolerances; rows below 4 KiB kept their bits). Q8_0 and Q4_0 need no such switch: their repacked groups
 * of rows are one stream already. */
#ifndef FROW_MIN
#define FROW_MIN 512
#endif
#ifndef FROW_MAX
#define FROW_MAX 8192
#endif
static bool f_one_row(int ti, int64_t ncols) {
    const int64_t bytes = ncols * (ti == 0 ? 4 : 2);
    return bytes >= FROW_MIN && bytes < FROW_MAX;
}

/* One row, one batch row (the decode one-row path): 4 accumulators over 32
 * columns a step, so the fma chain's latency does not bound it (one accumulator
 * held F16 at ~11 GB/s per core even from L2, about what a core has to stream
 * from memory with 2 threads). */
ALWAYS_INLINE float row1_f(enum moetax_type t, const bool far, const uint8_t *w, const float *x, int64_t ncols) {
    const size_t esz = t == MOETAX_TYPE_F32 ? 4 : 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= ncols; k += 32) {
        _mm_prefetch((const char *)w + (size_t)k * esz + FPF(esz), QPF_HINT);
        if (esz == 4) _mm_prefetch((const char *)w + (size_t)k * esz + FPF(esz) + 64, QPF_HINT);
        if (far) { /* streamed weights: PF_FAR ahead into L2 as well */
            _mm_prefetch((const char *)w + (size_t)k * esz + PF_FAR, _MM_HINT_T1);
            if (esz == 4) _mm_prefetch((const char *)w + (size_t)k * esz + PF_FAR + 64, _MM_HINT_T1);
        }
        a0 = _mm256_fmadd_ps(load_w8(t, w, k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_w8(t, w, k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_w8(t, w, k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_w8(t, w, k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= ncols; k += 8) a0 = _mm256_fmadd_ps(load_w8(t, w, k), _mm256_loadu_ps(x + k), a0);
    float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < ncols; k++) s += load_w1(t, w, k) * x[k];
    return s;
}

/* Two rows, a and b, each summed exactly as row1_f sums it (same accumulators,
 * same order: the same bits), sharing the activation loads. */
ALWAYS_INLINE void row2_f(enum moetax_type t, const bool far, const uint8_t *wa, const uint8_t *wb, const float *x,
                          int64_t ncols, float *ya, float *yb) {
    const size_t esz = t == MOETAX_TYPE_F32 ? 4 : 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 32 <= ncols; k += 32) {
        _mm_prefetch((const char *)wa + (size_t)k * esz + FPF(esz), QPF_HINT);
        _mm_prefetch((const char *)wb + (size_t)k * esz + FPF(esz), QPF_HINT);
        if (far) {
            _mm_prefetch((const char *)wa + (size_t)k * esz + PF_FAR, _MM_HINT_T1);
            _mm_prefetch((const char *)wb + (size_t)k * esz + PF_FAR, _MM_HINT_T1);
            if (esz == 4) {
                _mm_prefetch((const char *)wa + (size_t)k * esz + PF_FAR + 64, _MM_HINT_T1);
                _mm_prefetch((const char *)wb + (size_t)k * esz + PF_FAR + 64, _MM_HINT_T1);
            }
        }
        if (esz == 4) {
            _mm_prefetch((const char *)wa + (size_t)k * esz + FPF(esz) + 64, QPF_HINT);
            _mm_prefetch((const char *)wb + (size_t)k * esz + FPF(esz) + 64, QPF_HINT);
        }
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(load_w8(t, wa, k), xv, a0);
        b0 = _mm256_fmadd_ps(load_w8(t, wb, k), xv, b0);
        xv = _mm256_loadu_ps(x + k + 8);
        a1 = _mm256_fmadd_ps(load_w8(t, wa, k + 8), xv, a1);
        b1 = _mm256_fmadd_ps(load_w8(t, wb, k + 8), xv, b1);
        xv = _mm256_loadu_ps(x + k + 16);
        a2 = _mm256_fmadd_ps(load_w8(t, wa, k + 16), xv, a2);
        b2 = _mm256_fmadd_ps(load_w8(t, wb, k + 16), xv, b2);
        xv = _mm256_loadu_ps(x + k + 24);
        a3 = _mm256_fmadd_ps(load_w8(t, wa, k + 24), xv, a3);
        b3 = _mm256_fmadd_ps(load_w8(t, wb, k + 24), xv, b3);
    }
    for (; k + 8 <= ncols; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(load_w8(t, wa, k), xv, a0);
        b0 = _mm256_fmadd_ps(load_w8(t, wb, k), xv, b0);
    }
    float sa = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float sb = hsum_ps(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
    for (; k < ncols; k++) {
        sa += load_w1(t, wa, k) * x[k];
        sb += load_w1(t, wb, k) * x[k];
    }
    *ya = sa;
    *yb = sb;
}

#ifndef ROWS2 /* -DROWS2=0: one row at a time (for A/B runs) */
#define ROWS2 1
#endif

ALWAYS_INLINE void rows1_f(int ti, const bool far, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const float *x, float *y) {
    if (ROWS2) {
        /* two streams per core: row i of the range's first half with row i of its second
         * half, each half one contiguous run */
        const int64_t h = (row1 - row0) / 2;
        for (int64_t i = 0; i < h; i++) {
            const int64_t ra = row0 + i, rb = row0 + h + i;
            const uint8_t *wa = w + (size_t)ra * row_bytes, *wb = w + (size_t)rb * row_bytes;
            if (ti == 0) row2_f(MOETAX_TYPE_F32, far, wa, wb, x, ncols, y + ra, y + rb);
            else if (ti == 1) row2_f(MOETAX_TYPE_F16, far, wa, wb, x, ncols, y + ra, y + rb);
            else row2_f(MOETAX_TYPE_BF16, far, wa, wb, x, ncols, y + ra, y + rb);
        }
        row0 += 2 * h;
    }
    for (int64_t r = row0; r < row1; r++) {
        const uint8_t *wr = w + (size_t)r * row_bytes;
        y[r] = ti == 0 ? row1_f(MOETAX_TYPE_F32, far, wr, x, ncols)
               : ti == 1 ? row1_f(MOETAX_TYPE_F16, far, wr, x, ncols)
                         : row1_f(MOETAX_TYPE_BF16, far, wr, x, ncols);
    }
}
static void rows1_f_near(int ti, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                         const float *x, float *y) {
    rows1_f(ti, false, w, row_bytes, row0, row1, ncols, x, y);
}
static void rows1_f_far(int ti, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                        const float *x, float *y) {
    rows1_f(ti, true, w, row_bytes, row0, row1, ncols, x, y);
}

/* With more batch rows than one tile holds, the columns are cut into chunks
 * whose RB weight rows stay in L1 (16 KiB) while every batch tile passes over
 * them, so weights come from memory once per call, not once per batch tile. */
static void matmul_f(int ti, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                     const float *x, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { BBMAX = 3 };
    const int64_t kc = n_batch > BBMAX ? (ti == 0 ? 1024 : 2048) : ncols;
    if (n_batch == 1 && f_one_row(ti, ncols)) {
        (far ? rows1_f_far : rows1_f_near)(ti, w, row_bytes, row0, row1, ncols, x, y);
        return;
    }
    for (int64_t r = row0; r < row1;) {
        const int rb4 = row1 - r >= 4;
        for (int64_t k0 = 0; k0 < ncols; k0 += kc) {
            const int64_t k1 = ncols - k0 > kc ? k0 + kc : ncols;
            for (int64_t j = 0; j < n_batch;) {
                const int64_t left = n_batch - j;
                const int bb = left >= BBMAX ? BBMAX : (int)left;
                k_tiles_f[ti][rb4][bb - 1](w + (size_t)r * row_bytes, row_bytes, x + j * ncols, ncols, k0, k1,
                                           y + j * ldy + r, ldy, k0 > 0);
                j += bb;
            }
        }
        r += rb4 ? 4 : 1;
    }
}

/* ------------------------------------------------------------------------ */
/* Q8_0 / Q4_0 weights x Q8 activations                                     */
/* ------------------------------------------------------------------------ */

/* Q8_0 rows compute, in every path (this one, qb_matmul_q8 below, any n_batch,
 * any row split), the same canonical sum: the exact int32 block sum S_b, then
 * one sequential chain per output acc = fma((float)S_b, d_w[b] * d_x[b], acc)
 * over the blocks in order, from 0. So prefill and step-by-step decode give
 * bit-identical logits (a rounding difference would otherwise cascade through
 * the next activation quantization and the expert choice). Here each row's 8
 * partial lanes are summed in int32 per block: 4 rows' sums by a pmaddwd
 * tree + phaddd, then one 4-lane cvt / mul / fma per batch row. */
ALWAYS_INLINE __m128i hsum4_epi32(__m256i t0, __m256i t1, __m256i t2, __m256i t3) {
    const __m256i a = _mm256_hadd_epi32(t0, t1), b = _mm256_hadd_epi32(t2, t3);
    const __m256i c = _mm256_hadd_epi32(a, b); /* [t0 t1 t2 t3 (lanes 0-3) | t0 t1 t2 t3 (lanes 4-7)] */
    return _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

ALWAYS_INLINE __m128i hsum1_epi32(__m256i t) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
}

/* Plain Q8_0 rows (a unit's last n_rows % 4 rows), one at a time, against BB
 * batch rows; and a Q8_0x4r group of 4 rows (kernels.h, WEIGHT LAYOUTS) against
 * BB batch rows: per block the 4 rows' scales are one 8-byte load + cvtph and
 * the 4 rows' quants the next 128 bytes, so the group is one sequential stream.
 * Both keep the canonical chain of every Q8_0 path: per row and batch row,
 * acc = fma((float)S_b, d_w[b] * d_x[b], acc) over the blocks in order, from 0,
 * with S_b the exact int32 block sum (so batch sizes, row splits and the
 * batched path below give bit-identical results). */
ALWAYS_INLINE void tile_q8(const int RB, const int BB, const uint8_t *w, const uint8_t *act, size_t act_row,
                           int64_t nb, float *y, int64_t ldy) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc[4]; /* per batch row: rows in lanes (RB == 4) or lane 0 (RB == 1) */
#pragma GCC unroll 4
    for (int j = 0; j < BB; j++) acc[j] = _mm_setzero_ps();

    for (int64_t b = 0; b < nb; b++) {
        __m256i xv[4];
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) xv[j] = _mm256_loadu_si256((const __m256i *)(act + j * act_row + b * 32));
        __m256i wv[4], aw[4];
        __m128 dw;
        if (RB == 4) { /* x4r: w is the group */
            const uint8_t *blk = w + (size_t)b * MOETAX_K_Q8R4_BLOCK_BYTES;
            if (QPF > 0) { /* 136 bytes a block: 3 prefetches 48 apart touch every line */
                _mm_prefetch((const char *)blk + QPF, QPF_HINT);
                _mm_prefetch((const char *)blk + QPF + 48, QPF_HINT);
                _mm_prefetch((const char *)blk + QPF + 96, QPF_HINT);
            }
            dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                wv[r] = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q8R4_QS_OFF + 32 * r));
                aw[r] = _mm256_sign_epi8(wv[r], wv[r]);
            }
        } else {
            const uint8_t *blk = w + (size_t)b * sizeof(moetax_block_q8_0);
            if (QPF > 0) _mm_prefetch((const char *)blk + QPF, QPF_HINT);
            uint16_t dh;
            memcpy(&dh, blk, 2);
            dw = _mm_set_ss(moetax_k_fp16_table[dh]);
            wv[0] = _mm256_loadu_si256((const __m256i *)(blk + 2));
            aw[0] = _mm256_sign_epi8(wv[0], wv[0]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) {
            __m256i t[4];
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++)
                t[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv[j], wv[r])), ones);
            const __m128i sum = RB == 4 ? hsum4_epi32(t[0], t[1], t[2], t[3]) : hsum1_epi32(t[0]);
            const __m128 dx = _mm_broadcast_ss((const float *)(act + j * act_row + d_off) + b);
            acc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(dw, dx), acc[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < BB; j++) {
        if (RB == 4) _mm_storeu_ps(y + j * ldy, acc[j]);
        else _mm_store_ss(y + j * ldy, acc[j]);
    }
}

/* Q4_0 weights in the Q4_0x8r layout (kernels.h, WEIGHT LAYOUTS): a group of 8
 * rows is one stream of 144-byte blocks [d of rows 0..7 | 4 chunks x 8 rows x 4
 * nibble bytes]. Chunk c of a block holds nibble bytes 4c..4c+3 of each row, i.e.
 * (low nibbles) values 4c..4c+3 and (high nibbles) 16+4c..16+4c+3: against the
 * activation quants at those positions, broadcast to every lane, pmaddubsw gives
 * per lane (row) two int16 partial sums. Four chunks' low and high products sum
 * in int16 without overflow (a lane adds 16 products q x, 0 <= q <= 15,
 * |x| <= 127: |lane| <= 30480), pmaddwd gives the 8 rows' exact block sums in
 * int32, minus s = 8 * sum(x) of the block; then the canonical chain of every
 * Q4_0 path here: acc = fma((float)S_b, d_w[b] * d_x[b], acc) over the blocks
 * in order, from 0, so every batch size and row split gives bit-identical
 * results (prefill == step-by-step decode, as for Q8_0).
 *
 * q4r8_group: the 8 rows of the group at g against BB (1..4) batch rows; the
 * weights of a block are decoded once for all BB. */
ALWAYS_INLINE void q4r8_group(const int BB, const bool far, const uint8_t *g, int64_t nb, const uint8_t *act,
                              size_t act_row, float *y, int64_t ldy) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    __m256 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < BB; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * MOETAX_K_Q4R8_BLOCK_BYTES;
        if (QPF > 0) { /* 144 bytes a block: 3 prefetches 48 apart touch every line */
            _mm_prefetch((const char *)blk + QPF, QPF_HINT);
            _mm_prefetch((const char *)blk + QPF + 48, QPF_HINT);
            _mm_prefetch((const char *)blk + QPF + 96, QPF_HINT);
        }
        if (far) { /* streamed weights (moetax_k_matmul_avx2_stream): PF_FAR ahead into L2 as well */
            _mm_prefetch((const char *)blk + PF_FAR, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + PF_FAR + 48, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + PF_FAR + 96, _MM_HINT_T1);
        }
        __m256i s16[4];
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) s16[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4R8_QS_OFF + 32 * c));
            const __m256i lo = _mm256_and_si256(v, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 4
            for (int j = 0; j < BB; j++) {
                const uint8_t *xq = act + j * act_row + (size_t)b * 32;
                int32_t xl, xh;
                memcpy(&xl, xq + 4 * c, 4);
                memcpy(&xh, xq + 16 + 4 * c, 4);
                s16[j] = _mm256_add_epi16(s16[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh))));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) {
            const uint8_t *aj = act + j * act_row;
            int32_t sx;
            memcpy(&sx, aj + s_off + (size_t)b * 4, 4);
            const __m256i sb = _mm256_sub_epi32(_mm256_madd_epi16(s16[j], ones), _mm256_set1_epi32(sx));
            const __m256 dd = _mm256_mul_ps(dw, _mm256_broadcast_ss((const float *)(aj + d_off) + b));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), dd, acc[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < BB; j++) _mm256_storeu_ps(y + j * ldy, acc[j]);
}

#define Q4R8_GROUP(BB)                                                                                        \
    static void q4r8_group_##BB(const uint8_t *g, int64_t nb, const uint8_t *act, size_t act_row, float *y, \
                                int64_t ldy) {                                                                \
        q4r8_group(BB, false, g, nb, act, act_row, y, ldy);                                                   \
    }
Q4R8_GROUP(1) Q4R8_GROUP(2) Q4R8_GROUP(3) Q4R8_GROUP(4)
static void q4r8_group_1_far(const uint8_t *g, int64_t nb, const uint8_t *act, size_t act_row, float *y, int64_t ldy) {
    q4r8_group(1, true, g, nb, act, act_row, y, ldy);
}
static void (*const k_q4r8[4])(const uint8_t *, int64_t, const uint8_t *, size_t, float *, int64_t) = {
    q4r8_group_1, q4r8_group_2, q4r8_group_3, q4r8_group_4};

/* One plain block_q4_0 row (a unit's last n_rows % 8 rows) against one batch
 * row, in the same canonical chain: the 16 nibble bytes of a block expand to
 * [low nibbles | high nibbles] = values 0..31 in order, one pmaddubsw against
 * the block's 32 quants. */
static float q4_plain_row(const uint8_t *w, int64_t nb, const uint8_t *a) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const float *dx = (const float *)(a + moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb));
    const int32_t *sx = (const int32_t *)(a + moetax_k_act_s_off(nb));
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * sizeof(moetax_block_q4_0);
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(a + b * 32))),
                                            ones);
        const int32_t sb = _mm_cvtsi128_si32(hsum1_epi32(p)) - sx[b];
        acc = _mm_fmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), sb),
                           _mm_set_ss(moetax_k_fp16_table[dh] * dx[b]), acc);
    }
    return _mm_cvtss_f32(acc);
}

/* Rows [row0, row1) (ROW RANGES in kernels.h: row0 a multiple of 8; a partial
 * last group is the unit's plain tail). Unlike F16/F32/Q8_0, pairing group i of
 * the range's first half with group i of its second half (two streams, shared
 * activation broadcasts) did not pay here: `small` Q4_0 decode 200-256 against
 * 229-278 t/s in 6 alternating pairs (Zen 3, 2 threads): the kernel is bound by
 * its arithmetic, not by the reads in flight. */
static void matmul_q4(const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { R = MOETAX_K_Q4R8_ROWS };
    const int64_t nb = ncols / 32;
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q4_0, ncols);
    int64_t r = row0;
    for (; r + R <= row1; r += R)
        for (int64_t j = 0; j < n_batch; j += 4) {
            const int bb = n_batch - j < 4 ? (int)(n_batch - j) : 4;
            (far && bb == 1 ? q4r8_group_1_far : k_q4r8[bb - 1])(w + (size_t)r * row_bytes, nb, act + (size_t)j * act_row,
                                                                 act_row, y + j * ldy + r, ldy);
        }
    for (; r < row1; r++)
        for (int64_t j = 0; j < n_batch; j++)
            y[j * ldy + r] = q4_plain_row(w + (size_t)r * row_bytes, nb, act + (size_t)j * act_row);
}

#define TILE_Q8(RB, BB)                                                                                   \
    static void tile_q8_0_##RB##x##BB(const uint8_t *w, const uint8_t *act, size_t act_row, int64_t nb,   \
                                      float *y, int64_t ldy) {                                             \
        tile_q8(RB, BB, w, act, act_row, nb, y, ldy);                                                      \
    }
TILE_Q8(4, 1) TILE_Q8(4, 2) TILE_Q8(1, 1) TILE_Q8(1, 2)

typedef void (*tile_q_fn)(const uint8_t *w, const uint8_t *act, size_t act_row, int64_t nb, float *y, int64_t ldy);
static const tile_q_fn k_tiles_q8[2][2] = {{tile_q8_0_1x1, tile_q8_0_1x2}, {tile_q8_0_4x1, tile_q8_0_4x2}};

/* One batch row against two groups of 4 rows, a and b, block by block: two
 * streams per core (see rows1_f). Each row's chain is tile_q8's (same bits). */
ALWAYS_INLINE void tile_q8_pair(const bool far, const uint8_t *wa, const uint8_t *wb, const uint8_t *act, int64_t nb,
                               float *ya, float *yb) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(act + b * 32));
        const __m128 dx = _mm_broadcast_ss((const float *)(act + d_off) + b);
#pragma GCC unroll 2
        for (int gi = 0; gi < 2; gi++) {
            const uint8_t *blk = (gi ? wb : wa) + (size_t)b * MOETAX_K_Q8R4_BLOCK_BYTES;
            if (QPF > 0) {
                _mm_prefetch((const char *)blk + QPF, QPF_HINT);
                _mm_prefetch((const char *)blk + QPF + 48, QPF_HINT);
                _mm_prefetch((const char *)blk + QPF + 96, QPF_HINT);
            }
            if (far) { /* streamed weights, as Q4_0's */
                _mm_prefetch((const char *)blk + PF_FAR, _MM_HINT_T1);
                _mm_prefetch((const char *)blk + PF_FAR + 48, _MM_HINT_T1);
                _mm_prefetch((const char *)blk + PF_FAR + 96, _MM_HINT_T1);
            }
            const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk));
            __m256i t[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q8R4_QS_OFF + 32 * r));
                t[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
            }
            const __m128i sum = hsum4_epi32(t[0], t[1], t[2], t[3]);
            acc[gi] = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(dw, dx), acc[gi]);
        }
    }
    _mm_storeu_ps(ya, acc[0]);
    _mm_storeu_ps(yb, acc[1]);
}
static void tile_q8_pair_near(const uint8_t *wa, const uint8_t *wb, const uint8_t *act, int64_t nb, float *ya,
                              float *yb) {
    tile_q8_pair(false, wa, wb, act, nb, ya, yb);
}
static void tile_q8_pair_far(const uint8_t *wa, const uint8_t *wb, const uint8_t *act, int64_t nb, float *ya,
                             float *yb) {
    tile_q8_pair(true, wa, wb, act, nb, ya, yb);
}

#ifndef Q8_PAIRS /* -DQ8_PAIRS=0: one group at a time in decode (for A/B runs) */
#define Q8_PAIRS 1
#endif

/* Rows [row0, row1) (ROW RANGES in kernels.h: row0 a multiple of 8; rows past
 * the last multiple of 4 below row1 are the unit's plain tail). One batch row:
 * group i of the range's first half with group i of its second half. */
static void matmul_q8(const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { BBMAX = 2, R = MOETAX_K_Q8R4_ROWS };
    const int64_t nb = ncols / 32;
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q8_0, ncols);
    if (Q8_PAIRS && n_batch == 1) {
        const int64_t h = (row1 - row0) / R / 2;
        for (int64_t i = 0; i < h; i++) {
            const int64_t ra = row0 + i * R, rb = row0 + (h + i) * R;
            (far ? tile_q8_pair_far : tile_q8_pair_near)(w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes, act, nb,
                                                         y + ra, y + rb);
        }
        row0 += 2 * h * R;
    }
    for (int64_t r = row0; r < row1;) {
        const int rb4 = row1 - r >= R;
        for (int64_t j = 0; j < n_batch;) {
            const int64_t left = n_batch - j;
            const int bb = left >= BBMAX ? BBMAX : (int)left;
            k_tiles_q8[rb4][bb - 1](w + (size_t)r * row_bytes, act + (size_t)j * act_row, act_row, nb, y + j * ldy + r,
                                    ldy);
            j += bb;
        }
        r += rb4 ? R : 1;
    }
}

/* ---- Q5_0, IQ4_NL, Q4_1 and Q5_1 rows as stored (a unit's last rows % 8): 4 rows x 1-2 batch rows per tile ----
 * Per block each row's 32 levels are made once: Q5_0 the nibbles ORed with 0xF0 where the fifth
 * bit is clear (q - 16 as int8), IQ4_NL the table's level by one vpshufb, both signed and
 * multiplied with each batch row's Q8_0 quants as tile_q8 does (|level| <= 127, so the sign
 * trick's pmaddubsw cannot saturate); Q4_1 / Q5_1 the unsigned q (at most 31) straight into
 * pmaddubsw, and the min's term from the Q4_0 row's block sums. The 4 rows' exact block sums go
 * through the chain of kernels.h (Q8_0's, plus the min's fma for Q4_1 / Q5_1): the same bits for
 * any batch size and row split. A range's last rows (fewer than 4) repeat the last row. */
enum q5nl_kind { K_Q5_0, K_IQ4_NL, K_Q4_1, K_Q5_1 };

ALWAYS_INLINE size_t q5nl_bytes(const int kind) {
    return kind == K_Q5_0 ? sizeof(moetax_block_q5_0) : kind == K_IQ4_NL ? sizeof(moetax_block_iq4_nl)
         : kind == K_Q4_1 ? sizeof(moetax_block_q4_1) : sizeof(moetax_block_q5_1);
}

ALWAYS_INLINE __m256i q5nl_levels(const int kind, const uint8_t *blk) {
    return kind == K_Q5_0 ? levels_q5_0(blk) : kind == K_IQ4_NL ? levels_iq4nl(blk)
         : kind == K_Q4_1 ? levels_q4_1(blk) : levels_q5_1(blk);
}

/* The 8 int32 partial sums of levels L times activation quants xv. */
ALWAYS_INLINE __m256i q5nl_dot(const int kind, __m256i L, __m256i xv) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind >= K_Q4_1) return _mm256_madd_epi16(_mm256_maddubs_epi16(L, xv), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(L, L), _mm256_sign_epi8(xv, L)), ones);
}

/* acc (4 rows in lanes) += one block of one batch row a: its exact sums S, then the min's term. */
ALWAYS_INLINE __m128 q5nl_acc(const int kind, __m128 acc, const __m256i *L, __m128 dw, __m128 mw, const uint8_t *a,
                              int64_t nb, int64_t b) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)(a + b * 32));
    const __m128 dx = _mm_broadcast_ss((const float *)(a + moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb)) + b);
    const __m128i s = hsum4_epi32(q5nl_dot(kind, L[0], xv), q5nl_dot(kind, L[1], xv), q5nl_dot(kind, L[2], xv),
                                  q5nl_dot(kind, L[3], xv));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, dx), acc);
    if (kind >= K_Q4_1) {
        const int32_t sx = ((const int32_t *)(a + moetax_k_act_s_off(nb)))[b] / 8;
        acc = _mm_fmadd_ps(_mm_set1_ps((float)sx), _mm_mul_ps(mw, dx), acc);
    }
    return acc;
}

ALWAYS_INLINE __m128 f16x4(const uint8_t *const *p, size_t off) {
    uint16_t h[4];
    for (int r = 0; r < 4; r++) memcpy(&h[r], p[r] + off, 2);
    return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
}

ALWAYS_INLINE void tile_q5nl(const int kind, const int BB, const bool far, const uint8_t *const *w,
                             const uint8_t *act, size_t act_row, int64_t nb, float *y, int64_t ldy, int nr) {
    const size_t bs = q5nl_bytes(kind);
    __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        __m256i L[4];
        const uint8_t *blk[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            blk[r] = w[r] + (size_t)b * bs;
            if (QPF > 0) _mm_prefetch((const char *)blk[r] + QPF, QPF_HINT);
            if (far) _mm_prefetch((const char *)blk[r] + PF_FAR, _MM_HINT_T1);
            L[r] = q5nl_levels(kind, blk[r]);
        }
        const __m128 dw = f16x4(blk, 0), mw = kind >= K_Q4_1 ? f16x4(blk, 2) : _mm_setzero_ps();
#pragma GCC unroll 2
        for (int j = 0; j < BB; j++) acc[j] = q5nl_acc(kind, acc[j], L, dw, mw, act + (size_t)j * act_row, nb, b);
    }
    for (int j = 0; j < BB; j++) {
        float o[4];
        _mm_storeu_ps(o, acc[j]);
        for (int r = 0; r < nr; r++) y[j * ldy + r] = o[r];
    }
}

typedef void (*tile_q5nl_fn)(const uint8_t *const *w, const uint8_t *act, size_t act_row, int64_t nb, float *y,
                             int64_t ldy, int nr);
/* per kind: tiles of 1 and 2 batch rows, the far-prefetch one-row tile */
#define TILES_Q5NL(K)                                                                                                \
    static void tile_##K##_1(const uint8_t *const *w, const uint8_t *act, size_t act_row, int64_t nb, float *y,    \
                             int64_t ldy, int nr) {                                                                 \
        tile_q5nl(K, 1, false, w, act, act_row, nb, y, ldy, nr);                                                   \
    }                                                                                                               \
    static void tile_##K##_2(const uint8_t *const *w, const uint8_t *act, size_t act_row, int64_t nb, float *y,    \
                             int64_t ldy, int nr) {                                                                 \
        tile_q5nl(K, 2, false, w, act, act_row, nb, y, ldy, nr);                                                   \
    }                                                                                                               \
    static void tile_##K##_1f(const uint8_t *const *w, const uint8_t *act, size_t act_row, int64_t nb, float *y,   \
                              int64_t ldy, int nr) {                                                                \
        tile_q5nl(K, 1, true, w, act, act_row, nb, y, ldy, nr);                                                    \
    }
TILES_Q5NL(K_Q5_0) TILES_Q5NL(K_IQ4_NL) TILES_Q5NL(K_Q4_1) TILES_Q5NL(K_Q5_1)
static const struct {
    tile_q5nl_fn one, two, one_far;
} k_q5nl[4] = {
#define Q5NL_ROW(K) {tile_##K##_1, tile_##K##_2, tile_##K##_1f}
    Q5NL_ROW(K_Q5_0), Q5NL_ROW(K_IQ4_NL), Q5NL_ROW(K_Q4_1), Q5NL_ROW(K_Q5_1)
#undef Q5NL_ROW
};

/* Q5_0x8r, IQ4_NLx8r, Q4_1x8r and Q5_1x8r (kernels.h: the avx512 table's layouts, which this table
 * reads too): 8 rows in the 8 int32 lanes, so the block sums need no horizontal adds. Q5_0 / Q4_1 /
 * Q5_1: the unsigned q (plus 16 where the chunk's mask word has the byte's bit: fifth_bits) into
 * pmaddubsw, Q5_0's offset of 16 from the activation's block sums; IQ4_NL: the table's signed level
 * (vpshufb) with the sign trick. G groups (decode: 2 streams) x JB batch rows; per lane the chain of
 * kernels.h (Q4_1 / Q5_1: then the min's fma). */
ALWAYS_INLINE size_t r8_gbs(const int kind) {
    return kind == K_Q5_0 ? MOETAX_K_Q5R8_BLOCK_BYTES : kind == K_IQ4_NL ? MOETAX_K_Q4R8_BLOCK_BYTES
         : kind == K_Q4_1 ? MOETAX_K_Q41R8_BLOCK_BYTES : MOETAX_K_Q51R8_BLOCK_BYTES;
}

ALWAYS_INLINE __m256i r8_levels(const int kind, const uint8_t *blk, int c, int h) {
    const size_t qs = kind == K_Q5_0 ? MOETAX_K_Q5R8_QS_OFF : kind == K_IQ4_NL ? MOETAX_K_Q4R8_QS_OFF
                    : kind == K_Q4_1 ? MOETAX_K_Q41R8_QS_OFF : MOETAX_K_Q51R8_QS_OFF;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * c));
    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    if (kind == K_IQ4_NL) {
        const __m128i t = _mm_loadu_si128((const __m128i *)moetax_iq4nl_values);
        return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
    }
    if (kind == K_Q4_1) return nib;
    const size_t qh = kind == K_Q5_0 ? MOETAX_K_Q5R8_QH_OFF : MOETAX_K_Q51R8_QH_OFF;
    return _mm256_add_epi8(nib, _mm256_and_si256(fifth_bits(blk + qh + 4 * (2 * c + h)), _mm256_set1_epi8(16)));
}

ALWAYS_INLINE void r8_tile(const int kind, const int G, const int JB, const bool far, const uint8_t *const *g,
                           const uint8_t *act, size_t act_row, int64_t nb, float *const *y, int64_t ldy) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    const size_t gbs = r8_gbs(kind);
    const bool nl = kind == K_IQ4_NL, with_m = kind >= K_Q4_1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int j = 0; j < JB; j++) acc[gi][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)b * gbs;
            if (QPF > 0)
                for (size_t o = 0; o < gbs; o += 64) _mm_prefetch((const char *)blk + QPF + o, QPF_HINT);
            if (far)
                for (size_t o = 0; o < gbs; o += 64) _mm_prefetch((const char *)blk + PF_FAR + o, _MM_HINT_T1);
            __m256i L[4][2];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) L[c][h] = r8_levels(kind, blk, c, h);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 mw = with_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + MOETAX_K_QX1R8_M_OFF)))
                                     : _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int j = 0; j < JB; j++) {
                const uint8_t *a = act + (size_t)j * act_row, *xq = a + (size_t)b * 32;
                int32_t sx;
                memcpy(&sx, a + s_off + (size_t)b * 4, 4);
                __m256i i0 = _mm256_set1_epi32(kind == K_Q5_0 ? -2 * sx : 0), i1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        int32_t x4;
                        memcpy(&x4, xq + 16 * h + 4 * c, 4);
                        const __m256i xv = _mm256_set1_epi32(x4);
                        const __m256i p = nl ? _mm256_maddubs_epi16(_mm256_sign_epi8(L[c][h], L[c][h]),
                                                                     _mm256_sign_epi8(xv, L[c][h]))
                                             : _mm256_maddubs_epi16(L[c][h], xv);
                        if (h) i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(p, ones));
                        else i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(p, ones));
                    }
                const __m256 dx = _mm256_broadcast_ss((const float *)(a + d_off) + b);
                acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(dw, dx), acc[gi][j]);
                if (with_m) acc[gi][j] = _mm256_fmadd_ps(_mm256_set1_ps((float)(sx / 8)), _mm256_mul_ps(mw, dx), acc[gi][j]);
            }
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int j = 0; j < JB; j++) _mm256_storeu_ps(y[gi] + j * ldy, acc[gi][j]);
}
#define R8_TILES(K)                                                                                               \
    static void r8_##K##_d2(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,            \
                            float *const *y, int64_t ldy) { r8_tile(K, 2, 1, false, g, act, act_row, nb, y, ldy); } \
    static void r8_##K##_d2f(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,           \
                             float *const *y, int64_t ldy) { r8_tile(K, 2, 1, true, g, act, act_row, nb, y, ldy); } \
    static void r8_##K##_1f(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,            \
                            float *const *y, int64_t ldy) { r8_tile(K, 1, 1, true, g, act, act_row, nb, y, ldy); }  \
    static void r8_##K##_1(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,             \
                           float *const *y, int64_t ldy) { r8_tile(K, 1, 1, false, g, act, act_row, nb, y, ldy); }  \
    static void r8_##K##_2(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,             \
                           float *const *y, int64_t ldy) { r8_tile(K, 1, 2, false, g, act, act_row, nb, y, ldy); }  \
    static void r8_##K##_3(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,             \
                           float *const *y, int64_t ldy) { r8_tile(K, 1, 3, false, g, act, act_row, nb, y, ldy); }  \
    static void r8_##K##_4(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,             \
                           float *const *y, int64_t ldy) { r8_tile(K, 1, 4, false, g, act, act_row, nb, y, ldy); }
R8_TILES(K_Q5_0) R8_TILES(K_IQ4_NL) R8_TILES(K_Q4_1) R8_TILES(K_Q5_1)
static const struct moetax_k_r8_tiles k_r8[4] = {
#define R8_ROW(K) {{r8_##K##_d2, r8_##K##_d2f}, {r8_##K##_1, r8_##K##_1f}, {r8_##K##_1, r8_##K##_2, r8_##K##_3, r8_##K##_4}}
    R8_ROW(K_Q5_0), R8_ROW(K_IQ4_NL), R8_ROW(K_Q4_1), R8_ROW(K_Q5_1)
#undef R8_ROW
};

/* Rows [row0, row1) of the x8r layouts above: the groups by the tiles, the last rows % 8 (plain) by
 * matmul_q5nl. */
static void matmul_q5nl(const int kind, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                        const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far);
static void matmul_r8(const int kind, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    const int64_t gend = moetax_k_r8_drive(&k_r8[kind], w, row_bytes, row0, row1, ncols / 32, act,
                                           moetax_k_act_row_bytes(MOETAX_TYPE_Q4_0, ncols), n_batch, y, ldy, far);
    if (gend < row1) matmul_q5nl(kind, w, row_bytes, gend, row1, ncols, act, n_batch, y, ldy, far);
}

/* Plain rows (a unit's last rows % 8 after the x8r groups): 4 at a time, 1-2 batch rows per tile. */
static void matmul_q5nl(const int kind, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                        const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    const int64_t nb = ncols / 32;
    /* the Q4_0 row: the Q8_0 row and its block sums (Q4_1 and Q5_1 use them) */
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q4_0, ncols);
    for (int64_t r = row0; r < row1; r += 4) {
        const int nr = row1 - r < 4 ? (int)(row1 - r) : 4;
        const uint8_t *rows[4];
        for (int i = 0; i < 4; i++) rows[i] = w + (size_t)(r + (i < nr ? i : nr - 1)) * row_bytes;
        for (int64_t j = 0; j < n_batch; j += 2) {
            const uint8_t *a = act + (size_t)j * act_row;
            float *yy = y + j * ldy + r;
            if (n_batch - j >= 2) k_q5nl[kind].two(rows, a, act_row, nb, yy, ldy, nr);
            else (far ? k_q5nl[kind].one_far : k_q5nl[kind].one)(rows, a, act_row, nb, yy, ldy, nr);
        }
    }
}

/* ---- batched Q8_0 (n_batch >= QB_MIN): weight rows in lanes ----
 *
 * With several batch rows tile_q8 is bound by its per-(row, batch row, block)
 * work, nearly all of it on ports 0/1 (psignb, pmaddubsw, pmaddwd, the int32
 * reduction, cvt, mul, fma). Here 8 weight rows share every register instead.
 * Per block, the 8 x 32 quants are transposed into 16 vectors
 *   wt[k] = [row0 q[2k] q[2k+1], row1 q[2k] q[2k+1], .., row7 ..] (int16)
 * and each batch row's quants are widened to int16 once per call (xs); then
 *   S = sum_k pmaddwd(wt[k], broadcast(xs[2k], xs[2k+1]))
 * holds the 8 rows' exact int32 block sums, one per lane, and one cvt + mul
 * + fma per (8 rows, batch row, block) applies d_w * d_x: the canonical chain
 * of tile_q8, so results are bit-identical to it. 34 ops per 8 (row, batch
 * row, block) triples instead of ~60, and pmaddwd + paddd spread over three
 * ports. The transpose is paid once per 8 rows and block for all the batch
 * rows (hence QB_MIN).
 *
 * Rows go in panels of QB_ROWS, each panel's columns in chunks of kb blocks
 * whose widened activations (xs) stay cached; y holds each row's running sum
 * between chunks (the chain continues exactly from it) and the panel's y
 * stays cached. The next 8 rows' weights are prefetched during the first
 * batch tile, spread over its blocks. Missing rows of a panel's last tile
 * duplicate a valid row and are neither loaded from nor stored to y.
 * Scratch: ~52 KiB of stack. */
#define QB_JG 64          /* batch rows per group */
#define QB_XS_BYTES 32768 /* widened activations per chunk (ceil4(batch rows) x kb x 64 bytes) */
#define QB_KBMAX 32       /* blocks per chunk at most */
#define QB_ROWS 64        /* weight rows per panel (a multiple of 8) */
#ifndef QB_MIN
#define QB_MIN 4 /* with fewer batch rows tile_q8 is as fast or faster */
#endif
#ifndef QB_PF_HINT
#define QB_PF_HINT _MM_HINT_T0
#endif

struct qb_scratch {
    _Alignas(32) int16_t xs[QB_XS_BYTES / 2];    /* [j / 4][bb][j % 4][32] */
    float dx[QB_XS_BYTES / 64];                  /* [j / 4][bb][j % 4] */
    _Alignas(32) int16_t wt[QB_KBMAX * 16 * 16]; /* [bb][k][16] */
    _Alignas(32) float sd[QB_KBMAX * 8];         /* [bb][row] */
};

/* Where row i of an 8-row tile keeps block b: quants at q[i] + b * st[i], the
 * F16 scale at d[i] + b * st[i] (Q8_0x4r rows and a unit's plain tail rows
 * differ in both). */
struct qb_rows {
    const uint8_t *q[8], *d[8];
    size_t st[8];
};

/* The tile of rows r..r+7 (nr valid; missing rows repeat the last valid one)
 * of a call whose rows before gend are Q8_0x4r groups, the rest plain. */
static void qb_rows_at(struct qb_rows *o, const uint8_t *w, size_t row_bytes, int64_t r, int nr, int64_t gend) {
    enum { R = MOETAX_K_Q8R4_ROWS };
    for (int i = 0; i < 8; i++) {
        const int64_t ri = r + (i < nr ? i : nr - 1);
        if (ri < gend) {
            const uint8_t *g = w + (size_t)(ri - ri % R) * row_bytes;
            o->q[i] = g + MOETAX_K_Q8R4_QS_OFF + 32 * (ri % R);
            o->d[i] = g + 2 * (ri % R);
            o->st[i] = MOETAX_K_Q8R4_BLOCK_BYTES;
        } else {
            o->d[i] = w + (size_t)ri * row_bytes;
            o->q[i] = o->d[i] + 2;
            o->st[i] = sizeof(moetax_block_q8_0);
        }
    }
}

/* Transpose blocks [b0, b0 + kn) of 8 rows into wt, their scales into sd. Per
 * 128-bit lane (quants 0..15, 16..31) an 8 x 8 transpose of 16-bit pairs, then
 * widening. */
static void qb_transpose(const struct qb_rows *wr, int64_t b0, int64_t kn, int16_t *wt, float *sd) {
    for (int64_t bb = 0; bb < kn; bb++) {
        const size_t b = (size_t)(b0 + bb);
        __m256i r[8], a[8], c[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(wr->q[i] + b * wr->st[i]));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);     /* pairs 0-3 of rows 2i, 2i+1 */
            a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]); /* pairs 4-7 */
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* rows 0-3, rows 4-7 */
            c[4 * h + 0] = _mm256_unpacklo_epi32(a[4 * h + 0], a[4 * h + 2]); /* pairs 0, 1 of 4 rows */
            c[4 * h + 1] = _mm256_unpackhi_epi32(a[4 * h + 0], a[4 * h + 2]); /* pairs 2, 3 */
            c[4 * h + 2] = _mm256_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]); /* pairs 4, 5 */
            c[4 * h + 3] = _mm256_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]); /* pairs 6, 7 */
        }
        __m256i *o = (__m256i *)(wt + bb * 256);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m256i c0 = _mm256_unpacklo_epi64(c[i], c[4 + i]); /* pair 2i of 8 rows (| pair 2i + 8) */
            const __m256i c1 = _mm256_unpackhi_epi64(c[i], c[4 + i]); /* pair 2i + 1 */
            _mm256_store_si256(o + 2 * i, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c0)));
            _mm256_store_si256(o + 2 * i + 8, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c0, 1)));
            _mm256_store_si256(o + 2 * i + 1, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c1)));
            _mm256_store_si256(o + 2 * i + 9, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c1, 1)));
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            uint16_t h;
            memcpy(&h, wr->d[i] + b * wr->st[i], 2);
            sd[bb * 8 + i] = moetax_k_fp16_table[h];
        }
    }
}

/* Widen blocks [b0, b0 + kn) of batch rows [j0, j0 + jn) into xs / dx, in
 * tiles of 4 batch rows interleaved by block: slot ((j / 4) * kn + bb) * 4 + j % 4. */
static void qb_widen(const uint8_t *act, size_t act_row, int64_t nb, int64_t j0, int64_t jn, int64_t b0, int64_t kn,
                     int16_t *xs, float *dx) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    for (int64_t j = 0; j < jn; j++) {
        const uint8_t *a = act + (size_t)(j0 + j) * act_row;
        for (int64_t bb = 0; bb < kn; bb++) {
            const int64_t b = b0 + bb, slot = ((j / 4) * kn + bb) * 4 + j % 4;
            __m256i *o = (__m256i *)(xs + slot * 32);
            _mm256_store_si256(o, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + b * 32))));
            _mm256_store_si256(o + 1, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + b * 32 + 16))));
            memcpy(&dx[slot], a + d_off + b * 4, 4);
        }
    }
}

/* 8 rows (wt / sd) x JB batch rows over kn blocks; xs / dx hold the tile's
 * batch rows interleaved by block ([bb][4][32], [bb][4]). y: the rows'
 * outputs (nr valid) of the first batch row; the chain starts from 0 (first
 * chunk) or continues from y. pf: the next tile's weights to prefetch, or NULL. */
ALWAYS_INLINE void qb_tile(const int JB, const int16_t *wt, const float *sd, const int16_t *xs, const float *dx,
                           int64_t kn, const struct qb_rows *pf, int64_t pb0, float *y, int64_t ldy, int nr,
                           bool first) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < JB; j++)
        acc[j] = first ? _mm256_setzero_ps()
                       : nr == 8 ? _mm256_loadu_ps(y + j * ldy) : _mm256_maskload_ps(y + j * ldy, mask);
    for (int64_t bb = 0; bb < kn; bb++, wt += 256, xs += 128, dx += 4, sd += 8) {
        if (pf) /* block pb0 + bb of the next tile's rows (a x4r block: 4 rows' quants 32 apart) */
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)pf->q[i] + (size_t)(pb0 + bb) * pf->st[i], QB_PF_HINT);
        const __m256i *w = (const __m256i *)wt;
        __m256i ia[4];
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) {
            const __m256i wv = _mm256_load_si256(w + k);
#pragma GCC unroll 4
            for (int j = 0; j < JB; j++) {
                int32_t q;
                memcpy(&q, xs + j * 32 + 2 * k, 4);
                const __m256i p = _mm256_madd_epi16(wv, _mm256_set1_epi32(q));
                ia[j] = k == 0 ? p : _mm256_add_epi32(ia[j], p);
                __asm__("" : "+x"(ia[j])); /* keep the chain: no reassociation into a tree of temporaries */
            }
        }
        const __m256 s = _mm256_load_ps(sd);
#pragma GCC unroll 4
        for (int j = 0; j < JB; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + j)), acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < JB; j++) {
        if (nr == 8) _mm256_storeu_ps(y + j * ldy, acc[j]);
        else _mm256_maskstore_ps(y + j * ldy, mask, acc[j]);
    }
}

#define QB_TILE(JB)                                                                                             \
    static void qb_tile_##JB(const int16_t *wt, const float *sd, const int16_t *xs, const float *dx, int64_t kn,  \
                             const struct qb_rows *pf, int64_t pb0, float *y, int64_t ldy, int nr, bool first) { \
        qb_tile(JB, wt, sd, xs, dx, kn, pf, pb0, y, ldy, nr, first);                                         \
    }
QB_TILE(1)
QB_TILE(2)
QB_TILE(3)
QB_TILE(4)
typedef void (*qb_tile_fn)(const int16_t *, const float *, const int16_t *, const float *, int64_t,
                           const struct qb_rows *, int64_t, float *, int64_t, int, bool);
static const qb_tile_fn k_qb_tiles[4] = {qb_tile_1, qb_tile_2, qb_tile_3, qb_tile_4};

static void qb_matmul_q8(const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                         const uint8_t *act, int64_t n_batch, float *y, int64_t ldy) {
    struct qb_scratch sc;
    const int64_t nb = ncols / 32, gend = row1 - row1 % MOETAX_K_Q8R4_ROWS;
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q8_0, ncols);
    for (int64_t j0 = 0; j0 < n_batch; j0 += QB_JG) {
        const int64_t jn = n_batch - j0 < QB_JG ? n_batch - j0 : QB_JG;
        int64_t kb = QB_XS_BYTES / (((jn + 3) / 4 * 4) * 64);
        kb = kb > QB_KBMAX ? QB_KBMAX : kb;
        for (int64_t p0 = row0; p0 < row1; p0 += QB_ROWS) {
            const int64_t p1 = row1 - p0 < QB_ROWS ? row1 : p0 + QB_ROWS;
            for (int64_t b0 = 0; b0 < nb; b0 += kb) {
                const int64_t kn = nb - b0 < kb ? nb - b0 : kb;
                qb_widen(act, act_row, nb, j0, jn, b0, kn, sc.xs, sc.dx);
                for (int64_t r = p0; r < p1; r += 8) {
                    const int nr = p1 - r < 8 ? (int)(p1 - r) : 8;
                    struct qb_rows wr, pfr;
                    qb_rows_at(&wr, w, row_bytes, r, nr, gend);
                    /* next tile's weights: the next 8 rows of this chunk, else the
                     * panel's first rows in the next chunk, else the next panel */
                    const struct qb_rows *pf = &pfr;
                    int64_t pb0 = b0;
                    if (r + 8 < p1) qb_rows_at(&pfr, w, row_bytes, r + 8, p1 - r - 8 < 8 ? (int)(p1 - r - 8) : 8, gend);
                    else if (b0 + kn < nb) qb_rows_at(&pfr, w, row_bytes, p0, p1 - p0 < 8 ? (int)(p1 - p0) : 8, gend), pb0 = b0 + kn;
                    else if (p1 < row1) qb_rows_at(&pfr, w, row_bytes, p1, row1 - p1 < 8 ? (int)(row1 - p1) : 8, gend), pb0 = 0;
                    else pf = NULL;
                    qb_transpose(&wr, b0, kn, sc.wt, sc.sd);
                    for (int64_t j = 0; j < jn; j += 4) {
                        const int jb = jn - j < 4 ? (int)(jn - j) : 4;
                        k_qb_tiles[jb - 1](sc.wt, sc.sd, sc.xs + j * kn * 32, sc.dx + j * kn, kn, j == 0 ? pf : NULL,
                                           pb0, y + (j0 + j) * ldy + r, ldy, nr, b0 == 0);
                    }
                }
            }
        }
    }
}

static void matmul_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                        int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    switch (wtype) {
    case MOETAX_TYPE_F32: matmul_f(0, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far); break;
    case MOETAX_TYPE_F16: matmul_f(1, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far); break;
    case MOETAX_TYPE_BF16: matmul_f(2, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far); break;
    case MOETAX_TYPE_Q8_0:
        assert(row0 % MOETAX_K_Q8R4_ROWS == 0); /* ROW RANGES, kernels.h */
        if (n_batch >= QB_MIN) qb_matmul_q8(w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy);
        else matmul_q8(w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q4_0:
        assert(row0 % MOETAX_K_Q4R8_ROWS == 0); /* ROW RANGES, kernels.h */
        matmul_q4(w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q5_0: case MOETAX_TYPE_IQ4_NL: case MOETAX_TYPE_Q4_1: case MOETAX_TYPE_Q5_1: /* their x8r layouts */
        matmul_r8(wtype == MOETAX_TYPE_Q5_0 ? K_Q5_0 : wtype == MOETAX_TYPE_IQ4_NL ? K_IQ4_NL
                  : wtype == MOETAX_TYPE_Q4_1 ? K_Q4_1 : K_Q5_1, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q2_K: case MOETAX_TYPE_Q3_K:
    case MOETAX_TYPE_Q4_K: case MOETAX_TYPE_Q5_K: case MOETAX_TYPE_Q6_K:
        moetax_k_matmul_kq_avx2(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    default: break;
    }
}

void moetax_k_matmul_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    matmul_avx2(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, false);
}

void moetax_k_matmul_avx2_stream(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                                 int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    matmul_avx2(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, true);
}
