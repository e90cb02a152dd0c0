/* matmul_avx2.c - AVX2/FMA/F16C activation preparation and matrix x
 * vector(s). Compiled with -mavx2 -mfma -mf16c; only reached through the
 * table when cpuid says the CPU has all three.
 *
 * Shape of every kernel: a tile of RB weight rows x BB batch rows is computed
 * in registers (RB*BB accumulators), so each weight vector loaded from memory
 * is used BB times and each activation vector RB times. Decode (n_batch == 1)
 * runs 4 rows at a time: four interleaved streams through the weights, each
 * software-prefetched QPF bytes ahead (short rows defeat the hardware
 * prefetcher), with the activation loads shared. F32/F16/BF16 with more batch
 * rows than one tile cut the columns into L1-sized chunks so the weights come
 * from memory once per call.
 *
 * Q8_0 / Q4_0 weights are multiplied in int8 with pmaddubsw (u8 x s8 -> i16
 * pairs), pmaddwd (-> i32), then converted to float and accumulated with the
 * block scale d_w * d_x:
 *   Q8_0: |w| x sign(x, w) (ggml's trick), one block per step.
 *   Q4_0: two blocks per step: the 2 x 16 nibble bytes in one register, low
 *         and high nibbles (unsigned 0..15) against the activations prepared
 *         in the matching arrangement, minus the prepared s = 8 * sum(x) for
 *         the -8 offset; one pmaddwd / cvt / fma serves both blocks.
 * d_w (F16) is read through the shared 64 Ki-entry fp16 -> fp32 table. */
#include "kernels_impl.h"

#include <immintrin.h>
#include <string.h>

#include "moetax/types.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* ggml's Q8_0 quantization of 32 floats: the quants (natural order) and d. */
ALWAYS_INLINE __m256i quantize_block(const float *xb, float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    *d_out = moetax_k_fp16_table[moetax_fp32_to_fp16(dd)];
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v0, vid)));
    __m256i i1 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v1, vid)));
    __m256i i2 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v2, vid)));
    __m256i i3 = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v3, vid)));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_row_q8(const float *x, int64_t nb, uint8_t *out) {
    float *d = (float *)(out + moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb));
    for (int64_t i = 0; i < nb; i++)
        _mm256_storeu_si256((__m256i *)(out + i * 32), quantize_block(x + i * 32, &d[i]));
}

/* Q4_0 pair layout (kernels.h): lo, hi, s, d per pair of blocks. */
static void quantize_row_q4pairs(const float *x, int64_t nb, uint8_t *out) {
    const __m256i eight = _mm256_set1_epi8(8);
    for (int64_t p = 0; p < (nb + 1) / 2; p++) {
        float d0, d1 = 0.0f;
        const __m256i q0 = quantize_block(x + p * 64, &d0);
        const __m256i q1 = 2 * p + 1 < nb ? quantize_block(x + p * 64 + 32, &d1) : _mm256_setzero_si256();
        const __m256i lo = _mm256_permute2x128_si256(q0, q1, 0x20);
        const __m256i hi = _mm256_permute2x128_si256(q0, q1, 0x31);
        uint8_t *o = out + p * 128;
        _mm256_storeu_si256((__m256i *)o, lo);
        _mm256_storeu_si256((__m256i *)(o + 32), hi);
        _mm256_storeu_si256((__m256i *)(o + 64),
                            _mm256_add_epi16(_mm256_maddubs_epi16(eight, lo), _mm256_maddubs_epi16(eight, hi)));
        _mm256_storeu_ps((float *)(o + 96), _mm256_blend_ps(_mm256_set1_ps(d0), _mm256_set1_ps(d1), 0xf0));
    }
}

