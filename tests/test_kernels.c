// ctest-labels: unit
// ctest-cost: 60
/* test_kernels.c - every SIMD table (avx2, avx512: each the machine supports)
 * against the scalar reference, the avx512 table's Q8_0/Q4_0 bits against the
 * avx2 table's, and the references against naive double-precision formulas. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels_impl.h" /* moetax_k_avx512_gfni: both variants of the avx512 table */
#include "moetax/kernels.h"
#include "moetax/types.h"
#include "testutil.h"

static tu_rng g_rng = {0x9e3779b97f4a7c15ull};

/* The SIMD table the table-parametrised tests check against the reference (main
 * runs them once per table this machine supports), or NULL. */
static const struct moetax_kernels *g_simd;

static float *rand_vec(int64_t n, float scale) {
    float *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = tu_rand_normal(&g_rng) * scale;
    return v;
}

static const enum moetax_type k_types[] = {MOETAX_TYPE_F32,  MOETAX_TYPE_F16,  MOETAX_TYPE_BF16, MOETAX_TYPE_Q8_0,
                                           MOETAX_TYPE_Q4_0, MOETAX_TYPE_Q4_K, MOETAX_TYPE_Q5_K, MOETAX_TYPE_Q6_K,
                                           MOETAX_TYPE_Q3_K, MOETAX_TYPE_Q2_K, MOETAX_TYPE_Q5_0, MOETAX_TYPE_IQ4_NL,
                                           MOETAX_TYPE_Q4_1, MOETAX_TYPE_Q5_1};

/* Types whose activations are quantized to 32-value blocks (Q8_0 rows; Q4_0 adds sums). */
static bool is_q32(enum moetax_type t) { return moetax_act_is_q8_0(t) || moetax_act_is_q4_0(t); }

/* k-quants: super-blocks of 256 values, block_q8_K activations. */
static bool is_kq(enum moetax_type t) {
    return t == MOETAX_TYPE_Q4_K || t == MOETAX_TYPE_Q5_K || t == MOETAX_TYPE_Q6_K || t == MOETAX_TYPE_Q3_K ||
           t == MOETAX_TYPE_Q2_K;
}

/* A random [rows, ncols] matrix of type t (rows stored back to back). */
static void *rand_matrix(enum moetax_type t, int64_t rows, int64_t ncols, size_t *row_bytes) {
    *row_bytes = moetax_row_size(t, ncols);
    uint8_t *w = malloc(*row_bytes * (size_t)(rows > 0 ? rows : 1));
    float *tmp = rand_vec(ncols, 1.0f);
    if (t == MOETAX_TYPE_IQ4_NL) { /* random scales and nibbles: every level, not only those the quantizer picks */
        for (int64_t b = 0; b < rows * ncols / 32; b++) {
            moetax_block_iq4_nl blk;
            blk.d = moetax_fp32_to_fp16(0.01f * (1.0f + (float)((uint32_t)tu_rand_u64(&g_rng) % 100)) * (b % 3 ? 1.0f : -1.0f));
            for (int j = 0; j < 16; j++) blk.qs[j] = (uint8_t)(uint32_t)tu_rand_u64(&g_rng);
            memcpy(w + (size_t)b * sizeof blk, &blk, sizeof blk);
        }
        free(tmp);
        return w;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < ncols; k++) tmp[k] = tu_rand_normal(&g_rng) * (r % 3 == 0 ? 0.02f : 1.0f);
        CHECK_MSG(moetax_from_float(t, tmp, w + (size_t)r * *row_bytes, ncols), "%s x %lld", moetax_type_name(t),
                  (long long)ncols);
    }
    free(tmp);
    return w;
}

/* Dequantized activations as the matmul sees them (for the naive check). */
static void act_to_float(enum moetax_type t, const void *xq, int64_t ncols, float *out) {
    const uint8_t *a = xq;
    if (t == MOETAX_TYPE_F32 || t == MOETAX_TYPE_F16 || t == MOETAX_TYPE_BF16) {
        memcpy(out, a, (size_t)ncols * sizeof(float));
        return;
    }
    if (is_kq(t)) { /* block_q8_K[ncols / 256]: d, qs[256], bsums[16] (checked here) */
        for (int64_t i = 0; i < ncols / 256; i++) {
            moetax_block_q8_k blk;
            memcpy(&blk, a + i * sizeof blk, sizeof blk);
            for (int j = 0; j < 256; j++) out[i * 256 + j] = (float)blk.qs[j] * blk.d;
            for (int j = 0; j < 16; j++) {
                int sum = 0;
                for (int l = 0; l < 16; l++) sum += blk.qs[16 * j + l];
                CHECK_MSG(sum == blk.bsums[j], "q8_K activations: block %lld bsums[%d] %d, sum %d", (long long)i, j,
                          blk.bsums[j], sum);
            }
        }
        return;
    }
    /* Q8_0 and Q4_0: qs[nb][32], float d[nb] (Q4_0: then int32 s[nb], checked here) */
    const int64_t nb = ncols / 32;
    for (int64_t i = 0; i < nb; i++) {
        float d;
        int8_t q[32];
        memcpy(q, a + i * 32, 32);
        memcpy(&d, a + nb * 32 + i * 4, 4);
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            out[i * 32 + j] = (float)q[j] * d;
            sum += q[j];
        }
        if (moetax_act_is_q4_0(t)) {
            int32_t s;
            memcpy(&s, a + nb * 36 + i * 4, 4);
            CHECK_MSG(s == 8 * sum, "q4_0 activations: block %lld: s %d, 8 * sum %d", (long long)i, s, 8 * sum);
        }
    }
}

/* Reference matmul vs naive dequantize + double dot; AVX2 vs reference. */
static void test_matmul_case(enum moetax_type t, int64_t rows, int64_t ncols, int64_t n_batch) {
    const struct moetax_kernels *ref = moetax_kernels_ref();
    const struct moetax_kernels *avx = g_simd;
    size_t rb;
    void *w = rand_matrix(t, rows, ncols, &rb);
    const int64_t ldx = ncols + 3;
    float *x = rand_vec(ldx * n_batch, 1.0f);
    const size_t asz = moetax_act_size(t, ncols, n_batch);
    CHECK(asz == moetax_act_size(t, ncols, 1) * (size_t)n_batch);
    void *xq_ref = malloc(asz ? asz : 1), *xq_avx = malloc(asz ? asz : 1);
    ref->quantize_act(t, x, ldx, ncols, n_batch, xq_ref);
    const int64_t ldy = rows + 5;
    float *y_ref = malloc(sizeof(float) * (size_t)(ldy * n_batch + 1));
    float *y_avx = malloc(sizeof(float) * (size_t)(ldy * n_batch + 1));
    for (int64_t i = 0; i < ldy * n_batch; i++) y_ref[i] = y_avx[i] = -777.0f;
    ref->matmul(t, w, rb, 0, rows, ncols, xq_ref, n_batch, y_ref, ldy);

    /* naive: dequantize both sides, double dot; bound relative to sum |w x| */
    float *wf = malloc(sizeof(float) * (size_t)ncols), *xf = malloc(sizeof(float) * (size_t)ncols);
    const double tol_ref = 1e-6;
    int bad = 0;
    for (int64_t b = 0; b < n_batch; b++) {
        act_to_float(t, (const uint8_t *)xq_ref + b * moetax_act_size(t, ncols, 1), ncols, xf);
        double qerr = 0.0; /* activation quantization error, vs the original x */
        for (int64_t k = 0; k < ncols; k++) qerr = fmax(qerr, fabs((double)xf[k] - x[b * ldx + k]));
        if (is_q32(t) || is_kq(t)) CHECK(qerr < 0.05);
        else CHECK(qerr == 0.0);
        for (int64_t r = 0; r < rows; r++) {
            moetax_to_float(t, (const uint8_t *)w + r * rb, wf, ncols);
            double dot = 0.0, mag = 0.0;
            for (int64_t k = 0; k < ncols; k++) {
                dot += (double)wf[k] * xf[k];
                mag += fabs((double)wf[k] * xf[k]);
            }
            const double err = fabs(y_ref[b * ldy + r] - dot);
            if (err > tol_ref * mag + 1e-30 && bad++ < 5)
                fprintf(stderr, "ref %s r=%lld b=%lld ncols=%lld: %g vs %g (mag %g)\n", moetax_type_name(t),
                        (long long)r, (long long)b, (long long)ncols, y_ref[b * ldy + r], dot, mag);
        }
        for (int64_t r = rows; r < ldy; r++) CHECK(y_ref[b * ldy + r] == -777.0f);
    }
    CHECK_MSG(bad == 0, "ref matmul %s rows=%lld ncols=%lld batch=%lld: %d bad", moetax_type_name(t),
              (long long)rows, (long long)ncols, (long long)n_batch, bad);

    if (avx) {
        /* the AVX2 kernels read weights in their own layout (Q4_0, Q8_0: repacked), the reference as stored */
        void *wa = malloc(rb * (size_t)(rows > 0 ? rows : 1));
        moetax_kernels_repack(avx, t, wa, w, rows, ncols);
        avx->quantize_act(t, x, ldx, ncols, n_batch, xq_avx);
        CHECK_MSG(asz == 0 || memcmp(xq_ref, xq_avx, asz) == 0, "quantize_act %s ncols=%lld differs",
                  moetax_type_name(t), (long long)ncols);
        avx->matmul(t, wa, rb, 0, rows, ncols, xq_ref, n_batch, y_avx, ldy);
        const double tol = 2e-6;
        bad = 0;
        for (int64_t b = 0; b < n_batch; b++) {
            act_to_float(t, (const uint8_t *)xq_ref + b * moetax_act_size(t, ncols, 1), ncols, xf);
            for (int64_t r = 0; r < rows; r++) {
                moetax_to_float(t, (const uint8_t *)w + r * rb, wf, ncols);
                double mag = 0.0;
                for (int64_t k = 0; k < ncols; k++) mag += fabs((double)wf[k] * xf[k]);
                const double err = fabs((double)y_avx[b * ldy + r] - y_ref[b * ldy + r]);
                if (!(err <= tol * mag + 1e-30) && bad++ < 5)
                    fprintf(stderr, "%s %s r=%lld b=%lld ncols=%lld: %g vs ref %g (mag %g)\n", avx->name,
                            moetax_type_name(t), (long long)r, (long long)b, (long long)ncols, y_avx[b * ldy + r],
                            y_ref[b * ldy + r], mag);
            }
            for (int64_t r = rows; r < ldy; r++)
                if (y_avx[b * ldy + r] != -777.0f) bad++;
        }
        CHECK_MSG(bad == 0, "%s matmul %s rows=%lld ncols=%lld batch=%lld: %d bad", avx->name, moetax_type_name(t),
                  (long long)rows, (long long)ncols, (long long)n_batch, bad);

        /* a sub-range of rows touches only those rows and gives the full call's values
         * (bit-identical); types with row groups split at group boundaries (ROW RANGES); the
         * entry for streamed weights (matmul_stream) gives the same bits, whole and in ranges */
        const int64_t g = avx->weights_repacked(t) ? MOETAX_KERNELS_ROW_GROUP : 1;
        const int64_t ranges[3][2] = {{g, g == 1 ? rows - 1 : rows}, {0, g == 1 ? rows - 1 : g}, {0, rows}};
        for (int ri = 0; ri < 6; ri++) {
            const int64_t r0 = ranges[ri % 3][0], r1 = ranges[ri % 3][1];
            if (!(r0 < r1 && r1 <= rows && (r1 < rows || g == 1 || ri % 3 != 1))) continue;
            if (ri == 2) continue; /* the full call is y_avx itself */
            float *y_sub = malloc(sizeof(float) * (size_t)(ldy * n_batch + 1));
            for (int64_t i = 0; i < ldy * n_batch; i++) y_sub[i] = -777.0f;
            (ri < 3 ? avx->matmul : avx->matmul_stream)(t, wa, rb, r0, r1, ncols, xq_ref, n_batch, y_sub, ldy);
            int diff = 0;
            for (int64_t b = 0; b < n_batch; b++)
                for (int64_t r = 0; r < ldy; r++) {
                    const float v = y_sub[b * ldy + r];
                    if (r >= r0 && r < r1) diff += v != y_avx[b * ldy + r];
                    else diff += v != -777.0f;
                }
            CHECK_MSG(diff == 0, "%s%s row range [%lld, %lld) of %lld %s: %d bad", avx->name,
                      ri < 3 ? "" : " matmul_stream", (long long)r0, (long long)r1, (long long)rows,
                      moetax_type_name(t), diff);
            free(y_sub);
        }
        free(wa);
    }
    free(w), free(x), free(xq_ref), free(xq_avx), free(y_ref), free(y_avx), free(wf), free(xf);
}

