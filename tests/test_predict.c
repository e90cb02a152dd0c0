// ctest-labels: unit;model
/* test_predict.c - the learned expert predictor (moetax/predict.h): a fit recovers a map the
 * router guess does not know and beats it on fresh samples; the file round-trips bit for bit,
 * with and without a hidden layer (version 2), and a version 1 file still loads; the evaluation
 * follows its definition; short, damaged or inconsistent files are refused with the field named,
 * never a crash; in the engine a predictor with a hidden layer, the route features and a margin
 * driving a 25% store's prefetch leaves every logit's bits as they are without a store, and its
 * extra experts are scored. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/predict.h"
#include "moetax/model.h"
#include "moetax/predict.h"
#include "moetax/store.h"
#include "testutil.h"

enum { D = 16, E = 8, K = 2, L = 4 };
/* the model the predictors below are for: MoE layers 1, 2, 3 */
static const bool IS_MOE[L] = {false, true, true, true};
static const struct moetax_predict_model MODEL = {L, D, E, IS_MOE};

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, [0, 1) */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (double)((rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}
static float nrand(void) { return (float)(sqrt(-2 * log(urand() + 1e-12)) * cos(6.283185307179586 * urand())); }

static void top(const float *z, int32_t *idx) { /* top K of E, descending */
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int i = 0; i < j; i++) taken = taken || idx[i] == e;
            if (!taken && (best < 0 || z[e] > z[best])) best = e;
        }
        idx[j] = best;
    }
}

static int overlap(const int32_t *a, const int32_t *b) {
    int h = 0;
    for (int i = 0; i < K; i++)
        for (int j = 0; j < K; j++) h += a[i] == b[j];
    return h;
}

/* Layers 1, 2, 3 are MoE: pairs 1->2, 2->3 (and 1->3 two ahead). Targets y = W* f + noise with
 * W* = G + a large change; the fit is pulled to G but the data outweigh it. */
static struct moetax_predictor *fitted(float *G /* [L][E][D] */, float *Wstar /* [L][E][D + 1] */) {
    const int moe[3] = {1, 2, 3};
    struct moetax_predictor *p = NULL;
    CHECK(moetax_predictor_new("synthetic", L, D, E, K, moe, 3, 2, MOETAX_PREDICT_FEAT_CUR, &p) == MOETAX_OK);
    if (!p) return NULL;
    CHECK_EQ_INT(p->n_feat, D + 1);
    CHECK_EQ_INT(p->target[moetax_predictor_pair(p, 1, 1)], 2);
    CHECK_EQ_INT(p->target[moetax_predictor_pair(p, 1, 2)], 3);
    CHECK_EQ_INT(p->target[moetax_predictor_pair(p, 3, 1)], -1);
    for (int i = 0; i < L * E * D; i++) G[i] = nrand();
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++)
            for (int i = 0; i <= D; i++)
                Wstar[(l * E + e) * (D + 1) + i] = (i < D ? 0.2f * G[(l * E + e) * D + i] : 0) + 1.5f * nrand();
    CHECK(moetax_predictor_fit_begin(p) == MOETAX_OK);
    enum { N = 2000 };
    float *f = malloc(sizeof(float) * N * (D + 1)), *y = malloc(sizeof(float) * N * E);
    for (int l = 1; f && y && l <= 2; l++)
        for (int a = 1; a <= 2; a++) {
            const int T = p->target[moetax_predictor_pair(p, l, a)];
            if (T < 0) continue;
            for (int t = 0; t < N; t++) {
                for (int i = 0; i < D; i++) f[t * (D + 1) + i] = nrand();
                f[t * (D + 1) + D] = 1;
                for (int e = 0; e < E; e++) {
                    float z = 0.05f * nrand();
                    for (int i = 0; i <= D; i++) z += Wstar[(T * E + e) * (D + 1) + i] * f[t * (D + 1) + i];
                    y[t * E + e] = z;
                }
            }
            moetax_predictor_fit_add(p, l, a, f, y, N / 2); /* in two parts: sums add up */
            moetax_predictor_fit_add(p, l, a, f + (N / 2) * (D + 1), y + (N / 2) * E, N - N / 2);
        }
    free(f);
    free(y);
    const float *router[L];
    for (int l = 0; l < L; l++) router[l] = G + l * E * D;
    CHECK_MSG(moetax_predictor_fit_solve(p, 0.1, router) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_EQ_INT(p->tokens, 2000);
    /* the pairs solved side by side (more threads than pairs) give the same weights, bit for bit */
    const size_t nw = (size_t)L * 2 * E * (D + 1);
    float *w1 = malloc(sizeof(float) * nw);
    if (w1) {
        memcpy(w1, p->w, sizeof(float) * nw);
        p->fit_threads = 5;
        CHECK(moetax_predictor_fit_solve(p, 0.1, router) == MOETAX_OK);
        CHECK(memcmp(w1, p->w, sizeof(float) * nw) == 0);
        CHECK_EQ_INT(p->tokens, 2000);
        p->fit_threads = 0;
        free(w1);
    }
    return p;
}

