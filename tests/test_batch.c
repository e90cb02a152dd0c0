// ctest-labels: unit;model;threads
// ctest-cost: 20
/* test_batch.c - many sequences in one context: the paged KV cache's memory
 * operations, and batched decoding against each sequence run alone.
 *
 * Exactness: with Q8_0/Q4_0 weights every kernel is batch-invariant (a row's
 * result does not depend on the other rows of its matmul, test_kernels), so a
 * sequence decoded in a batch gets the very bits it gets alone. With F32
 * weights the one-row matmul path (decode of one token) sums in another order
 * than the tiles of several rows, so a sequence's logits in a batch differ
 * from its logits alone by float rounding only: checked within 2e-5 of the
 * largest logit, like prefill against step-by-step decode in test_model. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "moetax/kvcache.h"
#include "moetax/ledger.h"
#include "moetax/model.h"
#include "testutil.h"

enum { NSEQ_MAX = 8, HIST_MAX = 96 };

static enum moetax_type g_kv_type = MOETAX_TYPE_F32; /* the cells of every context below */

static int gen(const char *args, const char *out) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s gen %s -o %s >/dev/null 2>&1", tu_moetax_bin, args, out);
    return tu_run(cmd, NULL);
}

static struct moetax_ctx *ctx(struct moetax_model *m, int n_ctx, int ubatch, int threads) {
    struct moetax_ctx_params p = {.n_ctx = n_ctx, .n_threads = threads, .n_ubatch = ubatch, .n_seq_max = NSEQ_MAX,
                                  .kv_type = g_kv_type};
    struct moetax_ctx *c = NULL;
    moetax_status st = moetax_ctx_init(m, &p, &c);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    return c;
}

/* Logits of the last token of hist[0..n) run alone from position 0 (prefill of the first
 * n-1 tokens, then the last one as a decode step, as a sequence decoded token by token
 * ends). NULL on error. */
static float *alone_in(struct moetax_model *m, const int32_t *hist, int n, int n_ctx, int threads) {
    struct moetax_ctx *c = ctx(m, n_ctx, 64, threads);
    if (!c) return NULL;
    const int64_t V = m->hp.n_vocab;
    float *l = malloc(sizeof(float) * (size_t)V);
    moetax_status st = n > 1 ? moetax_ctx_eval(c, hist, n - 1, NULL, false) : MOETAX_OK;
    if (!st) st = moetax_ctx_eval(c, hist + n - 1, 1, l, false);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    moetax_ctx_free(c);
    if (st) { free(l); return NULL; }
    return l;
}

static float *alone(struct moetax_model *m, const int32_t *hist, int n) { return alone_in(m, hist, n, 128, 2); }

static bool same(const float *a, const float *b, int64_t n, float tol_rel) {
    float mag = 0, diff = 0;
    for (int64_t i = 0; i < n; i++) {
        mag = fmaxf(mag, fabsf(a[i]));
        diff = fmaxf(diff, fabsf(a[i] - b[i]));
    }
    if (tol_rel == 0) return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
    return diff <= tol_rel * mag;
}

/* ---- the KV cache object alone -------------------------------------------------------- */

static void kvcache_ops(void) {
    struct moetax_kvcache *kv;
    struct moetax_kvcache_params p = {.n_cells = 100, .block_size = 16, .n_seq_max = 4};
    struct moetax_kvcache_params huge = {.n_cells = INT64_MAX, .block_size = 16};
    CHECK(moetax_kvcache_init(2, 8, &huge, &kv) == MOETAX_ERR_ARG); /* no overflow rounding it up to blocks */
    CHECK(kv == NULL && strstr(moetax_last_error(), "too large") != NULL);
    CHECK(moetax_kvcache_init(2, 8, &p, &kv) == MOETAX_OK);
    if (!kv) return;
    CHECK_EQ_INT(moetax_kvcache_n_cells(kv), 112); /* 7 blocks */
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 112);
    int32_t seq[40], pos[40];
    for (int i = 0; i < 40; i++) seq[i] = 0, pos[i] = i;
    CHECK(moetax_kvcache_reserve(kv, seq, pos, 40) == MOETAX_OK);
    moetax_kvcache_commit(kv, seq, pos, 40);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 40);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 112 - 48);
    for (int il = 0; il < 2; il++)
        for (int i = 0; i < 40; i++) ((float *)moetax_kvcache_row(kv, il, 0, i))[0] = (float)(il * 1000 + i);
    /* a gap, a wrong position, a bad id: refused, nothing changes */
    int32_t s1 = 0, p1 = 41;
    CHECK(moetax_kvcache_reserve(kv, &s1, &p1, 1) == MOETAX_ERR_ARG);
    s1 = 9, p1 = 0;
    CHECK(moetax_kvcache_reserve(kv, &s1, &p1, 1) == MOETAX_ERR_ARG);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 64);
    /* a prefix shared in the middle of block 2: no new blocks, 2 shared */
    CHECK(moetax_kvcache_seq_cp(kv, 0, 1, 0, 37) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 1), 37);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 64);
    CHECK_EQ_INT(moetax_kvcache_n_shared_blocks(kv), 3);
    /* sequence 1 writes position 37: its third block is copied (rows 32..36), sequence 0's stays */
    s1 = 1, p1 = 37;
    CHECK(moetax_kvcache_reserve(kv, &s1, &p1, 1) == MOETAX_OK);
    ((float *)moetax_kvcache_row(kv, 1, 1, 37))[0] = -1.0f;
    moetax_kvcache_commit(kv, &s1, &p1, 1);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 48);
    CHECK_EQ_INT(moetax_kvcache_n_shared_blocks(kv), 2);
    CHECK(((float *)moetax_kvcache_row(kv, 1, 1, 36))[0] == 1036.0f); /* copied */
    CHECK(((float *)moetax_kvcache_row(kv, 1, 0, 37))[0] == 1037.0f); /* the source's own row untouched */
    CHECK(((float *)moetax_kvcache_row(kv, 0, 1, 5))[0] == 5.0f);     /* shared */
    /* a bad sequence id: the message names the batch token and the id (it wrapped the message it was
     * formatted into, which came out garbled) */
    int32_t s9 = 9, p9 = 0;
    CHECK(moetax_kvcache_reserve(kv, &s9, &p9, 1) == MOETAX_ERR_ARG);
    CHECK_MSG(!strcmp(moetax_last_error(), "batch token 0: KV cache: batch token's sequence id 9 is outside 0..3"),
              "%s", moetax_last_error());
    /* an empty range removes nothing (llama.cpp's seq_rm likewise), for one sequence or all */
    CHECK(moetax_kvcache_seq_rm(kv, 0, 5, 5) == MOETAX_OK);
    CHECK(moetax_kvcache_seq_rm(kv, 0, 30, 10) == MOETAX_OK);
    CHECK(moetax_kvcache_seq_rm(kv, -1, 3, 1) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 40);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 1), 38);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 48);
    /* a reserved batch that failed is taken back out: lengths and free cells as before its
     * reservation, also after part of it was committed */
    int32_t sa[20], pa[20];
    for (int i = 0; i < 20; i++) sa[i] = 0, pa[i] = 40 + i;
    CHECK(moetax_kvcache_reserve(kv, sa, pa, 20) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 32);
    moetax_kvcache_commit(kv, sa, pa, 5);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 45);
    moetax_kvcache_abort(kv);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 40);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 1), 38);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 48);
    CHECK(((float *)moetax_kvcache_row(kv, 1, 0, 37))[0] == 1037.0f);
    /* the middle of a sequence cannot go; its tail can */
    CHECK(moetax_kvcache_seq_rm(kv, 0, 10, 20) == MOETAX_ERR_UNSUPPORTED);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 40);
    CHECK(moetax_kvcache_seq_rm(kv, 0, 20, -1) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 20);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 64); /* its third block freed; block 2 still held by 1 */
    /* full: 4 blocks free, 5 needed: nothing changes */
    int32_t sf[70], pf[70];
    for (int i = 0; i < 70; i++) sf[i] = 2, pf[i] = i;
    CHECK(moetax_kvcache_reserve(kv, sf, pf, 70) == MOETAX_ERR_LIMIT);
    CHECK(strstr(moetax_last_error(), "KV cache full") != NULL);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 64);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 2), 0);
    moetax_kvcache_seq_keep(kv, 1);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 0);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 112 - 48);
    CHECK_EQ_INT(moetax_kvcache_n_shared_blocks(kv), 0);
    CHECK(moetax_kvcache_seq_rm(kv, -1, 0, -1) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 112);
    moetax_kvcache_free(kv);
}