static void test_matmul(void) {
    static const int64_t batches[] = {1, 2, 3, 7, 8, 33, 64};
    static const int64_t rows_list[] = {0, 1, 2, 3, 4, 5, 9, 17};
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        const enum moetax_type t = k_types[ti];
        const bool kq = is_kq(t), q = is_q32(t) || kq;
        const int64_t cols_f[] = {1, 5, 8, 13, 31, 64, 100, 257};
        const int64_t cols_q[] = {32, 64, 96, 160, 256, 1024};
        const int64_t cols_k[] = {256, 512, 768, 1280};
        const int64_t *cols = kq ? cols_k : q ? cols_q : cols_f;
        const int ncols_n = kq ? 4 : q ? 6 : 8;
        for (int ci = 0; ci < ncols_n; ci++)
            for (size_t ri = 0; ri < sizeof rows_list / sizeof rows_list[0]; ri++)
                for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
                    if (cols[ci] > 300 && batches[bi] > 8 && rows_list[ri] > 5) continue; /* keep it quick */
                    test_matmul_case(t, rows_list[ri], cols[ci], batches[bi]);
                }
        test_matmul_case(t, 37, q ? 4096 : 4099, 1);
        /* decode rows of 0.5-8 KiB: F32/F16/BF16 two rows at a time (avx2), an odd count leaves one */
        test_matmul_case(t, 13, kq ? 768 : q ? 640 : 700, 1);
        test_matmul_case(t, 11, q ? 2048 : 2044, 1);
        test_matmul_case(t, 9, kq ? 768 : q ? 640 : 256, 1);
        test_matmul_case(t, 13, kq ? 768 : q ? 640 : 700, 2);
        test_matmul_case(t, 6, q ? 2048 : 2047, 65);
    }
    /* Q4_0 and Q8_0 (repacked for AVX2 in groups of 8 and 4 rows, the last rows % 8 or % 4
     * plain): one to several groups with and without a tail, any block count, batches 1..64
     * (Q4_0: tiles of 1..4; Q8_0: tiles of 1..2 below QB_MIN, the batched path above) */
    {
        static const int64_t nbs[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, 31, 40};
        static const int64_t g_rows[] = {1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 22, 24, 31};
        static const int64_t g_batches[] = {1, 2, 3, 4, 5, 8, 17, 64};
        for (int q8 = 0; q8 < 2; q8++)
            for (size_t ni = 0; ni < sizeof nbs / sizeof nbs[0]; ni++)
                for (size_t ri = 0; ri < sizeof g_rows / sizeof g_rows[0]; ri++)
                    for (size_t bi = 0; bi < sizeof g_batches / sizeof g_batches[0]; bi++)
                        test_matmul_case(q8 ? MOETAX_TYPE_Q8_0 : MOETAX_TYPE_Q4_0, g_rows[ri], 32 * nbs[ni],
                                         g_batches[bi]);
    }
    /* k-quants (avx512: every k-quant's x8r in groups of 8 rows; Q4_K/Q5_K/Q6_K batches in pairs of
     * groups x tiles of 1..8 batch rows, 9..16 two even tiles, and more; a range's odd last group, and
     * every Q2_K/Q3_K group, in 256-bit tiles of 1..4; the plain tail): row counts of one to five groups
     * with and without a tail, batch sizes
     * of every tile width, odd and past one tile, against the scalar reference */
    {
        static const enum moetax_type kts[] = {MOETAX_TYPE_Q4_K, MOETAX_TYPE_Q5_K, MOETAX_TYPE_Q6_K,
                                               MOETAX_TYPE_Q2_K, MOETAX_TYPE_Q3_K};
        static const int64_t k_rows[] = {8, 16, 21, 24, 40, 43};
        static const int64_t k_batches[] = {4, 5, 6, 7, 9, 11, 12, 15, 16, 17, 23, 33};
        for (size_t ti = 0; ti < sizeof kts / sizeof kts[0]; ti++)
            for (int ci = 1; ci <= 2; ci++)
                for (size_t ri = 0; ri < sizeof k_rows / sizeof k_rows[0]; ri++)
                    for (size_t bi = 0; bi < sizeof k_batches / sizeof k_batches[0]; bi++)
                        test_matmul_case(kts[ti], k_rows[ri], 256 * ci, k_batches[bi]);
    }
    /* Q5_0 / IQ4_NL / Q4_1 / Q5_1 batches (avx512: Q5_0 and IQ4_NL past 8 rows in chunks of 64 blocks
     * in Q8_0x8r, batch rows in slabs of 64, a range's last rows % 8 on avx2's path): several chunks
     * and slabs, pairs of groups, a lone group */
    for (int ti = 0; ti < 4; ti++) {
        static const enum moetax_type ts[] = {MOETAX_TYPE_Q5_0, MOETAX_TYPE_IQ4_NL, MOETAX_TYPE_Q4_1, MOETAX_TYPE_Q5_1};
        const enum moetax_type t = ts[ti];
        test_matmul_case(t, 27, 32 * 70, 70);
        test_matmul_case(t, 40, 32 * 130, 9);
        test_matmul_case(t, 8, 32 * 44, 131);
        /* the avx512 x4z tiles (pairs of groups x 1..8 batch rows; Q5_0 / IQ4_NL up to 8 rows, the
         * odd group through the chunks; Q4_1 / Q5_1 any batch in tiles of up to 8): every tile width,
         * one to five groups with and without an odd group and a tail */
        static const int64_t x_rows[] = {8, 16, 24, 25, 40, 41};
        static const int64_t x_batches[] = {2, 3, 4, 5, 6, 7, 8, 9, 17};
        for (size_t ri = 0; ri < sizeof x_rows / sizeof x_rows[0]; ri++)
            for (size_t bi = 0; bi < sizeof x_batches / sizeof x_batches[0]; bi++)
                for (int64_t nb = 1; nb <= 9; nb += 4) test_matmul_case(t, x_rows[ri], 32 * nb, x_batches[bi]);
    }
    CHECK(moetax_act_size(MOETAX_TYPE_Q8_0, 33, 1) == 0);
    CHECK(moetax_act_size(MOETAX_TYPE_Q4_0, 48, 1) == 0);
    CHECK(moetax_act_size(MOETAX_TYPE_Q4_K, 256, 1) == sizeof(moetax_block_q8_k));
    CHECK(moetax_act_size(MOETAX_TYPE_Q6_K, 512, 3) == 6 * sizeof(moetax_block_q8_k));
    CHECK(moetax_act_size(MOETAX_TYPE_Q4_K, 288, 1) == 0 && moetax_act_size(MOETAX_TYPE_Q6_K, 32, 1) == 0);
    CHECK(moetax_act_size(MOETAX_TYPE_Q5_K, 128, 1) == 0);
    CHECK(moetax_act_size(MOETAX_TYPE_F16, 7, 3) == 7 * 3 * sizeof(float));
}

/* The inverse of the AVX2 table's Q4_0 repack of one unit of rows, written from
 * the layout in kernels.h (groups of 8 rows: per block, F16 d of rows 0..7, then
 * 4 chunks x 8 rows x 4 nibble bytes; the last rows % 8 rows plain). */
static void unrepack_q4r8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t rb = (size_t)nb * 18;
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (size_t)r0 * rb + (size_t)b * 144;
            for (int r = 0; r < 8; r++) {
                uint8_t *o = dst + (size_t)(r0 + r) * rb + (size_t)b * 18;
                memcpy(o, blk + 2 * r, 2);
                for (int c = 0; c < 4; c++) memcpy(o + 2 + 4 * c, blk + 16 + 32 * c + 4 * r, 4);
            }
        }
    memcpy(dst + (size_t)r0 * rb, src + (size_t)r0 * rb, (size_t)(rows - r0) * rb);
}

/* The inverse of the AVX2 table's Q8_0 repack (groups of 4 rows: per block, F16 d of
 * rows 0..3, then the 4 rows' 32 quants; the last rows % 4 rows plain). */
static void unrepack_q8r4(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t rb = (size_t)nb * 34;
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (size_t)r0 * rb + (size_t)b * 136;
            for (int r = 0; r < 4; r++) {
                uint8_t *o = dst + (size_t)(r0 + r) * rb + (size_t)b * 34;
                memcpy(o, blk + 2 * r, 2);
                memcpy(o + 2, blk + 8 + 32 * r, 32);
            }
        }
    memcpy(dst + (size_t)r0 * rb, src + (size_t)r0 * rb, (size_t)(rows - r0) * rb);
}

/* The inverse of the AVX-512 table's Q8_0 repack (groups of 8 rows: per block, F16 d of
 * rows 0..7, then 8 chunks x 8 rows x 4 quants, each plus 128; the last rows % 8 rows plain). */