/* The fit's sums are every token's f f^T and f y^T, whatever the parts the tokens come in and
 * wherever the fit's buffering and chunking cut them: after the solve (which takes the tokens
 * still buffered) the upper triangle of the sums matches a double-precision reference. */
static void fit_sums_exact(void) {
    const int moe[3] = {1, 2, 3};
    struct moetax_predictor *p = NULL;
    enum { DS = 150, NT = 700 }; /* features in three blocks of the fit's products; tokens in
                                   * more than two of its chunks, and a part */
    CHECK(moetax_predictor_new("sums", L, DS, E, K, moe, 3, 1, MOETAX_PREDICT_FEAT_CUR, &p) == MOETAX_OK);
    if (!p) return;
    CHECK(moetax_predictor_fit_begin(p) == MOETAX_OK);
    const int F = DS + 1;
    float *f = malloc(sizeof(float) * NT * F), *y = malloc(sizeof(float) * NT * E);
    double *xx = calloc((size_t)F * F, sizeof(double)), *xy = calloc((size_t)F * E, sizeof(double));
    if (!f || !y || !xx || !xy) { CHECK(false); goto done; }
    for (int t = 0; t < NT; t++) {
        for (int i = 0; i < DS; i++) f[t * F + i] = nrand();
        f[t * F + DS] = 1;
        for (int e = 0; e < E; e++) y[t * E + e] = nrand();
        for (int i = 0; i < F; i++) {
            for (int j = i; j < F; j++) xx[i * F + j] += (double)f[t * F + i] * f[t * F + j];
            for (int e = 0; e < E; e++) xy[i * E + e] += (double)f[t * F + i] * y[t * E + e];
        }
    }
    static const int parts[] = {1, 254, 3, 300, 142}; /* sums to NT */
    for (int k = 0, t = 0; k < 5; t += parts[k], k++) moetax_predictor_fit_add(p, 1, 1, f + t * F, y + t * E, parts[k]);
    CHECK(moetax_predictor_fit_solve(p, 0.1, NULL) == MOETAX_OK);
    double worst = 0;
    for (int i = 0; i < F; i++) {
        for (int j = i; j < F; j++) {
            const double d = fabs(p->xtx[i * F + j] - xx[i * F + j]) / (fabs(xx[i * F + j]) + NT);
            worst = d > worst ? d : worst;
        }
        for (int e = 0; e < E; e++) {
            const double d = fabs(p->xty[i * E + e] - xy[i * E + e]) / (fabs(xy[i * E + e]) + NT);
            worst = d > worst ? d : worst;
        }
    }
    CHECK_MSG(worst < 1e-6, "the fit's sums differ from the reference by %g (relative)", worst);
    CHECK(p->tokens == NT);
    /* the weights solve the ridge's normal equations (no router: pulled to 0), (S + r I) w_e = y_e,
     * with r = lambda x the mean of S's diagonal, the bias's floor 1e-9 x that mean */
    const float *W = moetax_predictor_weights(p, 1, 1);
    CHECK(W != NULL);
    double mean = 0;
    for (int i = 0; i < F; i++) mean += xx[i * F + i];
    mean /= F;
    double res = 0;
    for (int e = 0; W && e < E; e++) {
        double ny = 0, nr = 0;
        for (int i = 0; i < F; i++) {
            double z = (i == F - 1 ? 1e-9 * mean : (0.1 + 1e-9) * mean) * W[e * F + i];
            for (int j = 0; j < F; j++) z += (i <= j ? xx[i * F + j] : xx[j * F + i]) * W[e * F + j];
            nr += (z - xy[i * E + e]) * (z - xy[i * E + e]);
            ny += xy[i * E + e] * xy[i * E + e];
        }
        res = sqrt(nr / ny) > res ? sqrt(nr / ny) : res;
    }
    CHECK_MSG(res < 1e-5, "the weights leave a residual of %g (relative) in the normal equations", res);
done:
    free(f);
    free(y);
    free(xx);
    free(xy);
    moetax_predictor_free(p);
}

