// ctest-labels: unit;model;threads
/* test_model.c - the DeepSeek2 forward pass against itself: decode step by step
 * equals prefill of the same tokens, 1 and 2 threads agree, micro-batch sizes
 * agree, --no-mmap copies agree with the mapping, a golden greedy sequence, routing invariants, the KV-cache limit, bad
 * tokens, and models whose tensors do not match their metadata.
 * (The comparison against the independent NumPy reference is test_model_ref.py.) */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "moetax/model.h"
#include "moetax/pool.h"
#include "testutil.h"

/* recorded from moetax and equal to tests/ref/deepseek2_ref.py --tokens 1..8 --decode 16 */
#define GOLDEN_TINY_V3_F32 "199,152,189,451,503,291,105,226,281,44,133,195,158,373,509,103"

static float max_abs(const float *a, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i]));
    return m;
}

static float max_diff(const float *a, const float *b, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

/* logits of every token, by one prefill (ubatch) or step by step */
static float *run(struct moetax_model *m, int threads, int ubatch, const int32_t *toks, int n, bool step) {
    struct moetax_ctx_params p = {.n_ctx = 64, .n_threads = threads, .n_ubatch = ubatch};
    struct moetax_ctx *c;
    if (moetax_ctx_init(m, &p, &c) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return NULL; }
    const int64_t V = m->hp.n_vocab;
    float *l = malloc(sizeof(float) * (size_t)(V * n));
    moetax_status st = MOETAX_OK;
    if (step)
        for (int i = 0; i < n && !st; i++) st = moetax_ctx_eval(c, toks + i, 1, l + i * V, false);
    else
        st = moetax_ctx_eval(c, toks, n, l, true);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    CHECK_EQ_INT(moetax_ctx_pos(c), n);
    moetax_ctx_free(c);
    return l;
}

static void consistency(const char *path, float tol_rel) {
    struct moetax_model *m;
    moetax_status st = moetax_model_load(path, &m);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    if (st) return;
    int32_t toks[20];
    for (int i = 0; i < 20; i++) toks[i] = (int32_t)((i * 37 + 11) % m->hp.n_vocab);
    const int n = 20;
    const int64_t V = m->hp.n_vocab;
    float *a = run(m, 1, 64, toks, n, false);   /* one batch, 1 thread */
    float *b = run(m, 2, 64, toks, n, false);   /* one batch, 2 threads */
    float *s = run(m, 2, 64, toks, n, true);    /* decode step by step */
    float *u = run(m, 2, 7, toks, n, false);    /* micro-batches of 7 */
    /* decode with 4 workers: a worker's share of the q/kv_a phase is then smaller than kv_a,
     * and decode keeps the rope/cache/q_abs phase instead of fusing it (mla.c) */
    float *s4 = run(m, 4, 64, toks, n, true);
    if (a && b && s && u && s4) {
        float mag = max_abs(a, V * n);
        CHECK_MSG(mag > 0.1f && isfinite(mag), "%s: logits magnitude %g", path, mag);
        float d1 = max_diff(a, b, V * n), d2 = max_diff(a, s, V * n), d3 = max_diff(a, u, V * n);
        CHECK_MSG(d1 <= tol_rel * mag, "%s: 1 vs 2 threads differ by %g (max |logit| %g)", path, d1, mag);
        CHECK_MSG(d2 <= tol_rel * mag, "%s: step-by-step vs prefill differ by %g (max |logit| %g)", path, d2, mag);
        CHECK_MSG(d3 <= tol_rel * mag, "%s: ubatch 7 vs 64 differ by %g (max |logit| %g)", path, d3, mag);
        float d4 = max_diff(s, s4, V * n);
        CHECK_MSG(d4 <= tol_rel * mag, "%s: decode with 4 vs 2 threads differ by %g (max |logit| %g)", path, d4, mag);
    }
    free(a); free(b); free(s); free(u); free(s4);
    moetax_model_free(m);
}

/* --no-mmap: every weight read from a private copy gives the very same logits as the mapping;
 * both report how their weights are paged */
static void no_mmap_same(const char *path) {
    struct moetax_model *mm = NULL, *mc = NULL;
    CHECK_MSG(moetax_model_load(path, &mm) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_MSG(moetax_model_load_ex(path, &(struct moetax_model_params){.no_mmap = true}, &mc) == MOETAX_OK, "%s",
              moetax_last_error());
    if (!mm || !mc) { moetax_model_free(mm); moetax_model_free(mc); return; }
    int32_t toks[12];
    for (int i = 0; i < 12; i++) toks[i] = (int32_t)((i * 29 + 5) % mm->hp.n_vocab);
    const size_t nb = sizeof(float) * (size_t)mm->hp.n_vocab * 12;
    for (int step = 0; step < 2; step++) {
        float *a = run(mm, 2, 64, toks, 12, step), *b = run(mc, 2, 64, toks, 12, step);
        CHECK_MSG(a && b && !memcmp(a, b, nb), "%s: --no-mmap logits differ from the mapped model's (%s)", path,
                  step ? "decode" : "prefill");
        free(a); free(b);
    }
    /* every weight the kernels read (the routed experts too, copied when the first context
     * started) lies outside the file mapping; token_embd stays there, read by rows */
    const uint8_t *lo = mc->gguf->base, *hi = lo + mc->gguf->size;
    int in_map = 0, copied = 0;
    for (int il = 0; il < mc->hp.n_layer; il++) {
        const struct moetax_layer *l = &mc->layers[il];
        const struct moetax_weight *ws[] = {&l->wq, &l->wq_a, &l->wq_b, &l->wkv_a, &l->wk_b, &l->wv_b, &l->wo,
                                            &l->ffn_gate, &l->ffn_up, &l->ffn_down, &l->gate_inp, &l->gate_sh,
                                            &l->up_sh, &l->down_sh, &l->gate_exps, &l->up_exps, &l->down_exps};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
            const uint8_t *d = ws[i]->data;
            if (!d) continue;
            copied++;
            in_map += d >= lo && d < hi;
        }
    }
    const uint8_t *od = mc->output.data;
    in_map += od >= lo && od < hi;
    CHECK_MSG(copied > 0 && in_map == 0, "%s: --no-mmap: %d of %d weights still read from the mapping", path, in_map,
              copied + 1);
    for (int i = 0; i < 2; i++) {
        uint64_t res = 0, huge = 0;
        moetax_status st = moetax_model_weight_pages(i ? mc : mm, &res, &huge);
        CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
        CHECK_MSG(res > 0 && huge <= res, "%s: weight pages: %llu resident, %llu huge", path, (unsigned long long)res,
                  (unsigned long long)huge);
    }
    moetax_model_free(mm);
    moetax_model_free(mc);
}

static void routing_invariants(const char *path, bool v3) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    struct moetax_ctx_params p = {.n_ctx = 32, .n_threads = 2};
    struct moetax_ctx *c;
    CHECK(moetax_ctx_init(m, &p, &c) == MOETAX_OK);
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK(moetax_ctx_eval(c, toks, 8, NULL, false) == MOETAX_OK);
    const int k = m->hp.n_expert_used, E = m->hp.n_expert;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const float *w;
        int64_t nt;
        const int32_t *sel = moetax_ctx_routing(c, il, &w, &nt);
        if (il < m->hp.n_layer_dense_lead) { CHECK(sel == NULL); continue; }
        CHECK(sel != NULL && nt == 8);
        for (int64_t t = 0; sel && t < nt; t++) {
            float sum = 0;
            for (int j = 0; j < k; j++) {
                int32_t e = sel[t * k + j];
                CHECK(e >= 0 && e < E);
                for (int j2 = 0; j2 < j; j2++) CHECK(sel[t * k + j2] != e);
                CHECK(w[t * k + j] > 0);
                sum += w[t * k + j];
                if (v3 && m->hp.n_expert_group > 1) {
                    /* all chosen experts come from at most n_group_used groups */
                    int per = E / m->hp.n_expert_group, groups[64], ng = 0;
                    for (int j2 = 0; j2 <= j; j2++) {
                        int g = sel[t * k + j2] / per, seen = 0;
                        for (int q = 0; q < ng; q++) seen |= groups[q] == g;
                        if (!seen) groups[ng++] = g;
                    }
                    CHECK(ng <= m->hp.n_expert_group_used);
                }
            }
            if (v3) CHECK_MSG(fabsf(sum - m->hp.expert_weights_scale) < 1e-4f, "weights sum %g", sum);
            else CHECK_MSG(sum <= 1.0f + 1e-5f, "layer %d token %lld: sum %g", il, (long long)t, sum); /* softmax, no renormalisation */
        }
    }
    /* the KV cache limit: 32 positions, 8 used */
    int32_t many[30] = {0};
    CHECK(moetax_ctx_eval(c, many, 30, NULL, false) == MOETAX_ERR_LIMIT);
    CHECK(strstr(moetax_last_error(), "context size") != NULL);
    CHECK_EQ_INT(moetax_ctx_pos(c), 8);
    int32_t bad = m->hp.n_vocab;
    CHECK(moetax_ctx_eval(c, &bad, 1, NULL, false) == MOETAX_ERR_ARG);
    CHECK(moetax_ctx_eval(c, many, 24, NULL, false) == MOETAX_OK);
    moetax_ctx_reset(c);
    CHECK_EQ_INT(moetax_ctx_pos(c), 0);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* golden greedy sequence of the tiny-v3 q8_0 model (seed 42): pins the whole
 * pipeline; cross-checked against tests/ref/deepseek2_ref.py when recorded. */