static void unrepack_q8r8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t rb = (size_t)nb * 34;
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (size_t)r0 * rb + (size_t)b * 272;
            for (int r = 0; r < 8; r++) {
                uint8_t *o = dst + (size_t)(r0 + r) * rb + (size_t)b * 34;
                memcpy(o, blk + 2 * r, 2);
                for (int c = 0; c < 8; c++) memcpy(o + 2 + 4 * c, blk + 16 + 32 * c + 4 * r, 4);
                for (int i = 2; i < 34; i++) o[i] ^= 0x80; /* stored as w + 128 */
            }
        }
    memcpy(dst + (size_t)r0 * rb, src + (size_t)r0 * rb, (size_t)(rows - r0) * rb);
}

/* The inverse of the avx512 table's Q4_K repack (kernels.h: groups of 8 rows; per
 * super-block d[8], dmin[8], the 12 scale bytes as 3 dwords x 8 rows, then 4
 * chunks x 8 four-byte groups x 8 rows of qs; the last rows % 8 rows plain). */
static void unrepack_q4kr8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t bs = sizeof(moetax_block_q4_k), rb = (size_t)nb * bs, gb = 8 * bs;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * gb;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + (size_t)(r + k) * rb + (size_t)b * bs;
                memcpy(o, g + 2 * k, 2);
                memcpy(o + 2, g + 16 + 2 * k, 2);
                for (int d = 0; d < 3; d++) memcpy(o + 4 + 4 * d, g + 32 + 32 * d + 4 * k, 4);
                for (int c = 0; c < 4; c++)
                    for (int q = 0; q < 8; q++) memcpy(o + 16 + 32 * c + 4 * q, g + 128 + 256 * c + 32 * q + 4 * k, 4);
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

/* The inverse of the avx512 table's Q5_K repack (kernels.h: Q4_Kx8r's d, dmin and
 * scales, qh as 8 four-byte groups x 8 rows, then Q4_Kx8r's qs). */
static void unrepack_q5kr8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t bs = sizeof(moetax_block_q5_k), rb = (size_t)nb * bs, gb = 8 * bs;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * gb;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + (size_t)(r + k) * rb + (size_t)b * bs;
                memcpy(o, g + 2 * k, 2);
                memcpy(o + 2, g + 16 + 2 * k, 2);
                for (int d = 0; d < 3; d++) memcpy(o + 4 + 4 * d, g + 32 + 32 * d + 4 * k, 4);
                for (int q = 0; q < 8; q++) memcpy(o + 16 + 4 * q, g + 128 + 32 * q + 4 * k, 4);
                for (int c = 0; c < 4; c++)
                    for (int q = 0; q < 8; q++) memcpy(o + 48 + 32 * c + 4 * q, g + 384 + 256 * c + 32 * q + 4 * k, 4);
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

/* The inverse of the avx512 table's Q6_K repack (kernels.h: groups of 8 rows; per
 * super-block d[8], the 16 scales as 4 dwords x 8 rows, ql as 2 halves x 16 four-byte
 * groups x 8 rows, qh as 2 halves x 8 groups x 8 rows; the last rows % 8 rows plain). */
static void unrepack_q6kr8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t bs = sizeof(moetax_block_q6_k), rb = (size_t)nb * bs, gb = 8 * bs;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * gb;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + (size_t)(r + k) * rb + (size_t)b * bs;
                memcpy(o + offsetof(moetax_block_q6_k, d), g + 2 * k, 2);
                for (int d = 0; d < 4; d++) memcpy(o + offsetof(moetax_block_q6_k, scales) + 4 * d, g + 16 + 32 * d + 4 * k, 4);
                for (int h = 0; h < 2; h++) {
                    for (int q = 0; q < 16; q++) memcpy(o + 64 * h + 4 * q, g + 144 + 512 * h + 32 * q + 4 * k, 4);
                    for (int q = 0; q < 8; q++)
                        memcpy(o + offsetof(moetax_block_q6_k, qh) + 32 * h + 4 * q, g + 1168 + 256 * h + 32 * q + 4 * k, 4);
                }
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

/* The inverse of the avx512 table's Q2_K repack (kernels.h: groups of 8 rows; per super-block
 * d[8], dmin[8], the 16 scale bytes as 4 dwords x 8 rows, then 16 four-byte groups of qs x 8 rows). */
static void unrepack_q2kr8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t bs = sizeof(moetax_block_q2_k), rb = (size_t)nb * bs, gb = 8 * bs;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * gb;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + (size_t)(r + k) * rb + (size_t)b * bs;
                memcpy(o + offsetof(moetax_block_q2_k, d), g + 2 * k, 2);
                memcpy(o + offsetof(moetax_block_q2_k, dmin), g + 16 + 2 * k, 2);
                for (int d = 0; d < 4; d++)
                    memcpy(o + offsetof(moetax_block_q2_k, scales) + 4 * d, g + 32 + 32 * d + 4 * k, 4);
                for (int q = 0; q < 16; q++)
                    memcpy(o + offsetof(moetax_block_q2_k, qs) + 4 * q, g + 160 + 32 * q + 4 * k, 4);
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

/* The inverse of the avx512 table's Q3_K repack (kernels.h: groups of 8 rows; per super-block
 * d[8], the 12 packed scale bytes as 3 dwords x 8 rows, 16 four-byte groups of qs x 8 rows, then
 * 8 four-byte groups of hmask x 8 rows). */
static void unrepack_q3kr8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const size_t bs = sizeof(moetax_block_q3_k), rb = (size_t)nb * bs, gb = 8 * bs;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * gb;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = dst + (size_t)(r + k) * rb + (size_t)b * bs;
                memcpy(o + offsetof(moetax_block_q3_k, d), g + 2 * k, 2);
                for (int d = 0; d < 3; d++)
                    memcpy(o + offsetof(moetax_block_q3_k, scales) + 4 * d, g + 16 + 32 * d + 4 * k, 4);
                for (int q = 0; q < 16; q++)
                    memcpy(o + offsetof(moetax_block_q3_k, qs) + 4 * q, g + 112 + 32 * q + 4 * k, 4);
                for (int q = 0; q < 8; q++)
                    memcpy(o + offsetof(moetax_block_q3_k, hmask) + 4 * q, g + 624 + 32 * q + 4 * k, 4);
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

static int cmp_u8(const void *a, const void *b) { return (int)*(const uint8_t *)a - (int)*(const uint8_t *)b; }

/* The inverse of the avx512 table's Q5_0 / Q4_1 / Q5_1 repacks, written from the layouts in
 * kernels.h (groups of 8 rows: per block d[8], Q4_1/Q5_1 then m[8], Q5_0/Q5_1 then the masks
 * M[c][h] with bit 4r + i = bit 16h + 4c + i of row r's qh, then qs[c][r][4]; the last rows % 8
 * plain). Blocks: d, (m), (qh), 16 nibble bytes. */
static void unrepack_q5r8(enum moetax_type t, const uint8_t *src, uint8_t *dst, int64_t rows, int64_t nb) {
    const bool with_m = t != MOETAX_TYPE_Q5_0, five = t != MOETAX_TYPE_Q4_1;
    const size_t bs = t == MOETAX_TYPE_Q5_0 ? 22 : t == MOETAX_TYPE_Q4_1 ? 20 : 24, rb = (size_t)nb * bs;
    const size_t mo = with_m ? 32 : 16, qo = mo + (five ? 32 : 0); /* masks, then qs, in the group's block */
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *g = src + (size_t)r * rb + (size_t)b * 8 * bs;
            for (int i = 0; i < 8; i++) {
                uint8_t *o = dst + (size_t)(r + i) * rb + (size_t)b * bs;
                memcpy(o, g + 2 * i, 2);
                if (with_m) memcpy(o + 2, g + 16 + 2 * i, 2);
                if (five) {
                    uint32_t qh = 0;
                    for (int c = 0; c < 4; c++)
                        for (int h = 0; h < 2; h++) {
                            uint32_t m;
                            memcpy(&m, g + mo + 4 * (2 * c + h), 4);
                            qh |= (m >> (4 * i) & 0xfu) << (16 * h + 4 * c);
                        }
                    for (int k = 0; k < 4; k++) o[(with_m ? 4 : 2) + k] = (uint8_t)(qh >> (8 * k));
                }
                for (int c = 0; c < 4; c++) memcpy(o + bs - 16 + 4 * c, g + qo + 32 * c + 4 * i, 4);
            }
        }
    memcpy(dst + (size_t)r * rb, src + (size_t)r * rb, (size_t)(rows - r) * rb);
}

/* Repacking is a per-row permutation of the bytes that round-trips, in place or
 * not; tables that do not repack copy; the reference table reads the stored layout. */
/* The SIMD tables' block_q8_K preparation gives the reference's bytes on the inputs where its
 * steps could part from the scalar's: ties of +a and -a for the largest magnitude (the first
 * one's sign), the largest value in every position, exact halves after scaling, all zeros, tiny
 * values, a NaN or an infinity in a block (the scalar code's bytes), and random rows. */
static void test_quantize_q8k(void) {
    if (!g_simd) return;
    enum { NB = 12, N = 256 * NB };
    float *x = rand_vec(N, 2.0f);
    x[3] = 5.0f, x[200] = -5.0f;            /* block 0: +a first */
    x[256 + 7] = -5.0f, x[256 + 9] = 5.0f;  /* block 1: -a first */
    x[2 * 256 + 255] = -9.0f;               /* block 2: the last value */
    x[3 * 256] = 9.0f;                      /* block 3: the first */
    for (int j = 0; j < 256; j++) x[4 * 256 + j] = j % 2 ? 0.0f : -0.0f;            /* block 4: zeros */
    for (int j = 0; j < 256; j++) x[5 * 256 + j] = (float)(j % 201 - 100) + 0.5f; /* block 5: iscale 1, halves */
    x[5 * 256 + 1] = -127.0f;
    for (int j = 0; j < 256; j++) x[6 * 256 + j] *= 1e-40f;                         /* block 6: subnormal */
    x[7 * 256 + 17] = NAN;                                                          /* block 7: a NaN */
    x[8 * 256 + 100] = INFINITY;                                                    /* block 8: inf */
    x[9 * 256 + 31] = -INFINITY, x[9 * 256 + 32] = NAN;
    const size_t asz = moetax_act_size(MOETAX_TYPE_Q4_K, N, 1);
    uint8_t *a = malloc(asz), *b = malloc(asz);
    for (int ti = 0; ti < 3; ti++) {
        const enum moetax_type t = ti == 2 ? MOETAX_TYPE_Q6_K : ti ? MOETAX_TYPE_Q2_K : MOETAX_TYPE_Q4_K;
        memset(a, 0x55, asz), memset(b, 0xaa, asz);
        moetax_kernels_ref()->quantize_act(t, x, N, N, 1, a);
        g_simd->quantize_act(t, x, N, N, 1, b);
        for (int i = 0; i < NB; i++)
            CHECK_MSG(memcmp(a + i * sizeof(moetax_block_q8_k), b + i * sizeof(moetax_block_q8_k),
                             sizeof(moetax_block_q8_k)) == 0,
                      "%s quantize_act %s: q8_K block %d differs from the reference", g_simd->name,
                      moetax_type_name(t), i);
    }
    free(x), free(a), free(b);
}

