// ctest-labels: unit;model;threads
// ctest-cost: 48
/* test_model_store.c - the forward pass with routed experts read through the
 * expert store: for every budget (all experts down to one token's worth), each
 * policy, with and without prefetch, 1 and 2 threads, prefill and decode, the
 * logits are bit-identical to the run on the mapped file with the same
 * micro-batch size; a read fault gives a clear error naming the expert and the
 * file, not wrong output. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe/predict.h"
#include "moetax/model.h"
#include "moetax/predict.h"
#include "moetax/store.h"
#include "testutil.h"

enum { N_TOK = 24 };

/* logits of a prefill of 8 tokens then 16 decode steps (teacher-forced) */
static float *run(struct moetax_model *m, struct moetax_store *store, int threads, int ubatch, bool prefetch,
                  moetax_status *st_out) {
    struct moetax_ctx_params cp = {.n_ctx = 64, .n_threads = threads, .n_ubatch = ubatch, .store = store,
                                   .no_prefetch = !prefetch};
    struct moetax_ctx *c;
    moetax_status st = moetax_ctx_init(m, &cp, &c);
    if (st) { *st_out = st; return NULL; }
    const int64_t V = m->hp.n_vocab;
    float *l = calloc((size_t)(V * N_TOK), sizeof(float));
    int32_t t[N_TOK];
    for (int i = 0; i < N_TOK; i++) t[i] = (int32_t)((i * 53 + 7) % V);
    st = moetax_ctx_eval(c, t, 8, l, true);
    for (int i = 8; !st && i < N_TOK; i++) st = moetax_ctx_eval(c, t + i, 1, l + i * V, false);
    moetax_ctx_free(c);
    *st_out = st;
    if (st) { free(l); return NULL; }
    return l;
}

/* a VFS whose reads fail from the n-th on (a failed prefetch alone is retried by
 * the acquire, so the fault must persist to surface) */
struct fault { _Atomic int fail_at, reads; };
static int f_open(void *u, const char *path, bool direct, int *fd) {
    (void)u;
    *fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
    if (*fd < 0 && direct) *fd = open(path, O_RDONLY);
    return *fd < 0 ? errno : 0;
}
static ssize_t f_pread(void *u, int fd, void *buf, size_t n, uint64_t off) {
    struct fault *f = u;
    if (atomic_fetch_add(&f->reads, 1) + 1 >= atomic_load(&f->fail_at)) return -EIO;
    ssize_t r = pread(fd, buf, n, (off_t)off);
    return r < 0 ? -errno : r;
}
static int f_sig(void *u, int fd, uint64_t *size, uint64_t *mtime) {
    return moetax_store_vfs_default()->fstat_sig(u, fd, size, mtime);
}
static void f_close(void *u, int fd) { (void)u; close(fd); }
/* the same fault for the io_uring engine, on what the ring read */
static ssize_t f_result(void *u, int fd, void *buf, size_t n, uint64_t off, ssize_t res) {
    struct fault *f = u;
    (void)fd, (void)buf, (void)n, (void)off;
    return atomic_fetch_add(&f->reads, 1) + 1 >= atomic_load(&f->fail_at) ? -EIO : res;
}

/* Both I/O engines at a 25% budget (reads and evictions on every step), O_DIRECT, 2 threads,
 * prefetch on: the logits are the mapped run's bits, and the uring engine is the one reading
 * when this build and kernel have it. */