/* ---- batches against each sequence alone ---------------------------------------------- */

/* B sequences with prompts of different lengths, prefilled together in one interleaved
 * batch, then decoded together one token each, with micro-batches of `ubatch` tokens: every
 * logits row equals the sequence run alone. Also a mixed batch (one sequence's prompt
 * chunk with the others' decode tokens), and the ledger books the steps as decode with
 * batch size B. */
static void batch_vs_alone(const char *path, float tol, int ubatch) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int B = 4, steps = 5, V = m->hp.n_vocab;
    const int plen[4] = {5, 1, 9, 3};
    int32_t hist[4][HIST_MAX];
    int n[4] = {0};
    for (int s = 0; s < B; s++)
        for (int i = 0; i < plen[s] + steps + 4; i++) hist[s][i] = (int32_t)((s * 131 + i * 37 + 7) % V);
    struct moetax_ctx *c = ctx(m, 256, ubatch, 2);
    struct moetax_ledger *led = NULL;
    struct moetax_ledger_params lp = {.n_workers = 2, .n_layer = m->hp.n_layer};
    CHECK(moetax_ledger_init(&lp, &led) == MOETAX_OK);
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 64) == MOETAX_OK);
    if (!c || !led) goto out;
    /* prompts interleaved: token i of every sequence that has one, logits for each last one */
    for (int i = 0; i < 9; i++)
        for (int s = 0; s < B; s++)
            if (i < plen[s]) CHECK(moetax_batch_add(&b, hist[s][i], i, s, i == plen[s] - 1) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    for (int s = 0; s < B; s++) n[s] = plen[s];
    for (int i = 0; i < b.n_tokens; i++) {
        const float *l = moetax_ctx_logits_ith(c, i);
        CHECK(!l == !b.logits[i]);
        if (!l) continue;
        const int s = b.seq[i];
        float *ref = alone(m, hist[s], n[s]);
        CHECK_MSG(ref && same(l, ref, V, tol), "%s ubatch %d: prompt of sequence %d differs from it alone", path,
                  ubatch, s);
        free(ref);
    }
    /* decode steps, one token per sequence, booked as decode with batch B */
    moetax_ctx_set_ledger(c, led);
    for (int st = 0; st < steps; st++) {
        moetax_batch_clear(&b);
        for (int s = B - 1; s >= 0; s--) CHECK(moetax_batch_add(&b, hist[s][n[s]], n[s], s, true) == MOETAX_OK);
        CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
        for (int i = 0; i < b.n_tokens; i++) {
            const int s = b.seq[i];
            float *ref = alone(m, hist[s], n[s] + 1);
            CHECK_MSG(ref && same(moetax_ctx_logits_ith(c, i), ref, V, tol),
                      "%s ubatch %d: step %d of sequence %d differs from it alone", path, ubatch, st, s);
            free(ref);
        }
        for (int s = 0; s < B; s++) n[s]++;
    }
    moetax_ctx_set_ledger(c, NULL);
    if (ubatch >= B) {
        double ph[MOETAX_PHASE_COUNT], wall;
        int64_t tokens, nsteps;
        moetax_ledger_totals(led, true, ph, &wall, &tokens, &nsteps);
        CHECK_EQ_INT(nsteps, steps);
        CHECK_EQ_INT(tokens, steps * B);
    }
    /* a mixed batch: three more prompt tokens of sequence 1 and one decode token of the others */
    moetax_batch_clear(&b);
    for (int j = 0; j < 3; j++) CHECK(moetax_batch_add(&b, hist[1][n[1] + j], n[1] + j, 1, j == 2) == MOETAX_OK);
    for (int s = 0; s < B; s++)
        if (s != 1) CHECK(moetax_batch_add(&b, hist[s][n[s]], n[s], s, true) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    n[1] += 2;
    for (int i = 0; i < b.n_tokens; i++) {
        if (!b.logits[i]) { CHECK(moetax_ctx_logits_ith(c, i) == NULL); continue; }
        const int s = b.seq[i];
        float *ref = alone(m, hist[s], n[s] + 1);
        CHECK_MSG(ref && same(moetax_ctx_logits_ith(c, i), ref, V, tol),
                  "%s ubatch %d: mixed batch, sequence %d differs from it alone", path, ubatch, s);
        free(ref);
    }
out:
    moetax_batch_free(&b);
    moetax_ledger_free(led);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* Sequences past several chunks of attention's positions (src/attn/attend.h): three prompts of
 * 300, 560 and 700 tokens prefilled together, then steps of one token each for all three, then a
 * step of two tokens of the first and one of the second (a micro-batch with two tokens of one
 * sequence: attention's phases, split over chunks of positions in MLA, mla.c); every step's logits
 * equal each sequence run alone (its history prefilled, then its last token as a decode step,
 * which with 2 threads splits over chunks too and with 1 does not) with 2 threads and with 1, bit
 * for bit (Q8_0 weights). */
static void long_context(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    enum { B = 3, STEPS = 3, NCTX = 2048 };
    const int V = m->hp.n_vocab, plen[B] = {300, 560, 700};
    int32_t *hist[B];
    for (int q = 0; q < B; q++) {
        hist[q] = malloc(sizeof(int32_t) * (size_t)(plen[q] + STEPS + 1));
        for (int i = 0; i < plen[q] + STEPS + 1; i++) hist[q][i] = (int32_t)((i * 61 + q * 17 + 5) % V);
    }
    struct moetax_ctx *c = ctx(m, NCTX, 64, 2);
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, NCTX) == MOETAX_OK);
    int bad = 0, checked = 0;
    for (int q = 0; c && q < B; q++)
        for (int i = 0; i < plen[q]; i++) CHECK(moetax_batch_add(&b, hist[q][i], i, q, false) == MOETAX_OK);
    moetax_status st = c ? moetax_ctx_decode(c, &b) : MOETAX_ERR_ARG;
    CHECK_MSG(st == MOETAX_OK, "prefill: %s", moetax_last_error());
    int expect = 0;
    for (int step = 0; !st && step < STEPS; step++) {
        moetax_batch_clear(&b);
        if (step < STEPS - 1)
            for (int q = 0; q < B; q++) CHECK(moetax_batch_add(&b, hist[q][plen[q] + step], plen[q] + step, q, true) == MOETAX_OK);
        else { /* the last: two tokens of sequence 0, one of sequence 1 */
            for (int i = 0; i < 2; i++) CHECK(moetax_batch_add(&b, hist[0][plen[0] + step + i], plen[0] + step + i, 0, true) == MOETAX_OK);
            CHECK(moetax_batch_add(&b, hist[1][plen[1] + step], plen[1] + step, 1, true) == MOETAX_OK);
        }
        st = moetax_ctx_decode(c, &b);
        CHECK_MSG(st == MOETAX_OK, "step %d: %s", step, moetax_last_error());
        expect += b.n_tokens * 2;
        for (int i = 0; !st && i < b.n_tokens; i++) {
            const int q = b.seq[i], n = b.pos[i] + 1;
            for (int threads = 1; threads <= 2; threads++) {
                float *ref = alone_in(m, hist[q], n, NCTX, threads);
                checked++;
                if (!ref || !same(moetax_ctx_logits_ith(c, i), ref, V, 0)) {
                    bad++;
                    CHECK_MSG(0, "%s: sequence %d at position %d differs from it alone with %d thread(s)", path, q,
                              n - 1, threads);
                }
                free(ref);
            }
        }
    }
    CHECK_MSG(bad == 0 && checked == expect && expect == (B * (STEPS - 1) + 3) * 2,
              "%s: %d of %d long sequences' logits differ from them alone", path, bad, checked);
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    for (int q = 0; q < B; q++) free(hist[q]);
    moetax_model_free(m);
}

/* Random schedules: sequences join with prompts, decode in random subsets, leave, are cut
 * back (seq_rm of a tail) and go on, or start as a copy of another's prefix (shared
 * blocks, copy on write); after every step each sequence's last logits equal its whole
 * history run alone (the reference schedule: one sequence, from position 0). */
static void random_schedules(const char *path, float tol, uint64_t seed) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int V = m->hp.n_vocab;
    tu_rng r = {seed};
    struct moetax_ctx *c = ctx(m, 512, 16, 2);
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 256) == MOETAX_OK);
    int32_t hist[NSEQ_MAX][HIST_MAX];
    int n[NSEQ_MAX] = {0}, bad = 0, checked = 0, shared_seen = 0;
    for (int round = 0; c && round < 14; round++) {
        int op = (int)(tu_rand_u64(&r) % 6);
        int s = (int)(tu_rand_u64(&r) % NSEQ_MAX), o = (int)(tu_rand_u64(&r) % NSEQ_MAX);
        struct moetax_kvcache *kv = moetax_ctx_kv(c);
        if (op == 4 && n[s] > 2) { /* cut back */
            int keep = 1 + (int)(tu_rand_u64(&r) % (uint64_t)(n[s] - 1));
            CHECK(moetax_kvcache_seq_rm(kv, s, keep, -1) == MOETAX_OK);
            n[s] = keep;
            continue;
        }
        if (op == 5 && n[o] > 1 && s != o) { /* s starts as a prefix of o */
            int keep = 1 + (int)(tu_rand_u64(&r) % (uint64_t)n[o]);
            CHECK(moetax_kvcache_seq_cp(kv, o, s, 0, keep) == MOETAX_OK);
            memcpy(hist[s], hist[o], sizeof(int32_t) * (size_t)keep);
            n[s] = keep;
            shared_seen += moetax_kvcache_n_shared_blocks(kv) > 0;
            continue;
        }
        if (op == 3 && n[s] > 0 && round % 3 == 0) { /* leave */
            CHECK(moetax_kvcache_seq_rm(kv, s, 0, -1) == MOETAX_OK);
            n[s] = 0;
            continue;
        }
        /* a step: every sequence joins (prompt of 1-12) or goes on by 1-2 tokens with probability 3/4 */
        moetax_batch_clear(&b);
        int grew[NSEQ_MAX] = {0};
        for (int q = 0; q < NSEQ_MAX; q++) {
            if (tu_rand_u64(&r) % 4 == 0) continue;
            int add = n[q] == 0 ? 1 + (int)(tu_rand_u64(&r) % 12) : 1 + (int)(tu_rand_u64(&r) % 2);
            if (n[q] + add > 60) continue;
            for (int j = 0; j < add; j++) {
                hist[q][n[q] + j] = (int32_t)(tu_rand_u64(&r) % (uint64_t)V);
                CHECK(moetax_batch_add(&b, hist[q][n[q] + j], n[q] + j, q, j == add - 1) == MOETAX_OK);
            }
            grew[q] = add;
        }
        if (!b.n_tokens) continue;
        moetax_status st = moetax_ctx_decode(c, &b);
        CHECK_MSG(st == MOETAX_OK, "round %d: %s", round, moetax_last_error());
        if (st) break;
        for (int i = 0; i < b.n_tokens; i++) {
            if (!b.logits[i]) continue;
            const int q = b.seq[i];
            float *ref = alone(m, hist[q], n[q] + grew[q]);
            checked++;
            if (!ref || !same(moetax_ctx_logits_ith(c, i), ref, V, tol)) bad++;
            free(ref);
        }
        for (int q = 0; q < NSEQ_MAX; q++) n[q] += grew[q];
        for (int q = 0; q < NSEQ_MAX; q++) CHECK_EQ_INT(moetax_ctx_seq_pos(c, q), n[q]);
    }
    CHECK_MSG(bad == 0 && checked > 20, "%s seed %llu: %d of %d sequences' logits differ from them alone", path,
              (unsigned long long)seed, bad, checked);
    (void)shared_seen;
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* A prompt shared by copy (seq_cp) is stored once; each copy then decodes its own tokens
 * and gets what it gets alone. A full cache is an error that leaves the sequences as they
 * were: they go on as if it had not happened. */
