/*
 * moetax/kernels.h - CPU compute kernels: matrix x vector(s) for the weight
 * types moetax computes with, and the F32 vector ops of a transformer step.
 *
 * DESIGN
 *   Every kernel exists as a plain-C scalar reference (src/kernels/ *_ref.c) and,
 *   where it pays, as an AVX2/FMA/F16C variant (*_avx2.c) and an AVX-512 one
 *   (*_avx512.c: F/BW/VL/DQ + VNNI, for the Q8_0, Q4_0 and k-quant matmul and the
 *   F32/F16/BF16 matmul of 2+ batch rows; its other entries are the avx2
 *   table's), each compiled with its own flags. A `struct
 *   moetax_kernels` table of function pointers is chosen once, from cpuid and
 *   the OS's saved-state bits (XCR0), by moetax_kernels_get(): avx512, else
 *   avx2, else ref. MOETAX_FORCE_REF=1 in the environment (any non-empty value
 *   but "0") forces the reference table; otherwise MOETAX_KERNELS=ref|avx2|avx512
 *   names one; a table the CPU cannot run, or an unknown name, prints a warning
 *   on stderr and the best table is used (a library call must not fail on an
 *   environment variable). Callers fetch the table once and call through it;
 *   there is no per-call dispatch.
 *
 *   Matmul is the decode hot spot and is memory-bound: it streams weights
 *   row-major, in their stored (GGUF / ggml) layout, zero-copy from mmap,
 *   except the types a table reads in a repacked layout (WEIGHT LAYOUTS):
 *     W: [rows, ncols] row-major, row r starts at w + r * row_bytes, with
 *        row_bytes = moetax_row_size(wtype, ncols) (or larger, for padded rows).
 *        ggml's ne0 = ncols (input dim), ne1 = rows (output dim).
 *   Activations are first *prepared* (quantize_act), once per step, into a
 *   buffer of moetax_act_size() bytes; then any number of threads call matmul
 *   on disjoint row ranges [row0, row1) and write y[b * ldy + r].
 *
 * PREPARED ACTIVATIONS (the `xq` buffer; same layout in every table)
 *   n_batch rows, each of moetax_act_size(wtype, ncols, 1) bytes, back to back:
 *   act_size(w, n, b) == b * act_size(w, n, 1), so batch row i of xq starts at
 *   (char *)xq + i * act_size(w, n, 1) and rows may be prepared separately
 *   (e.g. split across threads).
 *     F32, F16, BF16 weights: the row is ncols floats (x copied, F32).
 *     Q8_0 weights (nb = ncols / 32): int8 qs[nb][32]; float d[nb]
 *       ggml's Q8_0 quantization of x (d rounded to F16 as in a block_q8_0,
 *       stored widened to float).
 *     Q5_0 and IQ4_NL weights: the Q4_0 row below (the avx512 table's decode
 *       takes the offsets of 16 and 128 from its sums).
 *       Per output the avx2 and avx512 tables take the exact block sums S_b of
 *       the signed weight levels (Q5_0: q - 16; IQ4_NL: the table's level)
 *       times the activation quants and acc = fma((float)S_b, d_w[b] * d_x[b],
 *       acc) over the blocks in order, from 0 (Q8_0's chain).
 *     Q4_1 and Q5_1 weights: the Q4_0 row below (the same bytes). Per output the
 *       avx2 and avx512 tables take the exact block sums S_b of the unsigned levels
 *       q times the activation quants and X_b = s[b] / 8, and per block
 *       acc = fma((float)S_b, d_w[b] * d_x[b], acc), then
 *       acc = fma((float)X_b, m_w[b] * d_x[b], acc), from 0, blocks in order.
 *     Q4_0 weights: the Q8_0 row, then int32 s[nb] with s[i] = 8 * sum of
 *       block i's 32 quants: int8 qs[nb][32]; float d[nb]; int32 s[nb]. The
 *       unsigned nibbles q (0..15) of a weight block give sum((q - 8) x) =
 *       sum(q x) - s, so the kernels never subtract the offset per weight.
 *     Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights (nb = ncols / 256): moetax_block_q8_k[nb],
 *       ggml's block_q8_K (float d; int8 qs[256]; int16 bsums[16]), i.e.
 *       ggml's quantize_row_q8_K of x: d = max / -127 (max: the value of
 *       largest magnitude, d kept in float), qs = nearest(x / d) (ties to
 *       even), bsums[j] = sum of qs[16j..16j+15]. The bsums give the kernels
 *       the mins' term of Q4_K/Q5_K (sum_j m_j * (bsums[2j] + bsums[2j+1]))
 *       and Q6_K's offset of 32 (32 * sum_j sc_j * bsums[j]) without a
 *       subtraction per weight. Every block sum is exact in int32: per
 *       super-block the output is acc += (d_x * d_w) * sumi - (d_x * dmin_w) * summ
 *       (Q6_K: acc += (d_x * d_w) * sumi), super-blocks in order. Q2_K: as
 *       Q4_K with 16-value sub-blocks (summ = sum_j m_j * bsums[j]); Q3_K: as
 *       Q6_K (sumi of the signed levels -4..3; the SIMD tables sum levels + 4
 *       and subtract 4 * sum_j sc_j * bsums[j]).
 *   quantize_act of every table produces identical bytes.
 *
 * WEIGHT LAYOUTS (per table and weight type; files on disk stay GGUF)
 *   A table may read a weight type in an in-memory layout of its own:
 *   weights_repacked(t) is then true, and such weights must be converted once
 *   with moetax_kernels_repack before matmul sees them (the model does it at
 *   load, the expert store after reading an expert). The unit of a repack is
 *   one matrix of n_rows rows (a 3-D tensor is n matrices; the gate and up
 *   halves of a fused gate_up matrix are two). Repacking keeps the unit's
 *   size and is a permutation of its bytes (Q5_0x8r and Q5_1x8r, below, also
 *   transpose bits within their groups' fifth-bit words); row groups (below) never cross
 *   units, so row r of a unit stays within the bytes of its group of G rows
 *   from w + (r - r % G) * row_bytes (G: 8 for Q4_0, avx512's Q5_0 and the k-quants, 4 for avx2's
 *   Q8_0; below).
 *   Rows read any other way (moetax_to_float,
 *   e.g. the token embedding) must stay as stored.
 *     ref:  every type as stored. (Every k-quant is read as stored by ref;
 *           avx2 and avx512 read all five in the x8r layouts below.)
 *     avx2: Q4_0 in "Q4_0x8r", eight rows interleaved: rows 8i..8i+7 of a
 *           unit (the same 8 * row_bytes bytes) hold, for each block b in
 *           order, 144 bytes (the size of 8 block_q4_0):
 *             uint16 d[8]           F16 scales of block b of rows 0..7
 *             uint8  qs[4][8][4]    chunk c, row r: nibble bytes 4c..4c+3 of
 *                                   block b of row r (as in block_q4_0)
 *           and the unit's last n_rows % 8 rows stay plain block_q4_0 rows.
 *           So one 32-byte load holds 4 bytes of each of 8 rows: integer
 *           dot products land in one 32-bit lane per row, the 8 scales are
 *           one 16-byte load + cvtph, and the weights of 8 rows are one
 *           sequential stream (no horizontal sums, one prefetch stream).
 *           Q8_0 in "Q8_0x4r", four rows side by side: rows 4i..4i+3 of a
 *           unit hold, for each block b in order, 136 bytes (the size of 4
 *           block_q8_0):
 *             uint16 d[4]           F16 scales of block b of rows 0..3
 *             int8   qs[4][32]      the quants of block b of rows 0..3
 *           and the unit's last n_rows % 4 rows stay plain block_q8_0. A
 *           decode tile of 4 rows thus reads one stream, not 4 (rows of
 *           0.5-2 KiB are too short for the prefetcher to follow 4 streams).
 *     avx512: Q5_0 in "Q5_0x8r": rows 8i..8i+7 of a unit hold, for each block
 *           b in order, 176 bytes (8 block_q5_0): uint16 d[8], then the fifth
 *           bits as uint32 M[4][2] (chunk c, half h: bit 4r + i is bit 16h +
 *           4c + i of row r's qh: a mask register per chunk and half), then
 *           uint8 qs[4][8][4] (chunk c, row r: nibble bytes 4c..4c+3 of the
 *           row's block); the unit's last n_rows % 8 rows plain. Not a
 *           permutation of bytes: the qh bits are transposed (the one
 *           exception to the rule above; the size is kept). IQ4_NL in
 *           "IQ4_NLx8r": Q4_0x8r's layout (the blocks have Q4_0's: d, then
 *           16 nibble bytes). Q4_1 in "Q4_1x8r", 160 bytes (8 block_q4_1) per
 *           block: uint16 d[8], uint16 m[8], then qs[4][8][4] as Q5_0x8r's;
 *           Q5_1 in "Q5_1x8r", 192 bytes (8 block_q5_1): d[8], m[8], then
 *           Q5_0x8r's 8 masks and qs; each with the last n_rows % 8 rows plain.
 *           The avx2 table reads these four layouts too.
 *           Q4_0 in avx2's Q4_0x8r. Q8_0 in "Q8_0x8r", eight rows
 *           interleaved as Q4_0x8r is: rows 8i..8i+7 of a unit hold, for each
 *           block b in order, 272 bytes (the size of 8 block_q8_0):
 *             uint16 d[8]           F16 scales of block b of rows 0..7
 *             uint8  qs[8][8][4]    chunk c, row r: quants 4c..4c+3 of
 *                                   block b of row r, each plus 128 (its
 *                                   sign bit flipped: vpdpbusd's unsigned
 *                                   operand as stored)
 *           and the unit's last n_rows % 8 rows stay plain block_q8_0. One
 *           32-byte load holds 4 quants of each of 8 rows, so VNNI's vpdpbusd
 *           against 4 activation quants broadcast to every lane adds into one
 *           32-bit lane per row (no horizontal sums). Q4_K in "Q4_Kx8r", eight
 *           rows interleaved the same way: rows 8i..8i+7 of a unit hold, for
 *           each super-block in order, 1152 bytes (8 block_q4_k):
 *             uint16 d[8], uint16 dmin[8]   F16 scales of rows 0..7
 *             uint8  sc[3][8][4]            dword k, row r: bytes 4k..4k+3 of
 *                                           the row's packed scales[12]
 *             uint8  qs[4][8][8][4]         chunk c, group q, row r: bytes
 *                                           32c+4q..32c+4q+3 of the row's qs
 *           and the unit's last n_rows % 8 rows stay plain block_q4_k. Q5_K in
 *           "Q5_Kx8r": Q4_Kx8r's d, dmin and sc (128 bytes), then uint8
 *           qh[8][8][4] (group q, row r: bytes 4q..4q+3 of the row's qh),
 *           then Q4_Kx8r's qs: 1408 bytes (8 block_q5_k) per super-block,
 *           the last n_rows % 8 rows plain. Q6_K in
 *           "Q6_Kx8r", likewise, 1680 bytes (8 block_q6_k) per super-block:
 *             uint16 d[8]                   F16 scales of rows 0..7
 *             int8   sc[4][8][4]            dword k, row r: scales 4k..4k+3
 *             uint8  ql[2][16][8][4]        half h, group g, row r: bytes
 *                                           64h+4g..64h+4g+3 of the row's ql
 *             uint8  qh[2][8][8][4]         half h, group p, row r: bytes
 *                                           32h+4p..32h+4p+3 of the row's qh
 *           and the unit's last n_rows % 8 rows stay plain block_q6_k.
 *           Q2_K in "Q2_Kx8r", 672 bytes (8 block_q2_k) per super-block:
 *             uint16 d[8], uint16 dmin[8]   F16 scales of rows 0..7
 *             uint8  sc[4][8][4]            dword k, row r: bytes 4k..4k+3 of
 *                                           the row's scales[16]
 *             uint8  qs[16][8][4]           group g, row r: bytes 4g..4g+3 of
 *                                           the row's qs
 *           and Q3_K in "Q3_Kx8r", 880 bytes (8 block_q3_k) per super-block:
 *             uint16 d[8]                   F16 scales of rows 0..7
 *             uint8  sc[3][8][4]            dword k, row r: bytes 4k..4k+3 of
 *                                           the row's packed scales[12]
 *             uint8  qs[16][8][4]           group g, row r: bytes 4g..4g+3 of
 *                                           the row's qs
 *             uint8  hm[8][8][4]            group p, row r: bytes 4p..4p+3 of
 *                                           the row's hmask
 *           each with the unit's last n_rows % 8 rows plain. A qs group
 *           holds the 2-bit levels of 4 values of each of 8 rows at 4 bit
 *           offsets (values 128h + 32k + l, l = 4p..4p+3, for group g = 8h + p,
 *           at bits 2k; Q3_K's hm group p has their high bits at bit 4h + k),
 *           so one AND per level vector (in place, times 4^k) feeds vpdpbusd
 *           with 4 activation bytes broadcast; a scale dword holds 4 sub-blocks'
 *           scales of one row (Q2_K: low nibble, min in the high one; Q3_K:
 *           ggml's packing, unpacked for the 8 rows at once with its 32-bit
 *           mask steps).
 *           Weights repacked for one table must not be given to another
 *           (Q8_0 and k-quant layouts differ).
 *   ROW RANGES. A call's rows [row0, row1) are relative to w: for a type
 *   with row groups (Q4_0: 8 rows; Q8_0: avx2 4, avx512 8; Q5_0, IQ4_NL, Q4_1, Q5_1: avx512 8; k-quants: 8), w must be at a multiple
 *   of MOETAX_KERNELS_ROW_GROUP (8, a multiple of both) rows into its unit,
 *   row0 a multiple of 8, and row1 a multiple of 8 or the unit's last row
 *   (so a call ending inside a group ends at the unit's plain tail).
 *   Splitting rows into blocks of 64 from the unit's start, the last block
 *   ending at n_rows, satisfies this.

 * INVARIANTS
 *   - Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL: ncols must be a multiple of 32, Q2_K..Q6_K of 256
 *     (moetax_act_size returns 0 otherwise and matmul must not be called).
 *     F32/F16/BF16: any ncols >= 1.
 *   - k-quants: the avx512 table's kernels (Q2_K..Q6_Kx8r, any n_batch; a
 *     unit's plain tail: decode its own, batches its own for Q2_K/Q3_K and
 *     avx2's for the others) are its own (VNNI,
 *     matmul_kq_avx512.c: other exact int32 sums, avx2's float steps per
 *     output unchanged), so the two tables are bit-identical; avx2 keeps, for every output, the float chain
 *     above (the same for any n_batch or row split: batch-invariant). Its
 *     decode path (n_batch 1: 4 rows side by side, plain layout, no repack)
 *     and its batch path (one row, up to 4 batch rows per decoded block)
 *     differ only in how the exact int32 sums are formed; the float steps are
 *     the same operations in the same order (4 lanes or scalar; no
 *     contraction), so both give the same bits.
 *   - matmul: rows in [row0, row1) only, y[b * ldy + r] for b < n_batch; row1 ==
 *     row0 is a no-op; any n_batch >= 1 (tiled internally). y must not alias w or
 *     xq. Results are deterministic for a given table and do not depend on how
 *     rows are split across threads (each y element is computed by one call).
 *   - Integer block sums are exact; float accumulation order differs between
 *     tables, so ref and avx2 agree to a relative error of ~1e-6 of sum|w*x|.
 *   - avx512 against avx2: Q8_0 and Q4_0 results are bit-identical (the same
 *     exact block sums, then the same float chain per output: acc =
 *     fma((float)S_b, d_w[b] * d_x[b], acc) over the blocks in order, from 0),
 *     for every batch size and row split. F32/F16/BF16 matmul too: decode
 *     is the avx2 table's function, 2+ batch rows keep its per-output chain
 *     (8-column fma steps per lane from each column chunk's start, the same
 *     chunks, hsum tree and scalar tail) with two batch rows per 512-bit
 *     vector. Every other entry is the avx2 table's own function. BF16 uses
 *     no AVX512-BF16 instruction (vdpbf16ps rounds differently).
 *   - Vector ops take F32, n >= 0, and allow out == in where stated.
 *   - topk is deterministic: the k largest values in descending order, ties to
 *     the lower index; NaN ranks below -inf.
 *   - All functions are thread-safe (no shared mutable state after init).
 */