static void engines_case(struct moetax_model *m, const char *type, const float *ref) {
    const int64_t V = m->hp.n_vocab;
    const enum moetax_store_io_engine engines[2] = {MOETAX_STORE_IO_PREAD, MOETAX_STORE_IO_URING};
    for (int k = 0; k < 2; k++) {
        struct moetax_store_params sp = {.policy = MOETAX_STORE_NEXT_USE, .io_engine = engines[k]};
        struct moetax_store *s = NULL;
        const uint64_t slot = tu_store_slot_bytes(m, &sp);
        CHECK(slot > 0);
        sp.budget_bytes = (slot ? slot : 1) * (uint64_t)m->hp.n_expert * 2 / 4; /* 2 MoE layers */
        int ub = 64;
        moetax_status st = moetax_model_store_open(m, &sp, ub, 0, &s, &ub);
        CHECK_MSG(st == MOETAX_OK, "%s %s: %s", type, moetax_store_io_engine_name(engines[k]), moetax_last_error());
        if (st) continue;
        float *ref_ub = ub == 64 ? (float *)ref : run(m, NULL, 1, ub, false, &st);
        float *got = run(m, s, 2, ub, true, &st);
        CHECK_MSG(got && ref_ub && !memcmp(got, ref_ub, sizeof(float) * (size_t)(V * N_TOK)),
                  "%s engine %s: %s", type, moetax_store_io_engine_name(engines[k]),
                  got ? "logits differ from the resident run" : moetax_last_error());
        struct moetax_store_stats ss;
        moetax_store_get_stats(s, &ss);
        CHECK(ss.evictions > 0 && ss.loads > 0);
#ifdef MOETAX_WITH_URING
        if (engines[k] == MOETAX_STORE_IO_URING)
            CHECK_MSG(ss.io_engine == MOETAX_STORE_IO_URING || (ss.io_engine_fallback && ss.io_engine_errno == EPERM),
                      "%s: the uring engine is not reading", type);
#endif
        if (engines[k] == MOETAX_STORE_IO_PREAD) CHECK(ss.io_engine == MOETAX_STORE_IO_PREAD);
        if (ref_ub != ref) free(ref_ub);
        free(got);
        moetax_store_free(s);
    }
}

/* A learned predictor (moetax/predict.h) fitted on one run through a 25% store, then driving its
 * prefetch: it only chooses what is read ahead, so the logits stay the mapped run's, and both it and
 * the router guess are scored on every token of the layers it predicts. */
static void predictor_case(struct moetax_model *m, const char *type) {
    int moe[64], n_moe = 0;
    for (int l = 0; l < m->hp.n_layer && n_moe < 64; l++)
        if (m->layers[l].is_moe) moe[n_moe++] = l;
    struct moetax_predictor *p = NULL;
    CHECK(moetax_predictor_new("t", m->hp.n_layer, m->hp.n_embd, m->hp.n_expert, m->hp.n_expert_used, moe, n_moe, 2,
                               MOETAX_PREDICT_FEAT_CUR | MOETAX_PREDICT_FEAT_PREV, &p) == MOETAX_OK);
    if (!p) return;
    CHECK(moetax_predictor_fit_begin(p) == MOETAX_OK);
    p->use = false;
    struct moetax_store_params sp = {.policy = MOETAX_STORE_NEXT_USE};
    struct moetax_store *s = NULL;
    const uint64_t slot = tu_store_slot_bytes(m, &sp);
    CHECK(slot > 0);
    sp.budget_bytes = (slot ? slot : 1) * (uint64_t)m->hp.n_expert * (uint64_t)n_moe / 4;
    int ub = 64;
    moetax_status st = moetax_model_store_open(m, &sp, ub, 0, &s, &ub);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    float *ref = s ? run(m, NULL, 1, ub, false, &st) : NULL;
    if (s) moetax_store_set_predictor(s, p, false);
    float *got = ref ? run(m, s, 1, ub, true, &st) : NULL; /* fitting */
    const int64_t V = m->hp.n_vocab;
    CHECK_MSG(got && !memcmp(got, ref, sizeof(float) * (size_t)(V * N_TOK)), "%s fitting: logits differ", type);
    free(got);
    float *router[64] = {NULL};
    for (int i = 0; i < n_moe; i++) {
        router[moe[i]] = malloc(sizeof(float) * (size_t)(m->hp.n_expert * m->hp.n_embd));
        if (router[moe[i]]) CHECK(moe_predict_router_rows(m, moe[i], router[moe[i]]));
    }
    CHECK_MSG(moetax_predictor_fit_solve(p, 0.1, (const float *const *)router) == MOETAX_OK, "%s", moetax_last_error());
    CHECK(moetax_predictor_weights(p, moe[0], 1) != NULL);
    CHECK_EQ_INT(p->tokens, N_TOK);
    p->use = true;
    /* again through a store with the read-ahead two layers on (the learned guesses offered with
     * their margins, read by precision): the same logits, the same scores */
    struct moetax_store_params sp2 = sp;
    sp2.read_ahead = 2;
    sp2.read_ahead_min_precision = 0.01;
    struct moetax_store *s2 = NULL;
    int ub2 = 64;
    CHECK(moetax_model_store_open(m, &sp2, ub2, 0, &s2, &ub2) == MOETAX_OK && ub2 == ub);
    if (s2) moetax_store_set_predictor(s2, p, false);
    for (int threads = 1; ref && threads <= 4; threads++) {
        moetax_predictor_score_reset(p);
        got = run(m, threads > 2 ? s2 : s, threads > 2 ? threads - 2 : threads, ub, true, &st);
        CHECK_MSG(got && !memcmp(got, ref, sizeof(float) * (size_t)(V * N_TOK)),
                  "%s run %d (3, 4: read-ahead 2): logits with the learned predictor differ from the mapped run", type, threads);
        free(got);
        struct moetax_predict_score r = moetax_predictor_total(p, MOETAX_PREDICT_ROUTER, 1);
        struct moetax_predict_score l = moetax_predictor_total(p, MOETAX_PREDICT_LEARNED, 1);
        CHECK_EQ_INT(r.tokens, (uint64_t)N_TOK * (uint64_t)(n_moe - 1));
        CHECK_EQ_INT(l.tokens, r.tokens);
        CHECK(l.hits <= l.predicted && l.predicted == l.tokens * (uint64_t)m->hp.n_expert_used);
        CHECK_EQ_INT(moetax_predictor_total(p, MOETAX_PREDICT_LEARNED, 2).tokens,
                     n_moe > 2 ? (uint64_t)N_TOK * (uint64_t)(n_moe - 2) : 0);
    }
    if (s2) {
        struct moetax_store_stats ss;
        moetax_store_get_stats(s2, &ss);
        CHECK_MSG(ss.ahead_offered > 0 && ss.ahead_issued > 0, "%s: read-ahead with the predictor: %llu offered, %llu read",
                  type, (unsigned long long)ss.ahead_offered, (unsigned long long)ss.ahead_issued);
    }
    moetax_store_free(s2);
    for (int i = 0; i < n_moe; i++) free(router[moe[i]]);
    free(ref);
    moetax_store_free(s);
    moetax_predictor_free(p);
}

