// ctest-labels: unit
// ctest-cost: 3
/* test_attend.c - chunked attention over a paged cache (src/attn/attend.h) against a float64
 * softmax-weighted sum of the same cells, on every kernel table the machine has: positions
 * within one chunk, just past it and over several (the merge of chunks), chunks that begin
 * inside a cache block (a block size that does not divide the chunk), a sequence's blocks in
 * order and interleaved with another's, F32, F16 and Q8_0 cells (Q8_0 rows padded to whole blocks), keys and values at offsets of the row (GQA's layout) or overlapping (MLA's); and a head's bits do not
 * depend on the group of heads it is computed in (two or more: MLA's decode splits the heads into
 * one group per worker, or two, and a batch takes them all), with rows of 576 bytes, where one
 * batch row would take the F32 matmul's decode path and other bits; and a prompt's tile of tokens
 * (attend_tile, some of them seeing part of the last chunk) gives each token the bits of its heads
 * alone. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attend.h"
#include "moetax/kernels.h"
#include "moetax/kvcache.h"
#include "moetax/types.h"
#include "testutil.h"

struct layout {
    int64_t kvr, k_off, k_cols, v_off, v_cols;
};

static void one(const struct moetax_kernels *K, enum moetax_type ct, int32_t bs, const struct layout *ly, int64_t np, int64_t nh,
                uint64_t seed) {
    /* odd seeds: sequence 0's blocks interleaved with sequence 1's (every third block of sequence 0
     * is followed by one of sequence 1), so its blocks do not follow each other in memory */
    const bool split = seed % 2 == 1;
    struct moetax_kvcache_params kp = {.n_cells = (split ? 2 * np : np) + 2 * bs, .block_size = bs, .n_seq_max = 2,
                                       .type = ct};
    const char *cn = moetax_type_name(ct);
    struct moetax_kvcache *kv = NULL;
    if (moetax_kvcache_init(2, ly->kvr, &kp, &kv) != MOETAX_OK) {
        CHECK_MSG(0, "%s", moetax_last_error());
        return;
    }
    tu_rng r = {seed};
    /* sequence 1 holds a few positions first, so sequence 0's blocks are not the first ones */
    int32_t s1 = 1, p1 = 0;
    CHECK(moetax_kvcache_reserve(kv, &s1, &p1, 1) == MOETAX_OK);
    moetax_kvcache_commit(kv, &s1, &p1, 1);
    int32_t *seq = calloc((size_t)np, sizeof(int32_t)), *pos = malloc(sizeof(int32_t) * (size_t)np);
    for (int64_t i = 0; i < np; i++) pos[i] = (int32_t)i;
    for (int64_t i = 0, n1 = 1; i < np;) {
        const int64_t piece = split ? (np - i < 3 * bs ? np - i : 3 * bs) : np;
        CHECK(moetax_kvcache_reserve(kv, seq + i, pos + i, piece) == MOETAX_OK);
        moetax_kvcache_commit(kv, seq + i, pos + i, piece);
        i += piece;
        for (int64_t j = 0; split && i < np && j < bs; j++, n1++) { /* a block of sequence 1 */
            int32_t q1 = 1, pq = (int32_t)n1;
            CHECK(moetax_kvcache_reserve(kv, &q1, &pq, 1) == MOETAX_OK);
            moetax_kvcache_commit(kv, &q1, &pq, 1);
        }
    }
    /* cells of layer 1 (layer 0 left as zeros); the values as stored, in float for the reference */
    double *cell = malloc(sizeof(double) * (size_t)(np * ly->kvr));
    const int64_t kvr32 = attend_cell_row_floats(ly->kvr);
    float *fr = calloc((size_t)kvr32, sizeof(float)), *back = malloc(sizeof(float) * (size_t)kvr32);
    for (int64_t p = 0; p < np; p++) {
        void *row = moetax_kvcache_row(kv, 1, 0, p);
        for (int64_t c = 0; c < ly->kvr; c++) fr[c] = tu_rand_normal(&r) * (c % 7 == 0 ? 3.0f : 1.0f);
        if (ct == MOETAX_TYPE_F32) memcpy(row, fr, sizeof(float) * (size_t)ly->kvr);
        else attend_cell_write(K, ct, fr, ly->kvr, row);
        CHECK(moetax_to_float(ct, row, back, ct == MOETAX_TYPE_Q8_0 ? kvr32 : ly->kvr));
        for (int64_t c = 0; c < ly->kvr; c++) cell[p * ly->kvr + c] = back[c];
    }
    free(fr), free(back);
    float *q = malloc(sizeof(float) * (size_t)(nh * ly->k_cols));
    for (int64_t i = 0; i < nh * ly->k_cols; i++) q[i] = tu_rand_normal(&r);
    const float kq_scale = 1.0f / sqrtf((float)ly->k_cols);

    int32_t nblk;
    const struct attend_src src = {.kv = kv, .layer = 1, .blk = moetax_kvcache_seq_blocks(kv, 0, &nblk), .ct = ct,
                                   .kvr = ly->kvr, .k_off = ly->k_off, .k_cols = ly->k_cols, .v_off = ly->v_off,
                                   .v_cols = ly->v_cols};
    float *buf = malloc(sizeof(float) * (size_t)attend_scratch_floats(nh, ly->v_cols));
    float *vb = malloc(sizeof(float) * (size_t)attend_cells_floats(ly->k_cols, ly->v_cols, 7 * nh)); /* tiles below */
    const struct attend_scratch w = attend_scratch_at(buf, nh, ly->v_cols, ct != MOETAX_TYPE_F32 ? vb : NULL);
    const int64_t ldo = ly->v_cols + 3; /* a stride wider than the row */
    float *o = malloc(sizeof(float) * (size_t)(nh * ldo));
    attend_heads(K, &src, q, nh, np, kq_scale, o, ldo, &w);

    /* float64 reference: one softmax over all positions; with Q8_0 cells the scores' queries as
     * llama.cpp's q8_0 K cache takes them: each query row padded with zeros to whole blocks and
     * quantized to Q8_0 (ggml's quantize_row_q8_0), the products then exact */
    const int64_t k32 = attend_cell_row_floats(ly->k_cols);
    float *qr = calloc((size_t)(nh * k32), sizeof(float));
    for (int64_t h = 0; h < nh; h++) {
        memcpy(qr + h * k32, q + h * ly->k_cols, sizeof(float) * (size_t)ly->k_cols);
        if (ct != MOETAX_TYPE_Q8_0) continue;
        moetax_block_q8_0 qb[64];
        CHECK(k32 / 32 <= 64);
        moetax_quantize_row_q8_0_ref(qr + h * k32, qb, k32);
        CHECK(moetax_to_float(MOETAX_TYPE_Q8_0, qb, qr + h * k32, k32));
    }
    double *s = malloc(sizeof(double) * (size_t)np), worst = 0, mag = 0;
    for (int64_t h = 0; h < nh; h++) {
        double mx = -INFINITY, z = 0;
        for (int64_t j = 0; j < np; j++) {
            double d = 0;
            for (int64_t c = 0; c < ly->k_cols; c++) d += (double)qr[h * k32 + c] * cell[j * ly->kvr + ly->k_off + c];
            s[j] = d * kq_scale;
            mx = fmax(mx, s[j]);
        }
        for (int64_t j = 0; j < np; j++) z += (s[j] = exp(s[j] - mx));
        for (int64_t c = 0; c < ly->v_cols; c++) {
            double want = 0;
            for (int64_t j = 0; j < np; j++) want += s[j] / z * cell[j * ly->kvr + ly->v_off + c];
            worst = fmax(worst, fabs(o[h * ldo + c] - want));
            mag = fmax(mag, fabs(want));
        }
    }
    CHECK_MSG(worst <= 2e-6 + 2e-5 * mag, "%s %s bs %d np %lld nh %lld: max error %.3g (max |o| %.3g)", K->name,
              cn, bs, (long long)np, (long long)nh, worst, mag);

    /* a head's bits do not depend on the group it is computed in (groups of two or more) */
    if (nh >= 4) {
        const int64_t cut = nh / 2 - 1; /* [0, cut) and [cut, nh), each of 2+ heads for nh >= 5 */
        float *o2 = malloc(sizeof(float) * (size_t)(nh * ldo));
        const int64_t lo = cut >= 2 ? cut : 2;
        attend_heads(K, &src, q, lo, np, kq_scale, o2, ldo, &w);
        attend_heads(K, &src, q + lo * ly->k_cols, nh - lo, np, kq_scale, o2 + lo * ldo, ldo, &w);
        bool sg = true;
        for (int64_t h = 0; h < nh; h++) sg &= !memcmp(o2 + h * ldo, o + h * ldo, sizeof(float) * (size_t)ly->v_cols);
        CHECK_MSG(sg, "%s %s bs %d np %lld: heads in groups of %lld and %lld differ from one group of %lld", K->name,
                  cn, bs, (long long)np, (long long)lo, (long long)(nh - lo), (long long)nh);
        free(o2);
    }
    /* a prompt's tile: tokens at the last nt positions (crossing a chunk's end where np is just past
     * one), each token's heads the bits of attend_heads for it alone */
    if (nh >= 2) {
        const int64_t nt = np < 7 ? np : 7;
        int64_t tnp[7];
        float *qt = malloc(sizeof(float) * (size_t)(nt * nh * ly->k_cols));
        for (int64_t i = 0; i < nt * nh * ly->k_cols; i++) qt[i] = tu_rand_normal(&r);
        for (int64_t i = 0; i < nt; i++) tnp[i] = np - nt + 1 + i;
        float *tb = malloc(sizeof(float) * (size_t)attend_tile_floats(nt * nh, ly->v_cols));
        const struct attend_tile_scratch tw = attend_tile_at(tb, nt * nh, ly->v_cols, ct != MOETAX_TYPE_F32 ? vb : NULL);
        const int64_t ldt = nh * ldo + 5; /* a token's stride wider than its heads */
        float *ot = malloc(sizeof(float) * (size_t)(nt * ldt)), *oh = malloc(sizeof(float) * (size_t)(nh * ldo));
        attend_tile(K, &src, qt, nh, tnp, nt, kq_scale, ot, ldt, ldo, &tw);
        bool sg = true;
        for (int64_t i = 0; i < nt; i++) {
            attend_heads(K, &src, qt + i * nh * ly->k_cols, nh, tnp[i], kq_scale, oh, ldo, &w);
            for (int64_t h = 0; h < nh; h++)
                sg &= !memcmp(ot + i * ldt + h * ldo, oh + h * ldo, sizeof(float) * (size_t)ly->v_cols);
        }
        CHECK_MSG(sg, "%s %s bs %d np %lld nh %lld: a tile of %lld tokens differs from each token alone", K->name,
                  cn, bs, (long long)np, (long long)nh, (long long)nt);
        free(qt), free(tb), free(ot), free(oh);
    }
    free(s), free(o), free(vb), free(buf), free(q), free(qr), free(cell), free(seq), free(pos);
    moetax_kvcache_free(kv);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    const struct moetax_kernels *tabs[3] = {moetax_kernels_ref(), moetax_kernels_avx2(), moetax_kernels_avx512()};
    if (!tabs[1]) printf("test_attend: no AVX2 on this CPU: its table is skipped\n");
    if (!tabs[2]) printf("test_attend: no AVX-512 table on this CPU: skipped\n");
    /* MLA: keys the whole row, values its first part (rows of 576 B in F32; 144 values: 4.5 Q8_0
     * blocks, the last padded); GQA: one KV head's keys and values (Q8_0: heads of whole blocks) */
    const struct layout mla = {.kvr = 144, .k_off = 0, .k_cols = 144, .v_off = 0, .v_cols = 128};
    /* values that end inside a Q8_0 block whose rest is keys (33 of a row of 150: 4.7 blocks) */
    const struct layout mla_odd = {.kvr = 150, .k_off = 0, .k_cols = 150, .v_off = 0, .v_cols = 33};
    const struct layout gqa = {.kvr = 4 * 16 + 4 * 24, .k_off = 16, .k_cols = 16, .v_off = 4 * 16 + 2 * 24, .v_cols = 24};
    const struct layout gqa32 = {.kvr = 4 * 32 + 4 * 64, .k_off = 32, .k_cols = 32, .v_off = 4 * 32 + 2 * 64, .v_cols = 64};
    const enum moetax_type cts[] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_Q8_0};
    const int64_t nps[] = {1, 37, ATTEND_CHUNK, ATTEND_CHUNK + 1, 2 * ATTEND_CHUNK + 77, 4 * ATTEND_CHUNK + 5};
    uint64_t seed = 1;
    for (int t = 0; t < 3; t++) {
        if (!tabs[t]) continue;
        for (int c = 0; c < 3; c++) {
            const enum moetax_type ct = cts[c];
            const struct layout *g = ct == MOETAX_TYPE_Q8_0 ? &gqa32 : &gqa;
            for (size_t i = 0; i < sizeof nps / sizeof nps[0]; i++) {
                one(tabs[t], ct, 32, &mla, nps[i], 4, seed++);
                one(tabs[t], ct, 48, g, nps[i], 3, seed++); /* 48 does not divide the chunk */
                one(tabs[t], ct, 32, g, nps[i], 1, seed++);
                one(tabs[t], ct, 32, &mla, nps[i], 11, seed++);
                one(tabs[t], ct, 32, &mla, nps[i], 9, seed++);
                one(tabs[t], ct, 16, &mla_odd, nps[i], 5, seed++);
            }
        }
    }
    return tu_finish("test_attend");
}