#ifndef MOETAX_KERNELS_H
#define MOETAX_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE modes: ggml's values. NORM rotates adjacent pairs (x[2i], x[2i+1])
 * (llama, deepseek2); NEOX rotates halves (x[i], x[i + n_dims/2]). */
enum moetax_rope_mode {
    MOETAX_ROPE_MODE_NORM = 0,
    MOETAX_ROPE_MODE_NEOX = 2,
};

#define MOETAX_ROPE_MAX_DIMS 1024

/* RoPE with YaRN, with ggml's formula. For pair i (i0 = 2i < n_dims):
 *   theta_extrap = pos * freq_base^(-i0 / n_dims) / freq_factors[i] (if given)
 *   theta_interp = freq_scale * theta_extrap
 *   ext_factor == 0: theta = theta_interp, mscale = attn_factor
 *   else: ramp = 1 - clamp((i - corr_lo) / max(0.001, corr_hi - corr_lo), 0, 1)
 *         mix = ramp * ext_factor
 *         theta = theta_interp * (1 - mix) + theta_extrap * mix
 *         mscale = attn_factor * (1 + 0.1 * ln(1 / freq_scale))
 *   with [corr_lo, corr_hi] from moetax_rope_corr_dims; the pair is rotated by
 *   theta and scaled by mscale. Dims n_dims.. of each head are left unchanged. */
