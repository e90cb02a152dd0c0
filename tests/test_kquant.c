// ctest-labels: unit;model
// ctest-cost: 17
/* test_kquant.c - a model with k-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in the engine.
 *
 * A tiny-v3 model made 256 wide (so its projections are whole 256-value super-blocks) in
 * F32, quantized to each k-quant type (its 64-column attn_output falls back to Q8_0) and
 * to Q8_0 for comparison:
 *   - prefill logits == step-by-step decode logits, bit for bit, with 1 and 2 threads;
 *   - a batch of sequences (struct moetax_batch) == each sequence alone, bit for bit;
 *   - the avx512 table's logits == the avx2 table's, bit for bit (moetax eval, 1 and 2 threads),
 *     also for the Q8_0 model with --expert-type q2_k / q3_k;
 *   - Q3_K, Q2_K: the avx2 table's logits within KQ_REF_REL of the ref table's;
 *   - logits within a stated distance of the F32 model's: the distance relative to the
 *     largest F32 logit, no more than KQ_DIST_MAX times the Q8_0 model's (Q8_0 is the
 *     yardstick since this random model amplifies rounding) and under an absolute bound.
 * The kernel table is the best the machine has (MOETAX_KERNELS forces another). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/kernels.h"
#include "moetax/model.h"
#include "testutil.h"

enum { NTOK = 24, NSEQ = 3, STEPS = 4 };

/* The random model amplifies rounding through its routing (Q8_0 itself is 0.30 of the
 * largest F32 logit away over these 24 tokens), so the bound is relative to Q8_0's
 * distance: at most KQ_DIST_MAX times it (measured on this model: Q4_K 2.31, Q5_K 2.02,
 * Q6_K 1.84 times), and under rel_max of the largest F32 logit. */
static const struct {
    const char *type;
    float rel_max;
} g_types[] = {{"q4_k", 1.0f}, {"q5_k", 0.9f}, {"q6_k", 0.8f}, {"q3_k", 1.2f}, {"q2_k", 1.35f}};
#define KQ_DIST_MAX 3.0f
/* Q3_K and Q2_K (2-3 bits) are further from F32: their own bound on the ratio to Q8_0's
 * (measured: Q3_K 3.08, Q2_K 3.46 times). */
static float dist_max(const char *type) { return type[1] == '3' ? 4.0f : type[1] == '2' ? 4.5f : KQ_DIST_MAX; }
enum { NT = (int)(sizeof g_types / sizeof g_types[0]) };

static int run(const char *fmt, const char *a, const char *b, const char *c) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, fmt, tu_moetax_bin, a, b, c);
    return tu_run(cmd, NULL);
}

static struct moetax_ctx *ctx(struct moetax_model *m, int threads, int ubatch) {
    struct moetax_ctx_params p = {.n_ctx = 128, .n_threads = threads, .n_ubatch = ubatch, .n_seq_max = NSEQ};
    struct moetax_ctx *c = NULL;
    moetax_status st = moetax_ctx_init(m, &p, &c);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    return c;
}

static void tokens(int32_t *t, int n, int V, int seed) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 37 + seed * 101 + 3) % V);
}

/* Logits of every token of t[0..n) from position 0: one batch (prefill) or one at a time. */
static float *logits_all(struct moetax_model *m, const int32_t *t, int n, int threads, bool step) {
    const int64_t V = m->hp.n_vocab;
    struct moetax_ctx *c = ctx(m, threads, 64);
    if (!c) return NULL;
    float *l = malloc(sizeof(float) * (size_t)(n * V));
    moetax_status st = MOETAX_OK;
    if (step)
        for (int i = 0; i < n && !st; i++) st = moetax_ctx_eval(c, t + i, 1, l + i * V, false);
    else st = moetax_ctx_eval(c, t, n, l, true);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    moetax_ctx_free(c);
    if (st) { free(l); return NULL; }
    return l;
}