static void prefix_and_full(const char *path, float tol) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int V = m->hp.n_vocab;
    struct moetax_ctx *c = ctx(m, 128, 64, 2); /* 4 blocks of 32 */
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 128) == MOETAX_OK);
    int32_t hist[3][64];
    for (int i = 0; i < 64; i++) hist[0][i] = (int32_t)((i * 53 + 3) % V);
    if (!c) goto out;
    struct moetax_kvcache *kv = moetax_ctx_kv(c);
    CHECK(moetax_ctx_eval(c, hist[0], 40, NULL, false) == MOETAX_OK); /* 2 blocks */
    CHECK(moetax_kvcache_seq_cp(kv, 0, 1, 0, -1) == MOETAX_OK);
    CHECK(moetax_kvcache_seq_cp(kv, 0, 2, 0, 35) == MOETAX_OK);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 128 - 64);
    memcpy(hist[1], hist[0], sizeof hist[0]);
    memcpy(hist[2], hist[0], sizeof hist[0]);
    hist[1][40] = 7, hist[2][35] = 11;
    int n[3] = {40, 40, 35};
    moetax_batch_clear(&b);
    for (int s = 0; s < 3; s++) CHECK(moetax_batch_add(&b, hist[s][n[s]], n[s], s, true) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    /* each wrote into the shared second block: two copies, the third keeps the original */
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 0);
    for (int s = 0; s < 3; s++) {
        float *ref = alone(m, hist[s], n[s] + 1);
        CHECK_MSG(ref && same(moetax_ctx_logits_ith(c, s), ref, V, tol), "%s: prefix copy %d differs from alone",
                  path, s);
        free(ref);
        n[s]++;
    }
    /* full: a fourth sequence cannot start; the others are untouched and go on */
    moetax_batch_clear(&b);
    CHECK(moetax_batch_add(&b, 5, 0, 3, true) == MOETAX_OK);
    CHECK(moetax_ctx_decode(c, &b) == MOETAX_ERR_LIMIT);
    CHECK(strstr(moetax_last_error(), "KV cache full") != NULL);
    for (int s = 0; s < 3; s++) CHECK_EQ_INT(moetax_ctx_seq_pos(c, s), n[s]);
    CHECK_EQ_INT(moetax_ctx_seq_pos(c, 3), 0);
    /* a position that is not the next one: refused, nothing changes */
    moetax_batch_clear(&b);
    CHECK(moetax_batch_add(&b, 5, n[0] + 1, 0, true) == MOETAX_OK);
    CHECK(moetax_ctx_decode(c, &b) == MOETAX_ERR_ARG);
    moetax_batch_clear(&b);
    for (int s = 0; s < 3; s++) CHECK(moetax_batch_add(&b, hist[s][n[s]], n[s], s, true) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    for (int s = 0; s < 3; s++) {
        float *ref = alone(m, hist[s], n[s] + 1);
        CHECK_MSG(ref && same(moetax_ctx_logits_ith(c, s), ref, V, tol), "%s: sequence %d after the full cache", path,
                  s);
        free(ref);
    }
out:
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* The capacity factor: infinite (or large) is the same as off, bit for bit; at C = 1 each
 * expert takes at most ceil(n k / E) assignments per layer, every assignment is counted
 * (kept + dropped = n k per layer pass; rerouted ones are kept), a token's weights still
 * sum to its total when some of its experts were dropped, and rerouting drops fewer. */
static void capacity(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int n = 16, V = m->hp.n_vocab, k = m->hp.n_expert_used, E = m->hp.n_expert, L = m->hp.n_layer;
    int32_t toks[16];
    for (int i = 0; i < n; i++) toks[i] = (int32_t)((i * 71 + 5) % V);
    float *ref = malloc(sizeof(float) * (size_t)(n * V)), *got = malloc(sizeof(float) * (size_t)(n * V));
    float wsum_off[64][16];
    int64_t dropped[2] = {0};
    const float cfs[] = {0, INFINITY, 100.0f, 1.0f, 1.0f};
    for (int ci = 0; ci < 5; ci++) {
        struct moetax_ctx_params p = {.n_ctx = 64, .n_threads = 2, .capacity_factor = cfs[ci],
                                      .overflow = ci == 4 ? MOETAX_OVERFLOW_REROUTE : MOETAX_OVERFLOW_DROP};
        struct moetax_ctx *c;
        if (moetax_ctx_init(m, &p, &c) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); break; }
        struct moetax_ledger *led = NULL;
        struct moetax_ledger_params lp = {.n_workers = 2, .n_layer = L};
        CHECK(moetax_ledger_init(&lp, &led) == MOETAX_OK);
        moetax_ctx_set_ledger(c, led);
        CHECK(moetax_ctx_eval(c, toks, n, ci ? got : ref, true) == MOETAX_OK);
        struct moetax_ledger_moe_stats ms;
        moetax_ledger_moe_totals(led, false, &ms);
        const int moe_layers = L - m->hp.n_layer_dense_lead;
        CHECK_EQ_INT(ms.moe_layers, moe_layers);
        CHECK_EQ_INT(ms.assignments + ms.dropped, (int64_t)moe_layers * n * k); /* nothing lost from the counts */
        if (ci > 0 && ci < 3) {
            CHECK_MSG(!memcmp(ref, got, sizeof(float) * (size_t)(n * V)), "capacity factor %g differs from off", cfs[ci]);
            CHECK_EQ_INT(ms.dropped + ms.rerouted, 0);
        }
        const int cap = (n * k + E - 1) / E;
        for (int il = 0; il < L; il++) {
            const float *w;
            int64_t nt;
            const int32_t *sel = moetax_ctx_routing(c, il, &w, &nt);
            if (!sel) continue;
            int cnt[256] = {0}, drops = 0;
            for (int t = 0; t < n; t++) {
                float sum = 0;
                int kept = 0;
                for (int j = 0; j < k; j++) {
                    if (sel[t * k + j] < 0) { drops++; CHECK(w[t * k + j] == 0); continue; }
                    cnt[sel[t * k + j]]++;
                    sum += w[t * k + j];
                    kept++;
                }
                if (ci == 0) wsum_off[il][t] = sum;
                else if (kept) CHECK_MSG(fabsf(sum - wsum_off[il][t]) <= 1e-5f * wsum_off[il][t],
                                         "C %g layer %d token %d: weights sum %g, %g without the factor", cfs[ci], il, t,
                                         sum, wsum_off[il][t]);
            }
            if (ci >= 3)
                for (int e = 0; e < E; e++) CHECK_MSG(cnt[e] <= cap, "layer %d expert %d: %d > cap %d", il, e, cnt[e], cap);
            if (ci == 3) dropped[0] += drops;
            if (ci == 4) dropped[1] += drops;
        }
        if (ci == 3) CHECK_MSG(ms.dropped > 0 && ms.dropped == dropped[0], "C = 1: %lld dropped (routing shows %lld)",
                               (long long)ms.dropped, (long long)dropped[0]);
        if (ci == 4) {
            CHECK_MSG(ms.rerouted > 0, "reroute moved nothing");
            CHECK(ms.dropped == dropped[1] && ms.dropped < dropped[0]);
        }
        moetax_ctx_free(c);
        moetax_ledger_free(led);
    }
    struct moetax_ctx_params bad = {.n_ctx = 64, .capacity_factor = -1};
    struct moetax_ctx *c = NULL;
    CHECK(moetax_ctx_init(m, &bad, &c) == MOETAX_ERR_ARG);
    free(ref);
    free(got);
    moetax_model_free(m);
}