/* Q8_0 / Q4_0 activation rows of few blocks (attention's per-head rows, experts' hidden rows): the
 * table quantizes 8 blocks at a time across rows. With rows apart in memory (ldx > ncols) and blocks
 * of zeros and of exact halves after scaling at every position in the groups of 8, every row's bytes
 * are the reference's; with blocks that hold an infinity or only subnormals (where the reference's
 * float-to-int conversion is undefined and the tables' saturates), the rows quantized together are
 * the bytes of the same rows quantized one at a time. (A block with a NaN gets bytes that depend on
 * which operand of vmaxps its NaN meets, in rows of 8+ blocks before as now: not compared.) */
static void test_quantize_q8_rows(void) {
    if (!g_simd) return;
    static const int64_t nbs[] = {1, 2, 3, 5, 8, 9};
    for (int special = 0; special < 2; special++)
        for (int q8 = 0; q8 < 2; q8++) {
            const enum moetax_type t = q8 ? MOETAX_TYPE_Q8_0 : MOETAX_TYPE_Q4_0;
            for (size_t ni = 0; ni < sizeof nbs / sizeof nbs[0]; ni++)
                for (int64_t n = 1; n <= 11; n++) {
                    const int64_t nb = nbs[ni], ncols = 32 * nb, ldx = ncols + 5, nblk = nb * n;
                    float *x = rand_vec(ldx * n, 3.0f);
                    for (int64_t g = 0; g < nblk; g++) { /* block g: row g / nb, block g % nb */
                        float *blk = x + (g / nb) * ldx + (g % nb) * 32;
                        switch ((g + n) % 9) {
                        case 3: if (special) blk[(g * 5) % 32] = -INFINITY; break;
                        case 5: for (int j = 0; j < 32; j++) blk[j] = j % 2 ? 0.0f : -0.0f; break;
                        case 6: if (special) for (int j = 0; j < 32; j++) blk[j] *= 1e-40f; break;
                        case 7: for (int j = 0; j < 32; j++) blk[j] = (float)(j - 16) * 127.0f / 16.0f + 0.5f; break;
                        default: break;
                        }
                    }
                    const size_t asz = moetax_act_size(t, ncols, n), rsz = moetax_act_size(t, ncols, 1);
                    uint8_t *a = malloc(asz), *b = malloc(asz);
                    memset(a, 0x55, asz), memset(b, 0xaa, asz);
                    if (special)
                        for (int64_t r = 0; r < n; r++) g_simd->quantize_act(t, x + r * ldx, ldx, ncols, 1, a + r * rsz);
                    else
                        moetax_kernels_ref()->quantize_act(t, x, ldx, ncols, n, a);
                    g_simd->quantize_act(t, x, ldx, ncols, n, b);
                    CHECK_MSG(memcmp(a, b, asz) == 0, "%s quantize_act %s: %lld rows of %lld blocks differ from %s",
                              g_simd->name, moetax_type_name(t), (long long)n, (long long)nb,
                              special ? "the rows one at a time" : "the reference");
                    free(x), free(a), free(b);
                }
        }
}

static void test_repack(void) {
    const struct moetax_kernels *ref = moetax_kernels_ref(), *avx = g_simd;
    CHECK(!ref->weights_repacked(MOETAX_TYPE_Q4_0) && !ref->weights_repacked(MOETAX_TYPE_Q8_0));
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        const enum moetax_type t = k_types[ti];
        const int64_t rows = 3, ncols = is_kq(t) ? 256 * 3 : 64 * 9; /* 18 blocks; k-quants 3 */
        size_t rb;
        uint8_t *w = rand_matrix(t, rows, ncols, &rb), *a = malloc(rb * rows), *b = malloc(rb * rows);
        moetax_kernels_repack(ref, t, a, w, rows, ncols);
        CHECK(memcmp(a, w, rb * rows) == 0);
        if (avx) {
            const bool rp = t == MOETAX_TYPE_Q4_0 || t == MOETAX_TYPE_Q8_0 || is_kq(t) || /* Q2_K..Q6_Kx8r */
                            t == MOETAX_TYPE_Q5_0 || t == MOETAX_TYPE_IQ4_NL ||          /* Q5_0x8r, IQ4_NLx8r, */
                            t == MOETAX_TYPE_Q4_1 || t == MOETAX_TYPE_Q5_1;              /* Q4_1x8r, Q5_1x8r */
            CHECK(avx->weights_repacked(t) == rp);
            moetax_kernels_repack(avx, t, a, w, rows, ncols);
            if (!rp) CHECK(memcmp(a, w, rb * rows) == 0);
            memcpy(b, w, rb * rows);
            moetax_kernels_repack(avx, t, b, b, rows, ncols); /* in place gives the same bytes */
            CHECK(memcmp(a, b, rb * rows) == 0);
        }
        free(w), free(a), free(b);
    }
    if (!avx) return;
    const bool q8x8 = strcmp(avx->name, "avx512") == 0; /* Q8_0x8r, else Q8_0x4r */
    { /* Q5_0x8r, IQ4_NLx8r (Q4_0x8r's layout), Q4_1x8r, Q5_1x8r (avx2 and avx512): round trip through the
       * layout's inverse, in place the same, units with tails */
        static const int64_t q5_rows[] = {1, 7, 8, 9, 16, 23};
        static const enum moetax_type q5_types[] = {MOETAX_TYPE_Q5_0, MOETAX_TYPE_IQ4_NL, MOETAX_TYPE_Q4_1,
                                                    MOETAX_TYPE_Q5_1};
        for (int ti = 0; ti < 4; ti++)
        for (int64_t nb = 1; nb <= 45; nb += 11)
            for (size_t ui = 0; ui < sizeof q5_rows / sizeof q5_rows[0]; ui++) {
                const enum moetax_type t = q5_types[ti];
                const int64_t rows = q5_rows[ui], ncols = 32 * nb;
                size_t rb;
                uint8_t *w = rand_matrix(t, rows, ncols, &rb);
                const size_t n = rb * (size_t)rows;
                uint8_t *a = malloc(n), *b = malloc(n), *back = malloc(n);
                CHECK(moetax_kernels_repack(avx, t, a, w, rows, ncols) == MOETAX_OK);
                memcpy(b, w, n);
                CHECK(moetax_kernels_repack(avx, t, b, b, rows, ncols) == MOETAX_OK);
                CHECK(memcmp(a, b, n) == 0);
                if (t == MOETAX_TYPE_IQ4_NL) unrepack_q4r8(a, back, rows, nb);
                else unrepack_q5r8(t, a, back, rows, nb);
                CHECK_MSG(memcmp(back, w, n) == 0, "%s x8r rows=%lld nb=%lld: no round trip", moetax_type_name(t),
                          (long long)rows, (long long)nb);
                CHECK(rows >= 8 || memcmp(a, w, n) == 0);
                free(w), free(a), free(b), free(back);
            }
    }
    static const int64_t unit_rows[] = {1, 3, 4, 5, 7, 8, 9, 16, 23};
    for (int q8 = 0; q8 < 2; q8++)
        for (int64_t nb = 1; nb <= 41; nb += 4)
            for (size_t ui = 0; ui < sizeof unit_rows / sizeof unit_rows[0]; ui++) {
                const enum moetax_type t = q8 ? MOETAX_TYPE_Q8_0 : MOETAX_TYPE_Q4_0;
                const int64_t rows = unit_rows[ui], ncols = 32 * nb, R = q8 && !q8x8 ? 4 : 8;
                size_t rb;
                uint8_t *w = rand_matrix(t, rows, ncols, &rb);
                CHECK(rb == (size_t)nb * (q8 ? 34 : 18));
                const size_t n = rb * (size_t)rows;
                uint8_t *a = malloc(n), *back = malloc(n), *s1 = malloc(n), *s2 = malloc(n);
                CHECK(moetax_kernels_repack(avx, t, a, w, rows, ncols) == MOETAX_OK);
                if (q8 && q8x8) unrepack_q8r8(a, back, rows, nb);
                else if (q8) unrepack_q8r4(a, back, rows, nb);
                else unrepack_q4r8(a, back, rows, nb);
                CHECK_MSG(memcmp(back, w, n) == 0, "%s repack rows=%lld nb=%lld does not round-trip",
                          moetax_type_name(t), (long long)rows, (long long)nb);
                memcpy(s1, w, n), memcpy(s2, a, n);
                if (q8 && q8x8) /* Q8_0x8r stores each quant plus 128: flip them back */
                    for (int64_t g = 0; g < rows / 8; g++)
                        for (int64_t b = 0; b < nb; b++)
                            for (int i = 16; i < 272; i++) s2[(size_t)g * 8 * rb + (size_t)b * 272 + i] ^= 0x80;
                qsort(s1, n, 1, cmp_u8), qsort(s2, n, 1, cmp_u8);
                CHECK_MSG(memcmp(s1, s2, n) == 0, "%s repack rows=%lld nb=%lld: not a permutation",
                          moetax_type_name(t), (long long)rows, (long long)nb);
                /* the last rows % R rows are untouched; a full group is not (random scales differ) */
                const size_t tail = (size_t)(rows % R) * rb;
                CHECK(memcmp(a + n - tail, w + n - tail, tail) == 0);
                if (rows >= R) CHECK(memcmp(a, w, 2 * (size_t)R) != 0);
                memcpy(back, w, n); /* in place: the same bytes */
                CHECK(moetax_kernels_repack(avx, t, back, back, rows, ncols) == MOETAX_OK);
                CHECK(memcmp(back, a, n) == 0);
                free(w), free(a), free(back), free(s1), free(s2);
            }
    /* Q2_Kx8r .. Q6_Kx8r (avx512): round trip, a permutation, the plain tail untouched, in place the same */
    static const enum moetax_type kr8[] = {MOETAX_TYPE_Q4_K, MOETAX_TYPE_Q5_K, MOETAX_TYPE_Q6_K, MOETAX_TYPE_Q2_K,
                                           MOETAX_TYPE_Q3_K};
    for (int ki = 0; ki < 5; ki++)
        for (int64_t nb = 1; nb <= 5; nb += 2)
            for (size_t ui = 0; ui < sizeof unit_rows / sizeof unit_rows[0]; ui++) {
                const enum moetax_type t = kr8[ki];
                if (!avx->weights_repacked(t)) continue;
                const int64_t rows = unit_rows[ui], ncols = 256 * nb;
                size_t rb;
                uint8_t *w = rand_matrix(t, rows, ncols, &rb);
                const size_t n = rb * (size_t)rows;
                uint8_t *a = malloc(n), *back = malloc(n), *s1 = malloc(n), *s2 = malloc(n);
                CHECK(moetax_kernels_repack(avx, t, a, w, rows, ncols) == MOETAX_OK);
                if (t == MOETAX_TYPE_Q6_K) unrepack_q6kr8(a, back, rows, nb);
                else if (t == MOETAX_TYPE_Q5_K) unrepack_q5kr8(a, back, rows, nb);
                else if (t == MOETAX_TYPE_Q2_K) unrepack_q2kr8(a, back, rows, nb);
                else if (t == MOETAX_TYPE_Q3_K) unrepack_q3kr8(a, back, rows, nb);
                else unrepack_q4kr8(a, back, rows, nb);
                CHECK_MSG(memcmp(back, w, n) == 0, "%s repack rows=%lld nb=%lld does not round-trip",
                          moetax_type_name(t), (long long)rows, (long long)nb);
                memcpy(s1, w, n), memcpy(s2, a, n);
                qsort(s1, n, 1, cmp_u8), qsort(s2, n, 1, cmp_u8);
                CHECK(memcmp(s1, s2, n) == 0);
                const size_t tail = (size_t)(rows % 8) * rb;
                CHECK(memcmp(a + n - tail, w + n - tail, tail) == 0);
                if (rows >= 8) CHECK(memcmp(a, w, 64) != 0);
                memcpy(back, w, n);
                CHECK(moetax_kernels_repack(avx, t, back, back, rows, ncols) == MOETAX_OK);
                CHECK(memcmp(back, a, n) == 0);
                free(w), free(a), free(back), free(s1), free(s2);
            }
    /* rows wider than the stack room go through the heap, in place too */
    for (int q8 = 0; q8 < 2; q8++) {
        const enum moetax_type t = q8 ? MOETAX_TYPE_Q8_0 : MOETAX_TYPE_Q4_0;
        const int64_t rows = 9, ncols = 32 * (MOETAX_KERNELS_REPACK_STACK / (q8 && !q8x8 ? 4 * 34 : 8 * (q8 ? 34 : 18)) + 3);
        size_t rb;
        uint8_t *w = rand_matrix(t, rows, ncols, &rb);
        const size_t n = rb * (size_t)rows;
        uint8_t *a = malloc(n), *b = malloc(n);
        CHECK(moetax_kernels_repack(avx, t, a, w, rows, ncols) == MOETAX_OK);
        memcpy(b, w, n);
        CHECK(moetax_kernels_repack(avx, t, b, b, rows, ncols) == MOETAX_OK);
        CHECK(memcmp(a, b, n) == 0);
        free(w), free(a), free(b);
    }
}