static bool bits_equal(const float *a, const float *b, int64_t n) {
    return a && b && memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* max |a - b| over max |ref| */
static float rel_dist(const float *a, const float *ref, int64_t n) {
    float mag = 0, d = 0;
    for (int64_t i = 0; i < n; i++) {
        mag = fmaxf(mag, fabsf(ref[i]));
        d = fmaxf(d, fabsf(a[i] - ref[i]));
    }
    return mag > 0 ? d / mag : d;
}

static void prefill_vs_step(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int64_t V = m->hp.n_vocab;
    int32_t t[NTOK];
    tokens(t, NTOK, (int)V, 1);
    for (int threads = 1; threads <= 2; threads++) {
        float *p = logits_all(m, t, NTOK, threads, false), *s = logits_all(m, t, NTOK, threads, true);
        CHECK_MSG(bits_equal(p, s, NTOK * V), "%s, %d thread(s): prefill differs from step-by-step by %g", path,
                  threads, p && s ? rel_dist(p, s, NTOK * V) : -1.0f);
        free(p);
        free(s);
    }
    moetax_model_free(m);
}

/* NSEQ sequences with prompts of different lengths, prefilled in one batch and then
 * decoded together STEPS times, against each alone (its own context, prompt then steps). */
static void batch_vs_alone(const char *path, int threads) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int64_t V = m->hp.n_vocab;
    const int plen[NSEQ] = {7, 1, 12};
    int32_t hist[NSEQ][32];
    for (int s = 0; s < NSEQ; s++) tokens(hist[s], plen[s] + STEPS, (int)V, s + 2);
    /* alone: the logits of the prompt's last token and of each decode step */
    float *ref = malloc(sizeof(float) * (size_t)(NSEQ * (STEPS + 1) * V));
    for (int s = 0; s < NSEQ; s++) {
        struct moetax_ctx *c = ctx(m, threads, 64);
        if (!c) continue;
        float *l = malloc(sizeof(float) * (size_t)(plen[s] * V));
        CHECK(moetax_ctx_eval(c, hist[s], plen[s], l, true) == MOETAX_OK);
        memcpy(ref + (size_t)(s * (STEPS + 1)) * V, l + (plen[s] - 1) * V, sizeof(float) * (size_t)V);
        for (int j = 0; j < STEPS; j++)
            CHECK(moetax_ctx_eval(c, hist[s] + plen[s] + j, 1, ref + (size_t)(s * (STEPS + 1) + 1 + j) * V, false) ==
                  MOETAX_OK);
        free(l);
        moetax_ctx_free(c);
    }
    struct moetax_ctx *c = ctx(m, threads, 64);
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 64) == MOETAX_OK);
    for (int s = 0; s < NSEQ; s++)
        for (int i = 0; i < plen[s]; i++) CHECK(moetax_batch_add(&b, hist[s][i], i, s, i == plen[s] - 1) == MOETAX_OK);
    CHECK_MSG(c && moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
    int bad = 0;
    for (int j = 0; j <= STEPS; j++) {
        if (j > 0) {
            moetax_batch_clear(&b);
            for (int s = NSEQ - 1; s >= 0; s--)
                CHECK(moetax_batch_add(&b, hist[s][plen[s] + j - 1], plen[s] + j - 1, s, true) == MOETAX_OK);
            CHECK_MSG(c && moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
        }
        for (int i = 0; i < b.n_tokens; i++) {
            if (!b.logits[i]) continue;
            const float *got = c ? moetax_ctx_logits_ith(c, i) : NULL;
            if (!bits_equal(got, ref + (size_t)(b.seq[i] * (STEPS + 1) + j) * V, V)) bad++;
        }
    }
    CHECK_MSG(bad == 0, "%s, %d thread(s): %d of %d logits rows in the batch differ from the sequence alone", path,
              threads, bad, NSEQ * (STEPS + 1));
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    free(ref);
    moetax_model_free(m);
}

/* The avx512 table reads k-quants in its own 8-row layouts (repacked at load; kernels.h): the
 * model's logits (prefill and greedy decode, 1 and 2 threads) are the avx2 table's, bit for
 * bit. With expert_type (e.g. "q2_k") the routed experts are re-quantized at load
 * (--expert-type), then repacked. Skipped, and said, where the CPU lacks either table. */
static void tables_agree(const char *path, const char *type, const char *expert_type) {
    if (!moetax_kernels_avx2() || !moetax_kernels_avx512()) {
        printf("test_kquant: CPU lacks avx2 or avx512: %s avx512 vs avx2 model logits skipped\n", type);
        return;
    }
    for (int threads = 1; threads <= 2; threads++) {
        char out[2][2600], cmd[8192];
        for (int k = 0; k < 2; k++) {
            snprintf(out[k], sizeof out[k], "%s.%s%s.%d.f32", path, expert_type ? expert_type : "",
                     k ? "avx512" : "avx2", threads);
            snprintf(cmd, sizeof cmd,
                     "MOETAX_KERNELS=%s %s eval -m %s --tokens 5,17,33,2,91,7,64,3,12 --decode 6 -t %d --out %s "
                     "%s%s >/dev/null 2>&1",
                     k ? "avx512" : "avx2", tu_moetax_bin, path, threads, out[k], expert_type ? "--expert-type " : "",
                     expert_type ? expert_type : "");
            CHECK_EQ_INT(tu_run(cmd, NULL), 0);
        }
        snprintf(cmd, sizeof cmd, "cmp -s %s %s", out[0], out[1]);
        CHECK_MSG(tu_run(cmd, NULL) == 0, "%s, %d thread(s): avx512 logits differ from avx2's", type, threads);
    }
}

static float *read_f32(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f) / 4;
    rewind(f);
    float *v = malloc(sizeof(float) * (size_t)(*n > 0 ? *n : 1));
    if (v && fread(v, sizeof(float), (size_t)*n, f) != (size_t)*n) { free(v); v = NULL; }
    fclose(f);
    return v;
}