struct moetax_rope_params {
    int n_dims;             /* rotated dims per head: even, <= MOETAX_ROPE_MAX_DIMS */
    enum moetax_rope_mode mode;
    int n_ctx_orig;         /* training context (YaRN) */
    float freq_base;        /* e.g. 10000 */
    float freq_scale;       /* 1 / context scaling factor; 1 = none */
    float ext_factor;       /* YaRN extrapolation mix; 0 = off */
    float attn_factor;      /* magnitude scale; 1 = none */
    float beta_fast;        /* YaRN, e.g. 32 */
    float beta_slow;        /* YaRN, e.g. 1 */
    const float *freq_factors; /* optional [n_dims / 2] divisors of theta, or NULL */
};

/* ggml_rope_yarn_corr_dims: dims[0] = max(0, floor(cd(beta_fast))),
 * dims[1] = min(n_dims - 1, ceil(cd(beta_slow))), with
 * cd(b) = n_dims * ln(n_ctx_orig / (b * 2 pi)) / (2 ln(freq_base)). */
void moetax_rope_corr_dims(int n_dims, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                           float dims[2]);

/* cos/sin of every rotated pair at position pos, already scaled by mscale:
 * cs[2i] = cos(theta_i) * mscale, cs[2i+1] = sin(theta_i) * mscale, i < n_dims/2.
 * Compute once per position and reuse for every head (rope_cached). */