/* Each batch row's result does not depend on the batch it came in (the canonical
 * per-row chain of the quantized paths): a batch of 1, 2 (tiles), 8 and 64 (Q8_0's
 * batched path) gives the bits of each row computed alone, so prefill equals
 * step-by-step decode. Rows with repacked groups and a plain tail. */
static void test_matmul_batch_invariance(const struct moetax_kernels *k) {
    static const enum moetax_type ts[] = {MOETAX_TYPE_Q8_0, MOETAX_TYPE_Q4_0, MOETAX_TYPE_Q4_K, MOETAX_TYPE_Q5_K,
                                          MOETAX_TYPE_Q6_K, MOETAX_TYPE_Q3_K, MOETAX_TYPE_Q2_K};
    /* row counts with a plain tail after one group (13), two groups (22), five (43), a panel and more (75) */
    static const int64_t nrows[] = {13, 22, 43, 75};
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++)
        for (size_t ri = 0; ri < 4; ri++) {
            const int64_t rows = nrows[ri];
            const enum moetax_type t = ts[ti];
            const int64_t ncols = is_kq(t) ? 256 * (1 + ri % 3) : 32 * 11, nbmax = 64;
            size_t rb;
            uint8_t *w = rand_matrix(t, rows, ncols, &rb);
            k->weights_repacked(t) ? (void)moetax_kernels_repack(k, t, w, w, rows, ncols) : (void)0;
            float *x = rand_vec(ncols * nbmax, 1.0f), *y1 = malloc(sizeof(float) * (size_t)rows),
                  *yb = malloc(sizeof(float) * (size_t)(rows * nbmax));
            const size_t ar = moetax_act_size(t, ncols, 1);
            uint8_t *xq = malloc(ar * nbmax);
            k->quantize_act(t, x, ncols, ncols, nbmax, xq);
            static const int64_t bs[] = {2, 3, 5, 8, 9, 16, 64};
            for (size_t bi = 0; bi < 7; bi++) {
                k->matmul(t, w, rb, 0, rows, ncols, xq, bs[bi], yb, rows);
                int diff = 0;
                for (int64_t b = 0; b < bs[bi]; b++) {
                    k->matmul(t, w, rb, 0, rows, ncols, xq + (size_t)b * ar, 1, y1, rows);
                    for (int64_t r = 0; r < rows; r++) diff += memcmp(&y1[r], &yb[b * rows + r], sizeof(float)) != 0;
                }
                CHECK_MSG(diff == 0, "%s %s rows=%lld batch %lld: %d results differ from the rows alone", k->name,
                          moetax_type_name(t), (long long)rows, (long long)bs[bi], diff);
            }
            free(w), free(x), free(y1), free(yb), free(xq);
        }
}

/* Quantized matmul stays close to the exact F32 product (quantization error). */
static void test_matmul_vs_f32(const struct moetax_kernels *k) {
    const int64_t rows = 16, ncols = 512;
    float *wf = rand_vec(rows * ncols, 1.0f), *x = rand_vec(ncols, 1.0f);
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        const enum moetax_type t = k_types[ti];
        const size_t rb = moetax_row_size(t, ncols);
        uint8_t *w = malloc(rb * rows);
        for (int64_t r = 0; r < rows; r++) moetax_from_float(t, wf + r * ncols, w + r * rb, ncols);
        moetax_kernels_repack(k, t, w, w, rows, ncols); /* in place: the layout k reads */
        void *xq = malloc(moetax_act_size(t, ncols, 1));
        float y[16];
        k->quantize_act(t, x, ncols, ncols, 1, xq);
        k->matmul(t, w, rb, 0, rows, ncols, xq, 1, y, rows);
        /* relative to sum |w x|; k-quants measured on this data: q4_k ~0.04, q5_k ~0.02, q6_k ~0.01 at worst */
        const double tol = t == MOETAX_TYPE_Q2_K                           ? 0.5
                           : t == MOETAX_TYPE_Q3_K                         ? 0.3
                           : t == MOETAX_TYPE_Q4_0 || t == MOETAX_TYPE_Q4_K || t == MOETAX_TYPE_Q4_1 ? 0.15
                           : t == MOETAX_TYPE_Q5_0 || t == MOETAX_TYPE_Q5_1 ? 0.06
                           : t == MOETAX_TYPE_IQ4_NL                      ? 0.1
                           : t == MOETAX_TYPE_Q5_K                       ? 0.06
                           : t == MOETAX_TYPE_Q6_K                       ? 0.03
                           : t == MOETAX_TYPE_F32                        ? 1e-5
                                                                         : 0.02;
        for (int64_t r = 0; r < rows; r++) {
            double dot = 0, mag = 0;
            for (int64_t c = 0; c < ncols; c++) {
                dot += (double)wf[r * ncols + c] * x[c];
                mag += fabs((double)wf[r * ncols + c] * x[c]);
            }
            CHECK_MSG(fabs(y[r] - dot) <= tol * mag, "%s: %g vs %g", moetax_type_name(t), y[r], dot);
        }
        free(w), free(xq);
    }
    free(wf), free(x);
}

/* ---- vector ops ---- */

static double max_rel(const float *a, const float *b, int64_t n, double floor_) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]) / fmax(floor_, fabs((double)b[i])));
    return m;
}