/* The store's read-ahead (store.h, READ-AHEAD): off, one and two layers ahead, the router guess's
 * offers (a precision floor low enough that they are read) only choose what is read early, so the
 * logits stay the mapped run's; with it on, offers are made and some are read. */
static void read_ahead_case(struct moetax_model *m, const char *type) {
    int n_moe = 0;
    for (int l = 0; l < m->hp.n_layer; l++) n_moe += m->layers[l].is_moe;
    const int depths[3] = {MOETAX_STORE_READ_AHEAD_OFF, 1, 2};
    for (int di = 0; di < 3; di++)
        for (int threads = 1; threads <= 2; threads++) {
            struct moetax_store_params sp = {.policy = MOETAX_STORE_NEXT_USE, .read_ahead = depths[di],
                                             .read_ahead_min_precision = 0.01};
            const uint64_t slot = tu_store_slot_bytes(m, &sp);
            CHECK(slot > 0);
            sp.budget_bytes = (slot ? slot : 1) * (uint64_t)m->hp.n_expert * (uint64_t)n_moe / 4;
            struct moetax_store *s = NULL;
            int ub = 64;
            moetax_status st = moetax_model_store_open(m, &sp, ub, 0, &s, &ub);
            CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
            if (st) continue;
            float *ref = run(m, NULL, 1, ub, false, &st);
            float *got = ref ? run(m, s, threads, ub, true, &st) : NULL;
            CHECK_MSG(got && !memcmp(got, ref, sizeof(float) * (size_t)(m->hp.n_vocab * N_TOK)),
                      "%s read-ahead %d threads %d: logits differ from the mapped run", type, depths[di], threads);
            struct moetax_store_stats ss;
            moetax_store_get_stats(s, &ss);
            if (depths[di] > 0) {
                CHECK_MSG(ss.ahead_offered > 0 && ss.ahead_issued > 0, "%s read-ahead %d: %llu offered, %llu read",
                          type, depths[di], (unsigned long long)ss.ahead_offered, (unsigned long long)ss.ahead_issued);
                CHECK(ss.ahead_used <= ss.ahead_issued && ss.ahead_issued <= ss.predicted_issued);
            } else CHECK_EQ_INT(ss.ahead_offered, 0);
            free(ref);
            free(got);
            moetax_store_free(s);
        }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    char path[512];
    snprintf(path, sizeof path, "%s", tu_path("store_model.gguf"));
    /* q4_0: the kernels may read it repacked (kernels.h: 8 rows interleaved; a fused gate_up's
     * halves repacked apart): the store repacks each expert it reads, the mapped run reads a private
     * repacked copy, and both must give the same bits (plain and fused gate_up) */
    const char *types[] = {"q8_0", "f32", "q4_0", "q4_0"};
    const char *extra[] = {"--expert-ff 64", "--expert-ff 64", "--embd 288 --expert-ff 320",
                           "--embd 288 --expert-ff 320 --fused-gate-up"};
    for (int ti = 0; ti < 4; ti++) {
        /* under ThreadSanitizer two of the files (Q8_0, and Q4_0 with a fused gate_up: both
         * layouts' repack paths); the store's threading is the same for every type */
        if (TU_UNDER_TSAN && (ti == 1 || ti == 2)) continue;
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "%s gen --preset tiny-v3 --type %s --experts 16 %s -o %s >/dev/null 2>&1",
                 tu_moetax_bin, types[ti], extra[ti], path);
        CHECK_EQ_INT(tu_run(cmd, NULL), 0);
        struct moetax_model *m;
        if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); continue; }
        const int64_t V = m->hp.n_vocab;
        moetax_status st;
        float *ref = run(m, NULL, 1, 64, false, &st);
        CHECK_MSG(ref != NULL, "resident run: %s", moetax_last_error());
        const double fracs[] = {1.0, 0.5, 0.25, 0.0};
        const enum moetax_store_policy pols[] = {MOETAX_STORE_LRU, MOETAX_STORE_NEXT_USE, MOETAX_STORE_LFU,
                                                 MOETAX_STORE_LFRU};
        /* under ThreadSanitizer (the `threads` stage, ~10x slower) two policies: the locking and
         * the slot life cycle are the same for all four, only the victim's score differs, and
         * the release build runs all four */
        const size_t n_pols = TU_UNDER_TSAN ? 2 : sizeof pols / sizeof pols[0];
        for (size_t fi = 0; ref && fi < sizeof fracs / sizeof fracs[0]; fi++) {
            for (size_t pi = 0; pi < n_pols; pi++) {
                for (int threads = 1; threads <= 2; threads++) {
                    for (int pf = 0; pf < 2; pf++) {
                        struct moetax_store_params sp = {.policy = pols[pi], .budget_bytes = 1};
                        /* budget: a fraction of all experts, or 0 = the minimum for one token */
                        uint64_t slot = tu_store_slot_bytes(m, &sp);
                        CHECK(slot > 0);
                        if (!slot) slot = 1;
                        uint64_t all = slot * (uint64_t)m->hp.n_expert * 2; /* 2 MoE layers */
                        sp.budget_bytes = fracs[fi] > 0 ? (uint64_t)(fracs[fi] * (double)all)
                                                        : slot * (uint64_t)m->hp.n_expert_used;
                        struct moetax_store *s = NULL;
                        int ub = 64;
                        st = moetax_model_store_open(m, &sp, ub, 0, &s, &ub);
                        CHECK_MSG(st == MOETAX_OK, "store %.0f%%: %s", 100 * fracs[fi], moetax_last_error());
                        if (st) continue;
                        /* the reference: the mapped run with the same micro-batch (a budget too small for a
                         * 64-token micro-batch of experts shrinks it, and batching changes float rounding) */
                        float *ref_ub = ub == 64 ? ref : run(m, NULL, 1, ub, false, &st);
                        float *got = run(m, s, threads, ub, pf, &st);
                        CHECK_MSG(got != NULL, "budget %.0f%% %s: %s", 100 * fracs[fi],
                                  moetax_store_policy_name(pols[pi]), moetax_last_error());
                        if (got) {
                            CHECK_MSG(ref_ub && memcmp(got, ref_ub, sizeof(float) * (size_t)(V * N_TOK)) == 0,
                                      "%s budget %.0f%% (ubatch %d) policy %s threads %d prefetch %d: logits differ from the "
                                      "resident run", types[ti], 100 * fracs[fi], ub, moetax_store_policy_name(pols[pi]),
                                      threads, pf);
                        }
                        struct moetax_store_stats ss;
                        moetax_store_get_stats(s, &ss);
                        if (fracs[fi] < 0.5) CHECK_MSG(ss.evictions > 0, "a small budget evicts");
                        if (fracs[fi] == 1.0 && pf == 0) CHECK(ss.loads <= (uint64_t)(2 * m->hp.n_expert));
                        if (ref_ub != ref) free(ref_ub);
                        free(got);
                        moetax_store_free(s);
                    }
                }
            }
        }
        /* budget below one token's experts: refused with the minimum named */
        struct moetax_store_params small = {.budget_bytes = 4096};
        struct moetax_store *s = NULL;
        int ub = 64;
        CHECK(moetax_model_store_open(m, &small, ub, 0, &s, &ub) == MOETAX_ERR_ARG);
        CHECK_MSG(strstr(moetax_last_error(), "at least"), "message: %s", moetax_last_error());
        /* a read fault: clear error naming the expert and the file, and the next step retries */
        for (int fail_at = 1; fail_at <= 6; fail_at++) { /* 4..6: the same with the uring engine */
            struct fault fl;
            atomic_init(&fl.fail_at, (fail_at - 1) % 3 + 1);
            atomic_init(&fl.reads, 0);
            struct moetax_store_vfs vfs = {f_open, f_pread, f_sig, f_close, &fl, f_result};
            struct moetax_store_params fp = {.budget_bytes = (uint64_t)1 << 30, .vfs = &vfs, .buffered_io = true,
                                             .io_engine = fail_at > 3 ? MOETAX_STORE_IO_URING : MOETAX_STORE_IO_PREAD};
            ub = 64;
            CHECK(moetax_model_store_open(m, &fp, ub, 0, &s, &ub) == MOETAX_OK);
            float *got = run(m, s, 2, ub, true, &st);
            CHECK_MSG(got == NULL && st == MOETAX_ERR_IO, "fault at read %d: status %s", fail_at, moetax_status_name(st));
            const char *e = moetax_last_error();
            CHECK_MSG(strstr(e, "store_model.gguf") && strstr(e, "expert") && strstr(e, "layer"), "message: %s", e);
            free(got);
            atomic_store(&fl.fail_at, 1 << 30); /* the device recovers: the failed experts are read again */
            got = run(m, s, 2, ub, true, &st);
            CHECK_MSG(got != NULL && !memcmp(got, ref, sizeof(float) * (size_t)(V * N_TOK)), "after a fault: %s",
                      got ? "logits differ" : moetax_last_error());
            free(got);
            moetax_store_free(s);
        }
        if (ref) engines_case(m, types[ti], ref);
        predictor_case(m, types[ti]);
        read_ahead_case(m, types[ti]);
        free(ref);
        moetax_model_free(m);
    }
    { /* more MoE layers than two: the learned predictor's deeper prefetch (two layers ahead) runs too */
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "%s gen --preset tiny-v3 --type q8_0 --experts 16 --expert-ff 64 --layers 5 -o %s "
                 ">/dev/null 2>&1", tu_moetax_bin, path);
        CHECK_EQ_INT(tu_run(cmd, NULL), 0);
        struct moetax_model *m;
        if (moetax_model_load(path, &m) == MOETAX_OK) {
            predictor_case(m, "q8_0, 5 layers");
            read_ahead_case(m, "q8_0, 5 layers");
            moetax_model_free(m);
        } else CHECK_MSG(0, "%s", moetax_last_error());
    }
    return tu_finish("test_model_store");
}