static void golden(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m) != MOETAX_OK) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    struct moetax_ctx_params p = {.n_ctx = 64, .n_threads = 2};
    struct moetax_ctx *c;
    CHECK(moetax_ctx_init(m, &p, &c) == MOETAX_OK);
    const int64_t V = m->hp.n_vocab;
    float *l = malloc(sizeof(float) * (size_t)V);
    int32_t t[24] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK(moetax_ctx_eval(c, t, 8, l, false) == MOETAX_OK);
    char got[256] = "";
    for (int i = 8; i < 24; i++) {
        int32_t best = 0;
        for (int64_t v = 1; v < V; v++) if (l[v] > l[best]) best = (int32_t)v;
        t[i] = best;
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%d", i > 8 ? "," : "", best);
        CHECK(moetax_ctx_eval(c, &t[i], 1, l, false) == MOETAX_OK);
    }
    const char *want = getenv("MOETAX_GOLDEN") ? getenv("MOETAX_GOLDEN") : GOLDEN_TINY_V3_F32;
    CHECK_MSG(!strcmp(got, want), "greedy: got %s, want %s", got, want);
    free(l);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* a file whose tensors do not match its metadata: kv_lora_rank changed */
static void shape_mismatch(const char *src, const char *dst) {
    struct moetax_gguf *g;
    if (moetax_gguf_open(src, &g) != MOETAX_OK) { CHECK(0); return; }
    struct moetax_gguf_writer *w;
    CHECK(moetax_gguf_writer_init(dst, &w) == MOETAX_OK);
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const struct moetax_gguf_kv *kv = &g->kv[i];
        if (kv->key.len == 32 && !memcmp(kv->key.data, "deepseek2.attention.kv_lora_rank", 32)) continue;
        CHECK(moetax_gguf_writer_copy_kv(w, g, kv) == MOETAX_OK);
    }
    CHECK(moetax_gguf_writer_set_u32(w, "deepseek2.attention.kv_lora_rank", 48) == MOETAX_OK);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)g->tensors[i].name.len, g->tensors[i].name.data);
        CHECK(moetax_gguf_writer_add_tensor(w, name, g->tensors[i].type, g->tensors[i].n_dims, g->tensors[i].ne) == MOETAX_OK);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++)
        CHECK(moetax_gguf_writer_write(w, g->tensors[i].data, g->tensors[i].nbytes) == MOETAX_OK);
    CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
    moetax_gguf_writer_free(w);
    moetax_gguf_close(g);
    struct moetax_model *m;
    CHECK(moetax_model_load(dst, &m) == MOETAX_ERR_SHAPE);
    const char *e = moetax_last_error();
    CHECK_MSG(strstr(e, "blk.0.attn_kv_a_mqa.weight") && strstr(e, "{64, 40}") && strstr(e, "{64, 56}"),
              "message: %s", e);
}