static void test_vec_ops(void) {
    const struct moetax_kernels *ref = moetax_kernels_ref(), *avx = g_simd;
    static const int64_t sizes[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1023, 4096};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int64_t n = sizes[si];
        float *x = rand_vec(n, 3.0f), *w = rand_vec(n, 1.0f), *u = rand_vec(n, 1.0f);
        float *a = malloc(sizeof(float) * (size_t)(n + 1)), *b = malloc(sizeof(float) * (size_t)(n + 1));

        /* rmsnorm vs double formula */
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
        ref->rmsnorm(a, x, w, n, 1e-6f);
        for (int64_t i = 0; i < n; i++) {
            const double want = x[i] / sqrt(ss / n + 1e-6) * w[i];
            CHECK(fabs(a[i] - want) <= 1e-5 * (1 + fabs(want)));
        }
        if (avx) {
            avx->rmsnorm(b, x, w, n, 1e-6f);
            CHECK_MSG(max_rel(b, a, n, 1e-3) < 1e-5, "rmsnorm n=%lld", (long long)n);
            memcpy(b, x, sizeof(float) * (size_t)n);
            avx->rmsnorm(b, b, NULL, n, 1e-6f); /* in place, no weight */
            ref->rmsnorm(a, x, NULL, n, 1e-6f);
            CHECK(max_rel(b, a, n, 1e-3) < 1e-5);
        }

        if (n > 0) {
            /* softmax sums to 1, matches exp formula */
            /* the max and the divisor it reports (ms): the max exactly, the sum within float
             * rounding of exp's; the values the same bits with ms as without */
            memcpy(a, x, sizeof(float) * (size_t)n);
            ref->softmax(a, n, NULL);
            double sum = 0, max = -INFINITY;
            for (int64_t i = 0; i < n; i++) max = fmax(max, x[i]);
            double z = 0;
            for (int64_t i = 0; i < n; i++) z += exp(x[i] - max);
            for (int64_t i = 0; i < n; i++) {
                sum += a[i];
                CHECK(fabs(a[i] - exp(x[i] - max) / z) <= 1e-6 * (1 + exp(x[i] - max) / z));
            }
            CHECK(fabs(sum - 1.0) < 1e-5);
            const struct moetax_kernels *tabs[2] = {ref, avx};
            for (int ti = 0; ti < 2; ti++) {
                if (!tabs[ti]) continue;
                float ms[2] = {NAN, NAN};
                memcpy(b, x, sizeof(float) * (size_t)n);
                tabs[ti]->softmax(b, n, ms);
                float *plain = malloc(sizeof(float) * (size_t)n);
                memcpy(plain, x, sizeof(float) * (size_t)n);
                tabs[ti]->softmax(plain, n, NULL);
                CHECK_MSG(!memcmp(b, plain, sizeof(float) * (size_t)n), "%s softmax n=%lld: ms changed the values",
                          tabs[ti]->name, (long long)n);
                free(plain);
                CHECK_MSG(ms[0] == (float)max && fabs(ms[1] - z) <= 1e-5 * z, "%s softmax n=%lld: ms %g %g, want %g %g",
                          tabs[ti]->name, (long long)n, ms[0], ms[1], max, z);
            }
            if (avx) {
                memcpy(b, x, sizeof(float) * (size_t)n);
                avx->softmax(b, n, NULL);
                sum = 0;
                for (int64_t i = 0; i < n; i++) sum += b[i];
                CHECK(fabs(sum - 1.0) < 1e-5);
                /* the divisor is a float sum of n terms in 8 lane chains: its rounding grows with n */
                const double tol = 2e-6 * (n > 1024 ? (double)n / 1024 : 1.0);
                CHECK_MSG(max_rel(b, a, n, 1e-30) < tol, "softmax n=%lld: %g (bound %g)", (long long)n,
                          max_rel(b, a, n, 1e-30), tol);
            }
        }

        /* sigmoid, silu_mul */
        memcpy(a, x, sizeof(float) * (size_t)n);
        ref->sigmoid(a, n);
        for (int64_t i = 0; i < n; i++) CHECK(fabs(a[i] - 1.0 / (1.0 + exp(-(double)x[i]))) < 1e-6);
        if (avx) {
            memcpy(b, x, sizeof(float) * (size_t)n);
            avx->sigmoid(b, n);
            CHECK_MSG(max_rel(b, a, n, 1e-3) < 2e-6, "sigmoid n=%lld", (long long)n);
        }
        ref->silu_mul(a, x, u, n);
        for (int64_t i = 0; i < n; i++) {
            const double want = x[i] / (1.0 + exp(-(double)x[i])) * u[i];
            CHECK(fabs(a[i] - want) <= 1e-5 * (1 + fabs(want)));
        }
        if (avx) {
            memcpy(b, x, sizeof(float) * (size_t)n);
            avx->silu_mul(b, b, u, n); /* out == g */
            CHECK_MSG(max_rel(b, a, n, 1e-3) < 3e-6, "silu_mul n=%lld", (long long)n);
        }

        /* dot, axpy, scale */
        double d = 0;
        for (int64_t i = 0; i < n; i++) d += (double)x[i] * w[i];
        CHECK(fabs(ref->dot(x, w, n) - d) <= 1e-6 * (1 + fabs(d)));
        if (avx) CHECK(fabs(avx->dot(x, w, n) - d) <= 1e-5 * (1 + sqrt((double)n)));
        memcpy(a, u, sizeof(float) * (size_t)n);
        memcpy(b, u, sizeof(float) * (size_t)n);
        ref->axpy(a, 0.37f, x, n);
        if (avx) {
            avx->axpy(b, 0.37f, x, n);
            CHECK(max_rel(b, a, n, 1.0) < 2e-6);
            ref->scale(a, -1.5f, n);
            avx->scale(b, -1.5f, n);
            CHECK(max_rel(b, a, n, 1.0) < 2e-6);
        }

        /* row conversions: bit exact for finite inputs */
        if (avx) {
            uint16_t *h1 = malloc(2 * (size_t)(n + 1)), *h2 = malloc(2 * (size_t)(n + 1));
            float *xs = rand_vec(n, 1.0f);
            for (int64_t i = 0; i < n; i++) {
                const int kind = (int)(i % 5);
                if (kind == 1) xs[i] *= 1e-6f;       /* fp16 subnormal */
                if (kind == 2) xs[i] *= 70000.0f;    /* fp16 overflow */
                if (kind == 3) xs[i] = ldexpf(1.0f + (float)(i % 3) * 0x1p-11f, -3); /* ties */
            }
            ref->fp32_to_fp16(xs, h1, n);
            avx->fp32_to_fp16(xs, h2, n);
            CHECK(n == 0 || memcmp(h1, h2, 2 * (size_t)n) == 0);
            ref->fp16_to_fp32(h1, a, n);
            avx->fp16_to_fp32(h1, b, n);
            CHECK(n == 0 || memcmp(a, b, 4 * (size_t)n) == 0);
            ref->fp32_to_bf16(xs, h1, n);
            avx->fp32_to_bf16(xs, h2, n);
            CHECK(n == 0 || memcmp(h1, h2, 2 * (size_t)n) == 0);
            ref->bf16_to_fp32(h1, a, n);
            avx->bf16_to_fp32(h1, b, n);
            CHECK(n == 0 || memcmp(a, b, 4 * (size_t)n) == 0);
            /* Q8_0 blocks (KV cache cells): each table's values are moetax_to_float's */
            const int64_t n32 = n / 32 * 32;
            if (n32) {
                moetax_block_q8_0 *qb = malloc(sizeof *qb * (size_t)(n32 / 32));
                float *c = malloc(sizeof(float) * (size_t)n32);
                moetax_quantize_row_q8_0_ref(xs, qb, n32);
                CHECK(moetax_to_float(MOETAX_TYPE_Q8_0, qb, c, n32));
                ref->q8_0_to_fp32(qb, a, n32);
                avx->q8_0_to_fp32(qb, b, n32);
                CHECK(memcmp(a, c, 4 * (size_t)n32) == 0);
                CHECK(memcmp(b, c, 4 * (size_t)n32) == 0);
                free(qb), free(c);
            }
            free(h1), free(h2), free(xs);
        }
        free(x), free(w), free(u), free(a), free(b);
    }
    /* softmax with -inf entries (masked attention) and extremes */
    float v[11] = {-INFINITY, 0.0f, 100.0f, -100.0f, 88.0f, -INFINITY, 1.0f, 2.0f, 3.0f, -1e30f, 50.0f};
    float va[11], vb[11];
    memcpy(va, v, sizeof v);
    ref->softmax(va, 11, NULL);
    CHECK(va[0] == 0.0f && va[5] == 0.0f);
    if (avx) {
        memcpy(vb, v, sizeof v);
        avx->softmax(vb, 11, NULL);
        CHECK(vb[0] == 0.0f && vb[5] == 0.0f);
        CHECK(max_rel(vb, va, 11, 1e-20) < 2e-6);
        float g[3] = {-200.0f, 200.0f, 0.0f}, one[3] = {1, 1, 1};
        avx->silu_mul(g, g, one, 3);
        CHECK(fabsf(g[0]) < 1e-30f && g[1] == 200.0f && g[2] == 0.0f);
    }
}

static void test_scatter_add(void) {
    const struct moetax_kernels *ref = moetax_kernels_ref(), *avx = g_simd;
    const int64_t n = 37, n_rows = 6, ld_src = 40, ld_dst = 41, n_dst = 4;
    float *src = rand_vec(n_rows * ld_src, 1.0f), *d1 = rand_vec(n_dst * ld_dst, 1.0f);
    float *d2 = malloc(sizeof(float) * (size_t)(n_dst * ld_dst)), *d0 = malloc(sizeof(float) * (size_t)(n_dst * ld_dst));
    memcpy(d2, d1, sizeof(float) * (size_t)(n_dst * ld_dst));
    memcpy(d0, d1, sizeof(float) * (size_t)(n_dst * ld_dst));
    const int32_t rows[6] = {3, 0, 3, 1, 2, 0};
    const float wts[6] = {0.5f, 0.25f, -1.0f, 2.0f, 0.125f, 1.0f};
    ref->scatter_add(d1, ld_dst, src, ld_src, rows, wts, n_rows, n);
    for (int64_t r = 0; r < n_dst; r++)
        for (int64_t j = 0; j < ld_dst; j++) {
            double want = d0[r * ld_dst + j];
            if (j < n)
                for (int i = 0; i < n_rows; i++)
                    if (rows[i] == r) want += (double)wts[i] * src[i * ld_src + j];
            CHECK(fabs(d1[r * ld_dst + j] - want) < 1e-5);
        }
    if (avx) {
        avx->scatter_add(d2, ld_dst, src, ld_src, rows, wts, n_rows, n);
        CHECK(max_rel(d2, d1, n_dst * ld_dst, 1e-3) < 1e-6);
        ref->scatter_add(d1, ld_dst, src, ld_src, NULL, wts, 4, n);
        avx->scatter_add(d2, ld_dst, src, ld_src, NULL, wts, 4, n);
        CHECK(max_rel(d2, d1, n_dst * ld_dst, 1e-3) < 1e-6);
    }
    free(src), free(d0), free(d1), free(d2);
}

static void check_topk(const struct moetax_kernels *k, const float *x, int64_t n, int64_t kk, const int32_t *want) {
    int32_t idx[16];
    float val[16];
    k->topk(x, n, kk, idx, val);
    for (int64_t i = 0; i < kk; i++) {
        CHECK_MSG(idx[i] == want[i], "%s topk n=%lld k=%lld: idx[%lld] = %d, want %d", k->name, (long long)n,
                  (long long)kk, (long long)i, idx[i], want[i]);
        CHECK(val[i] == x[want[i]] || (isnan(val[i]) && isnan(x[want[i]])));
    }
}

/* wsum: every table bit-identical to the chain of axpys it replaces in attention
 * (o = 0; o += p_j v_j for j in order), and close to the double-precision sum;
 * head counts and widths not multiples of the tiles, zero rows, strided p/v/out;
 * and the same chain when the rows come in two calls, the second with acc (the
 * KV cache's blocks), split at every kind of point (0, inside a tile chunk, np). */