void moetax_rope_cache(const struct moetax_rope_params *p, int64_t pos, float *cs);

/* Bytes of prepared activations for n_batch rows of ncols (see the layout
 * above); 0 if wtype is not computable or ncols is not a multiple of its block. */
size_t moetax_act_size(enum moetax_type wtype, int64_t ncols, int64_t n_batch);
/* True for the weight types whose prepared activations are the Q8_0 row: Q8_0. */
static inline bool moetax_act_is_q8_0(enum moetax_type wtype) { return wtype == MOETAX_TYPE_Q8_0; }
/* True for the weight types whose prepared activations are the Q4_0 row (the Q8_0 row and its
 * block sums): Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL. */
static inline bool moetax_act_is_q4_0(enum moetax_type wtype) {
    return wtype == MOETAX_TYPE_Q4_0 || wtype == MOETAX_TYPE_Q4_1 || wtype == MOETAX_TYPE_Q5_0 ||
           wtype == MOETAX_TYPE_Q5_1 || wtype == MOETAX_TYPE_IQ4_NL;
}

/* Rows of a row group in any table's layout (WEIGHT LAYOUTS, ROW RANGES):
 * callers that split a matrix's rows split at multiples of this. */
#define MOETAX_KERNELS_ROW_GROUP 8

struct moetax_kernels {
    const char *name; /* "ref", "avx2", "avx512" */