void moetax_k_quantize_act_avx2(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols,
                                int64_t n_batch, void *xq) {
    const size_t row_bytes = moetax_k_act_row_bytes(wtype, ncols);
    for (int64_t b = 0; b < n_batch; b++) {
        const float *xr = x + b * ldx;
        uint8_t *out = (uint8_t *)xq + (size_t)b * row_bytes;
        if (wtype == MOETAX_TYPE_Q8_0) quantize_row_q8(xr, ncols / 32, out);
        else if (wtype == MOETAX_TYPE_Q4_0) quantize_row_q4pairs(xr, ncols / 32, out);
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

/* Prefetch position pos + QPF of each of the RB rows of a tile (the same
 * offset in every row, so one base address serves all of them). */
ALWAYS_INLINE void prefetch_tile(const uint8_t *w, size_t rb, int RB, size_t pos) {
    const size_t off = pos + QPF;
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

/* RB rows starting at w (stride rb), BB batch rows starting at x (stride ncols). */
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
        prefetch_tile(w, rb, RB, (size_t)k * esz);
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

/* With more batch rows than one tile holds, the columns are cut into chunks
 * whose RB weight rows stay in L1 (16 KiB) while every batch tile passes over
 * them, so weights come from memory once per call, not once per batch tile. */
static void matmul_f(int ti, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                     const float *x, int64_t n_batch, float *y, int64_t ldy) {
    enum { BBMAX = 3 };
    const int64_t kc = n_batch > BBMAX ? (ti == 0 ? 1024 : 2048) : ncols;
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

ALWAYS_INLINE void tile_q8(const int RB, const int BB, const uint8_t *w, size_t rb, const uint8_t *act,
                           size_t act_row, int64_t nb, float *y, int64_t ldy) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) acc[r][j] = _mm256_setzero_ps();

    for (int64_t b = 0; b < nb; b++) {
        __m256i xv[4];
        __m256 dx[4];
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) {
            xv[j] = _mm256_loadu_si256((const __m256i *)(act + j * act_row + b * 32));
            dx[j] = _mm256_broadcast_ss((const float *)(act + j * act_row + d_off) + b);
        }
        if (QPF > 0) prefetch_tile(w, rb, RB, (size_t)b * sizeof(moetax_block_q8_0));
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const uint8_t *blk = w + r * rb + b * sizeof(moetax_block_q8_0);
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const __m256 dw = _mm256_broadcast_ss(&moetax_k_fp16_table[dh]);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i aw = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 4
            for (int j = 0; j < BB; j++) {
                const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[j], wv));
                const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, dx[j]), acc[r][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) y[j * ldy + r] = hsum_ps(acc[r][j]);
}

/* Q4_0, two blocks (a pair) per step: the 2 x 16 nibble bytes go in one
 * register (block 2p low lane, 2p+1 high lane); low nibbles and high nibbles
 * each meet the activations prepared in the same arrangement (see kernels.h),
 * so one pmaddwd / cvt / fma serves both blocks. `full` is false for the last,
 * unpaired block of an odd nb (its high lane is zero). */
ALWAYS_INLINE void q4_pair_step(const int RB, const int BB, const uint8_t *w, size_t rb, const uint8_t *act,
                                size_t act_row, int64_t p, bool full, __m256 acc[4][4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const uint8_t *ap = act + (size_t)p * 128;
    __m256i xlo[4], xhi[4];
#pragma GCC unroll 4
    for (int j = 0; j < BB; j++) {
        xlo[j] = _mm256_loadu_si256((const __m256i *)(ap + j * act_row));
        xhi[j] = _mm256_loadu_si256((const __m256i *)(ap + j * act_row + 32));
    }
    if (QPF > 0) prefetch_tile(w, rb, RB, (size_t)p * 2 * sizeof(moetax_block_q4_0));
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++) {
        const uint8_t *b0 = w + r * rb + (size_t)p * 2 * sizeof(moetax_block_q4_0);
        uint16_t d0, d1;
        memcpy(&d0, b0, 2);
        __m256i v;
        __m256 dw;
        if (full) {
            memcpy(&d1, b0 + sizeof(moetax_block_q4_0), 2);
            v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 2))),
                                        _mm_loadu_si128((const __m128i *)(b0 + sizeof(moetax_block_q4_0) + 2)), 1);
            dw = _mm256_blend_ps(_mm256_broadcast_ss(&moetax_k_fp16_table[d0]),
                                 _mm256_broadcast_ss(&moetax_k_fp16_table[d1]), 0xf0);
        } else {
            v = _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)(b0 + 2)), 0);
            dw = _mm256_broadcast_ss(&moetax_k_fp16_table[d0]);
        }
        const __m256i lo = _mm256_and_si256(v, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) {
            const __m256i sj = _mm256_loadu_si256((const __m256i *)(ap + j * act_row + 64));
            const __m256 dx = _mm256_loadu_ps((const float *)(ap + j * act_row + 96));
            __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo[j]), _mm256_maddubs_epi16(hi, xhi[j]));
            p16 = _mm256_sub_epi16(p16, sj);
            const __m256 pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            acc[r][j] = _mm256_fmadd_ps(pf, _mm256_mul_ps(dw, dx), acc[r][j]);
        }
    }
}