static void beats_router(const struct moetax_predictor *p, const float *G, const float *Wstar) {
    for (int l = 1; l <= 2; l++) {
        const int T = p->target[moetax_predictor_pair(p, l, 1)];
        const float *W = moetax_predictor_weights(p, l, 1);
        CHECK(W != NULL);
        if (!W) continue;
        int hit_l = 0, hit_r = 0, n = 0;
        for (int t = 0; t < 500; t++, n += K) {
            float f[D + 1], zt[E], zl[E], zr[E];
            for (int i = 0; i < D; i++) f[i] = nrand();
            f[D] = 1;
            for (int e = 0; e < E; e++) {
                zt[e] = zl[e] = zr[e] = 0;
                for (int i = 0; i <= D; i++) {
                    zt[e] += Wstar[(T * E + e) * (D + 1) + i] * f[i];
                    zl[e] += W[e * (D + 1) + i] * f[i];
                    if (i < D) zr[e] += G[(T * E + e) * D + i] * f[i];
                }
            }
            int32_t it[K], il[K], ir[K];
            top(zt, it);
            top(zl, il);
            top(zr, ir);
            hit_l += overlap(il, it);
            hit_r += overlap(ir, it);
        }
        const double rl = (double)hit_l / n, rr = (double)hit_r / n;
        CHECK_MSG(rl > 0.9 && rl > rr + 0.3, "layer %d -> %d: learned recall %.3f, router guess %.3f", l, T, rl, rr);
    }
    CHECK(moetax_predictor_weights(p, 3, 1) == NULL); /* no layer after the last */
}

static const char *write_bytes(const char *name, const unsigned char *b, size_t n) {
    const char *path = tu_path(name);
    FILE *f = fopen(path, "wb");
    if (!f) return path;
    if (n) fwrite(b, 1, n, f);
    fclose(f);
    return path;
}

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)sz + 1);
    *n = b ? fread(b, 1, (size_t)sz, f) : 0;
    fclose(f);
    return b;
}

static void put32(unsigned char *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}