static void test_wsum(void) {
    const struct moetax_kernels *tabs[3] = {moetax_kernels_ref(), moetax_kernels_avx2(), moetax_kernels_avx512()};
    static const int64_t nhs[] = {1, 3, 4, 5, 8, 16};
    static const int64_t nps[] = {0, 1, 2, 7, 64, 129};
    static const int64_t ns[] = {1, 7, 8, 15, 16, 17, 40, 256};
    int bad = 0;
    for (size_t a = 0; a < sizeof nhs / sizeof nhs[0]; a++)
        for (size_t b = 0; b < sizeof nps / sizeof nps[0]; b++)
            for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
                const int64_t nh = nhs[a], np = nps[b], n = ns[c];
                const int64_t ld_p = np + 3, ld_v = n + 5, ld_out = n + 2;
                float *p = rand_vec(nh * ld_p, 0.3f), *v = rand_vec((np > 0 ? np : 1) * ld_v, 1.0f);
                float *want = malloc(sizeof(float) * (size_t)(nh * ld_out));
                float *got = malloc(sizeof(float) * (size_t)(nh * ld_out));
                for (int64_t h = 0; h < nh; h++) {
                    float *o = want + h * ld_out;
                    memset(o, 0, sizeof(float) * (size_t)n);
                    for (int64_t j = 0; j < np; j++)
                        for (int64_t k = 0; k < n; k++) o[k] = fmaf(p[h * ld_p + j], v[j * ld_v + k], o[k]);
                    for (int64_t k = 0; k < n; k++) { /* and the chain is close to the exact sum */
                        double e = 0, mag = 0;
                        for (int64_t j = 0; j < np; j++) {
                            e += (double)p[h * ld_p + j] * v[j * ld_v + k];
                            mag += fabs((double)p[h * ld_p + j] * v[j * ld_v + k]);
                        }
                        if (fabs(o[k] - e) > 1e-6 * (mag + 1e-30) * (double)(np + 1)) bad++;
                    }
                }
                for (int ti = 0; ti < 3; ti++) {
                    if (!tabs[ti]) continue;
                    for (int split = 0; split < 4; split++) {
                        const int64_t cut = split == 0 ? np : split == 1 ? 0 : split == 2 ? np / 3 : (np > 0 ? np - 1 : 0);
                        for (int64_t i = 0; i < nh * ld_out; i++) got[i] = -777.0f;
                        tabs[ti]->wsum(got, ld_out, p, ld_p, nh, v, ld_v, cut, n, false);
                        if (split) tabs[ti]->wsum(got, ld_out, p + cut, ld_p, nh, v + cut * ld_v, ld_v, np - cut, n, true);
                        for (int64_t h = 0; h < nh; h++)
                            for (int64_t k = 0; k < ld_out; k++) {
                                const float g = got[h * ld_out + k];
                                const bool ok = k < n ? memcmp(&g, &want[h * ld_out + k], sizeof g) == 0 : g == -777.0f;
                                if (!ok && bad++ < 5)
                                    fprintf(stderr, "wsum %s nh=%lld np=%lld n=%lld h=%lld c=%lld: %.9g vs %.9g\n",
                                            tabs[ti]->name, (long long)nh, (long long)np, (long long)n, (long long)h,
                                            (long long)k, g, want[h * ld_out + k]);
                            }
                    }
                }
                free(p), free(v), free(want), free(got);
            }
    CHECK_MSG(bad == 0, "wsum: %d bad", bad);
}

static void test_topk(void) {
    const struct moetax_kernels *tabs[3] = {moetax_kernels_ref(), moetax_kernels_avx2(), moetax_kernels_avx512()};
    for (int ti = 0; ti < 3; ti++) {
        const struct moetax_kernels *k = tabs[ti];
        if (!k) continue;
        const float a[8] = {1, 3, 3, 2, 3, -1, 2, 0};
        check_topk(k, a, 8, 4, (const int32_t[]){1, 2, 4, 3});
        check_topk(k, a, 8, 1, (const int32_t[]){1});
        check_topk(k, a, 8, 8, (const int32_t[]){1, 2, 4, 3, 6, 0, 7, 5});
        check_topk(k, a, 8, 0, (const int32_t[]){0});
        const float same[5] = {7, 7, 7, 7, 7};
        check_topk(k, same, 5, 3, (const int32_t[]){0, 1, 2});
        const float nan_[5] = {NAN, -INFINITY, 1, NAN, 0};
        check_topk(k, nan_, 5, 5, (const int32_t[]){2, 4, 1, 0, 3});
        const float neg0[3] = {-0.0f, 0.0f, -1.0f}; /* -0 == +0: a tie, lower index first */
        check_topk(k, neg0, 3, 2, (const int32_t[]){0, 1});
        /* random: against a full stable sort */
        for (int rep = 0; rep < 50; rep++) {
            const int64_t n = 1 + (int64_t)(tu_rand_u64(&g_rng) % 300);
            const int64_t kk = (int64_t)(tu_rand_u64(&g_rng) % (uint64_t)(n < 16 ? n + 1 : 17));
            float *x = malloc(sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < n; i++) x[i] = (float)(tu_rand_u64(&g_rng) % 20); /* many ties */
            int32_t want[16];
            bool *used = calloc((size_t)n, 1);
            for (int64_t j = 0; j < kk; j++) {
                int64_t best = -1;
                for (int64_t i = 0; i < n; i++)
                    if (!used[i] && (best < 0 || x[i] > x[best])) best = i;
                used[best] = true;
                want[j] = (int32_t)best;
            }
            check_topk(k, x, n, kk, want);
            free(x), free(used);
        }
    }
}

/* RoPE against a direct double-precision formula. */
static void rope_expected(const float *x, double *out, int head_dim, int64_t pos, const struct moetax_rope_params *p) {
    const int nd = p->n_dims;
    double lo = 0, hi = 0, mscale = p->attn_factor;
    if (p->ext_factor != 0.0f) {
        const double cd_fast = nd * log(p->n_ctx_orig / (p->beta_fast * 2 * M_PI)) / (2 * log(p->freq_base));
        const double cd_slow = nd * log(p->n_ctx_orig / (p->beta_slow * 2 * M_PI)) / (2 * log(p->freq_base));
        lo = fmax(0, floor(cd_fast));
        hi = fmin(nd - 1, ceil(cd_slow));
        mscale *= 1 + 0.1 * log(1.0 / p->freq_scale);
    }
    for (int i = 0; i < head_dim; i++) out[i] = x[i];
    for (int i = 0; i < nd / 2; i++) {
        double te = (double)pos * pow(p->freq_base, -2.0 * i / nd);
        if (p->freq_factors) te /= p->freq_factors[i];
        double theta = p->freq_scale * te;
        if (p->ext_factor != 0.0f) {
            const double y = (i - lo) / fmax(0.001, hi - lo);
            const double mix = (1 - fmin(1, fmax(0, y))) * p->ext_factor;
            theta = theta * (1 - mix) + te * mix;
        }
        const int a = p->mode == MOETAX_ROPE_MODE_NEOX ? i : 2 * i;
        const int b = p->mode == MOETAX_ROPE_MODE_NEOX ? i + nd / 2 : 2 * i + 1;
        out[a] = (x[a] * cos(theta) - x[b] * sin(theta)) * mscale;
        out[b] = (x[a] * sin(theta) + x[b] * cos(theta)) * mscale;
    }
}

static void test_rope(void) {
    const struct moetax_kernels *k = moetax_kernels_get();
    const int head_dim = 72, n_head = 3, stride = 80;
    float ff[32];
    for (int i = 0; i < 32; i++) ff[i] = 1.0f + 0.1f * (float)i;
    for (int mode = 0; mode < 2; mode++)
        for (int yarn = 0; yarn < 3; yarn++) {
            struct moetax_rope_params p = {
                .n_dims = 64,
                .mode = mode ? MOETAX_ROPE_MODE_NEOX : MOETAX_ROPE_MODE_NORM,
                .n_ctx_orig = 4096,
                .freq_base = 10000.0f,
                .freq_scale = yarn ? 0.25f : 1.0f,
                .ext_factor = yarn ? 1.0f : 0.0f,
                .attn_factor = yarn ? 1.1f : 1.0f,
                .beta_fast = 32.0f,
                .beta_slow = 1.0f,
                .freq_factors = yarn == 2 ? ff : NULL,
            };
            const int64_t positions[] = {0, 1, 7, 123, 3000};
            for (int pi = 0; pi < 5; pi++) {
                const int64_t pos = positions[pi];
                float *x = rand_vec(n_head * stride, 1.0f), *x0 = malloc(sizeof(float) * n_head * stride);
                memcpy(x0, x, sizeof(float) * n_head * stride);
                k->rope(x, n_head, stride, pos, &p);
                double want[72];
                double maxerr = 0;
                for (int h = 0; h < n_head; h++) {
                    rope_expected(x0 + h * stride, want, head_dim, pos, &p);
                    for (int i = 0; i < head_dim; i++) maxerr = fmax(maxerr, fabs(x[h * stride + i] - want[i]));
                    for (int i = head_dim; i < stride; i++) CHECK(x[h * stride + i] == x0[h * stride + i]);
                }
                /* float theta: error grows with |theta| ~ pos */
                CHECK_MSG(maxerr < 2e-6 * (4 + (double)pos), "rope mode=%d yarn=%d pos=%lld: err %g", mode, yarn,
                          (long long)pos, maxerr);
                /* rope_cached matches rope */
                float cs[64];
                moetax_rope_cache(&p, pos, cs);
                float *x2 = malloc(sizeof(float) * n_head * stride);
                memcpy(x2, x0, sizeof(float) * n_head * stride);
                k->rope_cached(x2, n_head, stride, p.n_dims, p.mode, cs);
                CHECK(memcmp(x2, x, sizeof(float) * n_head * stride) == 0);
                free(x), free(x0), free(x2);
            }
        }
    /* corr dims, deepseek-v2-lite-like numbers */
    float dims[2];
    moetax_rope_corr_dims(64, 4096, 10000.0f, 32.0f, 1.0f, dims);
    CHECK(dims[0] == 10.0f && dims[1] == 23.0f);
}

/* The avx512 table's results are bit-identical to the avx2 table's (Q8_0 / Q4_0: the same exact
 * block sums and float chain; F32 / F16 / BF16: the same per-lane chains, kernels.h): decode, small batches 2-16 (tiles of up to 8,
 * 512-bit pairs of groups and a lone 256-bit group), prefill-sized batches (panels, column chunks past 512 blocks), plain tails,
 * row sub-ranges. Each table reads its own repacked layout. */