/* F16 cells: half the bytes, Q8_0 cells: 34 bytes a block of 32 values (a row's last block padded);
 * logits close to the F32 cache's (rounding of the cached rows only; the tiny random model amplifies
 * it to a few percent of the largest logit, where the trained model's held-out perplexity moves by
 * 0.01-0.02%) */
static void cells_close(const char *path, enum moetax_type ct) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int n = 40, V = m->hp.n_vocab;
    int32_t toks[40];
    for (int i = 0; i < n; i++) toks[i] = (int32_t)((i * 53 + 9) % V);
    float *l[2];
    size_t bytes[2];
    for (int k = 0; k < 2; k++) {
        g_kv_type = k ? ct : MOETAX_TYPE_F32;
        struct moetax_ctx *c = ctx(m, 64, 64, 2);
        l[k] = malloc(sizeof(float) * (size_t)(n * V));
        CHECK(c && moetax_ctx_eval(c, toks, n, l[k], true) == MOETAX_OK);
        bytes[k] = c ? moetax_ctx_kv_bytes(c) : 0;
        moetax_ctx_free(c);
    }
    g_kv_type = MOETAX_TYPE_F32;
    const struct moetax_hparams *hp = &m->hp;
    const size_t row = (size_t)(hp->attn == MOETAX_ATTN_GQA ? hp->n_head_kv * (hp->n_embd_head_k + hp->n_embd_head_v)
                                                            : hp->kv_lora_rank + hp->n_embd_head_qk_rope);
    if (ct == MOETAX_TYPE_F16) CHECK_EQ_INT(bytes[1] * 2, bytes[0]);
    else CHECK_EQ_INT(bytes[1] * 4 * row, bytes[0] * ((row + 31) / 32 * 34));
    const char *cn = moetax_type_name(ct);
    float mag = 0, diff = 0;
    for (int64_t i = 0; i < (int64_t)n * V; i++) mag = fmaxf(mag, fabsf(l[0][i])), diff = fmaxf(diff, fabsf(l[0][i] - l[1][i]));
    double mean = 0;
    int agree = 0;
    for (int64_t i = 0; i < (int64_t)n * V; i++) mean += fabsf(l[0][i] - l[1][i]);
    mean /= (double)n * V;
    for (int t = 0; t < n; t++) {
        int a0 = 0, a1 = 0;
        for (int v = 1; v < V; v++) {
            if (l[0][(int64_t)t * V + v] > l[0][(int64_t)t * V + a0]) a0 = v;
            if (l[1][(int64_t)t * V + v] > l[1][(int64_t)t * V + a1]) a1 = v;
        }
        agree += a0 == a1;
    }
    printf("%s cells: logits within %.3g of the F32 cache's (max |logit| %.3g), mean %.3g, argmax %d/%d\n", cn, diff,
           mag, mean, agree, n);
    /* Q8_0's coarser rounding also moves a few of these tiny random models' expert choices (seen: 2.07 of
     * max |logit| 4.22 on one row): its bound is on the mean and the greedy tokens; the exact check of its
     * rounding is test_model_ref's (the NumPy reference with the same cells) */
    if (ct == MOETAX_TYPE_F16)
        CHECK_MSG(diff <= 5e-2f * mag, "%s cells: logits differ from the F32 cache's by %g (max |logit| %g)", cn, diff,
                  mag);
    CHECK_MSG(mean <= 2e-2 * mag && agree >= n * 9 / 10,
              "%s cells: logits %g off the F32 cache's on average (max |logit| %g), argmax the same in %d of %d", cn,
              mean, mag, agree, n);
    CHECK_MSG(!same(l[0], l[1], (int64_t)n * V, 0), "%s cells: logits bit-identical to F32 (were they used?)", cn);
    free(l[0]);
    free(l[1]);
    moetax_model_free(m);
}

