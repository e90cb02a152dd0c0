/* kernels_impl.h - declarations shared by the kernel files (not public).
 *
 * Each *_ref.c / *_avx2.c / *_avx512.c file exports plain functions named
 * moetax_k_<op>_<isa>; kernels.c assembles them into the tables. */
#ifndef MOETAX_KERNELS_IMPL_H
#define MOETAX_KERNELS_IMPL_H

#include <stdint.h>
#include <stddef.h>

#include "moetax/kernels.h"
#include "moetax/types.h"

/* A little-endian uint32 (Q5_0 / Q5_1's qh) at any address. */
static inline uint32_t moetax_k_le32(const uint8_t *h) { return (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24; }

/* ---- prepared-activation layout (see kernels.h) ---- */
static inline int moetax_k_act_is_q(enum moetax_type t) {
    return moetax_act_is_q8_0(t) || moetax_act_is_q4_0(t);
}
/* k-quant weights: activations are block_q8_K rows (kernels.h). */
static inline int moetax_k_act_is_k(enum moetax_type t) { return moetax_type_is_kquant(t); }
/* Bytes of one prepared batch row. */
static inline size_t moetax_k_act_row_bytes(enum moetax_type t, int64_t ncols) {
    const size_t nb = (size_t)(ncols / 32);
    if (moetax_act_is_q8_0(t)) return nb * (32 + sizeof(float));
    if (moetax_act_is_q4_0(t)) return nb * (32 + sizeof(float) + sizeof(int32_t));
    switch (t) {
    case MOETAX_TYPE_F32: case MOETAX_TYPE_F16: case MOETAX_TYPE_BF16: return (size_t)ncols * sizeof(float);
    case MOETAX_TYPE_Q2_K: case MOETAX_TYPE_Q3_K: case MOETAX_TYPE_Q4_K: case MOETAX_TYPE_Q5_K: case MOETAX_TYPE_Q6_K:
        return (size_t)(ncols / 256) * sizeof(moetax_block_q8_k);
    default: return 0;
    }
}
/* Q8_0 / Q4_0 row (Q4_1, Q5_0, Q5_1 and IQ4_NL weights take Q4_0's): qs[nb][32] at 0, then
 * float d[nb]; Q4_0 then int32 s[nb]. */
static inline size_t moetax_k_act_d_off(enum moetax_type t, int64_t nb) { (void)t; return (size_t)nb * 32; }
static inline size_t moetax_k_act_s_off(int64_t nb) { return (size_t)nb * (32 + sizeof(float)); }

/* ---- repacked weight layouts (see kernels.h, WEIGHT LAYOUTS) ---- */
/* Q4_0x8r (avx2): per group of 8 rows and block, uint16 d[8] then qs[4][8][4]. */
#define MOETAX_K_Q4R8_ROWS 8
#define MOETAX_K_Q4R8_BLOCK_BYTES 144 /* 16 + 4 * 8 * 4 == 8 * sizeof(moetax_block_q4_0) */
#define MOETAX_K_Q4R8_QS_OFF 16
/* Q8_0x4r (avx2): per group of 4 rows and block, uint16 d[4] then qs[4][32]. */
#define MOETAX_K_Q8R4_ROWS 4
#define MOETAX_K_Q8R4_BLOCK_BYTES 136 /* 8 + 4 * 32 == 4 * sizeof(moetax_block_q8_0) */
#define MOETAX_K_Q8R4_QS_OFF 8
/* One group of 4 rows of nb blocks (row stride rb = 34 nb), standard ->
 * Q8_0x4r, from src to dst (no overlap). */
void moetax_k_repack_group_q8r4(void *dst, const void *src, int64_t nb);
/* Q8_0x8r (avx512): per group of 8 rows and block, uint16 d[8] then qs[8][8][4]
 * (chunk c, row r: quants 4c..4c+3 of the block of row r, each plus 128). The x8r layouts are
 * repacked by kernels.c's table of them (moetax_kernels_repack). */
#define MOETAX_K_Q8R8_ROWS 8
#define MOETAX_K_Q8R8_BLOCK_BYTES 272 /* 16 + 8 * 8 * 4 == 8 * sizeof(moetax_block_q8_0) */
#define MOETAX_K_Q8R8_QS_OFF 16

/* Q4_Kx8r (avx2, avx512): per group of 8 rows and super-block, uint16 d[8], uint16
 * dmin[8], uint8 sc[3][8][4] (dword k of row r's 12 packed scale bytes at
 * 32 k + 4 r), then qs[4][8][8][4] (chunk c, 4-byte group q, row r: bytes
 * 32 c + 4 q .. + 3 of the row's qs). */
#define MOETAX_K_Q4KR8_ROWS 8
#define MOETAX_K_Q4KR8_BLOCK_BYTES 1152 /* 8 * sizeof(moetax_block_q4_k) */
#define MOETAX_K_Q4KR8_DMIN_OFF 16
#define MOETAX_K_Q4KR8_SC_OFF 32
#define MOETAX_K_Q4KR8_QS_OFF 128

/* Q5_Kx8r (avx2, avx512): Q4_Kx8r's d, dmin and scales, then qh[8][8][4] (group q, row
 * r: bytes 4 q .. + 3 of the row's qh) at 128, then Q4_Kx8r's qs at 384. */
#define MOETAX_K_Q5KR8_BLOCK_BYTES 1408 /* 8 * sizeof(moetax_block_q5_k) */
#define MOETAX_K_Q5KR8_QH_OFF 128
#define MOETAX_K_Q5KR8_QS_OFF 384

/* Q6_Kx8r (avx2, avx512): per group of 8 rows and super-block, uint16 d[8], int8
 * sc[4][8][4] (dword k of row r's 16 scales at 16 + 32 k + 4 r), ql[2][16][8][4]
 * (half h, group g, row r: bytes 64 h + 4 g .. + 3 of the row's ql), qh[2][8][8][4]
 * (half h, group p, row r: bytes 32 h + 4 p .. + 3 of the row's qh). */
#define MOETAX_K_Q6KR8_ROWS 8
#define MOETAX_K_Q6KR8_BLOCK_BYTES 1680 /* 8 * sizeof(moetax_block_q6_k) */
#define MOETAX_K_Q6KR8_SC_OFF 16
#define MOETAX_K_Q6KR8_QL_OFF 144
#define MOETAX_K_Q6KR8_QH_OFF 1168

/* Q2_Kx8r (avx2, avx512): per group of 8 rows and super-block, uint16 d[8], uint16 dmin[8],
 * uint8 sc[4][8][4] (dword k of row r's 16 scale bytes at 32 + 32 k + 4 r), then
 * qs[16][8][4] (group g, row r: bytes 4 g .. + 3 of the row's qs). */
#define MOETAX_K_Q2KR8_ROWS 8
#define MOETAX_K_Q2KR8_BLOCK_BYTES 672 /* 8 * sizeof(moetax_block_q2_k) */
#define MOETAX_K_Q2KR8_DMIN_OFF 16
#define MOETAX_K_Q2KR8_SC_OFF 32
#define MOETAX_K_Q2KR8_QS_OFF 160

/* Q3_Kx8r (avx2, avx512): per group of 8 rows and super-block, uint16 d[8], uint8
 * sc[3][8][4] (dword k of row r's 12 packed scale bytes at 16 + 32 k + 4 r),
 * qs[16][8][4] (group g, row r: bytes 4 g .. + 3 of the row's qs), then
 * hm[8][8][4] (group p, row r: bytes 4 p .. + 3 of the row's hmask). */
/* Q5_0x8r (avx512): per group of 8 rows and block, uint16 d[8], then the fifth bits as 8
 * 32-bit masks M[c][h] (chunk c, half h: bit 4r + i is bit 16h + 4c + i of row r's qh),
 * then qs[4][8][4] (chunk c, row r: nibble bytes 4c..4c+3 of the row's block). */
#define MOETAX_K_Q5R8_BLOCK_BYTES 176 /* 8 * sizeof(moetax_block_q5_0) */
#define MOETAX_K_Q5R8_QH_OFF 16
#define MOETAX_K_Q5R8_QS_OFF 48
/* Q4_1x8r / Q5_1x8r (avx512): per group of 8 rows and block, uint16 d[8], uint16 m[8], then
 * (Q5_1) the fifth bits as Q5_0x8r's 8 masks, then qs[4][8][4] as Q5_0x8r's. */
#define MOETAX_K_Q41R8_BLOCK_BYTES 160 /* 8 * sizeof(moetax_block_q4_1) */
#define MOETAX_K_Q51R8_BLOCK_BYTES 192 /* 8 * sizeof(moetax_block_q5_1) */
#define MOETAX_K_QX1R8_M_OFF 16
#define MOETAX_K_Q51R8_QH_OFF 32
#define MOETAX_K_Q41R8_QS_OFF 32
#define MOETAX_K_Q51R8_QS_OFF 64
#define MOETAX_K_Q3KR8_ROWS 8
#define MOETAX_K_Q3KR8_BLOCK_BYTES 880 /* 8 * sizeof(moetax_block_q3_k) */
#define MOETAX_K_Q3KR8_SC_OFF 16
#define MOETAX_K_Q3KR8_QS_OFF 112
#define MOETAX_K_Q3KR8_HM_OFF 624

/* The row-group driver of the 8-row layouts whose tiles share one signature (matmul_avx2.c's
 * Q5_0x8r / IQ4_NLx8r / Q4_1x8r / Q5_1x8r tiles, matmul_avx512.c's Q4_1x8r / Q5_1x8r ones): decode
 * pairs group i of the range's first half with group i of its second (two streams; dec2, an odd last
 * group dec1; [far]: the streamed-weights variant), batches run every tile of up to 4 batch rows over
 * one group while it stays cached. Returns the end of the groups: the caller takes the plain rows
 * after it. */
typedef void (*moetax_k_r8_fn)(const uint8_t *const *g, const uint8_t *act, size_t act_row, int64_t nb,
                               float *const *y, int64_t ldy);
struct moetax_k_r8_tiles {
    moetax_k_r8_fn dec2[2], dec1[2], tile[4]; /* dec: [far]; tile: one group x 1..4 batch rows */
};
static inline int64_t moetax_k_r8_drive(const struct moetax_k_r8_tiles *k, const uint8_t *w, size_t row_bytes,
                                        int64_t row0, int64_t row1, int64_t nb, const uint8_t *act, size_t act_row,
                                        int64_t n_batch, float *y, int64_t ldy, int far) {
    enum { R = 8 };
    const int64_t gend = row0 + (row1 - row0) / R * R, ng = (gend - row0) / R;
    if (n_batch == 1) {
        const int64_t np = ng / 2;
        for (int64_t i = 0; i < np; i++) {
            const int64_t ra = row0 + i * R, rb = ra + np * R;
            const uint8_t *gg[2] = {w + (size_t)ra * row_bytes, w + (size_t)rb * row_bytes};
            float *yy[2] = {y + ra, y + rb};
            k->dec2[far](gg, act, act_row, nb, yy, ldy);
        }
        if (ng % 2) {
            const int64_t r = row0 + (ng - 1) * R;
            const uint8_t *gg[1] = {w + (size_t)r * row_bytes};
            float *yy[1] = {y + r};
            k->dec1[far](gg, act, act_row, nb, yy, ldy);
        }
    } else {
        for (int64_t i = 0; i < ng; i++) {
            const int64_t r = row0 + i * R;
            const uint8_t *gg[1] = {w + (size_t)r * row_bytes};
            for (int64_t j = 0; j < n_batch; j += 4) {
                const int jb = n_batch - j < 4 ? (int)(n_batch - j) : 4;
                float *yy[1] = {y + j * ldy + r};
                k->tile[jb - 1](gg, act + (size_t)j * act_row, act_row, nb, yy, ldy);
            }
        }
    }
    return gend;
}

/* Shared tables (kernels.c): fp16 -> fp32 for every bit pattern. */
extern float moetax_k_fp16_table[1 << 16];
/* The avx512 table's Q3_K, Q5_K and Q6_K tiles use GFNI (vgf2p8affineqb): set once by the table's
 * selection (kernels.c) where the CPU has GFNI and MOETAX_GFNI is not "0"; the same bits either way. */
extern bool moetax_k_avx512_gfni;
void moetax_k_tables_init(void);

/* ---- matmul ---- */
/* One block of 32 floats to Q8_0 quants and d (widened from F16), ggml's quantize_row_q8_0 with NaN
 * to 0 and saturation (moetax_q8_round): the reference's, and the SIMD tables' for the blocks their
 * vector steps would give other bytes for (a NaN or an infinity among the floats, or 1 / d overflowing),
 * so that quantize_act gives identical bytes in every table for any input. */
void moetax_k_quantize_block_q8_ref(const float *x, int8_t *qs, float *d_out);
void moetax_k_quantize_act_ref(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols,
                               int64_t n_batch, void *xq);
void moetax_k_matmul_ref(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                         int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
void moetax_k_quantize_act_avx2(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols,
                                int64_t n_batch, void *xq);
/* k-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) against block_q8_K activations (matmul_kq_avx2.c);
 * far: weights streamed from memory (matmul_stream): the decode prefetches far ahead into L2. */
void moetax_k_matmul_kq_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                             int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far);
/* The same for the avx512 table (matmul_kq_avx512.c), bit-identical to avx2's: every k-quant in its x8r
 * layout (a plain tail: one batch row on VNNI; batches: Q2_K/Q3_K on VNNI, the others avx2's). */
void moetax_k_matmul_kq_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                               int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy, bool far);
void moetax_k_matmul_avx2(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
/* The same bits for weights streamed from memory (matmul_stream, kernels.h): prefetches further ahead. */
void moetax_k_matmul_avx2_stream(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                                 int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
/* Q8_0 (Q8_0x8r) and Q4_0 (Q4_0x8r) with VNNI; other types: moetax_k_matmul_avx2. */
void moetax_k_matmul_avx512(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                            int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
void moetax_k_matmul_avx512_stream(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                                   int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);

/* ---- vector ops ---- */
void moetax_k_rmsnorm_ref(float *out, const float *x, const float *w, int64_t n, float eps);
void moetax_k_softmax_ref(float *x, int64_t n, float ms[2]);
void moetax_k_sigmoid_ref(float *x, int64_t n);
void moetax_k_topk_ref(const float *x, int64_t n, int64_t k, int32_t *idx, float *val);
void moetax_k_silu_mul_ref(float *out, const float *g, const float *u, int64_t n);
void moetax_k_rope_ref(float *x, int64_t n_head, int64_t head_stride, int64_t pos,
                       const struct moetax_rope_params *p);
void moetax_k_rope_cached_ref(float *x, int64_t n_head, int64_t head_stride, int n_dims,
                              enum moetax_rope_mode mode, const float *cs);
void moetax_k_scatter_add_ref(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, const int32_t *rows,
                              const float *w, int64_t n_rows, int64_t n);
float moetax_k_dot_ref(const float *a, const float *b, int64_t n);
void moetax_k_axpy_ref(float *y, float a, const float *x, int64_t n);
void moetax_k_scale_ref(float *x, float a, int64_t n);
void moetax_k_wsum_ref(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                       int64_t ld_v, int64_t np, int64_t n, bool acc);
void moetax_k_fp16_to_fp32_ref(const uint16_t *x, float *y, int64_t n);
void moetax_k_fp32_to_fp16_ref(const float *x, uint16_t *y, int64_t n);
void moetax_k_bf16_to_fp32_ref(const uint16_t *x, float *y, int64_t n);
void moetax_k_fp32_to_bf16_ref(const float *x, uint16_t *y, int64_t n);
void moetax_k_q8_0_to_fp32_ref(const void *x, float *y, int64_t n);

void moetax_k_rmsnorm_avx2(float *out, const float *x, const float *w, int64_t n, float eps);
void moetax_k_softmax_avx2(float *x, int64_t n, float ms[2]);
void moetax_k_sigmoid_avx2(float *x, int64_t n);
void moetax_k_silu_mul_avx2(float *out, const float *g, const float *u, int64_t n);
void moetax_k_scatter_add_avx2(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, const int32_t *rows,
                               const float *w, int64_t n_rows, int64_t n);
float moetax_k_dot_avx2(const float *a, const float *b, int64_t n);
void moetax_k_axpy_avx2(float *y, float a, const float *x, int64_t n);
void moetax_k_scale_avx2(float *x, float a, int64_t n);
void moetax_k_wsum_avx2(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                        int64_t ld_v, int64_t np, int64_t n, bool acc);
void moetax_k_wsum_avx512(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                          int64_t ld_v, int64_t np, int64_t n, bool acc);
void moetax_k_fp16_to_fp32_avx2(const uint16_t *x, float *y, int64_t n);
void moetax_k_fp32_to_fp16_avx2(const float *x, uint16_t *y, int64_t n);
void moetax_k_bf16_to_fp32_avx2(const uint16_t *x, float *y, int64_t n);
void moetax_k_fp32_to_bf16_avx2(const float *x, uint16_t *y, int64_t n);
void moetax_k_q8_0_to_fp32_avx2(const void *x, float *y, int64_t n);
void moetax_k_q8_0_to_fp32_avx512(const void *x, float *y, int64_t n);

#endif
