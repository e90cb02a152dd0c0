/* matmul_avx512.c - AVX-512 (F/BW/VL/DQ) + VNNI matrix x vector(s) for Q8_0 and
 * Q4_0 weights. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
 * -mavx512vnni (and the AVX2 flags); only reached through the avx512 table when
 * cpuid and XCR0 say the CPU and the OS allow all of them. The activation
 * preparation and one-row (decode) F32/F16/BF16 matmul are the AVX2 table's
 * (same bytes, same bits); F32/F16/BF16 with 2+ batch rows: see below.
 *
 * Q8_0 and Q4_0 read weights with 8 rows interleaved (kernels.h, WEIGHT LAYOUTS:
 * Q4_0x8r as the avx2 table, Q8_0x8r of this table's own), so that each 32-bit
 * lane of a 256-bit vector belongs to one row and holds 4 consecutive quants of
 * it. One vpdpbusd (u8 x s8 -> s32, 4 products per lane, added to the lane)
 * against the activation's matching 4 quants, broadcast to every lane, adds 4
 * products of each of the 8 rows: 8 vpdpbusd give the 8 rows' exact int32 block
 * sums, with no horizontal sums. vpdpbusd takes one unsigned operand:
 *   Q4_0: the nibbles q (0..15) are unsigned already; sum((q - 8) x) =
 *         sum(q x) - s with the prepared s = 8 * sum(x), which seeds the lane.
 *   Q8_0: the weights are stored unsigned, w + 128 = w ^ 0x80 (by the repack, so
 *         the tiles load vpdpbusd's operand as it is); sum(w x) = sum((w + 128) x)
 *         - 128 * sum(x), the second term computed once per call for each batch
 *         row and block. (A unit's plain tail rows flip their bytes as they load them.)
 * The float steps are the avx2 table's canonical chain: per row and batch row,
 * acc = fma((float)S_b, d_w[b] * d_x[b], acc) over the blocks in order, from 0
 * (continued from y across column chunks). So every result is bit-identical to
 * the avx2 table's (and independent of the batch and of the row split).
 *
 * Batches (2+ batch rows) use 512-bit vectors over two groups: lanes 0-7 hold
 * group A's 8 rows, lanes 8-15 group B's (two 32-byte loads joined, one cvtph for
 * the 16 scales), so one activation broadcast ({1to16}, embedded in vpdpbusd)
 * serves 16 rows; a tile is one pair of groups x JB (1..8) batch rows (9..16 batch
 * rows: two tiles of even size over the same panel of weights, which stays in
 * L1/L2). Group A is group i of the panel's first half, B group i of its second
 * half (the panel: the whole range for up to 8 batch rows), so each tile streams
 * two long sequential runs, and batch tiles prefetch further ahead, into L2
 * (prefetch_blk). Per lane the float chain is unchanged, so 512-bit lanes give
 * the same bits as 256-bit ones. A range's odd last group takes the 256-bit tile
 * (one group x JB). Decode (one batch row) stays on 256-bit tiles, pairing
 * group i of the range's first half with group i of its second half (two
 * sequential streams per core, as the avx2 Q8_0 path; Q4_0 on one stream read
 * DRAM at about half the plain read's rate on an Intel Xeon whose per-core
 * bandwidth is latency-bound, and at the read's rate from L3): there 512-bit vectors
 * measured slower (L2-resident experts), the joins of two groups' loads costing
 * more than the shared broadcasts save with one batch row. The 512-bit tiles with
 * JB <= 2 (and the 256-bit ones with JB <= 4) sum each (row, batch row) block in
 * two int32 chains (chunks 0-3 and 4-7, added at the end: the same exact sum) so
 * the vpdpbusd latency (4-5 cycles) does not bound a tile; wider tiles interleave
 * their JB chains chunk by chunk. */
#include "kernels_impl.h"

#include <assert.h>
#include <immintrin.h>
#include <string.h>

#include "moetax/types.h"
#include "simd_avx2.h"

/* Bytes ahead in each group's stream (as the avx2 table's QPF). */
#ifndef QPF512
#define QPF512 1024
#endif

/* Blocks per column chunk: bounds the per-call scratch of Q8_0 corrections. */
#define KC_MAX 512
#ifndef Q8_NC2_MAX /* Q8_0 tiles of up to this many batch rows sum each block in two chains */
#define Q8_NC2_MAX 8
#endif
/* Batch rows per tile at most. */
#define JB_MAX 8
/* Weight rows per panel for batches: the panel's weights stay in L2 while every
 * batch tile passes over them. */
#define PANEL_ROWS 64
#ifndef DPB_ASM /* -DDPB_ASM=0: the intrinsics' separate broadcast instead (for A/B runs) */
#define DPB_ASM 1
#endif

/* Batch tiles (2+ batch rows) prefetch each stream QPF_FAR bytes ahead into L2 and
 * QPF_NEAR ahead into L1. Such a tile takes 2-8x decode's time per weight byte, so
 * decode's distance (QPF512 into L1) covers too little of the memory latency, and each
 * line it asks for holds one of the L1's few miss buffers for the whole trip to DRAM
 * (measured: see the commit that added it). */
#ifndef QPF_FAR
#define QPF_FAR 4096
#endif
#ifndef QPF_NEAR
#define QPF_NEAR 512
#endif

/* Prefetch the block of n bytes at blk, QPF512 bytes ahead: one line per 64 bytes
 * (with the next block's, every line is touched); a batch tile (JB > 1) as above. The
 * decode of streamed weights (far: moetax_k_matmul_avx512_stream, a model larger than the
 * last-level cache, kernels.h) also prefetches QPF_FAR ahead into L2: its L1 prefetches then
 * find their lines there (a model in DRAM decodes faster; for one inside the L3 the added
 * instructions only cost, so its calls go without). Q8_0's decode took it later than Q4_0's:
 * on an Intel Xeon it did not gain, on an AMD Zen 4 it did (commit messages). */
ALWAYS_INLINE void prefetch_blk(const uint8_t *blk, int n, int JB, bool far) {
    if (JB > 1) {
#pragma GCC unroll 5
        for (int o = 0; o < n; o += 64) {
            _mm_prefetch((const char *)blk + QPF_FAR + o, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + QPF_NEAR + o, _MM_HINT_T0);
        }
    } else {
        if (far)
#pragma GCC unroll 5
            for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)blk + QPF_FAR + o, _MM_HINT_T1);
        if (QPF512 > 0)
#pragma GCC unroll 5
            for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)blk + QPF512 + o, _MM_HINT_T0);
    }
}

/* Sum of the 8 int32 lanes. */
ALWAYS_INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

ALWAYS_INLINE __m256i bcast32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* ---- 512-bit vectors over two groups of 8 rows: group A in lanes 0-7, B in 8-15 ---- */

#if !DPB_ASM
ALWAYS_INLINE __m512i bcast32z(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#endif

/* acc + vpdpbusd(w, the 4 bytes at p in every lane), the broadcast embedded in the
 * instruction ({1to16}: one fused load uop). GCC emits a separate vpbroadcastd for
 * the intrinsics: one more instruction per vpdpbusd (measured 5-8% slower tiles). */
ALWAYS_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const uint8_t *p) {
#if DPB_ASM
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, bcast32z(p));
#endif
}

/* 32 bytes at a (lanes 0-7) and 32 at b (lanes 8-15). */
ALWAYS_INLINE __m512i load_2x32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The 8 F16 scales at a and the 8 at b, widened. */
ALWAYS_INLINE __m512 cvtph_2x8(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

ALWAYS_INLINE __m512 load_2x8(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

ALWAYS_INLINE void store_2x8(float *a, float *b, __m512 v) {
    _mm256_storeu_ps(a, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(b, _mm512_extractf32x8_ps(v, 1));
}

/* Batch rows of the next tile: n_left split into tiles of at most JB_MAX, sizes as even as can be. */
static inline int next_jb(int64_t n_left) {
    const int64_t tiles = (n_left + JB_MAX - 1) / JB_MAX;
    return (int)((n_left + tiles - 1) / tiles);
}

/* ------------------------------------------------------------------------ */
/* Q8_0 x8r                                                                 */
/* ------------------------------------------------------------------------ */

/* corr[j * kn + bb] = -128 * sum of the 32 quants of block b0 + bb of batch row j. */
static void q8_corrections(const uint8_t *act, size_t act_row, int64_t jn, int64_t b0, int64_t kn, int32_t *corr) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t j = 0; j < jn; j++) {
        const uint8_t *a = act + (size_t)j * act_row;
        for (int64_t bb = 0; bb < kn; bb++) {
            /* sad against 0 of x + 128 (unsigned): 4 sums of 8 bytes */
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + (size_t)(b0 + bb) * 32)), flip);
            const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
            __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
            const int32_t sum = _mm_cvtsi128_si32(t) - 32 * 128;
            corr[j * kn + bb] = -128 * sum;
        }
    }
}

/* G groups (1 or 2: g[0], g[1]) of 8 rows x JB batch rows over blocks [b0, b0 + kn), block b of
 * the groups at g + (b - gb0) 272 bytes (gb0: 0, or b0 for a chunk made apart: q5nl_chunk);
 * y[gi][j * ldy + 0..7]; first: the chain starts from 0, else continues from y. */