/* Q3_K / Q2_K: the avx2 table's logits (moetax eval, 9 tokens prefilled, 1 thread) against the
 * ref table's (double sums): within KQ_REF_REL of the largest logit (measured 1.9e-7 for both;
 * the float chains differ, so not bit for bit; a flipped expert choice would show as a jump:
 * Q4_K's logits on this model jump at the 6th token, so it is not checked this way). */
#define KQ_REF_REL 1e-6f
static void ref_vs_avx2(const char *path, const char *type) {
    if (!moetax_kernels_avx2()) {
        printf("test_kquant: CPU lacks avx2: %s ref vs avx2 model logits skipped\n", type);
        return;
    }
    char out[2][2600], cmd[8192];
    float *l[2];
    long n[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        snprintf(out[k], sizeof out[k], "%s.%s.f32", path, k ? "ref" : "avx2");
        snprintf(cmd, sizeof cmd,
                 "MOETAX_KERNELS=%s %s eval -m %s --tokens 5,17,33,2,91,7,64,3,12 -t 1 --out %s >/dev/null 2>&1",
                 k ? "ref" : "avx2", tu_moetax_bin, path, out[k]);
        CHECK_EQ_INT(tu_run(cmd, NULL), 0);
        l[k] = read_f32(out[k], &n[k]);
    }
    CHECK_MSG(l[0] && l[1] && n[0] == n[1] && n[0] > 0, "%s: eval --out files", type);
    if (l[0] && l[1] && n[0] == n[1] && n[0] > 0) {
        const float d = rel_dist(l[0], l[1], n[0]);
        printf("%s: avx2 vs ref logits: max |diff| / max |ref| = %.3g\n", type, d);
        CHECK_MSG(d <= KQ_REF_REL, "%s: avx2 logits %g from ref's", type, d);
    }
    free(l[0]);
    free(l[1]);
}

static float *prefill(const char *path, const int32_t *t, int n, int64_t *V) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return NULL; }
    *V = m->hp.n_vocab;
    float *l = logits_all(m, t, n, 2, false);
    moetax_model_free(m);
    return l;
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    const char *gen_args = "--preset tiny-v3 --embd 256 --expert-ff 256 --ff 256 --kv-lora 256 --type f32";
    char f32[512], q8[512], kq[NT][512];
    snprintf(f32, sizeof f32, "%s", tu_path("kquant_f32.gguf"));
    snprintf(q8, sizeof q8, "%s", tu_path("kquant_q8_0.gguf"));
    CHECK_EQ_INT(run("%s gen %s -o %s >/dev/null 2>&1", gen_args, f32, ""), 0);
    CHECK_EQ_INT(run("%s quantize %s %s %s >/dev/null 2>&1", f32, q8, "q8_0"), 0);
    for (int i = 0; i < NT; i++) {
        snprintf(kq[i], sizeof kq[i], "%s", tu_path(g_types[i].type));
        strncat(kq[i], ".gguf", sizeof kq[i] - strlen(kq[i]) - 1);
        CHECK_EQ_INT(run("%s quantize %s %s %s >/dev/null 2>&1", f32, kq[i], g_types[i].type), 0);
    }
    for (int i = 0; i < NT; i++) {
        prefill_vs_step(kq[i]);
        batch_vs_alone(kq[i], 1);
        batch_vs_alone(kq[i], 2);
        tables_agree(kq[i], g_types[i].type, NULL);
        if (g_types[i].type[1] == '3' || g_types[i].type[1] == '2') ref_vs_avx2(kq[i], g_types[i].type);
    }
    tables_agree(q8, "q8_0 experts as q2_k", "q2_k"); /* --expert-type q2_k / q3_k: re-quantized, repacked */
    tables_agree(q8, "q8_0 experts as q3_k", "q3_k");
    /* distance to the F32 model */
    int32_t t[NTOK];
    int64_t V = 0;
    tokens(t, NTOK, 512, 5);
    float *lf = prefill(f32, t, NTOK, &V), *l8 = prefill(q8, t, NTOK, &V);
    const float d8 = lf && l8 ? rel_dist(l8, lf, NTOK * V) : INFINITY;
    printf("q8_0: max |logit - f32| / max |f32| = %.4g\n", d8);
    for (int i = 0; i < NT; i++) {
        float *l = prefill(kq[i], t, NTOK, &V);
        const float d = l && lf ? rel_dist(l, lf, NTOK * V) : INFINITY;
        printf("%s: max |logit - f32| / max |f32| = %.4g (%.2f x q8_0's)\n", g_types[i].type, d, d / d8);
        CHECK_MSG(d <= g_types[i].rel_max && d <= dist_max(g_types[i].type) * d8, "%s: %g from f32 (q8_0: %g)", g_types[i].type, d,
                  d8);
        free(l);
    }
    free(lf);
    free(l8);
    return tu_finish("test_kquant");
}