/* A tied output matrix (no output.weight: logits from token_embd, which is also read by rows for
 * the embedding) gives the same bits as the same file with output.weight = token_embd's bytes: with
 * kernels that read the type repacked, the output gets a repacked copy while the embedding rows are
 * still read as stored. */
static void tied_output(const char *src, const char *tied, const char *untied) {
    struct moetax_gguf *g;
    if (moetax_gguf_open(src, &g) != MOETAX_OK) { CHECK(0); return; }
    const struct moetax_gguf_tensor *te = moetax_gguf_find_tensor(g, "token_embd.weight");
    const struct moetax_gguf_tensor *to = moetax_gguf_find_tensor(g, "output.weight");
    CHECK(te && to && te->type == to->type && te->nbytes == to->nbytes);
    for (int variant = 0; te && to && variant < 2; variant++) {
        struct moetax_gguf_writer *w;
        CHECK(moetax_gguf_writer_init(variant ? untied : tied, &w) == MOETAX_OK);
        for (uint64_t i = 0; i < g->n_kv; i++) CHECK(moetax_gguf_writer_copy_kv(w, g, &g->kv[i]) == MOETAX_OK);
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            if (&g->tensors[i] == to && !variant) continue;
            char name[128];
            snprintf(name, sizeof name, "%.*s", (int)g->tensors[i].name.len, g->tensors[i].name.data);
            CHECK(moetax_gguf_writer_add_tensor(w, name, g->tensors[i].type, g->tensors[i].n_dims, g->tensors[i].ne) ==
                  MOETAX_OK);
        }
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            if (&g->tensors[i] == to && !variant) continue;
            const struct moetax_gguf_tensor *t = &g->tensors[i] == to ? te : &g->tensors[i];
            CHECK(moetax_gguf_writer_write(w, t->data, t->nbytes) == MOETAX_OK);
        }
        CHECK(moetax_gguf_writer_finish(w) == MOETAX_OK);
        moetax_gguf_writer_free(w);
    }
    moetax_gguf_close(g);
    struct moetax_model *mt = NULL, *mu = NULL;
    CHECK_MSG(moetax_model_load(tied, &mt) == MOETAX_OK, "%s", moetax_last_error());
    CHECK_MSG(moetax_model_load(untied, &mu) == MOETAX_OK, "%s", moetax_last_error());
    if (mt && mu) {
        CHECK(mt->output.file_data == mt->tok_embd.file_data && mu->output.file_data != mu->tok_embd.file_data);
        int32_t toks[12];
        for (int i = 0; i < 12; i++) toks[i] = (int32_t)((i * 53 + 5) % mt->hp.n_vocab);
        float *a = run(mt, 2, 64, toks, 12, false), *b = run(mu, 2, 64, toks, 12, false);
        float *c = run(mt, 1, 64, toks, 12, true), *d = run(mu, 1, 64, toks, 12, true);
        const size_t bytes = sizeof(float) * (size_t)(mt->hp.n_vocab * 12);
        CHECK_MSG(a && b && !memcmp(a, b, bytes), "tied output: prefill logits differ from the untied copy");
        CHECK_MSG(c && d && !memcmp(c, d, bytes), "tied output: decode logits differ from the untied copy");
        free(a); free(b); free(c); free(d);
    }
    moetax_model_free(mt);
    moetax_model_free(mu);
}