static void test_matmul_avx512_vs_avx2(void) {
    const struct moetax_kernels *a2 = moetax_kernels_avx2(), *a5 = moetax_kernels_avx512();
    if (!a2 || !a5) return;
    static const int64_t rows_l[] = {8, 13, 16, 24, 40, 64, 75, 136, 200};
    static const int64_t cols_l[] = {32, 96, 256, 1024, 32 * 515};
    static const int64_t bs_l[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33};
    static const int64_t cols_f[] = {1, 7, 8, 13, 100, 1031, 2047 + 1024}; /* F: tails, one and two chunks */
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        const enum moetax_type t = k_types[ti];
        const bool kq = is_kq(t), q = is_q32(t);
        static const int64_t cols_k[] = {256, 512, 768, 2048, 256 * 33};
        for (size_t ri = 0; ri < sizeof rows_l / sizeof rows_l[0]; ri++)
            for (size_t ci = 0; ci < sizeof cols_l / sizeof cols_l[0]; ci++) {
                const int64_t rows = rows_l[ri], ncols = kq ? cols_k[ci] : q ? cols_l[ci] : cols_f[ci + (rows & 1) * 2];
                if (ncols > 4096 && rows > 24) continue; /* keep it quick */
                size_t rb;
                uint8_t *w = rand_matrix(t, rows, ncols, &rb), *w2 = malloc(rb * rows), *w5 = malloc(rb * rows);
                CHECK(moetax_kernels_repack(a2, t, w2, w, rows, ncols) == MOETAX_OK);
                CHECK(moetax_kernels_repack(a5, t, w5, w, rows, ncols) == MOETAX_OK);
                const int64_t bmax = 33, ldy = rows + 3;
                float *x = rand_vec(ncols * bmax, 1.0f);
                const size_t ar = moetax_act_size(t, ncols, 1);
                uint8_t *xq = malloc(ar * bmax);
                a2->quantize_act(t, x, ncols, ncols, bmax, xq);
                float *y2 = malloc(sizeof(float) * (size_t)(ldy * bmax)), *y5 = malloc(sizeof(float) * (size_t)(ldy * bmax));
                for (size_t bi = 0; bi < sizeof bs_l / sizeof bs_l[0]; bi++) {
                    const int64_t n = bs_l[bi];
                    if (ncols > 4096 && n > 9) continue;
                    /* the whole range; rows [8, end); rows [8, the last whole group) (no plain tail;
                     * an odd or even number of groups, so 512-bit pairs of groups and a lone group) */
                    for (int sub = 0; sub < 3; sub++) {
                        const int64_t r0 = sub ? 8 : 0, r1 = sub == 2 ? rows / 8 * 8 : rows;
                        if (r0 >= r1 || (sub == 2 && r1 == rows)) continue;
                        for (int64_t i = 0; i < ldy * n; i++) y2[i] = y5[i] = -777.0f;
                        a2->matmul(t, w2, rb, r0, r1, ncols, xq, n, y2, ldy);
                        a5->matmul(t, w5, rb, r0, r1, ncols, xq, n, y5, ldy);
                        CHECK_MSG(memcmp(y2, y5, sizeof(float) * (size_t)(ldy * n)) == 0,
                                  "avx512 vs avx2 %s rows [%lld, %lld) ncols=%lld batch=%lld: not bit-identical",
                                  moetax_type_name(t), (long long)r0, (long long)r1, (long long)ncols, (long long)n);
                    }
                }
                free(w), free(w2), free(w5), free(x), free(xq), free(y2), free(y5);
            }
    }
}

static void test_dispatch(void) {
    const struct moetax_kernels *k = moetax_kernels_get();
    CHECK(k != NULL && moetax_kernels_ref() != NULL);
    CHECK(strcmp(moetax_kernels_ref()->name, "ref") == 0);
    if (moetax_kernels_avx512()) CHECK(moetax_kernels_avx2() && strcmp(moetax_kernels_avx512()->name, "avx512") == 0);
    const char *force = getenv("MOETAX_FORCE_REF"), *want = getenv("MOETAX_KERNELS");
    const struct moetax_kernels *best = moetax_kernels_avx512() ? moetax_kernels_avx512()
                                        : moetax_kernels_avx2() ? moetax_kernels_avx2()
                                                                : moetax_kernels_ref();
    if (force && force[0] && strcmp(force, "0") != 0) CHECK(k == moetax_kernels_ref());
    else if (want && strcmp(want, "ref") == 0) CHECK(k == moetax_kernels_ref());
    else if (want && strcmp(want, "avx2") == 0 && moetax_kernels_avx2()) CHECK(k == moetax_kernels_avx2());
    else if (want && strcmp(want, "avx512") == 0 && moetax_kernels_avx512()) CHECK(k == moetax_kernels_avx512());
    else CHECK(k == best); /* no choice, or one this CPU cannot run: the best table */
    if (!moetax_kernels_avx2()) printf("test_kernels: CPU lacks avx2/fma/f16c: AVX2 and AVX-512 comparisons skipped\n");
    else if (!moetax_kernels_avx512())
        printf("test_kernels: CPU (or OS) lacks AVX-512 F/BW/VL/DQ + VNNI: AVX-512 comparisons skipped\n");
    printf("test_kernels: moetax_kernels_get() is '%s'\n", k->name);
    /* streamed (matmul_stream) means larger than the last-level cache */
    const uint64_t llc = moetax_cpu_llc_bytes();
    CHECK(llc >= 1024 && moetax_cpu_llc_bytes() == llc);
    if (!getenv("MOETAX_STREAM")) /* the override (kernels.h) would answer instead */
        CHECK(!moetax_kernels_streamed(llc) && moetax_kernels_streamed(llc + 1) && !moetax_kernels_streamed(0));
}

/* The SIMD kernel files are built with -falign-functions=64 (CMakeLists.txt): without it a kernel's speed
 * from memory moved whenever other code changed size. Their table's entry points start on 64-byte lines. */
static void test_code_alignment(const struct moetax_kernels *k) {
    const uintptr_t a = (uintptr_t)k->matmul;
    CHECK_MSG(a % 64 == 0, "table '%s': its matmul starts at %#lx, not on a 64-byte line (-falign-functions=64 missing?)",
              k->name, (unsigned long)a);
}

/* The Q8_0 quantizers' quants of non-finite and tiny blocks (a NaN, an infinity, a maximum so small that
 * 1/d overflows: what a KV cache row of a diverged model or a crafted file's weights hold) are defined
 * (moetax_q8_round), not the C conversion's undefined behaviour (UBSan in the sanitizer stage). */
static void test_q8_round_special(void) {
    CHECK(moetax_q8_round(NAN) == 0 && moetax_q8_round(INFINITY) == 127 && moetax_q8_round(-INFINITY) == -128);
    CHECK(moetax_q8_round(3.4f) == 3 && moetax_q8_round(-0.5f) == -1 && moetax_q8_round(126.5f) == 127 &&
          moetax_q8_round(-127.0f) == -127 && moetax_q8_round(1e30f) == 127);
    float x[4 * 32];
    for (int j = 0; j < 4 * 32; j++) x[j] = (float)(j % 7) - 3.0f;
    x[5] = NAN;              /* block 0: a NaN among finite values */
    x[32 + 9] = -INFINITY;   /* block 1: an infinity (its scale infinite, the rest 0 * inf) */
    for (int j = 64; j < 96; j++) x[j] = j == 70 ? 1e-40f : 0.0f; /* block 2: 1/d overflows */
    moetax_block_q8_0 y[4];
    moetax_quantize_row_q8_0_ref(x, y, 4 * 32);
    /* block 1: d infinite, 1/d 0, so every value times it 0 or (the infinity) NaN */
    CHECK(y[0].qs[5] == 0 && y[1].qs[9] == 0 && y[1].qs[0] == 0 && y[2].qs[6] == 127 && y[2].qs[0] == 0);
    for (int i = 0; i < 32; i++) { /* block 3, finite, as ever: -3, 0, 3 at -127, 0, 127 */
        const float v = x[96 + i];
        if (v == 3.0f || v == -3.0f || v == 0.0f) CHECK(y[3].qs[i] == (int8_t)(v * 127.0f / 3.0f));
    }
    uint8_t a[4 * 36];
    moetax_kernels_ref()->quantize_act(MOETAX_TYPE_Q8_0, x, 4 * 32, 4 * 32, 1, a); /* no UB (UBSan) */
    CHECK(((int8_t *)a)[5] == 0 && ((int8_t *)a)[64 + 6] == 127);
    /* every table's quantize_act gives the reference's bytes for such blocks too (kernels.h: identical bytes
     * in every table), one block at a time and eight at a time, wherever the special block sits: rows of
     * 1, 3, 8 and 11 blocks (the SIMD tables quantize 8 blocks at a time across rows, the rest one by one) */
    const struct moetax_kernels *tabs[2] = {moetax_kernels_avx2(), moetax_kernels_avx512()};
    enum { NB = 24 };
    float z[NB * 32];
    uint8_t ra[NB * 36], sa[NB * 36];
    const float special[5] = {NAN, INFINITY, -INFINITY, 1e-40f, 3e38f};
    for (int t = 0; t < 2; t++) {
        if (!tabs[t]) continue;
        int bad = 0;
        for (int sp = 0; sp < 5; sp++)
            for (int at = 0; at < NB; at += 5)
                for (int nbr = 1; nbr <= 11; nbr += nbr < 3 ? 2 : nbr < 8 ? 5 : 3) {
                    const int rows = NB / nbr;
                    for (int j = 0; j < NB * 32; j++) z[j] = (float)((j * 37) % 19) - 9.0f;
                    if (sp == 3) /* a block of zeros and one tiny value: 1 / d overflows */
                        for (int j = 0; j < 32; j++) z[at * 32 + j] = j == 7 ? special[sp] : 0.0f;
                    else z[at * 32 + 11] = special[sp];
                    memset(ra, 0x5a, sizeof ra), memset(sa, 0xa5, sizeof sa);
                    moetax_kernels_ref()->quantize_act(MOETAX_TYPE_Q8_0, z, nbr * 32, nbr * 32, rows, ra);
                    tabs[t]->quantize_act(MOETAX_TYPE_Q8_0, z, nbr * 32, nbr * 32, rows, sa);
                    bad += memcmp(ra, sa, (size_t)rows * moetax_act_size(MOETAX_TYPE_Q8_0, nbr * 32, 1)) != 0;
                }
        CHECK(bad == 0);
        if (bad) printf("  table '%s': %d Q8_0 activation rows with a NaN, an infinity or a tiny scale differ from "
                        "the reference's\n", tabs[t]->name, bad);
    }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    test_dispatch();
    test_q8_round_special();
    const struct moetax_kernels *simd[2] = {moetax_kernels_avx2(), moetax_kernels_avx512()};
    for (int i = 0; i < 2; i++) {
        if (!(g_simd = simd[i])) continue;
        printf("test_kernels: table '%s'%s%s against the reference\n", g_simd->name, *moetax_kernels_extras(g_simd) ? " with " : "", moetax_kernels_extras(g_simd));
        test_code_alignment(g_simd);
        test_repack();
        test_quantize_q8k();
        test_quantize_q8_rows();
        test_matmul();
        test_vec_ops();
        test_scatter_add();
    }
    g_simd = NULL;
    test_repack(); /* the reference alone */
    const struct moetax_kernels *all[3] = {moetax_kernels_ref(), simd[0], simd[1]};
    for (int i = 0; i < 3; i++)
        if (all[i]) {
            test_matmul_batch_invariance(all[i]);
            test_matmul_vs_f32(all[i]);
        }
    test_matmul_avx512_vs_avx2();
    /* the avx512 table's Q3_K/Q5_K/Q6_K tiles exist with and without GFNI: the run above took the
     * CPU's, the one below the other (without GFNI, where the CPU has it) */
    if (simd[1] && moetax_k_avx512_gfni) {
        moetax_k_avx512_gfni = false;
        printf("test_kernels: table 'avx512' without GFNI against the reference and avx2\n");
        g_simd = simd[1];
        test_matmul();
        g_simd = NULL;
        test_matmul_batch_invariance(simd[1]);
        test_matmul_avx512_vs_avx2();
        moetax_k_avx512_gfni = true;
    } else if (simd[1])
        printf("test_kernels: this CPU lacks GFNI: the avx512 table's GFNI tiles skipped\n");
    test_wsum();
    test_topk();
    test_rope();
    return tu_finish("test_kernels");
}