ALWAYS_INLINE void q8r8_tile(const int G, const int JB, const bool far, const uint8_t *const *g, const int64_t gb0,
                             const uint8_t *act, size_t act_row, int64_t nb, const int32_t *corr, int64_t b0, int64_t kn,
                             float *const *y, int64_t ldy, bool first) {
    enum { NC = 2 }; /* chains per (group, batch row) when JB <= 4 */
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    __m256 acc[2][JB_MAX];
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) acc[gi][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y[gi] + j * ldy);
    for (int64_t bb = 0; bb < kn; bb++) {
        const int64_t b = b0 + bb;
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)(b - gb0) * MOETAX_K_Q8R8_BLOCK_BYTES;
            prefetch_blk(blk, MOETAX_K_Q8R8_BLOCK_BYTES, JB, far);
            __m256i wv[8];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) wv[c] = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q8R8_QS_OFF + 32 * c));
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            if (JB <= Q8_NC2_MAX) {
                __m256i ia[JB_MAX][NC];
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    ia[j][0] = _mm256_set1_epi32(corr[j * kn + bb]);
                    ia[j][1] = _mm256_setzero_si256();
                }
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
#pragma GCC unroll 8
                    for (int j = 0; j < JB; j++) {
                        const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                        ia[j][0] = _mm256_dpbusd_epi32(ia[j][0], wv[c], bcast32(xq + 4 * c));
                        ia[j][1] = _mm256_dpbusd_epi32(ia[j][1], wv[c + 4], bcast32(xq + 4 * c + 16));
                    }
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    const __m256i s = _mm256_add_epi32(ia[j][0], ia[j][1]);
                    const __m256 dx = _mm256_broadcast_ss((const float *)(act + (size_t)j * act_row + d_off) + b);
                    acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[gi][j]);
                }
            } else {
                __m256i ia[JB_MAX];
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) ia[j] = _mm256_set1_epi32(corr[j * kn + bb]);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
#pragma GCC unroll 8
                    for (int j = 0; j < JB; j++)
                        ia[j] = _mm256_dpbusd_epi32(ia[j], wv[c], bcast32(act + (size_t)j * act_row + (size_t)b * 32 + 4 * c));
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    const __m256 dx = _mm256_broadcast_ss((const float *)(act + (size_t)j * act_row + d_off) + b);
                    acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]), _mm256_mul_ps(dw, dx), acc[gi][j]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) _mm256_storeu_ps(y[gi] + j * ldy, acc[gi][j]);
}

typedef void (*q8r8_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, const int32_t *corr,
                        int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first);
#define Q8R8_TILE(G, JB)                                                                                          \
    static void q8r8_tile_##G##x##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,    \
                                     const int32_t *corr, int64_t b0, int64_t kn, float *const *y, int64_t ldy, \
                                     bool first) {                                                               \
        q8r8_tile(G, JB, false, g, 0, act, act_row, nb, corr, b0, kn, y, ldy, first);                           \
    }
#define Q8R8C_TILE(JB) /* one group, a chunk made apart (gb0 = b0) */                                            \
    static void q8r8c_tile_1x##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,      \
                                  const int32_t *corr, int64_t b0, int64_t kn, float *const *y, int64_t ldy,    \
                                  bool first) {                                                                 \
        q8r8_tile(1, JB, false, g, b0, act, act_row, nb, corr, b0, kn, y, ldy, first);                          \
    }

Q8R8_TILE(2, 1)
Q8R8_TILE(1, 1) Q8R8_TILE(1, 2) Q8R8_TILE(1, 3) Q8R8_TILE(1, 4)
Q8R8_TILE(1, 5) Q8R8_TILE(1, 6) Q8R8_TILE(1, 7) Q8R8_TILE(1, 8)
Q8R8C_TILE(1) Q8R8C_TILE(2) Q8R8C_TILE(3) Q8R8C_TILE(4) Q8R8C_TILE(5) Q8R8C_TILE(6) Q8R8C_TILE(7) Q8R8C_TILE(8)
/* decode of streamed weights (matmul_stream): also QPF_FAR ahead into L2 */
static void q8r8_tile_far_2x1(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, const int32_t *corr,
                              int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first) {
    q8r8_tile(2, 1, true, g, 0, act, act_row, nb, corr, b0, kn, y, ldy, first);
}
static void q8r8_tile_far_1x1(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, const int32_t *corr,
                              int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first) {
    q8r8_tile(1, 1, true, g, 0, act, act_row, nb, corr, b0, kn, y, ldy, first);
}
static const q8r8_fn k_q8r8[JB_MAX] = {q8r8_tile_1x1, q8r8_tile_1x2, q8r8_tile_1x3, q8r8_tile_1x4,
                                       q8r8_tile_1x5, q8r8_tile_1x6, q8r8_tile_1x7, q8r8_tile_1x8};
static const q8r8_fn k_q8r8c[JB_MAX] = {q8r8c_tile_1x1, q8r8c_tile_1x2, q8r8c_tile_1x3, q8r8c_tile_1x4,
                                        q8r8c_tile_1x5, q8r8c_tile_1x6, q8r8c_tile_1x7, q8r8c_tile_1x8};

/* Two groups of 8 rows (g[0] in lanes 0-7, g[1] in lanes 8-15 of each 512-bit vector)
 * x JB batch rows over blocks [b0, b0 + kn); NC int32 chains per batch row (1 or 2).
 * y[0], y[1]: the groups' outputs; per lane the canonical chain. */
ALWAYS_INLINE void q8z_tile(const int JB, const int NC, const uint8_t *const *g, const int64_t gb0, const uint8_t *act,
                            size_t act_row, int64_t nb, const int32_t *corr, int64_t b0, int64_t kn, float *const *y,
                            int64_t ldy, bool first) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb);
    __m512 acc[JB_MAX];
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) acc[j] = first ? _mm512_setzero_ps() : load_2x8(y[0] + j * ldy, y[1] + j * ldy);
    for (int64_t bb = 0; bb < kn; bb++) {
        const int64_t b = b0 + bb;
        const uint8_t *k0 = g[0] + (size_t)(b - gb0) * MOETAX_K_Q8R8_BLOCK_BYTES,
                      *k1 = g[1] + (size_t)(b - gb0) * MOETAX_K_Q8R8_BLOCK_BYTES;
        prefetch_blk(k0, MOETAX_K_Q8R8_BLOCK_BYTES, JB, false);
        prefetch_blk(k1, MOETAX_K_Q8R8_BLOCK_BYTES, JB, false);
        __m512i wv[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) wv[c] = load_2x32(k0 + MOETAX_K_Q8R8_QS_OFF + 32 * c, k1 + MOETAX_K_Q8R8_QS_OFF + 32 * c);
        __m512i s0[JB_MAX], s1[JB_MAX];
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            s0[j] = _mm512_set1_epi32(corr[j * kn + bb]);
            s1[j] = _mm512_setzero_si512();
        }
        /* chunk-major, so the JB x NC independent chains interleave */
#pragma GCC unroll 8
        for (int c = 0; c < 8 / NC; c++)
#pragma GCC unroll 8
            for (int j = 0; j < JB; j++) {
                const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                s0[j] = dpbusd_bcast(s0[j], wv[c], xq + 4 * c);
                if (NC == 2) s1[j] = dpbusd_bcast(s1[j], wv[c + 4], xq + 16 + 4 * c);
            }
        const __m512 dw = cvtph_2x8(k0, k1);
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            const __m512i sj = NC == 2 ? _mm512_add_epi32(s0[j], s1[j]) : s0[j];
            const __m512 dx = _mm512_set1_ps(((const float *)(act + (size_t)j * act_row + d_off))[b]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sj), _mm512_mul_ps(dw, dx), acc[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) store_2x8(y[0] + j * ldy, y[1] + j * ldy, acc[j]);
}

typedef void (*q8z_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, const int32_t *corr,
                       int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first);
#define Q8Z_TILE(JB, NC)                                                                                         \
    static void q8z_tile_##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,            \
                              const int32_t *corr, int64_t b0, int64_t kn, float *const *y, int64_t ldy,          \
                              bool first) {                                                                       \
        q8z_tile(JB, NC, g, 0, act, act_row, nb, corr, b0, kn, y, ldy, first);                                    \
    }                                                                                                             \
    static void q8zc_tile_##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,           \
                               const int32_t *corr, int64_t b0, int64_t kn, float *const *y, int64_t ldy,         \
                               bool first) {                                                                      \
        q8z_tile(JB, NC, g, b0, act, act_row, nb, corr, b0, kn, y, ldy, first);                                   \
    }
Q8Z_TILE(1, 2) Q8Z_TILE(2, 2) Q8Z_TILE(3, 1) Q8Z_TILE(4, 1) Q8Z_TILE(5, 1) Q8Z_TILE(6, 1) Q8Z_TILE(7, 1) Q8Z_TILE(8, 1)
static const q8z_fn k_q8z[JB_MAX] = {q8z_tile_1, q8z_tile_2, q8z_tile_3, q8z_tile_4,
                                     q8z_tile_5, q8z_tile_6, q8z_tile_7, q8z_tile_8};
static const q8z_fn k_q8zc[JB_MAX] = {q8zc_tile_1, q8zc_tile_2, q8zc_tile_3, q8zc_tile_4,
                                      q8zc_tile_5, q8zc_tile_6, q8zc_tile_7, q8zc_tile_8};

/* One plain block_q8_0 row (a unit's last n_rows % 8 rows) against one batch row
 * over blocks [b0, b0 + kn), in the canonical chain (the avx2 table's bits). */
static float q8_plain_row(const uint8_t *w, int64_t nb, const uint8_t *a, const int32_t *corr, int64_t b0, int64_t kn,
                          float init) {
    const float *dx = (const float *)(a + moetax_k_act_d_off(MOETAX_TYPE_Q8_0, nb));
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m128 acc = _mm_set_ss(init);
    for (int64_t bb = 0; bb < kn; bb++) {
        const int64_t b = b0 + bb;
        const uint8_t *blk = w + (size_t)b * sizeof(moetax_block_q8_0);
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), flip);
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, _mm256_loadu_si256((const __m256i *)(a + b * 32)));
        const int32_t s = hsum_epi32(p) + corr[bb];
        acc = _mm_fmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), s), _mm_mul_ss(_mm_set_ss(moetax_k_fp16_table[dh]),
                                                                          _mm_set_ss(dx[b])), acc);
    }
    return _mm_cvtss_f32(acc);
}