/* adapt_threads with every probe made to win (MOETAX_ADAPT_THREADS_FORCE): the steps switch
 * between 2 threads and 1 again and again, and every logit stays the bits of a plain
 * 2-thread context (this model's results do not depend on the thread count). */
static void adapt_threads_same(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int V = m->hp.n_vocab, B = 4, steps = 240;
    setenv("MOETAX_ADAPT_THREADS_FORCE", "1", 1);
    struct moetax_ctx_params pa = {.n_ctx = 1024, .n_threads = 2, .n_seq_max = NSEQ_MAX, .adapt_threads = true};
    struct moetax_ctx *ca = NULL, *cp = ctx(m, 1024, 64, 2);
    CHECK(moetax_ctx_init(m, &pa, &ca) == MOETAX_OK);
    unsetenv("MOETAX_ADAPT_THREADS_FORCE");
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 64) == MOETAX_OK);
    int bad = 0;
    for (int st = 0; ca && cp && st < steps; st++) {
        moetax_batch_clear(&b);
        for (int s = 0; s < B; s++) /* one token per sequence (a decode step); the first step a prompt */
            for (int i = 0; i < (st == 0 ? 3 : 1); i++) {
                const int pos = st == 0 ? i : st + 2;
                CHECK(moetax_batch_add(&b, (int32_t)((s * 131 + pos * 37 + 7) % V), pos, s, st > 0 || i == 2) == MOETAX_OK);
            }
        /* every other step only sequence 0 decodes: a one-token step (the decode path) */
        if (st % 2 && st > 0) b.n_tokens = 1;
        CHECK(moetax_ctx_decode(ca, &b) == MOETAX_OK && moetax_ctx_decode(cp, &b) == MOETAX_OK);
        for (int i = 0; i < b.n_tokens; i++) {
            const float *la = moetax_ctx_logits_ith(ca, i), *lp = moetax_ctx_logits_ith(cp, i);
            if (!la != !lp || (la && memcmp(la, lp, sizeof(float) * (size_t)V))) bad++;
        }
        if (st % 2 && st > 0) /* keep the sequences' lengths equal: the others catch up */
            for (int s = 1; s < B; s++) {
                moetax_batch_clear(&b);
                CHECK(moetax_batch_add(&b, (int32_t)((s * 131 + (st + 2) * 37 + 7) % V), st + 2, s, false) == MOETAX_OK);
                CHECK(moetax_ctx_decode(ca, &b) == MOETAX_OK && moetax_ctx_decode(cp, &b) == MOETAX_OK);
            }
    }
    int64_t probes = 0, switches = 0;
    if (ca) moetax_ctx_adapt_stats(ca, &probes, &switches);
    CHECK_MSG(bad == 0, "%s: %d logit rows of the adaptive context differ from the plain one's", path, bad);
    CHECK_MSG(switches >= 3 && probes >= switches, "%s: adapt_threads made %lld switches in %lld probes (forced: "
              "every probe that ends switches)", path, (long long)switches, (long long)probes);
    moetax_batch_free(&b);
    moetax_ctx_free(ca);
    moetax_ctx_free(cp);
    moetax_model_free(m);
}