/* Run-time top-k (ctx param n_expert_used): a file that says k = 2, run with 3, gives the
 * same bits as the same weights in a file that says 3 (gen's weights do not depend on k);
 * the routing has 3 distinct experts per token; a k beyond the group limit is refused. */
static void experts_used(const char *k2, const char *k3) {
    struct moetax_model *m2 = NULL, *m3 = NULL;
    CHECK_EQ_INT(moetax_model_load(k2, &m2), MOETAX_OK);
    CHECK_EQ_INT(moetax_model_load(k3, &m3), MOETAX_OK);
    if (!m2 || !m3) goto out;
    CHECK_EQ_INT(m2->hp.n_expert_used, 2);
    const int32_t toks[7] = {5, 77, 123, 9, 400, 31, 2};
    const int64_t V = m2->hp.n_vocab;
    struct moetax_ctx *c2 = NULL, *c3 = NULL;
    struct moetax_ctx_params p2 = {.n_ctx = 32, .n_threads = 2, .n_expert_used = 3}, p3 = {.n_ctx = 32, .n_threads = 2};
    CHECK_EQ_INT(moetax_ctx_init(m2, &p2, &c2), MOETAX_OK);
    CHECK_EQ_INT(moetax_ctx_init(m3, &p3, &c3), MOETAX_OK);
    if (c2 && c3) {
        CHECK_EQ_INT(moetax_ctx_n_expert_used(c2), 3);
        float *a = malloc(sizeof(float) * (size_t)(7 * V)), *b = malloc(sizeof(float) * (size_t)(7 * V));
        CHECK_EQ_INT(moetax_ctx_eval(c2, toks, 7, a, true), MOETAX_OK);
        CHECK_EQ_INT(moetax_ctx_eval(c3, toks, 7, b, true), MOETAX_OK);
        CHECK_MSG(memcmp(a, b, sizeof(float) * (size_t)(7 * V)) == 0, "k = 3 at run time differs from a k = 3 file");
        for (int il = 0; il < m2->hp.n_layer; il++) {
            int64_t nt = 0;
            const int32_t *sel = moetax_ctx_routing(c2, il, NULL, &nt);
            for (int64_t t = 0; sel && t < nt; t++)
                CHECK(sel[t * 3] != sel[t * 3 + 1] && sel[t * 3] != sel[t * 3 + 2] && sel[t * 3 + 1] != sel[t * 3 + 2]);
        }
        free(a), free(b);
    }
    moetax_ctx_free(c2), moetax_ctx_free(c3);
    struct moetax_ctx *bad = NULL;
    struct moetax_ctx_params pb = {.n_ctx = 32, .n_threads = 1, .n_expert_used = m2->hp.n_expert + 1};
    CHECK_EQ_INT(moetax_ctx_init(m2, &pb, &bad), MOETAX_ERR_ARG);
    CHECK(bad == NULL && strstr(moetax_last_error(), "experts used"));
out:
    moetax_model_free(m2), moetax_model_free(m3);
}