static void matmul_q8(const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { R = MOETAX_K_Q8R8_ROWS };
    const int64_t nb = ncols / 32, gend = row1 - (row1 - row0) % R;
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q8_0, ncols);
    int32_t corr[JB_MAX * KC_MAX];
    /* one tile of batch rows (decode, batches of up to JB_MAX): the whole range; more: panels
     * that every tile passes over while they stay in L2 */
    const int64_t pr = n_batch <= JB_MAX ? row1 - row0 : PANEL_ROWS;
    for (int64_t p0 = row0; p0 < row1; p0 += pr) {
        const int64_t p1 = row1 - p0 <= pr ? row1 : p0 + pr, pg = p1 < gend ? p1 : gend;
        const int64_t ng = (pg - p0) / R, np = ng / 2;
        for (int64_t b0 = 0; b0 < nb; b0 += KC_MAX) {
            const int64_t kn = nb - b0 < KC_MAX ? nb - b0 : KC_MAX;
            for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
                jb = next_jb(n_batch - j0);
                const uint8_t *aj = act + (size_t)j0 * act_row;
                float *yj = y + j0 * ldy;
                q8_corrections(aj, act_row, jb, b0, kn, corr);
                /* pairs of groups: group i of the panel's first half with group i of its second
                 * half, so that the tiles read two long sequential streams (decode: 256-bit tiles,
                 * as fast as one 512-bit vector there; batches: the two groups in one 512-bit
                 * vector). Adjacent groups (2i, 2i + 1) made each stream skip every other group's
                 * bytes, which the hardware prefetcher does not follow. */
                for (int64_t i = 0; i < np; i++) {
                    const int64_t ra = p0 + i * R, rb = ra + np * R;
                    const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
                    float *yy[2] = {yj + ra, yj + rb};
                    if (n_batch == 1 && far) q8r8_tile_far_2x1(gg, aj, act_row, nb, corr, b0, kn, yy, ldy, b0 == 0);
                    else if (n_batch == 1) q8r8_tile_2x1(gg, aj, act_row, nb, corr, b0, kn, yy, ldy, b0 == 0);
                    else k_q8z[jb - 1](gg, aj, act_row, nb, corr, b0, kn, yy, ldy, b0 == 0);
                }
                if (ng % 2) { /* the odd group */
                    const int64_t r = p0 + (ng - 1) * R;
                    const uint8_t *g[1] = {w + (size_t)r * row_bytes};
                    float *yy[1] = {yj + r};
                    if (far && jb == 1) q8r8_tile_far_1x1(g, aj, act_row, nb, corr, b0, kn, yy, ldy, b0 == 0);
                    else k_q8r8[jb - 1](g, aj, act_row, nb, corr, b0, kn, yy, ldy, b0 == 0);
                }
                for (int64_t r = pg; r < p1; r++)
                    for (int j = 0; j < jb; j++) {
                        float *yo = yj + j * ldy + r;
                        *yo = q8_plain_row(w + (size_t)r * row_bytes, nb, aj + (size_t)j * act_row, corr + j * kn, b0,
                                           kn, b0 == 0 ? 0.0f : *yo);
                    }
            }
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Q5_0 and IQ4_NL batches                                                  */
/* ------------------------------------------------------------------------ */

/* Q5_0 in Q5_0x8r, IQ4_NL in IQ4_NLx8r (kernels.h; decode below: q5r8_dec). A batch of up to JB_MAX
 * rows runs the x4z tiles on pairs of groups (below); a larger one, and a small one's odd group,
 * converts each group of 8 rows x Q5NL_KB blocks into a chunk in Q8_0x8r's layout (the
 * level plus 128, the F16 d as stored: a Q8_0 block of the same values, so the exact block sums are
 * the same) and runs the Q8_0 tiles on it: two groups in 512-bit vectors, a lone group in 256-bit
 * ones; each output's chain continues through y from one chunk to the next, as Q8_0's column chunks
 * do. Batch rows go in slabs of up to Q5NL_JS, the corrections of a slab's chunk made once for all
 * its row groups. A range's last rows % 8 (plain) take the avx2 table's path. The same bits as the
 * avx2 table (the canonical Q8_0 chain). */
#define Q5NL_KB 64
#define Q5NL_JS 64

/* IQ4_NLx8r (Q4_0x8r's layout): the table's levels plus 128 (unsigned) of chunk c, half h of a
 * group's block. */
ALWAYS_INLINE __m256i iq4r8_levels(const uint8_t *blk, int c, int h) {
    const __m128i t = _mm_add_epi8(_mm_loadu_si128((const __m128i *)moetax_iq4nl_values), _mm_set1_epi8((char)0x80));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4R8_QS_OFF + 32 * c));
    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
}

/* Q5_0x8r (kernels.h): the unsigned levels q (0..31) of chunk c, half h of a group's block: the
 * nibbles plus 16 where the chunk's mask has the byte's bit. */
ALWAYS_INLINE __m256i q5r8_levels(const uint8_t *blk, int c, int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q5R8_QS_OFF + 32 * c));
    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    uint32_t m;
    memcpy(&m, blk + MOETAX_K_Q5R8_QH_OFF + 4 * (2 * c + h), 4);
    return _mm256_mask_add_epi8(nib, _cvtu32_mask32(m), nib, _mm256_set1_epi8(16));
}

/* Decode: G groups (g[0], g[1]: two streams) of Q5_0x8r (nl: IQ4_NLx8r) x one batch row (the Q4_0
 * row: the offset of 16 (128) from its block sums s = 8 sum(x)). Per lane the chain of kernels.h. */
ALWAYS_INLINE void q5r8_dec(const bool nl, const int G, const bool far, const uint8_t *const *g, const uint8_t *act,
                            int64_t nb, float *const *y) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    const size_t gbs = nl ? MOETAX_K_Q4R8_BLOCK_BYTES : MOETAX_K_Q5R8_BLOCK_BYTES;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        int32_t sx;
        memcpy(&sx, act + s_off + (size_t)b * 4, 4);
        const uint8_t *xq = act + (size_t)b * 32;
        const __m256 dx = _mm256_broadcast_ss((const float *)(act + d_off) + b);
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)b * gbs;
            prefetch_blk(blk, (int)gbs, 1, far);
            __m256i i0 = _mm256_set1_epi32((nl ? -16 : -2) * sx), i1 = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                i0 = _mm256_dpbusd_epi32(i0, nl ? iq4r8_levels(blk, c, 0) : q5r8_levels(blk, c, 0), bcast32(xq + 4 * c));
                i1 = _mm256_dpbusd_epi32(i1, nl ? iq4r8_levels(blk, c, 1) : q5r8_levels(blk, c, 1),
                                         bcast32(xq + 16 + 4 * c));
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            acc[gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(dw, dx), acc[gi]);
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++) _mm256_storeu_ps(y[gi], acc[gi]);
}
typedef void (*q5r8_dec_fn)(const uint8_t *const *g, const uint8_t *act, int64_t nb, float *const *y);
#define Q5R8_DEC(NAME, NL, G, FAR)                                                                 \
    static void NAME(const uint8_t *const *g, const uint8_t *act, int64_t nb, float *const *y) {  \
        q5r8_dec(NL, G, FAR, g, act, nb, y);                                                       \
    }
Q5R8_DEC(q5r8_dec_2, false, 2, false) Q5R8_DEC(q5r8_dec_1, false, 1, false)
Q5R8_DEC(q5r8_dec_2f, false, 2, true) Q5R8_DEC(q5r8_dec_1f, false, 1, true)
Q5R8_DEC(iq4r8_dec_2, true, 2, false) Q5R8_DEC(iq4r8_dec_1, true, 1, false)
Q5R8_DEC(iq4r8_dec_2f, true, 2, true) Q5R8_DEC(iq4r8_dec_1f, true, 1, true)
/* [nl][G - 1][far] */
static const q5r8_dec_fn k_q5r8_dec[2][2][2] = {{{q5r8_dec_1, q5r8_dec_1f}, {q5r8_dec_2, q5r8_dec_2f}},
                                                {{iq4r8_dec_1, iq4r8_dec_1f}, {iq4r8_dec_2, iq4r8_dec_2f}}};

/* A Q5_0x8r (nl: IQ4_NLx8r) group's blocks [b0, b0 + kn) -> o, Q8_0x8r blocks (the signed level
 * plus 128). */
static void q5r8_chunk(bool nl, const uint8_t *g, int64_t b0, int64_t kn, uint8_t *o) {
    const __m256i off = _mm256_set1_epi8(nl ? 0 : 128 - 16);
    const size_t gbs = nl ? MOETAX_K_Q4R8_BLOCK_BYTES : MOETAX_K_Q5R8_BLOCK_BYTES;
    for (int64_t bb = 0; bb < kn; bb++, o += MOETAX_K_Q8R8_BLOCK_BYTES) {
        const uint8_t *blk = g + (size_t)(b0 + bb) * gbs;
        memcpy(o, blk, 16); /* d of the 8 rows, as Q8_0x8r keeps them */
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256((__m256i *)(o + MOETAX_K_Q8R8_QS_OFF + 32 * (4 * h + c)),
                                    _mm256_add_epi8(nl ? iq4r8_levels(blk, c, h) : q5r8_levels(blk, c, h), off));
    }
}

/* Q4_1x8r / Q5_1x8r (kernels.h): G groups (decode: 2 streams) x JB batch rows (the Q4_0 row), the
 * unsigned levels q (Q5_1: plus 16 where the chunk's mask says) summed by vpdpbusd, then per lane the
 * chain of kernels.h: acc = fma(S, d_w d_x, acc), acc = fma(X, m_w d_x, acc), X = s / 8. */
