// ctest-labels: unit
/* test_predict.c - the learned expert predictor (moetax/predict.h): a fit recovers a map the
 * router guess does not know and beats it on fresh samples; the file round-trips bit for bit;
 * short, damaged or inconsistent files are refused with the field named, never a crash. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/predict.h"
#include "testutil.h"

enum { D = 16, E = 8, K = 2, L = 4 };

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
    return p;
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
    CHECK_MSG(moetax_predictor_load(path, &q) == MOETAX_OK, "%s", moetax_last_error());
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
        bool is_moe[L] = {false, true, true, true};
        CHECK(moetax_predictor_check(q, path, L, D, E, is_moe) == MOETAX_OK);
        CHECK(moetax_predictor_check(q, path, L, D + 1, E, is_moe) == MOETAX_ERR_ARG);
        is_moe[2] = false;
        CHECK(moetax_predictor_check(q, path, L, D, E, is_moe) == MOETAX_ERR_ARG);
        CHECK_MSG(strstr(moetax_last_error(), "not both MoE"), "%s", moetax_last_error());
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
        {"ahead 3", "ahead"},
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
        case 5: put32(b + 8, 2); break;
        case 6: put32(b + 24, E + 1); break;
        case 7: put32(b + 36, D); break;
        case 8: put32(b + 40, 0xffffffffu); break;
        case 9: b[MOETAX_PREDICT_HEADER_BYTES + MOETAX_PREDICT_PAIR_HEADER_BYTES + 5] ^= 0x40; break;
        case 10: b[n - 1] ^= 1; break;
        case 11: put32(b + MOETAX_PREDICT_HEADER_BYTES, 99); fix_sum = true; break;
        case 12: put32(b + MOETAX_PREDICT_HEADER_BYTES + MOETAX_PREDICT_PAIR_HEADER_BYTES + 8, 0x7fc00000u); fix_sum = true; break;
        case 13: put32(b + 28, 3); break;
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
        moetax_status st = moetax_predictor_load(bp, &r);
        CHECK_MSG(st == MOETAX_ERR_FORMAT && r == NULL && strstr(moetax_last_error(), cases[c].field) &&
                      strstr(moetax_last_error(), "predict_bad.pred"),
                  "%s: status %s, message '%s' (wanted '%s')", cases[c].what, moetax_status_name(st), moetax_last_error(),
                  cases[c].field);
        moetax_predictor_free(r);
    }
    struct moetax_predictor *r = NULL;
    CHECK(moetax_predictor_load(tu_path("predict_missing.pred"), &r) == MOETAX_ERR_IO && r == NULL);
    free(b);
    free(good);
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
    }
    moetax_predictor_free(p);
    free(G);
    free(Wstar);
    return tu_finish("test_predict");
}