/* A logit that is not finite (an infinite weight in row `which` of the output matrix, < 0: from
 * the end) fails the batch with MOETAX_ERR_NUMERIC naming the first bad logit in order: token
 * 0's logit of that row. The workers check their own blocks of the logits (forward.c), so a row
 * in the last block (the last worker's) must be seen as well as one in the first. */
static void nonfinite_logits(const char *src, int64_t which) {
    char path[512];
    snprintf(path, sizeof path, "%s", tu_path("batch_inf_logit.gguf"));
    struct moetax_gguf *g = NULL;
    if (moetax_gguf_open(src, &g) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const struct moetax_gguf_tensor *t = moetax_gguf_find_tensor(g, "output.weight");
    CHECK(t && t->type == MOETAX_TYPE_F32);
    const int64_t V = t ? (int64_t)t->ne[1] : 0, d = t ? (int64_t)t->ne[0] : 0, row = which < 0 ? V + which : which;
    const uint64_t off = t ? g->data_offset + t->offset + (uint64_t)(row * d) * sizeof(float) : 0;
    moetax_gguf_close(g);
    if (!t) return;
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cp %s %s", src, path);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    FILE *f = fopen(path, "r+b");
    const float inf[2] = {INFINITY, INFINITY};
    CHECK(f && fseek(f, (long)off, SEEK_SET) == 0 && fwrite(inf, sizeof inf, 1, f) == 1);
    if (f) fclose(f);
    struct moetax_model *m = NULL;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    struct moetax_ctx *c = ctx(m, 128, 64, 2);
    struct moetax_batch b = {0};
    CHECK(moetax_batch_init(&b, 8) == MOETAX_OK);
    for (int s = 0; s < 3; s++) CHECK(moetax_batch_add(&b, 5 + s, 0, s, true) == MOETAX_OK);
    CHECK_EQ_INT(moetax_ctx_decode(c, &b), MOETAX_ERR_NUMERIC);
    char want[96];
    snprintf(want, sizeof want, "logits of token 0 (sequence 0, position 0) are not finite: logit %lld ", (long long)row);
    CHECK_MSG(strstr(moetax_last_error(), want) != NULL, "%s", moetax_last_error());
    struct moetax_kvcache *kv = moetax_ctx_kv(c);
    for (int s = 0; s < 3; s++) CHECK_EQ_INT(moetax_kvcache_seq_len(kv, s), 0); /* the batch failed whole */
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), moetax_kvcache_n_cells(kv));
    moetax_ctx_free(c);

    /* A batch of micro-batches of one token whose first fails after its cells were committed: the
     * cache as before the batch (none of its positions, none of its blocks), and a later batch that
     * needs every other free block fits (the blocks reserved for the failed one had been kept, past
     * the sequence's length, and the next reservation then counted them as needed negatively and
     * checked the wrong block for copy on write: out of blocks, an abort). */
    struct moetax_ctx_params p = {.n_ctx = 16, .n_threads = 2, .n_ubatch = 1, .n_seq_max = NSEQ_MAX,
                                  .kv_type = g_kv_type, .kv_block = 4};
    if (moetax_ctx_init(m, &p, &c) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    kv = moetax_ctx_kv(c);
    moetax_batch_free(&b);
    CHECK(moetax_batch_init(&b, 16) == MOETAX_OK);
    for (int i = 0; i < 5; i++) CHECK(moetax_batch_add(&b, 5 + i, i, 0, i == 0) == MOETAX_OK);
    CHECK_EQ_INT(moetax_ctx_decode(c, &b), MOETAX_ERR_NUMERIC);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 0);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 16);
    moetax_batch_clear(&b);
    for (int i = 0; i < 4; i++) CHECK(moetax_batch_add(&b, 5 + i, i, 0, false) == MOETAX_OK);
    for (int i = 0; i < 12; i++) CHECK(moetax_batch_add(&b, 5 + i, i, 1, false) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 0), 4);
    CHECK_EQ_INT(moetax_kvcache_seq_len(kv, 1), 12);
    CHECK_EQ_INT(moetax_kvcache_n_free(kv), 0);
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* A prompt whose length leaves one token after whole micro-batches: that token's step is prefill in
 * the ledger (the batch has several tokens of its sequence), as are the others; a batch of one token
 * per sequence is decode whatever its micro-batches (it was booked by each micro-batch alone, so the
 * prompt's last token counted as a decode step). */
static void ledger_prompt_tail(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    struct moetax_ctx *c = ctx(m, 512, 5, 2);
    struct moetax_ledger *led = NULL;
    struct moetax_ledger_params lp = {.n_workers = 2, .n_layer = m->hp.n_layer};
    CHECK(moetax_ledger_init(&lp, &led) == MOETAX_OK);
    struct moetax_batch b = {0};
    CHECK(moetax_batch_init(&b, 16) == MOETAX_OK);
    if (!c || !led) goto out;
    moetax_ctx_set_ledger(c, led);
    for (int i = 0; i < 11; i++) CHECK(moetax_batch_add(&b, 5 + i, i, 0, i == 10) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    double ph[MOETAX_PHASE_COUNT], wall;
    int64_t tokens, steps;
    moetax_ledger_totals(led, true, ph, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 0);
    moetax_ledger_totals(led, false, ph, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 3);
    CHECK_EQ_INT(tokens, 11);
    moetax_batch_clear(&b); /* 7 sequences' first tokens: micro-batches of 5 and 2, both decode */
    for (int s = 1; s < 8; s++) CHECK(moetax_batch_add(&b, 5 + s, 0, s, true) == MOETAX_OK);
    CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    moetax_ledger_totals(led, true, ph, &wall, &tokens, &steps);
    CHECK_EQ_INT(steps, 2);
    CHECK_EQ_INT(tokens, 7);
out:
    moetax_batch_free(&b);
    moetax_ledger_free(led);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* ---- MLA prompts with the keys and values decompressed ----------------------------------- */

/* Logits of every position of toks[0..n) in sequences 0 .. n_seqs-1 (all in one batch), by a context
 * of micro-batches of ub tokens whose prompts take the form f (moetax_ctx_params.attn_prefill). */
static float *prefill_rows(struct moetax_model *m, enum moetax_attn_prefill f, int threads, int ub,
                           const int32_t *toks, int n, int n_seqs) {
    struct moetax_ctx_params p = {.n_ctx = 1024, .n_threads = threads, .n_ubatch = ub, .n_seq_max = NSEQ_MAX,
                                  .kv_type = g_kv_type, .attn_prefill = f};
    struct moetax_ctx *c = NULL;
    moetax_status st = moetax_ctx_init(m, &p, &c);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    const int64_t V = m->hp.n_vocab;
    float *l = malloc(sizeof(float) * (size_t)(n * n_seqs * V));
    struct moetax_batch b = {0};
    CHECK(moetax_batch_init(&b, n * n_seqs) == MOETAX_OK);
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < n; i++) CHECK(moetax_batch_add(&b, toks[i], i, s, true) == MOETAX_OK);
    st = c ? moetax_ctx_decode(c, &b) : MOETAX_ERR_ARG;
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    for (int i = 0; !st && i < n * n_seqs; i++) memcpy(l + (size_t)i * V, moetax_ctx_logits_ith(c, i), sizeof(float) * (size_t)V);
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    return l;
}

/* A prompt of 300 tokens in micro-batches of 128 (chunks of 256 positions merged, later
 * micro-batches over the earlier ones' positions, a last tile of 12 queries), kv_lora 64 against
 * decompressed heads of 16 + 8 and 16: the decompressed form gives the absorbed form's logits within
 * float rounding (F32 weights: neither quantizes an activation), not its bits (it ran); auto takes it
 * for this prompt (DECOMPRESSED's bits) but not for two sequences in one micro-batch (ABSORBED's);
 * its bits do not depend on the thread count. F16 cells too (g_kv_type). */
static void mla_prefill_forms(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int n = 300, V = m->hp.n_vocab;
    int32_t toks[300];
    for (int i = 0; i < n; i++) toks[i] = (int32_t)((i * 61 + 5) % V);
    const int64_t all = (int64_t)n * V;
    float *ab = prefill_rows(m, MOETAX_ATTN_PREFILL_ABSORBED, 2, 128, toks, n, 1);
    float *de = prefill_rows(m, MOETAX_ATTN_PREFILL_DECOMPRESSED, 2, 128, toks, n, 1);
    float *de1 = prefill_rows(m, MOETAX_ATTN_PREFILL_DECOMPRESSED, 1, 128, toks, n, 1);
    float *au = prefill_rows(m, MOETAX_ATTN_PREFILL_AUTO, 2, 128, toks, n, 1);
    float *ab2 = prefill_rows(m, MOETAX_ATTN_PREFILL_ABSORBED, 2, 256, toks, 100, 2);
    float *au2 = prefill_rows(m, MOETAX_ATTN_PREFILL_AUTO, 2, 256, toks, 100, 2);
    const char *cells = moetax_type_name(g_kv_type);
    /* F16 / Q8_0 cells: a float difference of the earlier layers can round a later layer's cell the other
     * way (Q8_0: by a step of its block's scale); Q8_0 cells: the absorbed form's scores also take the
     * queries rounded to Q8_0 blocks (llama.cpp's q8_0 K cache), the decompressed form's are float */
    const float tol = g_kv_type == MOETAX_TYPE_F16 ? 2e-3f : g_kv_type == MOETAX_TYPE_Q8_0 ? 1e-1f : 2e-5f;
    float mag = 0, diff = 0;
    for (int64_t i = 0; i < all; i++) mag = fmaxf(mag, fabsf(ab[i])), diff = fmaxf(diff, fabsf(ab[i] - de[i]));
    CHECK_MSG(diff <= tol * mag, "%s cells: decompressed prefill %g off the absorbed form's logits (max %g)", cells,
              diff, mag);
    printf("%s cells: decompressed prefill within %.2g of the absorbed form's logits (max |logit| %.3g)\n", cells, diff,
           mag);
    CHECK_MSG(!same(ab, de, all, 0), "%s cells: decompressed prefill has the absorbed form's bits (did it run?)", cells);
    CHECK_MSG(same(de, de1, all, 0), "%s cells: decompressed prefill differs between 1 and 2 threads", cells);
    CHECK_MSG(same(au, de, all, 0), "%s cells: auto did not take the decompressed form for one long prompt", cells);
    CHECK_MSG(same(au2, ab2, 2 * 100 * (int64_t)V, 0), "%s cells: auto took the decompressed form for two sequences",
              cells);
    free(ab); free(de); free(de1); free(au); free(ab2); free(au2);
    moetax_model_free(m);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    kvcache_ops();
    char q8[512], q4[512], f32[512];
    snprintf(q8, sizeof q8, "%s", tu_path("batch_tiny_v3_q8_0.gguf"));
    snprintf(q4, sizeof q4, "%s", tu_path("batch_tiny_q4_0.gguf"));
    snprintf(f32, sizeof f32, "%s", tu_path("batch_tiny_f32.gguf"));
    CHECK_EQ_INT(gen("--preset tiny-v3 --type q8_0", q8), 0);
    CHECK_EQ_INT(gen("--preset tiny --type q4_0", q4), 0);
    CHECK_EQ_INT(gen("--preset tiny", f32), 0);
    batch_vs_alone(q8, 0, 64);
    batch_vs_alone(q8, 0, 3);
    batch_vs_alone(q4, 0, 64);
    batch_vs_alone(f32, 2e-5f, 64);
    { /* the fallback types of k-quant files: Q5_0 (avx512: Q5_0x8r) and Q5_1 (the avx2 kernels) */
        char q5[512], q51[512];
        snprintf(q5, sizeof q5, "%s", tu_path("batch_tiny_v3_q5_0.gguf"));
        snprintf(q51, sizeof q51, "%s", tu_path("batch_tiny_q5_1.gguf"));
        CHECK_EQ_INT(gen("--preset tiny-v3 --type q5_0 --seed 21", q5), 0);
        CHECK_EQ_INT(gen("--preset tiny --type q5_1 --seed 22", q51), 0);
        batch_vs_alone(q5, 0, 64);
        batch_vs_alone(q51, 0, 64);
        random_schedules(q5, 0, 4);
    }
    random_schedules(q8, 0, 1);
    random_schedules(q8, 0, 2);
    random_schedules(f32, 2e-5f, 3);
    ledger_prompt_tail(f32);
    prefix_and_full(q8, 0);
    capacity(q8);
    cells_close(q8, MOETAX_TYPE_F16);
    cells_close(q8, MOETAX_TYPE_Q8_0);
    adapt_threads_same(q8);
    {
        char wide[512];
        snprintf(wide, sizeof wide, "%s", tu_path("batch_tiny_kvl64_f32.gguf"));
        CHECK_EQ_INT(gen("--preset tiny --kv-lora 64 --ctx 1024 --seed 31", wide), 0);
        mla_prefill_forms(wide);
        g_kv_type = MOETAX_TYPE_F16;
        mla_prefill_forms(wide);
        g_kv_type = MOETAX_TYPE_Q8_0;
        mla_prefill_forms(wide);
        g_kv_type = MOETAX_TYPE_F32;
    }
    nonfinite_logits(f32, -1); /* the last block */
    nonfinite_logits(f32, 3);  /* the first */
    char q8l[512], q3l[512];
    snprintf(q8l, sizeof q8l, "%s", tu_path("batch_tiny_v3_ctx_q8_0.gguf"));
    snprintf(q3l, sizeof q3l, "%s", tu_path("batch_qwen3moe_ctx_q8_0.gguf"));
    CHECK_EQ_INT(gen("--preset tiny-v3 --type q8_0 --ctx 2048", q8l), 0);
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0 --ctx 2048", q3l), 0);
    long_context(q8l);
    long_context(q3l);
    { /* one KV head of 8 query heads: with 2 threads a long context splits over chunks (gqa.c) */
        char q3m[512];
        snprintf(q3m, sizeof q3m, "%s", tu_path("batch_qwen3moe_mqa_ctx_q8_0.gguf"));
        CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0 --heads 8 --heads-kv 1 --ctx 2048 --seed 7", q3m), 0);
        long_context(q3m);
        g_kv_type = MOETAX_TYPE_F16;
        long_context(q3m);
        g_kv_type = MOETAX_TYPE_F32;
    }
    for (int c = 0; c < 2; c++) { /* F16 and Q8_0 cells: a sequence in a batch still gets its bits alone */
        g_kv_type = c ? MOETAX_TYPE_Q8_0 : MOETAX_TYPE_F16;
        batch_vs_alone(q8, 0, 64);
        long_context(q8l);
        prefix_and_full(q8, 0);
    }
    g_kv_type = MOETAX_TYPE_F32;
    /* qwen3moe (grouped-query attention over the same paged cache): the same contracts */
    char q3[512], q3f[512];
    snprintf(q3, sizeof q3, "%s", tu_path("batch_qwen3moe_q8_0.gguf"));
    snprintf(q3f, sizeof q3f, "%s", tu_path("batch_qwen3moe_f32.gguf"));
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0", q3), 0);
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --heads 8 --heads-kv 2 --seed 4", q3f), 0);
    batch_vs_alone(q3, 0, 64);
    batch_vs_alone(q3, 0, 3);
    batch_vs_alone(q3f, 2e-5f, 64);
    random_schedules(q3, 0, 4);
    prefix_and_full(q3, 0);
    cells_close(q3f, MOETAX_TYPE_F16); /* F32 weights: with Q8_0 ones the cells' rounding can flip an activation's
                                        * quantization and with it an expert choice of this tiny model (seen: 0.53
                                        * of max |logit| 3.9) */
    g_kv_type = MOETAX_TYPE_F16;
    batch_vs_alone(q3, 0, 64);
    g_kv_type = MOETAX_TYPE_F32;
    { /* Q8_0 cells: heads of whole blocks (32 values); batches still each sequence's bits alone, a long
       * context over chunks split between the workers (one KV head) */
        char q3w[512], q3wf[512], q3wm[512];
        snprintf(q3w, sizeof q3w, "%s", tu_path("batch_qwen3moe_hd32_q8_0.gguf"));
        snprintf(q3wf, sizeof q3wf, "%s", tu_path("batch_qwen3moe_hd32_f32.gguf"));
        snprintf(q3wm, sizeof q3wm, "%s", tu_path("batch_qwen3moe_hd32_mqa_q8_0.gguf"));
        CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0 --head-dim 32", q3w), 0);
        CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --heads 8 --heads-kv 2 --head-dim 32 --seed 4", q3wf), 0);
        CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0 --heads 8 --heads-kv 1 --head-dim 32 --ctx 2048 "
                         "--seed 7", q3wm), 0);
        cells_close(q3wf, MOETAX_TYPE_Q8_0);
        g_kv_type = MOETAX_TYPE_Q8_0;
        batch_vs_alone(q3w, 0, 64);
        random_schedules(q3w, 0, 4);
        long_context(q3wm);
        struct moetax_model *m16; /* heads of 16 values: refused, with the reason */
        CHECK(moetax_model_load(q3, &m16) == MOETAX_OK);
        struct moetax_ctx_params p16 = {.n_ctx = 64, .n_threads = 2, .kv_type = MOETAX_TYPE_Q8_0};
        struct moetax_ctx *c16 = NULL;
        CHECK(moetax_ctx_init(m16, &p16, &c16) == MOETAX_ERR_UNSUPPORTED);
        CHECK_MSG(!c16 && strstr(moetax_last_error(), "blocks of 32"), "q8_0 cells on heads of 16: %s",
                  c16 ? "accepted" : moetax_last_error());
        moetax_ctx_free(c16);
        moetax_model_free(m16);
        g_kv_type = MOETAX_TYPE_F32;
    }
    /* olmoe (full-width q/k norm, not renormalised) and Mixtral (llama: NORM rope, no q/k norm) */
    char ol[512], olf[512], mx[512], mxf[512];
    snprintf(ol, sizeof ol, "%s", tu_path("batch_olmoe_q8_0.gguf"));
    snprintf(olf, sizeof olf, "%s", tu_path("batch_olmoe_f32.gguf"));
    snprintf(mx, sizeof mx, "%s", tu_path("batch_mixtral_q8_0.gguf"));
    snprintf(mxf, sizeof mxf, "%s", tu_path("batch_mixtral_f32.gguf"));
    CHECK_EQ_INT(gen("--arch olmoe --preset tiny --type q8_0", ol), 0);
    CHECK_EQ_INT(gen("--arch olmoe --preset tiny --heads 8 --heads-kv 2 --seed 4", olf), 0);
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --type q8_0", mx), 0);
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --heads 8 --heads-kv 2 --head-dim 16 --seed 4", mxf), 0);
    batch_vs_alone(ol, 0, 64);
    batch_vs_alone(ol, 0, 3);
    batch_vs_alone(olf, 2e-5f, 64);
    random_schedules(ol, 0, 4);
    batch_vs_alone(mx, 0, 64);
    batch_vs_alone(mx, 0, 3);
    batch_vs_alone(mxf, 2e-5f, 64);
    random_schedules(mx, 0, 4);
    /* 512 wide (embd), 8 experts: a batch's down projections go in pieces of 256 rows when an
     * expert has more than 1/8 of the slots (moe.c, down_pieces), the hidden rows prepared by the
     * expert's last gate/up block: the same bits as each sequence alone (Q4_0: repacked row groups) */
    char mw[512], mw4[512];
    snprintf(mw, sizeof mw, "%s", tu_path("batch_mixtral_wide_q8_0.gguf"));
    snprintf(mw4, sizeof mw4, "%s", tu_path("batch_mixtral_wide_q4_0.gguf"));
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --type q8_0 --embd 512 --heads 8 --heads-kv 2 --head-dim 64", mw), 0);
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --type q4_0 --embd 512 --heads 8 --heads-kv 2 --head-dim 64 --seed 5",
                     mw4), 0);
    batch_vs_alone(mw, 0, 64);
    if (!TU_UNDER_TSAN) { /* ThreadSanitizer: the Q8_0 file covers the pieces' threading (each case is long there) */
        batch_vs_alone(mw4, 0, 64);
        random_schedules(mw, 0, 5);
    }
    /* 32 experts, 4 per token: a small batch's experts are whole-expert items that run their
     * down projection too (moe.c, fused; at least 4 active experts per worker): the same bits */
    char many[512];
    snprintf(many, sizeof many, "%s", tu_path("batch_many_experts_q8_0.gguf"));
    CHECK_EQ_INT(gen("--preset tiny-v3 --type q8_0 --experts 32 --experts-used 4", many), 0);
    batch_vs_alone(many, 0, 64);
    random_schedules(many, 0, 6);
    return tu_finish("test_batch");
}