ALWAYS_INLINE void qx1r8_tile(const bool five, const int G, const int JB, const bool far, const uint8_t *const *g,
                              const uint8_t *act, size_t act_row, int64_t nb, float *const *y, int64_t ldy) {
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    const size_t gbs = five ? MOETAX_K_Q51R8_BLOCK_BYTES : MOETAX_K_Q41R8_BLOCK_BYTES;
    const size_t qs = five ? MOETAX_K_Q51R8_QS_OFF : MOETAX_K_Q41R8_QS_OFF;
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int j = 0; j < JB; j++) acc[gi][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)b * gbs;
            prefetch_blk(blk, (int)gbs, JB, far);
            __m256i L[4][2];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * c));
                L[c][0] = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
                L[c][1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
                if (five)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        uint32_t m;
                        memcpy(&m, blk + MOETAX_K_Q51R8_QH_OFF + 4 * (2 * c + h), 4);
                        L[c][h] = _mm256_mask_add_epi8(L[c][h], _cvtu32_mask32(m), L[c][h], _mm256_set1_epi8(16));
                    }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + MOETAX_K_QX1R8_M_OFF)));
#pragma GCC unroll 4
            for (int j = 0; j < JB; j++) {
                const uint8_t *a = act + (size_t)j * act_row, *xq = a + (size_t)b * 32;
                __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    i0 = _mm256_dpbusd_epi32(i0, L[c][0], bcast32(xq + 4 * c));
                    i1 = _mm256_dpbusd_epi32(i1, L[c][1], bcast32(xq + 16 + 4 * c));
                }
                int32_t sx;
                memcpy(&sx, a + s_off + (size_t)b * 4, 4);
                const __m256 dx = _mm256_broadcast_ss((const float *)(a + d_off) + b);
                acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_mul_ps(dw, dx), acc[gi][j]);
                acc[gi][j] = _mm256_fmadd_ps(_mm256_set1_ps((float)(sx / 8)), _mm256_mul_ps(mw, dx), acc[gi][j]);
            }
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 4
        for (int j = 0; j < JB; j++) _mm256_storeu_ps(y[gi] + j * ldy, acc[gi][j]);
}
#define QX1R8_TILE(NAME, FIVE, G, JB, FAR)                                                                      \
    static void NAME(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, float *const *y, \
                     int64_t ldy) {                                                                            \
        qx1r8_tile(FIVE, G, JB, FAR, g, act, act_row, nb, y, ldy);                                             \
    }
QX1R8_TILE(q41r8_d2, false, 2, 1, false) QX1R8_TILE(q41r8_d2f, false, 2, 1, true)
QX1R8_TILE(q41r8_1, false, 1, 1, false) QX1R8_TILE(q41r8_1f, false, 1, 1, true)
QX1R8_TILE(q41r8_2, false, 1, 2, false) QX1R8_TILE(q41r8_3, false, 1, 3, false) QX1R8_TILE(q41r8_4, false, 1, 4, false)
QX1R8_TILE(q51r8_d2, true, 2, 1, false) QX1R8_TILE(q51r8_d2f, true, 2, 1, true)
QX1R8_TILE(q51r8_1, true, 1, 1, false) QX1R8_TILE(q51r8_1f, true, 1, 1, true)
QX1R8_TILE(q51r8_2, true, 1, 2, false) QX1R8_TILE(q51r8_3, true, 1, 3, false) QX1R8_TILE(q51r8_4, true, 1, 4, false)
static const struct moetax_k_r8_tiles k_qx1r8[2] = {{{q41r8_d2, q41r8_d2f}, {q41r8_1, q41r8_1f}, {q41r8_1, q41r8_2, q41r8_3, q41r8_4}},
                {{q51r8_d2, q51r8_d2f}, {q51r8_1, q51r8_1f}, {q51r8_1, q51r8_2, q51r8_3, q51r8_4}}};

/* Batches of the four types that take the Q4_0 row (Q5_0, IQ4_NL, Q4_1, Q5_1): two groups (g[0] in
 * lanes 0-7, g[1] in lanes 8-15 of each 512-bit vector) x JB batch rows (up to JB_MAX) over all nb
 * blocks, each block's levels made once in registers for all the rows (an MoE prefill's experts get
 * a few tokens each; Q5_0 / IQ4_NL took a Q8_0x8r chunk's store and load and the corrections before,
 * which cost more than these levels at a few rows, and keep them for larger batches). Per lane
 * decode's chain (q5r8_dec, qx1r8_tile), so the same bits. */
enum x4z_kind { X4Z_Q5_0, X4Z_IQ4_NL, X4Z_Q4_1, X4Z_Q5_1 };

/* The unsigned levels of chunk c of both groups' block: half 0 (quants 4c..) in *lo, half 1 in *hi. */
ALWAYS_INLINE void x4z_levels(const enum x4z_kind kind, const uint8_t *k0, const uint8_t *k1, int c, __m512i *lo,
                              __m512i *hi) {
    const size_t qs = kind == X4Z_Q5_0   ? MOETAX_K_Q5R8_QS_OFF
                      : kind == X4Z_IQ4_NL ? MOETAX_K_Q4R8_QS_OFF
                      : kind == X4Z_Q4_1   ? MOETAX_K_Q41R8_QS_OFF
                                           : MOETAX_K_Q51R8_QS_OFF;
    const __m512i v = load_2x32(k0 + qs + 32 * c, k1 + qs + 32 * c), m4 = _mm512_set1_epi8(0x0f);
    const __m512i n0 = _mm512_and_si512(v, m4), n1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (kind == X4Z_IQ4_NL) {
        const __m512i t = _mm512_broadcast_i32x4(
            _mm_add_epi8(_mm_loadu_si128((const __m128i *)moetax_iq4nl_values), _mm_set1_epi8((char)0x80)));
        *lo = _mm512_shuffle_epi8(t, n0);
        *hi = _mm512_shuffle_epi8(t, n1);
    } else if (kind == X4Z_Q4_1) {
        *lo = n0;
        *hi = n1;
    } else { /* the fifth bits of half 0 and 1, group 0 and 1, as 16 */
        const size_t qh = kind == X4Z_Q5_0 ? MOETAX_K_Q5R8_QH_OFF : MOETAX_K_Q51R8_QH_OFF;
        uint32_t a0, a1, b0, b1;
        memcpy(&a0, k0 + qh + 4 * (2 * c), 4);
        memcpy(&a1, k0 + qh + 4 * (2 * c + 1), 4);
        memcpy(&b0, k1 + qh + 4 * (2 * c), 4);
        memcpy(&b1, k1 + qh + 4 * (2 * c + 1), 4);
        const __m512i f = _mm512_set1_epi8(16);
        *lo = _mm512_mask_add_epi8(n0, _cvtu64_mask64((uint64_t)b0 << 32 | a0), n0, f);
        *hi = _mm512_mask_add_epi8(n1, _cvtu64_mask64((uint64_t)b1 << 32 | a1), n1, f);
    }
}

ALWAYS_INLINE void x4z_tile(const enum x4z_kind kind, const int JB, const uint8_t *const *g, const uint8_t *act,
                            size_t act_row, int64_t nb, float *const *y, int64_t ldy) {
    const bool min = kind == X4Z_Q4_1 || kind == X4Z_Q5_1; /* the min's term (kernels.h) */
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    const size_t gbs = kind == X4Z_Q5_0   ? MOETAX_K_Q5R8_BLOCK_BYTES
                       : kind == X4Z_IQ4_NL ? MOETAX_K_Q4R8_BLOCK_BYTES
                       : kind == X4Z_Q4_1   ? MOETAX_K_Q41R8_BLOCK_BYTES
                                            : MOETAX_K_Q51R8_BLOCK_BYTES;
    /* the levels' offset from the signed values, through the block sums s = 8 sum(x): 16 (Q5_0), 128
     * (IQ4_NL's table plus 128); Q4_1 / Q5_1 keep it in their min */
    const int32_t off = kind == X4Z_Q5_0 ? -2 : kind == X4Z_IQ4_NL ? -16 : 0;
    __m512 acc[JB_MAX];
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *k0 = g[0] + (size_t)b * gbs, *k1 = g[1] + (size_t)b * gbs;
        prefetch_blk(k0, (int)gbs, JB, false);
        prefetch_blk(k1, (int)gbs, JB, false);
        __m512i wv[8]; /* 0-3: half 0 (quants 4c..4c+3), 4-7: half 1 (16 + 4c..) */
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) x4z_levels(kind, k0, k1, c, &wv[c], &wv[c + 4]);
        __m512i s0[JB_MAX], s1[JB_MAX];
        int32_t sx[JB_MAX];
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            memcpy(&sx[j], act + (size_t)j * act_row + s_off + (size_t)b * 4, 4);
            s0[j] = _mm512_set1_epi32(off * sx[j]);
            s1[j] = _mm512_setzero_si512();
        }
        /* two chains per row up to 2 rows, one from 3 (as the Q8_0 tiles) */
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
#pragma GCC unroll 8
            for (int j = 0; j < JB; j++) {
                const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                s0[j] = dpbusd_bcast(s0[j], wv[c], xq + 4 * c);
                if (JB <= 2) s1[j] = dpbusd_bcast(s1[j], wv[c + 4], xq + 16 + 4 * c);
                else s0[j] = dpbusd_bcast(s0[j], wv[c + 4], xq + 16 + 4 * c);
            }
        const __m512 dw = cvtph_2x8(k0, k1);
        const __m512 mw = min ? cvtph_2x8(k0 + MOETAX_K_QX1R8_M_OFF, k1 + MOETAX_K_QX1R8_M_OFF) : dw;
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            const __m512 dx = _mm512_set1_ps(((const float *)(act + (size_t)j * act_row + d_off))[b]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[j], s1[j])), _mm512_mul_ps(dw, dx), acc[j]);
            if (min) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps((float)(sx[j] / 8)), _mm512_mul_ps(mw, dx), acc[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) store_2x8(y[0] + j * ldy, y[1] + j * ldy, acc[j]);
}
typedef void (*x4z_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, float *const *y,
                       int64_t ldy);
#define X4Z_TILE(NAME, KIND, JB)                                                                                  \
    static void NAME(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, float *const *y,   \
                     int64_t ldy) {                                                                               \
        x4z_tile(KIND, JB, g, act, act_row, nb, y, ldy);                                                          \
    }