static int gen(const char *args, const char *out) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s gen %s -o %s >/dev/null 2>&1", tu_moetax_bin, args, out);
    return tu_run(cmd, NULL);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    char v2[512], v3[512]; /* tu_path's buffers rotate: keep copies */
    snprintf(v2, sizeof v2, "%s", tu_path("model_tiny.gguf"));
    snprintf(v3, sizeof v3, "%s", tu_path("model_tiny_v3.gguf"));
    CHECK_EQ_INT(gen("--preset tiny", v2), 0);
    CHECK_EQ_INT(gen("--preset tiny-v3", v3), 0);
    consistency(v2, 2e-5f);
    consistency(v3, 2e-5f);
    no_mmap_same(v3);
    const char *types[] = {"f16", "bf16", "q8_0", "q4_0"};
    for (int i = 0; i < 4; i++) {
        char args[128];
        snprintf(args, sizeof args, "--preset tiny-v3 --type %s", types[i]);
        const char *p = tu_path("model_tiny_v3_t.gguf");
        CHECK_EQ_INT(gen(args, p), 0);
        consistency(p, 2e-5f);
        no_mmap_same(p);
    }
    /* wide Q4_0 (the AVX2 kernels read it with 8 rows interleaved): d 288 (9 blocks), expert F 320
     * (10), dense ff 544 (17), kv_lora 256 (8); then row counts that leave a plain tail of rows % 8
     * (kv_a 36 rows, v_b 20 per head, output 517; q 100 rows and 6 experts before kv_a and the
     * shared expert in their joint row splits) */
    const char *wide = "--preset tiny-v3 --embd 288 --expert-ff 320 --ff 544 --kv-lora 256 --seed 11";
    for (int i = 2; i < 4; i++) {
        char args[256];
        snprintf(args, sizeof args, "%s --type %s", wide, types[i]);
        const char *pw = tu_path("model_wide_t.gguf");
        CHECK_EQ_INT(gen(args, pw), 0);
        consistency(pw, 2e-5f);
        if (i == 3) {
            char wsrc[512], wt[512];
            snprintf(wsrc, sizeof wsrc, "%s", pw);
            snprintf(wt, sizeof wt, "%s", tu_path("model_wide_tied.gguf"));
            tied_output(wsrc, wt, tu_path("model_wide_untied.gguf"));
        }
    }
    {
        const char *po = tu_path("model_odd_rows.gguf");
        CHECK_EQ_INT(gen("--preset tiny-v3 --q-lora 0 --rope-dim 4 --vocab 517 --heads 5 --v-head 20 --experts 6 --groups 2 "
                         "--groups-used 1 --shared 3 --seed 13 --type q4_0",
                         po), 0);
        consistency(po, 2e-5f);
    }
    const char *p = tu_path("model_variants.gguf");
    CHECK_EQ_INT(gen("--preset tiny-v3 --fused-gate-up --kv-b-merged --type q8_0", p), 0);
    consistency(p, 2e-5f);
    no_mmap_same(p);
    CHECK_EQ_INT(gen("--preset tiny-v3 --fused-gate-up --kv-b-merged --type f16", p), 0);
    no_mmap_same(p);
    {
        char k2[512], k3[512];
        snprintf(k2, sizeof k2, "%s", tu_path("model_k2.gguf"));
        snprintf(k3, sizeof k3, "%s", tu_path("model_k3.gguf"));
        CHECK_EQ_INT(gen("--preset tiny-v3 --experts-used 2", k2), 0);
        CHECK_EQ_INT(gen("--preset tiny-v3 --experts-used 3", k3), 0);
        experts_used(k2, k3);
    }
    routing_invariants(v2, false);
    routing_invariants(v3, true);
    golden(v3);
    shape_mismatch(v2, tu_path("model_bad_shape.gguf"));
    struct moetax_model *m;
    CHECK(moetax_model_load(tu_path("no-such-model.gguf"), &m) == MOETAX_ERR_IO);
    return tu_finish("test_model");
}