    /* ---- matrix x vector(s) ---- */

    /* Prepare n_batch rows of x (row i at x + i * ldx, ncols floats) into xq
     * (moetax_act_size(wtype, ncols, n_batch) bytes). */
    void (*quantize_act)(enum moetax_type wtype, const float *x, int64_t ldx, int64_t ncols, int64_t n_batch,
                         void *xq);
    /* y[b * ldy + r] = dot(W[r, :], x[b, :]) for r in [row0, row1), b < n_batch.
     * W in this table's layout for wtype (see weights_repacked). */
    void (*matmul)(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                   int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
    /* matmul, the same bits, for weights streamed from memory rather than read from the
     * caches (a model larger than the last-level cache: moetax_kernels_streamed): the SIMD
     * tables' decode (one batch row) also prefetches 4 KiB ahead into L2 (Q8_0 on avx2 only;
     * the rest on both), which pays when the weights come from DRAM and only adds
     * instructions when they are cached. The ref table's is its matmul. */
    void (*matmul_stream)(enum moetax_type wtype, const void *w, size_t row_bytes, int64_t row0, int64_t row1,
                          int64_t ncols, const void *xq, int64_t n_batch, float *y, int64_t ldy);
    /* True if matmul reads weights of type t in a repacked layout (WEIGHT
     * LAYOUTS): convert them with moetax_kernels_repack first. */
    bool (*weights_repacked)(enum moetax_type t);

    /* ---- vector ops (F32) ---- */

    /* out = x / sqrt(mean(x^2) + eps) * w (w == NULL: no weight); out == x allowed. */
    void (*rmsnorm)(float *out, const float *x, const float *w, int64_t n, float eps);
    /* x = softmax(x) in place (max-subtracted). n >= 1. ms (NULL: none) receives the max of x
     * and the sum of exp(x - max) by which the values were divided, as float (the chunks of a
     * long attention are merged with them). */
    void (*softmax)(float *x, int64_t n, float ms[2]);
    /* x = 1 / (1 + exp(-x)) in place. */
    void (*sigmoid)(float *x, int64_t n);
    /* Indices (and values, if val != NULL) of the k largest of x[0..n), in
     * descending order, ties to the lower index. 0 <= k <= n. */
    void (*topk)(const float *x, int64_t n, int64_t k, int32_t *idx, float *val);
    /* out[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i]; out may be g or u. */
    void (*silu_mul)(float *out, const float *g, const float *u, int64_t n);
    /* Rotate n_head heads (head h at x + h * head_stride) at position pos. */
    void (*rope)(float *x, int64_t n_head, int64_t head_stride, int64_t pos, const struct moetax_rope_params *p);
    /* Same with a precomputed moetax_rope_cache (n_dims, mode as given there). */
    void (*rope_cached)(float *x, int64_t n_head, int64_t head_stride, int n_dims, enum moetax_rope_mode mode,
                        const float *cs);
    /* MoE combine: for i < n_rows: dst[rows[i] * ld_dst + j] += w[i] * src[i * ld_src + j], j < n.
     * rows == NULL means rows[i] = i. Rows are applied in order i = 0, 1, ... */
    void (*scatter_add)(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, const int32_t *rows,
                        const float *w, int64_t n_rows, int64_t n);
    float (*dot)(const float *a, const float *b, int64_t n);
    /* y += a * x */
    void (*axpy)(float *y, float a, const float *x, int64_t n);
    /* Weighted sums of rows (attention's probabilities times values): for h < nh
     * and c < n, out[h * ld_out + c] = sum over j < np of p[h * ld_p + j] *
     * v[j * ld_v + c], accumulated in float from 0 (acc false) or from out's
     * values (acc true: a sum over rows held in several blocks, e.g. the KV
     * cache's, continues one chain) with one fused multiply-add per j in order
     * (every table: bit-identical results). out must not alias p or v. */
    void (*wsum)(float *out, int64_t ld_out, const float *p, int64_t ld_p, int64_t nh, const float *v,
                 int64_t ld_v, int64_t np, int64_t n, bool acc);
    /* x *= a */
    void (*scale)(float *x, float a, int64_t n);

    /* ---- row conversions (same results as types.h's scalar ones, finite inputs) ---- */
    void (*fp16_to_fp32)(const uint16_t *x, float *y, int64_t n);
    void (*fp32_to_fp16)(const float *x, uint16_t *y, int64_t n);
    void (*bf16_to_fp32)(const uint16_t *x, float *y, int64_t n);
    void (*fp32_to_bf16)(const float *x, uint16_t *y, int64_t n);
    /* y[i] = fp32(d) * q[i] over the Q8_0 blocks x (n a multiple of 32; exact products, so the same
     * values as types.h's moetax_to_float in every table): Q8_0 KV cache cells */
    void (*q8_0_to_fp32)(const void *x, float *y, int64_t n);
};

/* The table for this CPU (avx512 if AVX-512 F/BW/VL/DQ + VNNI with their state
 * saved by the OS, else avx2 if avx2+fma+f16c, else ref; MOETAX_FORCE_REF and
 * MOETAX_KERNELS as in DESIGN above), chosen on the first call; thread-safe.
 * Never NULL. */
const struct moetax_kernels *moetax_kernels_get(void);
/* The scalar reference table. */
const struct moetax_kernels *moetax_kernels_ref(void);
/* The last-level cache's size in bytes (sysfs's largest cache of CPU 0, else sysconf's
 * level-3 figure, else 32 MiB when neither is known). */
uint64_t moetax_cpu_llc_bytes(void);
/* Whether weights of this many bytes, read once per token, come from memory rather
 * than the caches, so that matmul_stream suits them: more than moetax_cpu_llc_bytes().
 * MOETAX_STREAM=1 or 0 in the environment forces the answer. */
bool moetax_kernels_streamed(uint64_t weight_bytes);
/* The AVX2/FMA/F16C table, or NULL if this CPU lacks any of them. */
const struct moetax_kernels *moetax_kernels_avx2(void);
/* The AVX-512 (F/BW/VL/DQ, VNNI) table, or NULL if this CPU or the OS's saved
 * state (XCR0 opmask / ZMM bits 5-7) does not allow it. */
const struct moetax_kernels *moetax_kernels_avx512(void);
/* What the table k uses beyond its name, for the lines that say which table ran: "gfni" for the
 * avx512 table on a CPU with GFNI (its Q3_K, Q5_K and Q6_K tiles; MOETAX_GFNI=0 in the environment
 * turns it off), else "". */
const char *moetax_kernels_extras(const struct moetax_kernels *k);

/* Convert one unit (WEIGHT LAYOUTS) of n_rows rows of ncols values of type
 * t, back to back in the stored (GGUF) layout at src (row_bytes =
 * moetax_row_size(t, ncols) each), into the layout k's matmul reads, at dst
 * (the same number of bytes). dst == src converts in place; otherwise the
 * two must not overlap. When k does not repack t this is a copy (nothing at
 * all in place). Thread-safe; disjoint units may be converted by several
 * threads. In place needs room for one row group (8 rows): on the stack up
 * to MOETAX_KERNELS_REPACK_STACK bytes, else from the heap, and only then
 * can it fail (MOETAX_ERR_NOMEM, dst untouched). */
#define MOETAX_KERNELS_REPACK_STACK (256 * 1024)
moetax_status moetax_kernels_repack(const struct moetax_kernels *k, enum moetax_type t, void *dst, const void *src,
                                    int64_t n_rows, int64_t ncols);

#ifdef __cplusplus
}
#endif
#endif