#define X4Z_TILES(P, KIND)                                                                                        \
    X4Z_TILE(P##_2, KIND, 2) X4Z_TILE(P##_3, KIND, 3) X4Z_TILE(P##_4, KIND, 4) X4Z_TILE(P##_5, KIND, 5)           \
    X4Z_TILE(P##_6, KIND, 6) X4Z_TILE(P##_7, KIND, 7) X4Z_TILE(P##_8, KIND, 8)
X4Z_TILES(q50z, X4Z_Q5_0) X4Z_TILES(iq4z, X4Z_IQ4_NL) X4Z_TILES(q41z, X4Z_Q4_1) X4Z_TILES(q51z, X4Z_Q5_1)
/* [kind][JB - 2]: batches only (decode has its own tiles) */
static const x4z_fn k_x4z[4][JB_MAX - 1] = {{q50z_2, q50z_3, q50z_4, q50z_5, q50z_6, q50z_7, q50z_8},
                                            {iq4z_2, iq4z_3, iq4z_4, iq4z_5, iq4z_6, iq4z_7, iq4z_8},
                                            {q41z_2, q41z_3, q41z_4, q41z_5, q41z_6, q41z_7, q41z_8},
                                            {q51z_2, q51z_3, q51z_4, q51z_5, q51z_6, q51z_7, q51z_8}};

/* A batch (2+ rows) of rows [row0, row1) on the x4z tiles: group i with group i + np (two streams,
 * as decode), the batch rows in tiles of up to JB_MAX. Returns where the paired groups end (an odd
 * group and the plain rows after it are the caller's). */
static int64_t x4z_pairs(enum x4z_kind kind, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1,
                         int64_t nb, const uint8_t *act, size_t act_row, int64_t n_batch, float *y, int64_t ldy) {
    enum { R = 8 };
    const int64_t np = (row1 - row0) / R / 2;
    for (int64_t i = 0; i < np; i++) {
        const int64_t ra = row0 + i * R, rb = ra + np * R;
        const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
        for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
            jb = next_jb(n_batch - j0);
            float *yj = y + j0 * ldy;
            float *yy[2] = {yj + ra, yj + rb};
            k_x4z[kind][jb - 2](gg, act + (size_t)j0 * act_row, act_row, nb, yy, ldy);
        }
    }
    return row0 + 2 * np * R;
}

static void matmul_qx1(bool five, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                       const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    const enum moetax_type t = five ? MOETAX_TYPE_Q5_1 : MOETAX_TYPE_Q4_1;
    const int64_t nb = ncols / 32;
    const size_t act_row = moetax_k_act_row_bytes(t, ncols);
    /* a batch's pairs of groups on the x4z tiles; the shared driver takes decode, or the odd group */
    const int64_t r8 = n_batch > 1 ? x4z_pairs(five ? X4Z_Q5_1 : X4Z_Q4_1, w, row_bytes, row0, row1, nb, act, act_row,
                                               n_batch, y, ldy)
                                   : row0;
    const int64_t gend = moetax_k_r8_drive(&k_qx1r8[five], w, row_bytes, r8, row1, nb, act, act_row, n_batch, y, ldy, far);
    if (gend < row1) /* the last rows % 8, plain */
        moetax_k_matmul_avx2(t, w, row_bytes, gend, row1, ncols, act, n_batch, y, ldy);
}

static void matmul_q5nl(bool nl, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                        const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { R = 8 };
    const enum moetax_type t = nl ? MOETAX_TYPE_IQ4_NL : MOETAX_TYPE_Q5_0;
    const int64_t nb = ncols / 32, gend = row0 + (row1 - row0) / R * R;
    const size_t act_row = moetax_k_act_row_bytes(t, ncols);
    if (gend == row0) { /* a range of plain rows: avx2's */
        (far ? moetax_k_matmul_avx2_stream : moetax_k_matmul_avx2)(t, w, row_bytes, row0, row1, ncols, act, n_batch, y,
                                                                  ldy);
        return;
    }
    if (n_batch == 1) { /* decode: group i of the first half with group i of the second */
        const int64_t ng = (gend - row0) / R, np = ng / 2;
        for (int64_t i = 0; i < np; i++) {
            const int64_t ra = row0 + i * R, rb = ra + np * R;
            const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
            float *yy[2] = {y + ra, y + rb};
            k_q5r8_dec[nl][1][far](gg, act, nb, yy);
        }
        if (ng % 2) {
            const int64_t r = row0 + (ng - 1) * R;
            const uint8_t *gg[1] = {w + (size_t)r * row_bytes};
            float *yy[1] = {y + r};
            k_q5r8_dec[nl][0][far](gg, act, nb, yy);
        }
    } else {
        /* small batches: pairs of groups (i with i + np, two streams, as decode) on the direct
         * tiles; the odd group, and larger batches, through Q8_0x8r chunks */
        const int64_t c0 = n_batch <= JB_MAX ? x4z_pairs(nl ? X4Z_IQ4_NL : X4Z_Q5_0, w, row_bytes, row0, gend, nb,
                                                         act, act_row, n_batch, y, ldy)
                                             : row0;
        _Alignas(64) uint8_t buf[2][Q5NL_KB * MOETAX_K_Q8R8_BLOCK_BYTES];
        int32_t corr[Q5NL_JS * Q5NL_KB];
        for (int64_t s0 = 0; s0 < n_batch && c0 < gend; s0 += Q5NL_JS) {
            const int64_t sn = n_batch - s0 < Q5NL_JS ? n_batch - s0 : Q5NL_JS;
            const uint8_t *as = act + (size_t)s0 * act_row;
            for (int64_t b0 = 0; b0 < nb; b0 += Q5NL_KB) {
                const int64_t kn = nb - b0 < Q5NL_KB ? nb - b0 : Q5NL_KB;
                /* per tile of batch rows, its corrections at corr + j0 * kn (q8_corrections' layout) */
                for (int64_t j0 = 0, jb; j0 < sn; j0 += jb) {
                    jb = next_jb(sn - j0);
                    q8_corrections(as + (size_t)j0 * act_row, act_row, jb, b0, kn, corr + j0 * kn);
                }
                for (int64_t p0 = c0; p0 < gend; p0 += 2 * R) {
                    const int G = gend - p0 >= 2 * R ? 2 : 1;
                    for (int gi = 0; gi < G; gi++) q5r8_chunk(nl, w + (size_t)(p0 + gi * R) * row_bytes, b0, kn, buf[gi]);
                    const uint8_t *gg[2] = {buf[0], buf[1]};
                    for (int64_t j0 = 0, jb; j0 < sn; j0 += jb) {
                        jb = next_jb(sn - j0);
                        float *yj = y + (s0 + j0) * ldy;
                        float *yy[2] = {yj + p0, yj + p0 + R};
                        const uint8_t *aj = as + (size_t)j0 * act_row;
                        if (G == 2) k_q8zc[jb - 1](gg, aj, act_row, nb, corr + j0 * kn, b0, kn, yy, ldy, b0 == 0);
                        else k_q8r8c[jb - 1](gg, aj, act_row, nb, corr + j0 * kn, b0, kn, yy, ldy, b0 == 0);
                    }
                }
            }
        }
    }
    if (gend < row1) /* the last rows % 8, plain */
        moetax_k_matmul_avx2(t, w, row_bytes, gend, row1, ncols, act, n_batch, y, ldy);
}

/* ------------------------------------------------------------------------ */
/* Q4_0 x8r                                                                 */
/* ------------------------------------------------------------------------ */

/* G groups (1 or 2: g[0], g[1]) of 8 rows (Q4_0x8r) x JB batch rows over blocks
 * [b0, b0 + kn); y[gi][j * ldy + 0..7]. G = 2 (decode) reads two streams at once. */
ALWAYS_INLINE void q4r8_tile(const int G, const int JB, const bool far, const uint8_t *const *g, const uint8_t *act, size_t act_row,
                             int64_t nb, int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    __m256 acc[2][JB_MAX];
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) acc[gi][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y[gi] + j * ldy);
    for (int64_t bb = 0; bb < kn; bb++) {
        const int64_t b = b0 + bb;
#pragma GCC unroll 2
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = g[gi] + (size_t)b * MOETAX_K_Q4R8_BLOCK_BYTES;
            prefetch_blk(blk, MOETAX_K_Q4R8_BLOCK_BYTES, JB, far);
            __m256i lo[4], hi[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + MOETAX_K_Q4R8_QS_OFF + 32 * c));
                lo[c] = _mm256_and_si256(v, m4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            if (JB <= 4) {
                __m256i ia[JB_MAX][2];
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    int32_t sx;
                    memcpy(&sx, act + (size_t)j * act_row + s_off + (size_t)b * 4, 4);
                    ia[j][0] = _mm256_set1_epi32(-sx);
                    ia[j][1] = _mm256_setzero_si256();
                }
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
#pragma GCC unroll 8
                    for (int j = 0; j < JB; j++) {
                        const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                        ia[j][0] = _mm256_dpbusd_epi32(ia[j][0], lo[c], bcast32(xq + 4 * c));
                        ia[j][1] = _mm256_dpbusd_epi32(ia[j][1], hi[c], bcast32(xq + 16 + 4 * c));
                    }
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    const __m256i s = _mm256_add_epi32(ia[j][0], ia[j][1]);
                    const __m256 dx = _mm256_broadcast_ss((const float *)(act + (size_t)j * act_row + d_off) + b);
                    acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[gi][j]);
                }
            } else {
                __m256i ia[JB_MAX];
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    int32_t sx;
                    memcpy(&sx, act + (size_t)j * act_row + s_off + (size_t)b * 4, 4);
                    ia[j] = _mm256_set1_epi32(-sx);
                }
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
#pragma GCC unroll 8
                    for (int j = 0; j < JB; j++) {
                        const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                        ia[j] = _mm256_dpbusd_epi32(ia[j], lo[c], bcast32(xq + 4 * c));
                        ia[j] = _mm256_dpbusd_epi32(ia[j], hi[c], bcast32(xq + 16 + 4 * c));
                    }