ALWAYS_INLINE void tile_q4(const int RB, const int BB, const uint8_t *w, size_t rb, const uint8_t *act,
                           size_t act_row, int64_t nb, float *y, int64_t ldy) {
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) acc[r][j] = _mm256_setzero_ps();
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) q4_pair_step(RB, BB, w, rb, act, act_row, p, true, acc);
    if (nb & 1) q4_pair_step(RB, BB, w, rb, act, act_row, np, false, acc);
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < BB; j++) y[j * ldy + r] = hsum_ps(acc[r][j]);
}

ALWAYS_INLINE void tile_q(enum moetax_type t, const int RB, const int BB, const uint8_t *w, size_t rb,
                          const uint8_t *act, size_t act_row, int64_t nb, float *y, int64_t ldy) {
    if (t == MOETAX_TYPE_Q8_0) tile_q8(RB, BB, w, rb, act, act_row, nb, y, ldy);
    else tile_q4(RB, BB, w, rb, act, act_row, nb, y, ldy);
}

#define TILE_Q(T, RB, BB, tag)                                                                            \
    static void tile_##tag##_##RB##x##BB(const uint8_t *w, size_t rb, const uint8_t *act, size_t act_row, \
                                         int64_t nb, float *y, int64_t ldy) {                            \
        tile_q(T, RB, BB, w, rb, act, act_row, nb, y, ldy);                                              \
    }
#define TILES_Q(T, tag)                                                                                    \
    TILE_Q(T, 4, 1, tag) TILE_Q(T, 4, 2, tag) TILE_Q(T, 1, 1, tag) TILE_Q(T, 1, 2, tag)
TILES_Q(MOETAX_TYPE_Q8_0, q8_0)
TILES_Q(MOETAX_TYPE_Q4_0, q4_0)

typedef void (*tile_q_fn)(const uint8_t *w, size_t rb, const uint8_t *act, size_t act_row, int64_t nb, float *y,
                          int64_t ldy);
static const tile_q_fn k_tiles_q[2][2][2] = {
    {{tile_q8_0_1x1, tile_q8_0_1x2}, {tile_q8_0_4x1, tile_q8_0_4x2}},
    {{tile_q4_0_1x1, tile_q4_0_1x2}, {tile_q4_0_4x1, tile_q4_0_4x2}},
};

static void matmul_q(int ti, enum moetax_type t, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                     int64_t ncols, const uint8_t *act, int64_t n_batch, float *y, int64_t ldy) {
    enum { BBMAX = 2 };
    const int64_t nb = ncols / 32;
    const size_t act_row = moetax_k_act_row_bytes(t, ncols);
    for (int64_t r = row0; r < row1; ) {
        const int rb4 = row1 - r >= 4;
        for (int64_t j = 0; j < n_batch; ) {
            const int64_t left = n_batch - j;
            const int bb = left >= BBMAX ? BBMAX : (int)left;
            k_tiles_q[ti][rb4][bb - 1](w + (size_t)r * row_bytes, row_bytes, act + (size_t)j * act_row, act_row,
                                       nb, y + j * ldy + r, ldy);
            j += bb;
        }
        r += rb4 ? 4 : 1;
    }
}

void moetax_k_matmul_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    switch (wtype) {
    case MOETAX_TYPE_F32: matmul_f(0, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy); break;
    case MOETAX_TYPE_F16: matmul_f(1, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy); break;
    case MOETAX_TYPE_BF16: matmul_f(2, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy); break;
    case MOETAX_TYPE_Q8_0: matmul_q(0, wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy); break;
    case MOETAX_TYPE_Q4_0: matmul_q(1, wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy); break;
    default: break;
    }
}