static void file_roundtrip_and_damage(const struct moetax_predictor *p) {
    const char *path = tu_path("predict_rt.pred");
    CHECK_MSG(moetax_predictor_write(p, path) == MOETAX_OK, "%s", moetax_last_error());
    struct moetax_predictor *q = NULL;
    CHECK_MSG(moetax_predictor_load(path, &MODEL, &q) == MOETAX_OK, "%s", moetax_last_error());
    if (q) {
        CHECK_EQ_INT(q->n_layer, L);
        CHECK_EQ_INT(q->n_embd, D);
        CHECK_EQ_INT(q->n_expert, E);
        CHECK_EQ_INT(q->n_expert_used, K);
        CHECK_EQ_INT(q->ahead, 2);
        CHECK_EQ_INT(q->features, MOETAX_PREDICT_FEAT_CUR);
        CHECK_EQ_INT(q->tokens, p->tokens);
        CHECK(!strcmp(q->model, "synthetic"));
        for (int l = 0; l < L; l++)
            for (int a = 1; a <= 2; a++) {
                const float *wp = moetax_predictor_weights(p, l, a), *wq = moetax_predictor_weights(q, l, a);
                CHECK_MSG((wp == NULL) == (wq == NULL), "pair (%d, %d) present in one only", l, a);
                if (wp && wq) {
                    CHECK(!memcmp(wp, wq, sizeof(float) * E * (D + 1)));
                    CHECK_EQ_INT(q->target[moetax_predictor_pair(q, l, a)], p->target[moetax_predictor_pair(p, l, a)]);
                }
            }
        /* the model it was written for, checked by the loader: its shape (another width: refused,
         * below) and its MoE layers (layer 2 dense: a pair that predicts it, or predicts from it, is
         * refused, naming the pair) */
        const bool is_moe[L] = {false, true, false, true};
        const struct moetax_predict_model dense2 = {L, D, E, is_moe};
        struct moetax_predictor *x = NULL;
        CHECK(moetax_predictor_load(path, &dense2, &x) == MOETAX_ERR_FORMAT && x == NULL);
        CHECK_MSG(strstr(moetax_last_error(), "pair") && strstr(moetax_last_error(), "MoE layer"), "%s",
                  moetax_last_error());
    }
    moetax_predictor_free(q);

    size_t n = 0;
    unsigned char *good = read_all(path, &n);
    CHECK(good && n == MOETAX_PREDICT_HEADER_BYTES + 3 * (MOETAX_PREDICT_PAIR_HEADER_BYTES + 4 * E * (D + 1)) + 8);
    unsigned char *b = good && n > MOETAX_PREDICT_HEADER_BYTES + 8 && n < (1u << 20) ? malloc(n) : NULL;
    if (!b) {
        free(good);
        return;
    }
    struct { const char *what, *field; } cases[] = {
        {"empty", "shorter"}, {"header only", "size"}, {"truncated by one byte", "size"}, {"one byte more", "size"},
        {"magic", "magic"}, {"version", "version"}, {"n_expert_used > n_expert", "n_expert_used"},
        {"n_feat", "n_feat"}, {"n_pairs huge", "n_pairs"}, {"a weight flipped", "checksum"},
        {"checksum flipped", "checksum"}, {"pair layer out of range", "pair layer"}, {"nan weight", "weight"},
        {"ahead 3", "ahead"}, {"n_hidden huge", "n_hidden"}, {"margin negative", "margin"},
        {"margin nan", "margin"}, {"features: an unknown bit", "features"}, {"version 0", "version"},
        {"version 1 with a hidden layer", "n_hidden"}, {"version 1 with a margin", "margin"},
        {"version 1 with FEAT_ROUTE", "features"}, {"no pairs, the size of three", "size"},
        {"a pair's target two MoE layers on at distance 1", "pair target"}, {"a pair of a dense layer", "pair layer"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        memcpy(b, good, n);
        size_t m = n;
        bool fix_sum = false; /* damage behind a valid checksum, to reach the later checks */
        switch (c) {
        case 0: m = 0; break;
        case 1: m = MOETAX_PREDICT_HEADER_BYTES + 8; break;
        case 2: m = n - 1; break;
        case 3: m = n; break; /* written with an extra byte below */
        case 4: b[0] = 'X'; break;
        case 5: put32(b + 8, 3); break;
        case 6: put32(b + 24, E + 1); break;
        case 7: put32(b + 36, D); break;
        case 8: put32(b + 40, 0xffffffffu); break;
        case 9: b[MOETAX_PREDICT_HEADER_BYTES + MOETAX_PREDICT_PAIR_HEADER_BYTES + 5] ^= 0x40; break;
        case 10: b[n - 1] ^= 1; break;
        case 11: put32(b + MOETAX_PREDICT_HEADER_BYTES, 99); fix_sum = true; break;
        case 12: put32(b + MOETAX_PREDICT_HEADER_BYTES + MOETAX_PREDICT_PAIR_HEADER_BYTES + 8, 0x7fc00000u); fix_sum = true; break;
        case 13: put32(b + 28, 3); break;
        case 14: put32(b + 44, MOETAX_PREDICT_HIDDEN_MAX + 1); break;
        case 15: put32(b + 60, 0xbf800000u); break; /* -1.0f */
        case 16: put32(b + 60, 0x7fc00000u); break;
        case 17: put32(b + 32, MOETAX_PREDICT_FEAT_CUR | 8); break;
        case 18: put32(b + 8, 0); break;
        case 19: put32(b + 8, 1); put32(b + 44, 1); break;
        case 20: put32(b + 8, 1); put32(b + 60, 0x3f800000u); break;
        case 21: put32(b + 8, 1); put32(b + 32, MOETAX_PREDICT_FEAT_CUR | MOETAX_PREDICT_FEAT_ROUTE); break;
        case 22: put32(b + 40, 0); break;
        case 23: put32(b + MOETAX_PREDICT_HEADER_BYTES + 8, 3); fix_sum = true; break; /* pair (1, 1): 2 */
        case 24: put32(b + MOETAX_PREDICT_HEADER_BYTES, 0); fix_sum = true; break;
        }
        if (fix_sum) { /* FNV-1a 64 of everything before the checksum, as the writer does */
            uint64_t h = 0xcbf29ce484222325ull;
            for (size_t i = 0; i + 8 < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
            for (int i = 0; i < 8; i++) b[n - 8 + i] = (unsigned char)(h >> (8 * i));
        }
        const char *bp;
        if (c == 3) {
            unsigned char *b2 = malloc(n + 1);
            memcpy(b2, b, n);
            b2[n] = 0;
            bp = write_bytes("predict_bad.pred", b2, n + 1);
            free(b2);
        } else bp = write_bytes("predict_bad.pred", b, m);
        struct moetax_predictor *r = NULL;
        moetax_status st = moetax_predictor_load(bp, &MODEL, &r);
        CHECK_MSG(st == MOETAX_ERR_FORMAT && r == NULL && strstr(moetax_last_error(), cases[c].field) &&
                      strstr(moetax_last_error(), "predict_bad.pred"),
                  "%s: status %s, message '%s' (wanted '%s')", cases[c].what, moetax_status_name(st), moetax_last_error(),
                  cases[c].field);
        moetax_predictor_free(r);
    }
    struct moetax_predictor *r = NULL;
    CHECK(moetax_predictor_load(tu_path("predict_missing.pred"), &MODEL, &r) == MOETAX_ERR_IO && r == NULL);
    /* another model: refused by its shape, naming both */
    const struct moetax_predict_model wider = {L, D + 1, E, IS_MOE};
    CHECK(moetax_predictor_load(path, &wider, &r) == MOETAX_ERR_ARG && r == NULL);
    CHECK_MSG(strstr(moetax_last_error(), "width 16") && strstr(moetax_last_error(), "the model has 4, 17, 8"), "%s",
              moetax_last_error());
    /* a header alone that asks for the largest shape (4096 layers, 65536 experts, 2 ahead, no pairs or
     * one): refused by the model's shape before anything of that size is allocated */
    memset(b, 0, MOETAX_PREDICT_HEADER_BYTES + 8);
    memcpy(b, good, 8);
    put32(b + 8, 2), put32(b + 12, 4096), put32(b + 16, 65536), put32(b + 20, 65536), put32(b + 24, 1);
    put32(b + 28, 2), put32(b + 32, MOETAX_PREDICT_FEAT_CUR), put32(b + 36, 65537);
    for (int big_pairs = 0; big_pairs <= 1; big_pairs++) {
        put32(b + 40, (uint32_t)big_pairs);
        uint64_t h = 0xcbf29ce484222325ull;
        for (size_t i = 0; i < MOETAX_PREDICT_HEADER_BYTES; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
        for (int i = 0; i < 8; i++) b[MOETAX_PREDICT_HEADER_BYTES + i] = (unsigned char)(h >> (8 * i));
        const char *hp = write_bytes("predict_huge.pred", b, MOETAX_PREDICT_HEADER_BYTES + 8);
        moetax_status st = moetax_predictor_load(hp, &MODEL, &r);
        CHECK_MSG(st != MOETAX_OK && r == NULL && strstr(moetax_last_error(), "predict_huge.pred") &&
                      strstr(moetax_last_error(), "the model has"),
                  "%d pairs: %s", big_pairs, moetax_last_error());
    }
    free(b);
    free(good);
}

/* A version 1 file (the same bytes with version 1: no hidden layer, no margin) loads as the same
 * predictor; a newer version is refused saying so. */
static void version1_loads(const struct moetax_predictor *p) {
    const char *path = tu_path("predict_v2.pred");
    CHECK(moetax_predictor_write(p, path) == MOETAX_OK);
    size_t n = 0;
    unsigned char *b = read_all(path, &n);
    if (!b || n < MOETAX_PREDICT_HEADER_BYTES + 8) {
        free(b);
        CHECK(false);
        return;
    }
    put32(b + 8, 1);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i + 8 < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    for (int i = 0; i < 8; i++) b[n - 8 + i] = (unsigned char)(h >> (8 * i));
    const char *v1 = write_bytes("predict_v1.pred", b, n);
    struct moetax_predictor *q = NULL;
    CHECK_MSG(moetax_predictor_load(v1, &MODEL, &q) == MOETAX_OK, "a version 1 file: %s", moetax_last_error());
    if (q) {
        CHECK_EQ_INT(q->n_hidden, 0);
        CHECK(q->margin == 0);
        const float *wp = moetax_predictor_weights(p, 1, 1), *wq = moetax_predictor_weights(q, 1, 1);
        CHECK(wp && wq && !memcmp(wp, wq, sizeof(float) * E * (D + 1)));
    }
    moetax_predictor_free(q);
    put32(b + 8, 3);
    h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i + 8 < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    for (int i = 0; i < 8; i++) b[n - 8 + i] = (unsigned char)(h >> (8 * i));
    const char *v3 = write_bytes("predict_v3.pred", b, n);
    q = NULL;
    CHECK(moetax_predictor_load(v3, &MODEL, &q) == MOETAX_ERR_FORMAT && !q);
    CHECK_MSG(strstr(moetax_last_error(), "newer than this moetax reads"), "%s", moetax_last_error());
    free(b);
}

/* A predictor with a hidden layer and the route features: evaluation is W f + W2 relu(W1 f + b1);
 * the file round-trips every weight and the margin bit for bit; a hidden weight that is not finite
 * is refused, at its offset. */
static void hidden_layer(void) {
    enum { HID = 5 };
    const int moe[3] = {1, 2, 3};
    const uint32_t feat = MOETAX_PREDICT_FEAT_CUR | MOETAX_PREDICT_FEAT_PREV | MOETAX_PREDICT_FEAT_ROUTE;
    struct moetax_predictor *p = NULL;
    CHECK(moetax_predictor_new_hidden("hid", L, D, E, K, moe, 3, 1, feat, MOETAX_PREDICT_HIDDEN_MAX + 1, &p) ==
          MOETAX_ERR_ARG && !p);
    CHECK(moetax_predictor_new_hidden("hid", L, D, E, K, moe, 3, 1, feat, HID, &p) == MOETAX_OK);
    if (!p) return;
    const int F = 2 * D + 2 * E + 1;
    CHECK_EQ_INT(p->n_feat, F);
    CHECK_EQ_INT(moetax_predictor_n_feat(D, E, feat), F);
    const float *w1, *b1, *w2;
    CHECK(!moetax_predictor_hidden(p, 1, 1, &w1, &b1, &w2)); /* no weights yet */
    for (int l = 1; l <= 2; l++) {
        const int q = moetax_predictor_pair(p, l, 1);
        p->have[q] = 1;
        for (int i = 0; i < E * F; i++) p->w[(size_t)q * E * F + i] = 0.3f * nrand();
        for (int i = 0; i < HID * F; i++) p->w1[(size_t)q * HID * F + i] = nrand();
        for (int i = 0; i < HID; i++) p->b1[(size_t)q * HID + i] = nrand();
        for (int i = 0; i < E * HID; i++) p->w2[(size_t)q * E * HID + i] = nrand();
    }
    p->margin = 0.125f;
    p->tokens = 77;
    CHECK(moetax_predictor_hidden(p, 2, 1, &w1, &b1, &w2) && w1 && b1 && w2);
    float f[2 * D + 2 * E + 1], z[E], h[HID];
    for (int i = 0; i < F; i++) f[i] = nrand();
    moetax_predictor_eval(p, 2, 1, f, z, h);
    const float *W = moetax_predictor_weights(p, 2, 1);
    int relu_zero = 0;
    for (int e = 0; e < E; e++) {
        double want = 0;
        for (int i = 0; i < F; i++) want += (double)W[e * F + i] * f[i];
        for (int j = 0; j < HID; j++) {
            double a = b1[j];
            for (int i = 0; i < F; i++) a += (double)w1[j * F + i] * f[i];
            relu_zero += e == 0 && a <= 0;
            want += (a > 0 ? a : 0) * w2[e * HID + j];
        }
        CHECK_MSG(fabs(want - z[e]) < 1e-4 * (1 + fabs(want)), "expert %d: z %g, want %g", e, z[e], want);
    }
    CHECK_MSG(relu_zero > 0 && relu_zero < HID, "the relu both cut and passed (%d of %d cut)", relu_zero, HID);
    const char *path = tu_path("predict_hidden.pred");
    CHECK_MSG(moetax_predictor_write(p, path) == MOETAX_OK, "%s", moetax_last_error());
    struct moetax_predictor *q = NULL;
    CHECK_MSG(moetax_predictor_load(path, &MODEL, &q) == MOETAX_OK, "%s", moetax_last_error());
    if (q) {
        CHECK_EQ_INT(q->n_hidden, HID);
        CHECK_EQ_INT(q->features, feat);
        CHECK(q->margin == 0.125f);
        CHECK_EQ_INT(q->tokens, 77);
        for (int l = 1; l <= 2; l++) {
            const float *a1, *a2, *a3, *c1, *c2, *c3;
            CHECK(moetax_predictor_hidden(p, l, 1, &a1, &a2, &a3) && moetax_predictor_hidden(q, l, 1, &c1, &c2, &c3));
            if (!c1) continue;
            CHECK(!memcmp(a1, c1, sizeof(float) * HID * F) && !memcmp(a2, c2, sizeof(float) * HID) &&
                  !memcmp(a3, c3, sizeof(float) * E * HID));
            CHECK(!memcmp(moetax_predictor_weights(p, l, 1), moetax_predictor_weights(q, l, 1), sizeof(float) * E * F));
        }
        CHECK(!moetax_predictor_hidden(q, 3, 1, &w1, &b1, &w2) && !w1 && !b1 && !w2); /* no pair after the last */
    }
    moetax_predictor_free(q);
    size_t n = 0;
    unsigned char *b = read_all(path, &n);
    const size_t entry = MOETAX_PREDICT_PAIR_HEADER_BYTES + 4 * ((size_t)E * F + (size_t)HID * F + HID + (size_t)E * HID);
    CHECK(b && n == MOETAX_PREDICT_HEADER_BYTES + 2 * entry + 8);
    if (b && n == MOETAX_PREDICT_HEADER_BYTES + 2 * entry + 8) {
        /* the last w2 weight of the second pair: NaN behind a valid checksum */
        put32(b + MOETAX_PREDICT_HEADER_BYTES + 2 * entry - 4, 0x7f800000u);
        uint64_t hh = 0xcbf29ce484222325ull;
        for (size_t i = 0; i + 8 < n; i++) { hh ^= b[i]; hh *= 0x100000001b3ull; }
        for (int i = 0; i < 8; i++) b[n - 8 + i] = (unsigned char)(hh >> (8 * i));
        const char *bp = write_bytes("predict_hidden_bad.pred", b, n);
        q = NULL;
        CHECK(moetax_predictor_load(bp, &MODEL, &q) == MOETAX_ERR_FORMAT && !q);
        char want[32];
        snprintf(want, sizeof want, "offset %zu", MOETAX_PREDICT_HEADER_BYTES + 2 * entry - 4);
        CHECK_MSG(strstr(moetax_last_error(), "weight") && strstr(moetax_last_error(), want), "%s (wanted %s)",
                  moetax_last_error(), want);
        /* one byte short */
        bp = write_bytes("predict_hidden_bad.pred", b, n - 1);
        CHECK(moetax_predictor_load(bp, &MODEL, &q) == MOETAX_ERR_FORMAT && !q && strstr(moetax_last_error(), "size"));
    }
    free(b);
    moetax_predictor_free(p);
}

enum { N_TOK = 24 };

/* logits of a prefill of 8 tokens then 16 decode steps (teacher-forced) */
static float *run_model(struct moetax_model *m, struct moetax_store *store, int threads, int ubatch) {
    struct moetax_ctx_params cp = {.n_ctx = 64, .n_threads = threads, .n_ubatch = ubatch, .store = store};
    struct moetax_ctx *c;
    if (moetax_ctx_init(m, &cp, &c)) return NULL;
    const int64_t V = m->hp.n_vocab;
    float *l = calloc((size_t)(V * N_TOK), sizeof(float));
    int32_t t[N_TOK];
    for (int i = 0; i < N_TOK; i++) t[i] = (int32_t)((i * 53 + 7) % V);
    moetax_status st = l ? moetax_ctx_eval(c, t, 8, l, true) : MOETAX_ERR_NOMEM;
    for (int i = 8; !st && i < N_TOK; i++) st = moetax_ctx_eval(c, t + i, 1, l + i * V, false);
    moetax_ctx_free(c);
    if (st) {
        free(l);
        return NULL;
    }
    return l;
}

static void engine(void) {
    const char *path = tu_path("predict_model.gguf");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s gen --preset tiny-v3 --experts 16 --expert-ff 64 -o %s >/dev/null 2>&1", tu_moetax_bin,
             path);
    CHECK_EQ_INT(tu_run(cmd, NULL), 0);
    struct moetax_model *m = NULL;
    if (moetax_model_load(path, &m) != MOETAX_OK) {
        CHECK_MSG(0, "%s", moetax_last_error());
        return;
    }
    int moe[64], n_moe = 0;
    for (int l = 0; l < m->hp.n_layer && n_moe < 64; l++)
        if (m->layers[l].is_moe) moe[n_moe++] = l;
    const int64_t V = m->hp.n_vocab, Em = m->hp.n_expert, k = m->hp.n_expert_used;
    enum { HID = 24 };
    struct moetax_predictor *p = NULL;
    CHECK(moetax_predictor_new_hidden("t", m->hp.n_layer, m->hp.n_embd, (int)Em, (int)k, moe, n_moe, 2,
                                      MOETAX_PREDICT_FEAT_ALL, HID, &p) == MOETAX_OK);
    struct moetax_store_params sp = {.policy = MOETAX_STORE_NEXT_USE};
    struct moetax_store *s = NULL;
    const uint64_t slot = tu_store_slot_bytes(m, &sp);
    CHECK(slot > 0);
    sp.budget_bytes = (slot ? slot : 1) * (uint64_t)Em * (uint64_t)n_moe / 4;
    int ub = 64;
    CHECK_MSG(moetax_model_store_open(m, &sp, ub, 0, &s, &ub) == MOETAX_OK, "%s", moetax_last_error());
    /* the reference: the mapped run with the micro-batch the budget allows (batching changes rounding) */
    float *ref = run_model(m, NULL, 1, ub);
    CHECK(ref != NULL);
    if (p && s && ref) {
        /* random weights: a wrong guess is as good as a right one for this test (only what is read
         * ahead may change); the margin makes extra experts */
        const int F = p->n_feat;
        for (int q = 0; q < p->n_layer * p->ahead; q++) {
            if (p->target[q] < 0) continue;
            p->have[q] = 1;
            for (int i = 0; i < Em * F; i++) p->w[(size_t)q * Em * F + i] = 0.2f * nrand();
            for (int i = 0; i < HID * F; i++) p->w1[(size_t)q * HID * F + i] = 0.2f * nrand();
            for (int i = 0; i < HID; i++) p->b1[(size_t)q * HID + i] = 0.1f * nrand();
            for (int i = 0; i < Em * HID; i++) p->w2[(size_t)q * Em * HID + i] = 0.2f * nrand();
        }
        p->margin = 0.05f;
        moetax_store_set_predictor(s, p, false);
        for (int threads = 1; threads <= 2; threads++) {
            moetax_predictor_score_reset(p);
            float *got = run_model(m, s, threads, ub);
            CHECK_MSG(got && !memcmp(got, ref, sizeof(float) * (size_t)(V * N_TOK)),
                      "threads %d: logits with a hidden-layer predictor and a margin differ from the mapped run", threads);
            free(got);
            struct moetax_predict_score r = moetax_predictor_total(p, MOETAX_PREDICT_ROUTER, 1);
            struct moetax_predict_score l = moetax_predictor_total(p, MOETAX_PREDICT_LEARNED, 1);
            CHECK_EQ_INT(r.tokens, (uint64_t)N_TOK * (uint64_t)(n_moe - 1));
            CHECK_EQ_INT(l.tokens, r.tokens);
            CHECK_EQ_INT(r.predicted, r.tokens * (uint64_t)k);
            CHECK_MSG(l.predicted > l.tokens * (uint64_t)k && l.predicted <= 2 * l.tokens * (uint64_t)k &&
                          l.hits <= l.actual && l.actual == l.tokens * (uint64_t)k,
                      "threads %d: learned predicted %llu for %llu tokens, hits %llu of %llu", threads,
                      (unsigned long long)l.predicted, (unsigned long long)l.tokens, (unsigned long long)l.hits,
                      (unsigned long long)l.actual);
        }
        /* new weights (weights_gen bumped): the router itself as the linear map, no hidden term, no
         * margin: the learned guess is then the router guess but for roundings (the engine's Q8_0
         * copies), so the engine must have prepared the new weights */
        for (int q = 0; q < p->n_layer * p->ahead; q++) {
            if (p->target[q] < 0) continue;
            const int T = p->target[q];
            float *G = malloc(sizeof(float) * (size_t)(Em * m->hp.n_embd));
            CHECK(G && moe_predict_router_rows(m, T, G));
            for (int e = 0; G && e < Em; e++)
                for (int i = 0; i < F; i++) p->w[((size_t)q * Em + e) * F + i] = i < m->hp.n_embd ? G[e * m->hp.n_embd + i] : 0;
            free(G);
            memset(p->w2 + (size_t)q * Em * HID, 0, sizeof(float) * (size_t)(Em * HID));
        }
        p->margin = 0;
        p->weights_gen++;
        moetax_predictor_score_reset(p);
        float *got = run_model(m, s, 1, ub);
        CHECK(got && !memcmp(got, ref, sizeof(float) * (size_t)(V * N_TOK)));
        free(got);
        struct moetax_predict_score r = moetax_predictor_total(p, MOETAX_PREDICT_ROUTER, 1);
        struct moetax_predict_score l = moetax_predictor_total(p, MOETAX_PREDICT_LEARNED, 1);
        CHECK_MSG(l.predicted == r.predicted && l.hits + 2 >= r.hits && r.hits + 2 >= l.hits,
                  "the router as the learned map: hits %llu of %llu, the router guess's %llu", (unsigned long long)l.hits,
                  (unsigned long long)l.predicted, (unsigned long long)r.hits);
        moetax_store_set_predictor(s, NULL, false);
    }
    moetax_store_free(s);
    moetax_predictor_free(p);
    free(ref);
    moetax_model_free(m);
}

static void args(void) {
    struct moetax_predictor *p = NULL;
    const int moe[2] = {0, 1};
    CHECK(moetax_predictor_new("x", 2, 4, 4, 5, moe, 2, 1, MOETAX_PREDICT_FEAT_CUR, &p) == MOETAX_ERR_ARG && !p);
    CHECK(moetax_predictor_new("x", 2, 4, 4, 2, moe, 2, 3, MOETAX_PREDICT_FEAT_CUR, &p) == MOETAX_ERR_ARG && !p);
    CHECK(moetax_predictor_new("x", 2, 4, 4, 2, moe, 2, 1, MOETAX_PREDICT_FEAT_PREV, &p) == MOETAX_ERR_ARG && !p);
    CHECK(moetax_predictor_new("x", 2, 4, 4, 2, moe, 2, 1, MOETAX_PREDICT_FEAT_CUR | MOETAX_PREDICT_FEAT_PREV, &p) ==
          MOETAX_OK);
    if (p) {
        CHECK_EQ_INT(p->n_feat, 9);
        CHECK(moetax_predictor_fit_solve(p, 0.1, NULL) == MOETAX_ERR_ARG); /* no fit_begin */
        CHECK(moetax_predictor_fit_begin(p) == MOETAX_OK);
        CHECK(moetax_predictor_fit_solve(p, 0.1, NULL) == MOETAX_OK); /* nothing added: no weights */
        CHECK(moetax_predictor_weights(p, 0, 1) == NULL);
    }
    moetax_predictor_free(p);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    args();
    float *G = malloc(sizeof(float) * L * E * D), *Wstar = malloc(sizeof(float) * L * E * (D + 1));
    struct moetax_predictor *p = G && Wstar ? fitted(G, Wstar) : NULL;
    if (p) {
        beats_router(p, G, Wstar);
        file_roundtrip_and_damage(p);
        version1_loads(p);
    }
    fit_sums_exact();
    hidden_layer();
    engine();
    moetax_predictor_free(p);
    free(G);
    free(Wstar);
    return tu_finish("test_predict");
}