#pragma GCC unroll 8
                for (int j = 0; j < JB; j++) {
                    const __m256 dx = _mm256_broadcast_ss((const float *)(act + (size_t)j * act_row + d_off) + b);
                    acc[gi][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]), _mm256_mul_ps(dw, dx), acc[gi][j]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) _mm256_storeu_ps(y[gi] + j * ldy, acc[gi][j]);
}

typedef void (*q4r8_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, int64_t b0,
                        int64_t kn, float *const *y, int64_t ldy, bool first);
#define Q4R8_TILE(G, JB)                                                                                          \
    static void q4r8_tile_##G##x##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,    \
                                     int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first) {         \
        q4r8_tile(G, JB, false, g, act, act_row, nb, b0, kn, y, ldy, first);                                    \
    }
Q4R8_TILE(2, 1)
Q4R8_TILE(1, 1) Q4R8_TILE(1, 2) Q4R8_TILE(1, 3) Q4R8_TILE(1, 4)
Q4R8_TILE(1, 5) Q4R8_TILE(1, 6) Q4R8_TILE(1, 7) Q4R8_TILE(1, 8)
/* decode of streamed weights (matmul_stream) */
static void q4r8_tile_far_2x1(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, int64_t b0,
                              int64_t kn, float *const *y, int64_t ldy, bool first) {
    q4r8_tile(2, 1, true, g, act, act_row, nb, b0, kn, y, ldy, first);
}
static void q4r8_tile_far_1x1(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, int64_t b0,
                              int64_t kn, float *const *y, int64_t ldy, bool first) {
    q4r8_tile(1, 1, true, g, act, act_row, nb, b0, kn, y, ldy, first);
}
static const q4r8_fn k_q4r8[JB_MAX] = {q4r8_tile_1x1, q4r8_tile_1x2, q4r8_tile_1x3, q4r8_tile_1x4,
                                       q4r8_tile_1x5, q4r8_tile_1x6, q4r8_tile_1x7, q4r8_tile_1x8};

/* Two groups of 8 rows (Q4_0x8r; g[0] in lanes 0-7, g[1] in lanes 8-15) x JB batch
 * rows over blocks [b0, b0 + kn); NC int32 chains per batch row (1 or 2). */
ALWAYS_INLINE void q4z_tile(const int JB, const int NC, const uint8_t *const *g, const uint8_t *act, size_t act_row,
                            int64_t nb, int64_t b0, int64_t kn, float *const *y, int64_t ldy, bool first) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const size_t d_off = moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb), s_off = moetax_k_act_s_off(nb);
    __m512 acc[JB_MAX];
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) acc[j] = first ? _mm512_setzero_ps() : load_2x8(y[0] + j * ldy, y[1] + j * ldy);
    for (int64_t bb = 0; bb < kn; bb++) {
        const int64_t b = b0 + bb;
        const uint8_t *k0 = g[0] + (size_t)b * MOETAX_K_Q4R8_BLOCK_BYTES, *k1 = g[1] + (size_t)b * MOETAX_K_Q4R8_BLOCK_BYTES;
        prefetch_blk(k0, MOETAX_K_Q4R8_BLOCK_BYTES, JB, true);
        prefetch_blk(k1, MOETAX_K_Q4R8_BLOCK_BYTES, JB, true);
        __m512i wv[8]; /* chunks 0-3: low nibbles (quants 4c..4c+3), 4-7: high (16 + 4c..) */
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i v = load_2x32(k0 + MOETAX_K_Q4R8_QS_OFF + 32 * c, k1 + MOETAX_K_Q4R8_QS_OFF + 32 * c);
            wv[c] = _mm512_and_si512(v, m4);
            wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        __m512i s0[JB_MAX], s1[JB_MAX];
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            int32_t sx;
            memcpy(&sx, act + (size_t)j * act_row + s_off + (size_t)b * 4, 4);
            s0[j] = _mm512_set1_epi32(-sx);
            s1[j] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int c = 0; c < 8 / NC; c++)
#pragma GCC unroll 8
            for (int j = 0; j < JB; j++) {
                const uint8_t *xq = act + (size_t)j * act_row + (size_t)b * 32;
                /* vector c < 4 meets quants 4c..4c+3, c >= 4 quants 16 + 4(c-4).. = 4c.. too */
                s0[j] = dpbusd_bcast(s0[j], wv[c], xq + 4 * c);
                if (NC == 2) s1[j] = dpbusd_bcast(s1[j], wv[c + 4], xq + 16 + 4 * c);
            }
        const __m512 dw = cvtph_2x8(k0, k1);
#pragma GCC unroll 8
        for (int j = 0; j < JB; j++) {
            const __m512i sj = NC == 2 ? _mm512_add_epi32(s0[j], s1[j]) : s0[j];
            const __m512 dx = _mm512_set1_ps(((const float *)(act + (size_t)j * act_row + d_off))[b]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sj), _mm512_mul_ps(dw, dx), acc[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < JB; j++) store_2x8(y[0] + j * ldy, y[1] + j * ldy, acc[j]);
}

typedef void (*q4z_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, int64_t b0,
                       int64_t kn, float *const *y, int64_t ldy, bool first);
#define Q4Z_TILE(JB, NC)                                                                                         \
    static void q4z_tile_##JB(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb, int64_t b0, \
                              int64_t kn, float *const *y, int64_t ldy, bool first) {                             \
        q4z_tile(JB, NC, g, act, act_row, nb, b0, kn, y, ldy, first);                                             \
    }
Q4Z_TILE(1, 2) Q4Z_TILE(2, 2) Q4Z_TILE(3, 1) Q4Z_TILE(4, 1) Q4Z_TILE(5, 1) Q4Z_TILE(6, 1) Q4Z_TILE(7, 1) Q4Z_TILE(8, 1)
static const q4z_fn k_q4z[JB_MAX] = {q4z_tile_1, q4z_tile_2, q4z_tile_3, q4z_tile_4,
                                     q4z_tile_5, q4z_tile_6, q4z_tile_7, q4z_tile_8};

/* One plain block_q4_0 row against one batch row, the canonical chain. */
static float q4_plain_row(const uint8_t *w, int64_t nb, const uint8_t *a, int64_t b0, int64_t kn, float init) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const float *dx = (const float *)(a + moetax_k_act_d_off(MOETAX_TYPE_Q4_0, nb));
    const int32_t *sx = (const int32_t *)(a + moetax_k_act_s_off(nb));
    __m128 acc = _mm_set_ss(init);
    for (int64_t b = b0; b < b0 + kn; b++) {
        const uint8_t *blk = w + (size_t)b * sizeof(moetax_block_q4_0);
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *)(a + b * 32)));
        const int32_t s = hsum_epi32(p) - sx[b];
        acc = _mm_fmadd_ss(_mm_cvtsi32_ss(_mm_setzero_ps(), s), _mm_mul_ss(_mm_set_ss(moetax_k_fp16_table[dh]),
                                                                          _mm_set_ss(dx[b])), acc);
    }
    return _mm_cvtss_f32(acc);
}

static void matmul_q4(const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const uint8_t *act, int64_t n_batch, float *y, int64_t ldy, bool far) {
    enum { R = MOETAX_K_Q4R8_ROWS };
    const int64_t nb = ncols / 32, gend = row1 - (row1 - row0) % R;
    const size_t act_row = moetax_k_act_row_bytes(MOETAX_TYPE_Q4_0, ncols);
    const int64_t pr = n_batch <= JB_MAX ? row1 - row0 : PANEL_ROWS;
    const int64_t kc = n_batch <= JB_MAX ? nb : KC_MAX;
    for (int64_t p0 = row0; p0 < row1; p0 += pr) {
        const int64_t p1 = row1 - p0 <= pr ? row1 : p0 + pr, pg = p1 < gend ? p1 : gend;
        for (int64_t b0 = 0; b0 < nb; b0 += kc) {
            const int64_t kn = nb - b0 < kc ? nb - b0 : kc;
            for (int64_t j0 = 0, jb; j0 < n_batch; j0 += jb) {
                jb = n_batch == 1 ? 1 : next_jb(n_batch - j0);
                const uint8_t *aj = act + (size_t)j0 * act_row;
                float *yj = y + j0 * ldy;
                /* groups i and i + np together (as matmul_q8): decode on 256-bit tiles of the
                 * two (two sequential streams per core), batches in one 512-bit vector */
                const int64_t np = (pg - p0) / R / 2;
                for (int64_t i = 0; i < np; i++) {
                    const int64_t ra = p0 + i * R, rb = ra + np * R;
                    const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
                    float *yy[2] = {yj + ra, yj + rb};
                    if (n_batch == 1) (far ? q4r8_tile_far_2x1 : q4r8_tile_2x1)(gg, aj, act_row, nb, b0, kn, yy, ldy, b0 == 0);
                    else k_q4z[jb - 1](gg, aj, act_row, nb, b0, kn, yy, ldy, b0 == 0);
                }
                int64_t r = p0 + 2 * np * R;
                for (; r < pg; r += R) {
                    const uint8_t *g1[1] = {w + (size_t)r * row_bytes};
                    float *y1[1] = {yj + r};
                    (far && jb == 1 ? q4r8_tile_far_1x1 : k_q4r8[jb - 1])(g1, aj, act_row, nb, b0, kn, y1, ldy, b0 == 0);
                }
                for (r = pg; r < p1; r++)
                    for (int j = 0; j < jb; j++) {
                        float *yo = yj + j * ldy + r;
                        *yo = q4_plain_row(w + (size_t)r * row_bytes, nb, aj + (size_t)j * act_row, b0, kn,
                                           b0 == 0 ? 0.0f : *yo);
                    }
            }
        }
    }
}

/* ------------------------------------------------------------------------ */
/* F32 / F16 / BF16 with two or more batch rows                             */
/* ------------------------------------------------------------------------ */

/* Two batch rows share each 512-bit vector: lanes 0-7 hold batch row j's sum,
 * lanes 8-15 batch row j + 1's, each lane's chain exactly the avx2 tile's (8
 * columns a step from the chunk's start, fma per step, then its hsum tree and
 * its scalar tail), so the results are the avx2 table's bits; a weight vector
 * (8 columns, broadcast to both halves, one cvtph for F16) serves two batch
 * rows per fma. Column chunks as the avx2 table (kc of 1024 / 2048 columns with
 * more than 3 batch rows); one batch row (decode) is the avx2 table's own path. */

ALWAYS_INLINE __m512 f_load_w16(enum moetax_type t, const uint8_t *w, int64_t k) {
    if (t == MOETAX_TYPE_F32) return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)w + k));
    const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    if (t == MOETAX_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE float f_load_w1(enum moetax_type t, const uint8_t *w, int64_t k) {
    if (t == MOETAX_TYPE_F32) return ((const float *)w)[k];
    uint16_t h;
    memcpy(&h, w + 2 * k, 2);
    if (t == MOETAX_TYPE_F16) return moetax_k_fp16_table[h];
    return moetax_bf16_to_fp32(h);
}

/* The avx2 table's hsum_ps (simd_avx2.h), the same order. */
ALWAYS_INLINE float f_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* f_hsum8 of each half of a0..a3 (4 rows x 2 batch rows), each the same three adds of the
 * same lanes in the same order, 8 sums at once: lanes 0-3 the first half's (rows 0..3),
 * lanes 4-7 the second half's. Stage 1 adds lanes i and i + 4 of each half (f_hsum8's
 * lo128 + hi128), stage 2 lanes i and i + 2 of those (+ movehl), stage 3 lanes 0 and 1
 * (+ movehdup); float adds commute bit for bit, so only the pairs matter. */
ALWAYS_INLINE __m512 hsum8_4x2(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* stage 1: groups of 4 lanes: (a0 h0) (a0 h1) (a1 h0) (a1 h1); the same of a2, a3 */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512 s01 = _mm512_add_ps(_mm512_permutex2var_ps(a0, lo, a1), _mm512_permutex2var_ps(a0, hi, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_permutex2var_ps(a2, lo, a3), _mm512_permutex2var_ps(a2, hi, a3));
    /* stage 2: pairs of lanes in the order (h0 r0) (h0 r1) (h0 r2) (h0 r3) (h1 r0) .. (h1 r3);
     * (h, r) sits in group h (r 0), 2 + h (r 1) of s01, the same of s23 (r 2, 3: + 16) */
    const __m512i l2 = _mm512_setr_epi32(0, 1, 8, 9, 16, 17, 24, 25, 4, 5, 12, 13, 20, 21, 28, 29);
    const __m512i h2 = _mm512_setr_epi32(2, 3, 10, 11, 18, 19, 26, 27, 6, 7, 14, 15, 22, 23, 30, 31);
    const __m512 u = _mm512_add_ps(_mm512_permutex2var_ps(s01, l2, s23), _mm512_permutex2var_ps(s01, h2, s23));
    /* stage 3: even lanes hold the sums; gather them into lanes 0-7 */
    const __m512 t = _mm512_add_ps(u, _mm512_movehdup_ps(u));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), t);
}

/* RB rows (stride rb) x JP pairs of batch rows (2 JP - odd rows; an odd last row is
 * paired with itself and stored once) over columns [k0, k1). xp (NULL: none) holds the
 * pairs' vectors already joined, [(k - k0) / 8][JP][16] (f2_pack), for the whole 8-column
 * steps: one load each instead of two loads and an insert (a shuffle, on the port that also
 * does half the fmas); the same values, the same bits. */
/* Each tile prefetches the rows TF_PF_ROWS below its own (the tile after next: tiles go down a
 * column chunk's rows) into L2, at the columns it reads. A row's own next bytes are too near to
 * hide the memory's latency where rows are short, as the KV cache's rows that attention reads
 * (attend.c; the figures are in the commit that added it). */
enum { TF_PF_ROWS = 8 };

ALWAYS_INLINE void tile_f2(enum moetax_type t, const int RB, const int JP, const uint8_t *w, size_t rb,
                           const float *x, int64_t ldx, int nj, int64_t k0, int64_t k1, float *y, int64_t ldy,
                           bool add, const float *xp) {
    const size_t esz = t == MOETAX_TYPE_F32 ? 4 : 2;
    const float *xr[8];
#pragma GCC unroll 8
    for (int j = 0; j < 2 * JP; j++) xr[j] = x + (j < nj ? j : nj - 1) * ldx;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int p = 0; p < JP; p++) acc[r][p] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) {
        if (((k - k0) & 15) == 0)
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) _mm_prefetch((const char *)w + (r + TF_PF_ROWS) * rb + (size_t)k * esz, _MM_HINT_T1);
        __m512 xv[4];
#pragma GCC unroll 4
        for (int p = 0; p < JP; p++)
            xv[p] = xp ? _mm512_loadu_ps(xp + ((k - k0) / 8 * JP + p) * 16)
                       : _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xr[2 * p] + k)),
                                            _mm256_loadu_ps(xr[2 * p + 1] + k), 1);
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const __m512 wv = f_load_w16(t, w + r * rb, k);
#pragma GCC unroll 4
            for (int p = 0; p < JP; p++) acc[r][p] = _mm512_fmadd_ps(wv, xv[p], acc[r][p]);
        }
    }
    if (RB == 4 && k == k1) { /* no scalar tail: the 8 sums of a pair at once, the same adds */
#pragma GCC unroll 4
        for (int p = 0; p < JP; p++) {
            const __m512 v = hsum8_4x2(acc[0][p], acc[1][p], acc[2][p], acc[3][p]);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                if (j >= nj) break;
                __m128 s = h ? _mm512_extractf32x4_ps(v, 1) : _mm512_castps512_ps128(v);
                if (add) s = _mm_add_ps(_mm_loadu_ps(y + j * ldy), s);
                _mm_storeu_ps(y + j * ldy, s);
            }
        }
        return;
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int p = 0; p < JP; p++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                if (j >= nj) break;
                float s = f_hsum8(h ? _mm512_extractf32x8_ps(acc[r][p], 1) : _mm512_castps512_ps256(acc[r][p]));
                for (int64_t kk = k; kk < k1; kk++) s += f_load_w1(t, w + r * rb, kk) * xr[j][kk];
                y[j * ldy + r] = add ? y[j * ldy + r] + s : s;
            }
}

typedef void (*tile_f2_fn)(const uint8_t *w, size_t rb, const float *x, int64_t ldx, int nj, int64_t k0, int64_t k1,
                           float *y, int64_t ldy, bool add, const float *xp);
#define TILE_F2(T, RB, JP, tag)                                                                                  \
    static void tile_f2_##tag##_##RB##x##JP(const uint8_t *w, size_t rb, const float *x, int64_t ldx, int nj,    \
                                            int64_t k0, int64_t k1, float *y, int64_t ldy, bool add,             \
                                            const float *xp) {                                                   \
        if (xp) tile_f2(T, RB, JP, w, rb, x, ldx, nj, k0, k1, y, ldy, add, xp);                                 \
        else tile_f2(T, RB, JP, w, rb, x, ldx, nj, k0, k1, y, ldy, add, NULL);                                  \
    }
#define TILES_F2(T, tag)                                                                                         \
    TILE_F2(T, 4, 1, tag) TILE_F2(T, 4, 2, tag) TILE_F2(T, 4, 3, tag) TILE_F2(T, 4, 4, tag)                     \
    TILE_F2(T, 1, 1, tag) TILE_F2(T, 1, 2, tag) TILE_F2(T, 1, 3, tag) TILE_F2(T, 1, 4, tag)
TILES_F2(MOETAX_TYPE_F32, f32)
TILES_F2(MOETAX_TYPE_F16, f16)
TILES_F2(MOETAX_TYPE_BF16, bf16)
#define TILES_F2_ROW(tag, RB) {tile_f2_##tag##_##RB##x1, tile_f2_##tag##_##RB##x2, tile_f2_##tag##_##RB##x3, tile_f2_##tag##_##RB##x4}
/* [type][rb == 4][pairs - 1] */
static const tile_f2_fn k_tiles_f2[3][2][4] = {
    {TILES_F2_ROW(f32, 1), TILES_F2_ROW(f32, 4)},
    {TILES_F2_ROW(f16, 1), TILES_F2_ROW(f16, 4)},
    {TILES_F2_ROW(bf16, 1), TILES_F2_ROW(bf16, 4)},
};

/* The pairs of batch rows 0 .. nj - 1 of x (an odd last row paired with itself), columns
 * [0, 8 * steps), joined as tile_f2 joins them: xp[step][pair][16]. */
static void f2_pack(const float *x, int64_t ldx, int nj, int64_t steps, float *xp) {
    const int np = (nj + 1) / 2;
    for (int p = 0; p < np; p++) {
        const float *a = x + 2 * p * ldx, *b = x + (2 * p + 1 < nj ? 2 * p + 1 : nj - 1) * ldx;
        for (int64_t st = 0; st < steps; st++) {
            float *d = xp + (st * np + p) * 16;
            memcpy(d, a + st * 8, 8 * sizeof(float));
            memcpy(d + 8, b + st * 8, 8 * sizeof(float));
        }
    }
}

static void matmul_f2(int ti, const uint8_t *w, size_t row_bytes, int64_t row0, int64_t row1, int64_t ncols,
                      const float *x, int64_t n_batch, float *y, int64_t ldy) {
    enum { AVX2_BBMAX = 3, JPMAX = 4, PACK_MIN_ROWS = 8, PACK_FLOATS = 16384, PACK_ROWS_BYTES = 256 * 1024 };
    const int64_t kc = n_batch > AVX2_BBMAX ? (ti == 0 ? 1024 : 2048) : ncols; /* the avx2 table's chunks */
    /* One column chunk, at least PACK_MIN_ROWS rows and batch rows that fit: every tile's pairs are
     * joined once (f2_pack) for all the row groups that pass over them, in the same order */
    const int64_t steps = ncols / 8, tile_floats = steps * JPMAX * 16;
    _Alignas(64) float xp[PACK_FLOATS];
    const bool pack = row1 - row0 >= PACK_MIN_ROWS && ncols <= kc &&
                      (n_batch + 2 * JPMAX - 1) / (2 * JPMAX) * tile_floats <= PACK_FLOATS;
    if (pack)
        for (int64_t j = 0; j < n_batch; j += 2 * JPMAX) {
            const int64_t left = n_batch - j;
            f2_pack(x + j * ncols, ncols, left >= 2 * JPMAX ? 2 * JPMAX : (int)left, steps,
                    xp + j / (2 * JPMAX) * tile_floats);
        }
    if (pack && (size_t)(row1 - row0) * row_bytes <= PACK_ROWS_BYTES) {
        /* rows that stay in L2 (attention's cache blocks): each tile of batch rows over all of them,
         * its joined pairs staying in L1 (both tiles' pairs and the rows did not) */
        for (int64_t j = 0; j < n_batch; j += 2 * JPMAX) {
            const int64_t left = n_batch - j;
            const int nj = left >= 2 * JPMAX ? 2 * JPMAX : (int)left;
            for (int64_t r = row0; r < row1;) {
                const int rb4 = row1 - r >= 4;
                k_tiles_f2[ti][rb4][(nj + 1) / 2 - 1](w + (size_t)r * row_bytes, row_bytes, x + j * ncols, ncols, nj,
                                                      0, ncols, y + j * ldy + r, ldy, false,
                                                      xp + j / (2 * JPMAX) * tile_floats);
                r += rb4 ? 4 : 1;
            }
        }
        return;
    }
    for (int64_t r = row0; r < row1;) {
        const int rb4 = row1 - r >= 4;
        for (int64_t k0 = 0; k0 < ncols; k0 += kc) {
            const int64_t k1 = ncols - k0 > kc ? k0 + kc : ncols;
            for (int64_t j = 0; j < n_batch;) {
                const int64_t left = n_batch - j;
                const int nj = left >= 2 * JPMAX ? 2 * JPMAX : (int)left;
                k_tiles_f2[ti][rb4][(nj + 1) / 2 - 1](w + (size_t)r * row_bytes, row_bytes, x + j * ncols, ncols, nj,
                                                      k0, k1, y + j * ldy + r, ldy, k0 > 0,
                                                      pack ? xp + j / (2 * JPMAX) * tile_floats : NULL);
                j += nj;
            }
        }
        r += rb4 ? 4 : 1;
    }
}

static void matmul_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far) {
    if (row1 <= row0 || n_batch <= 0 || ncols <= 0) return;
    switch (wtype) {
    case MOETAX_TYPE_Q8_0:
        assert(row0 % MOETAX_K_Q8R8_ROWS == 0); /* ROW RANGES, kernels.h */
        matmul_q8(w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q4_0:
        assert(row0 % MOETAX_K_Q4R8_ROWS == 0); /* ROW RANGES, kernels.h */
        matmul_q4(w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_F32:
    case MOETAX_TYPE_F16:
    case MOETAX_TYPE_BF16:
        if (n_batch >= 2) {
            const int ti = wtype == MOETAX_TYPE_F32 ? 0 : wtype == MOETAX_TYPE_F16 ? 1 : 2;
            matmul_f2(ti, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy);
        } else { /* decode: the avx2 table's */
            (far ? moetax_k_matmul_avx2_stream : moetax_k_matmul_avx2)(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch,
                                                                      y, ldy);
        }
        break;
    case MOETAX_TYPE_Q5_0:
    case MOETAX_TYPE_IQ4_NL:
        matmul_q5nl(wtype == MOETAX_TYPE_IQ4_NL, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q4_1:
    case MOETAX_TYPE_Q5_1:
        matmul_qx1(wtype == MOETAX_TYPE_Q5_1, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    case MOETAX_TYPE_Q2_K:
    case MOETAX_TYPE_Q3_K:
    case MOETAX_TYPE_Q4_K:
    case MOETAX_TYPE_Q5_K:
    case MOETAX_TYPE_Q6_K: /* decode on VNNI, bit-identical to avx2's (kernels.h) */
        moetax_k_matmul_kq_avx512(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, far);
        break;
    default:
        (far ? moetax_k_matmul_avx2_stream : moetax_k_matmul_avx2)(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y,
                                                                  ldy);
        break;
    }
}

void moetax_k_matmul_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                            int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    matmul_avx512(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, false);
}

void moetax_k_matmul_avx512_stream(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                                   int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy) {
    matmul_avx512(wtype, w, row_bytes, row0, row1, ncols, xq, n_batch, y, ldy, true);
}

/* ------------------------------------------------------------------------ */
/* wsum                                                                     */
/* ------------------------------------------------------------------------ */

/* The avx2 table's wsum (ops_avx2.c) with 512-bit rows: HB heads (1-4) x VB vectors of 16 columns
 * (1-4; the last one masked to `tail` columns when tail < 16) over rows [j0, j1); per element the
 * same chain o = fma(p_j, v_j, o) in row order, so the bits are avx2's and the reference's. */
ALWAYS_INLINE void wsum_tile512(const int HB, const int VB, float *out, int64_t ld_out, const float *p, int64_t ld_p,
                                const float *v, int64_t ld_v, int64_t j0, int64_t j1, bool cont, __mmask16 last) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int h = 0; h < HB; h++)
#pragma GCC unroll 4
        for (int k = 0; k < VB; k++) {
            const __mmask16 m = k == VB - 1 ? last : (__mmask16)0xffff;
            acc[h][k] = cont ? _mm512_maskz_loadu_ps(m, out + h * ld_out + 16 * k) : _mm512_setzero_ps();
        }
    for (int64_t j = j0; j < j1; j++) {
        __m512 vv[4];
#pragma GCC unroll 4
        for (int k = 0; k < VB; k++)
            vv[k] = _mm512_maskz_loadu_ps(k == VB - 1 ? last : (__mmask16)0xffff, v + j * ld_v + 16 * k);
#pragma GCC unroll 4
        for (int h = 0; h < HB; h++) {
            const __m512 ph = _mm512_set1_ps(p[h * ld_p + j]);
#pragma GCC unroll 4
            for (int k = 0; k < VB; k++) acc[h][k] = _mm512_fmadd_ps(ph, vv[k], acc[h][k]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; h++)
#pragma GCC unroll 4
        for (int k = 0; k < VB; k++)
            _mm512_mask_storeu_ps(out + h * ld_out + 16 * k, k == VB - 1 ? last : (__mmask16)0xffff, acc[h][k]);
}

typedef void (*wsum512_fn)(float *, int64_t, const float *, int64_t, const float *, int64_t, int64_t, int64_t, bool,
                           __mmask16);
#define WSUM512(HB, VB)                                                                                           \
    static void wsum512_##HB##x##VB(float *out, int64_t ld_out, const float *p, int64_t ld_p, const float *v,      \
                                    int64_t ld_v, int64_t j0, int64_t j1, bool cont, __mmask16 last) {             \
        wsum_tile512(HB, VB, out, ld_out, p, ld_p, v, ld_v, j0, j1, cont, last);                                  \
    }
WSUM512(1, 1) WSUM512(2, 1) WSUM512(3, 1) WSUM512(4, 1) WSUM512(1, 2) WSUM512(2, 2) WSUM512(3, 2) WSUM512(4, 2)
WSUM512(1, 3) WSUM512(2, 3) WSUM512(3, 3) WSUM512(4, 3) WSUM512(1, 4) WSUM512(2, 4) WSUM512(3, 4) WSUM512(4, 4)
/* [vectors - 1][heads - 1] */
static const wsum512_fn k_wsum512[4][4] = {{wsum512_1x1, wsum512_2x1, wsum512_3x1, wsum512_4x1},
                                           {wsum512_1x2, wsum512_2x2, wsum512_3x2, wsum512_4x2},
                                           {wsum512_1x3, wsum512_2x3, wsum512_3x3, wsum512_4x3},
                                           {wsum512_1x4, wsum512_2x4, wsum512_3x4, wsum512_4x4}};

/* Rows in chunks that stay in L2 while every (heads, columns) tile passes over them, as avx2's;
 * a tile continues its chain from out, so the chunking changes no bit. */
enum { WSUM512_J = 128 };

void moetax_k_wsum_avx512(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                          int64_t ld_v, int64_t np, int64_t n, bool acc) {
    if (acc && np == 0) return;
    for (int64_t j0 = 0; j0 < np || j0 == 0; j0 += WSUM512_J) {
        const bool cont = acc || j0 > 0;
        const int64_t j1 = np - j0 < WSUM512_J ? np : j0 + WSUM512_J;
        for (int64_t h0 = 0; h0 < nh; h0 += 4) {
            const int hb = nh - h0 < 4 ? (int)(nh - h0) : 4;
            for (int64_t c = 0; c < n; c += 64) {
                const int64_t w = n - c < 64 ? n - c : 64; /* columns of this tile */
                const int vb = (int)((w + 15) / 16);
                const __mmask16 last = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1u : 0xffffu);
                k_wsum512[vb - 1][hb - 1](out + h0 * ld_out + c, ld_out, p + h0 * ld_p, ld_p, v + c, ld_v, j0, j1, cont,
                                          last);
            }
        }
    }
}

void moetax_k_q8_0_to_fp32_avx512(const void *x, float *y, int64_t n) {
    const moetax_block_q8_0 *b = x;
    for (int64_t i = 0; i < n / 32; i++) {
        const __m512 d = _mm512_set1_ps(moetax_k_fp16_table[b[i].d]);
        for (int j = 0; j < 32; j += 16) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b[i].qs + j)));
            _mm512_storeu_ps(y + i * 32 + j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
        }
    }
}
