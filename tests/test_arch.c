// ctest-labels: unit;model;threads
/* test_arch.c - the architecture layer: qwen3moe files from `moetax gen --arch qwen3moe` load
 * with the hyper-parameters llama.cpp derives (GQA heads, head dim, NEOX rope, softmax +
 * renormalised routing, kq scale 1/sqrt(head_dim)); prefill equals step-by-step decode (bit
 * for bit with Q8_0 weights, whose kernels are batch-invariant; within 2e-5 with F32) and one
 * thread equals two; a file whose KV heads do not divide the heads is refused naming the key;
 * an unknown architecture is refused naming the ones moetax runs. olmoe (full-width q/k norm,
 * NEOX, softmax top-k not renormalised, experts feed_forward_length wide) and Mixtral (llama
 * with experts: no q/k norm, NORM rope, renormalised) the same way, plus Mixtral's refusals: a
 * file with experts split one tensor per expert (naming the tensor and what to do) and a dense
 * llama file. qwen2moe (q/k/v biases, NEOX, softmax top-k not renormalised, a shared expert
 * gated by sigmoid(ffn_gate_inp_shexp . x)): its hyper-parameters and tensors, prefill = steps,
 * a batch of sequences equals each alone (bit for bit with Q8_0, Q4_0), expert-store runs equal
 * the mapped run bit for bit, and a fused attn_qkv is refused. Logits against the NumPy
 * reference: test_model_ref.py; batches of the other architectures: test_batch.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/kernels.h"
#include "moetax/model.h"
#include "moetax/store.h"
#include "testutil.h"

static int gen(const char *args, const char *out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s gen %s -o %s >/dev/null 2>&1", tu_moetax_bin, args, out);
    return tu_run(cmd, NULL);
}

/* Logits of all n tokens: one prefill (step = false) or one token at a time. */
static float *run(struct moetax_model *m, const int32_t *toks, int n, bool step, int threads) {
    struct moetax_ctx_params p = {.n_ctx = 128, .n_threads = threads};
    struct moetax_ctx *c = NULL;
    if (moetax_ctx_init(m, &p, &c)) { CHECK_MSG(0, "%s", moetax_last_error()); return NULL; }
    const int64_t V = m->hp.n_vocab;
    float *l = malloc(sizeof(float) * (size_t)(n * V));
    moetax_status st = MOETAX_OK;
    if (!step) st = moetax_ctx_eval(c, toks, n, l, true);
    for (int i = 0; step && !st && i < n; i++) st = moetax_ctx_eval(c, toks + i, 1, l + i * V, false);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    moetax_ctx_free(c);
    return l;
}

static float rel_diff(const float *a, const float *b, int64_t n) {
    float mag = 0, diff = 0;
    for (int64_t i = 0; i < n; i++) mag = fmaxf(mag, fabsf(a[i])), diff = fmaxf(diff, fabsf(a[i] - b[i]));
    return mag > 0 ? diff / mag : diff;
}

static void prefill_vs_steps(const char *path, float tol) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m)) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const int n = 40; /* over two KV cache blocks */
    int32_t toks[40];
    for (int i = 0; i < n; i++) toks[i] = (int32_t)((i * 71 + 3) % m->hp.n_vocab);
    float *pre1 = run(m, toks, n, false, 1), *pre2 = run(m, toks, n, false, 2);
    float *st1 = run(m, toks, n, true, 1), *st2 = run(m, toks, n, true, 2);
    const int64_t N = (int64_t)n * m->hp.n_vocab;
    if (pre1 && pre2 && st1 && st2) {
        CHECK_MSG(rel_diff(pre1, pre2, N) == 0, "%s: prefill 1 vs 2 threads differ", path);
        CHECK_MSG(rel_diff(st1, st2, N) == 0, "%s: steps 1 vs 2 threads differ", path);
        CHECK_MSG(rel_diff(pre1, st1, N) <= tol, "%s: prefill vs step-by-step rel %g > %g", path,
                  (double)rel_diff(pre1, st1, N), (double)tol);
    }
    free(pre1); free(pre2); free(st1); free(st2);
    moetax_model_free(m);
}

/* Rename tensor `from` to `to` (same length) in file path: the first occurrence in its header. */
static bool rename_tensor(const char *path, const char *from, const char *to) {
    FILE *f = fopen(path, "r+b");
    static char buf[1 << 16];
    size_t got = f ? fread(buf, 1, sizeof buf, f) : 0;
    char *at = got ? memmem(buf, got, from, strlen(from)) : NULL;
    bool ok = at && strlen(from) == strlen(to);
    if (ok) {
        fseek(f, (long)(at - buf), SEEK_SET);
        ok = fwrite(to, 1, strlen(to), f) == strlen(to);
    }
    if (f) fclose(f);
    return ok;
}

/* olmoe and mixtral: hyper-parameters as llama.cpp derives them, prefill = steps, refusals. */
static void olmoe_mixtral(void) {
    char ol[512], olq[512], mx[512], mxq[512], bad[512];
    snprintf(ol, sizeof ol, "%s", tu_path("arch_olmoe_f32.gguf"));
    snprintf(olq, sizeof olq, "%s", tu_path("arch_olmoe_q8_0.gguf"));
    snprintf(mx, sizeof mx, "%s", tu_path("arch_mixtral_f32.gguf"));
    snprintf(mxq, sizeof mxq, "%s", tu_path("arch_mixtral_q8_0.gguf"));
    snprintf(bad, sizeof bad, "%s", tu_path("arch_mixtral_bad.gguf"));
    CHECK_EQ_INT(gen("--arch olmoe --preset tiny --heads 8 --heads-kv 2", ol), 0);
    CHECK_EQ_INT(gen("--arch olmoe --preset tiny --type q8_0", olq), 0);
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --heads 8 --heads-kv 2 --head-dim 32", mx), 0);
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --type q8_0", mxq), 0);
    struct moetax_model *m;
    if (moetax_model_load(ol, &m) == MOETAX_OK) {
        const struct moetax_hparams *hp = &m->hp;
        CHECK(!strcmp(hp->arch, "olmoe"));
        CHECK_EQ_INT(hp->attn, MOETAX_ATTN_GQA);
        CHECK_EQ_INT(hp->n_head, 8);
        CHECK_EQ_INT(hp->n_head_kv, 2);
        CHECK_EQ_INT(hp->n_embd_head_k, 8); /* n_embd / n_head: OLMoE files have no key_length */
        CHECK_EQ_INT(hp->n_rot, 8);
        CHECK_EQ_INT(hp->rope_mode, MOETAX_ROPE_MODE_NEOX);
        CHECK_EQ_INT(hp->qk_norm, MOETAX_QK_NORM_FULL);
        CHECK_EQ_INT(hp->gating_func, 1);
        CHECK(!hp->expert_weights_norm);
        CHECK_EQ_INT(hp->n_ff_exp, 32); /* feed_forward_length */
        CHECK_EQ_INT(hp->n_expert_shared, 0);
        CHECK(fabsf(hp->kq_scale - 1.0f / sqrtf(8.0f)) < 1e-7f);
        CHECK(fabsf(hp->rope_freq_base - 1e4f) < 1e-3f);
        CHECK(m->layers[0].is_moe && m->layers[0].attn_q_norm && m->layers[0].attn_k_norm);
        moetax_model_free(m);
    } else {
        CHECK_MSG(0, "%s", moetax_last_error());
    }
    if (moetax_model_load(mx, &m) == MOETAX_OK) {
        const struct moetax_hparams *hp = &m->hp;
        CHECK(!strcmp(hp->arch, "llama"));
        CHECK_EQ_INT(hp->attn, MOETAX_ATTN_GQA);
        CHECK_EQ_INT(hp->n_head, 8);
        CHECK_EQ_INT(hp->n_head_kv, 2);
        CHECK_EQ_INT(hp->n_embd_head_k, 32);
        CHECK_EQ_INT(hp->n_rot, 32);
        CHECK_EQ_INT(hp->rope_mode, MOETAX_ROPE_MODE_NORM);
        CHECK_EQ_INT(hp->qk_norm, MOETAX_QK_NORM_NONE);
        CHECK_EQ_INT(hp->gating_func, 1);
        CHECK(hp->expert_weights_norm);
        CHECK_EQ_INT(hp->n_expert, 8);
        CHECK_EQ_INT(hp->n_expert_used, 2);
        CHECK_EQ_INT(hp->n_ff_exp, 224);
        CHECK(fabsf(hp->kq_scale - 1.0f / sqrtf(32.0f)) < 1e-7f);
        CHECK(fabsf(hp->rope_freq_base - 1e6f) < 1.0f);
        CHECK(m->layers[0].is_moe && !m->layers[0].attn_q_norm && !m->layers[0].attn_k_norm);
        moetax_model_free(m);
    } else {
        CHECK_MSG(0, "%s", moetax_last_error());
    }
    prefill_vs_steps(olq, 0);
    prefill_vs_steps(ol, 2e-5f);
    prefill_vs_steps(mxq, 0);
    prefill_vs_steps(mx, 2e-5f);

    /* experts split one tensor per expert (older Mixtral conversions): refused naming the tensor */
    /* (names keep their length: layer 0 loses its merged gate, and an unused 23-character name
     * of layer 10 becomes blk.0.ffn_gate.0.weight) */
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny --layers 12", bad), 0);
    CHECK(rename_tensor(bad, "blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_exps.xxxxxx"));
    CHECK(rename_tensor(bad, "blk.10.attn_norm.weight", "blk.0.ffn_gate.0.weight"));
    moetax_status st = moetax_model_load(bad, &m);
    CHECK_EQ_INT(st, MOETAX_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(moetax_last_error(), "tensor 'blk.0.ffn_gate.0.weight': this file stores each expert as its own "
                                          "tensor") && strstr(moetax_last_error(), "convert the model again"),
              "%s", moetax_last_error());
    if (!st) moetax_model_free(m);
    /* llama.expert_count renamed away: a dense llama, whose layers need ffn_gate (the file has experts) */
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny", bad), 0);
    CHECK(rename_tensor(bad, "llama.expert_count", "llama.expert_cxunt"));
    st = moetax_model_load(bad, &m);
    CHECK_EQ_INT(st, MOETAX_ERR_NOT_FOUND);
    CHECK_MSG(strstr(moetax_last_error(), "tensor 'blk.0.ffn_gate.weight' is missing"), "%s", moetax_last_error());
    if (!st) moetax_model_free(m);
    /* a layer without a router */
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny", bad), 0);
    CHECK(rename_tensor(bad, "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_xxx.weight"));
    st = moetax_model_load(bad, &m);
    CHECK_EQ_INT(st, MOETAX_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(moetax_last_error(), "layer 1 has no router (blk.1.ffn_gate_inp.weight)"), "%s",
              moetax_last_error());
    if (!st) moetax_model_free(m);
}

/* Logits of the last token of hist[0..n) run alone (prefill of n - 1 tokens, then a step). */
static float *alone(struct moetax_model *m, const int32_t *hist, int n) {
    struct moetax_ctx_params p = {.n_ctx = 128, .n_threads = 2};
    struct moetax_ctx *c = NULL;
    if (moetax_ctx_init(m, &p, &c)) { CHECK_MSG(0, "%s", moetax_last_error()); return NULL; }
    float *l = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
    moetax_status st = n > 1 ? moetax_ctx_eval(c, hist, n - 1, NULL, false) : MOETAX_OK;
    if (!st) st = moetax_ctx_eval(c, hist + n - 1, 1, l, false);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    moetax_ctx_free(c);
    if (st) { free(l); return NULL; }
    return l;
}

/* Three sequences in one batch (prompts interleaved, then 4 decode steps of all three)
 * against each sequence alone: equal within tol (0: bit for bit). */
static void batch_vs_alone(const char *path, float tol) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m)) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    enum { B = 3, STEPS = 4, HIST = 32 };
    const int V = m->hp.n_vocab, plen[B] = {6, 1, 9};
    int32_t hist[B][HIST];
    int n[B];
    for (int s = 0; s < B; s++)
        for (int i = 0; i < HIST; i++) hist[s][i] = (int32_t)((s * 131 + i * 37 + 7) % V);
    struct moetax_ctx_params p = {.n_ctx = 256, .n_threads = 2, .n_ubatch = 64, .n_seq_max = 8};
    struct moetax_ctx *c = NULL;
    struct moetax_batch b;
    CHECK(moetax_batch_init(&b, 64) == MOETAX_OK);
    if (moetax_ctx_init(m, &p, &c)) { CHECK_MSG(0, "%s", moetax_last_error()); goto out; }
    for (int i = 0; i < 9; i++)
        for (int s = 0; s < B; s++)
            if (i < plen[s]) CHECK(moetax_batch_add(&b, hist[s][i], i, s, i == plen[s] - 1) == MOETAX_OK);
    for (int s = 0; s < B; s++) n[s] = plen[s];
    for (int st = 0; st <= STEPS; st++) {
        if (st > 0) {
            moetax_batch_clear(&b);
            for (int s = B - 1; s >= 0; s--) CHECK(moetax_batch_add(&b, hist[s][n[s]], n[s], s, true) == MOETAX_OK);
            for (int s = 0; s < B; s++) n[s]++;
        }
        CHECK_MSG(moetax_ctx_decode(c, &b) == MOETAX_OK, "%s", moetax_last_error());
        for (int i = 0; i < b.n_tokens; i++) {
            const float *l = moetax_ctx_logits_ith(c, i);
            if (!b.logits[i]) continue;
            float *ref = alone(m, hist[b.seq[i]], n[b.seq[i]]);
            CHECK_MSG(l && ref && (tol == 0 ? memcmp(l, ref, sizeof(float) * (size_t)V) == 0 : rel_diff(ref, l, V) <= tol),
                      "%s: step %d, sequence %d in a batch differs from it alone", path, st, b.seq[i]);
            free(ref);
        }
    }
out:
    moetax_batch_free(&b);
    moetax_ctx_free(c);
    moetax_model_free(m);
}

/* Prefill of 8 tokens then 16 steps through an expert store (budgets: all experts, a quarter,
 * one token's worth; 1 and 2 threads) against the mapped run: bit for bit. */
static float *store_run(struct moetax_model *m, struct moetax_store *store, int threads, int ubatch) {
    struct moetax_ctx_params cp = {.n_ctx = 64, .n_threads = threads, .n_ubatch = ubatch, .store = store};
    struct moetax_ctx *c;
    if (moetax_ctx_init(m, &cp, &c)) { CHECK_MSG(0, "%s", moetax_last_error()); return NULL; }
    enum { N = 24 };
    const int64_t V = m->hp.n_vocab;
    float *l = calloc((size_t)(V * N), sizeof(float));
    int32_t t[N];
    for (int i = 0; i < N; i++) t[i] = (int32_t)((i * 53 + 7) % V);
    moetax_status st = moetax_ctx_eval(c, t, 8, l, true);
    for (int i = 8; !st && i < N; i++) st = moetax_ctx_eval(c, t + i, 1, l + i * V, false);
    CHECK_MSG(st == MOETAX_OK, "%s", moetax_last_error());
    moetax_ctx_free(c);
    if (st) { free(l); return NULL; }
    return l;
}

static void store_vs_mapped(const char *path) {
    struct moetax_model *m;
    if (moetax_model_load(path, &m)) { CHECK_MSG(0, "%s", moetax_last_error()); return; }
    const size_t bytes = sizeof(float) * (size_t)(m->hp.n_vocab * 24);
    float *ref = store_run(m, NULL, 1, 64);
    struct moetax_store_params sp = {.policy = MOETAX_STORE_NEXT_USE};
    const uint64_t slot0 = tu_store_slot_bytes(m, &sp);
    CHECK(slot0 > 0);
    const uint64_t slot = slot0 ? slot0 : 1;
    const uint64_t all = slot * (uint64_t)m->hp.n_expert * (uint64_t)m->hp.n_layer;
    const uint64_t budgets[] = {all, all / 4, slot * (uint64_t)m->hp.n_expert_used};
    for (int bi = 0; ref && bi < 3; bi++)
        for (int threads = 1; threads <= 2; threads++) {
            struct moetax_store *s = NULL;
            sp.budget_bytes = budgets[bi];
            int ub = 64;
            if (moetax_model_store_open(m, &sp, ub, 0, &s, &ub)) { CHECK_MSG(0, "%s", moetax_last_error()); continue; }
            /* a budget too small for a 64-token micro-batch shrinks it: the mapped run with the same */
            float *ref_ub = ub == 64 ? ref : store_run(m, NULL, 1, ub);
            float *got = store_run(m, s, threads, ub);
            CHECK_MSG(ref_ub && got && memcmp(got, ref_ub, bytes) == 0,
                      "%s: budget %llu bytes (ubatch %d), %d threads: logits differ from the mapped run", path,
                      (unsigned long long)budgets[bi], ub, threads);
            if (ref_ub != ref) free(ref_ub);
            free(got);
            moetax_store_free(s);
        }
    free(ref);
    moetax_model_free(m);
}

/* qwen2moe: hyper-parameters as llama.cpp derives them, biases and the shared expert's gate
 * bound, prefill = steps, batch = alone, store = mapped, a fused attn_qkv refused. */
static void qwen2moe(void) {
    char f32[512], q8[512], q4[512], bad[512];
    snprintf(f32, sizeof f32, "%s", tu_path("arch_qwen2moe_f32.gguf"));
    snprintf(q8, sizeof q8, "%s", tu_path("arch_qwen2moe_q8_0.gguf"));
    snprintf(q4, sizeof q4, "%s", tu_path("arch_qwen2moe_q4_0.gguf"));
    snprintf(bad, sizeof bad, "%s", tu_path("arch_qwen2moe_bad.gguf"));
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny --embd 128 --heads 8 --heads-kv 2 --head-dim 16 --shared-ff 96", f32), 0);
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny --type q8_0", q8), 0);
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny --type q4_0 --seed 5", q4), 0);
    struct moetax_model *m;
    if (moetax_model_load(f32, &m) == MOETAX_OK) {
        const struct moetax_hparams *hp = &m->hp;
        const struct moetax_layer *l = &m->layers[0];
        CHECK(!strcmp(hp->arch, "qwen2moe"));
        CHECK_EQ_INT(hp->attn, MOETAX_ATTN_GQA);
        CHECK_EQ_INT(hp->n_head, 8);
        CHECK_EQ_INT(hp->n_head_kv, 2);
        CHECK_EQ_INT(hp->n_embd_head_k, 16); /* n_embd / n_head: the converter writes no key_length */
        CHECK_EQ_INT(hp->n_rot, 16);
        CHECK_EQ_INT(hp->rope_mode, MOETAX_ROPE_MODE_NEOX);
        CHECK_EQ_INT(hp->qk_norm, MOETAX_QK_NORM_NONE);
        CHECK_EQ_INT(hp->gating_func, 1);
        CHECK(!hp->expert_weights_norm);
        CHECK_EQ_INT(hp->n_ff_exp, 32);
        CHECK_EQ_INT(hp->n_ff_shexp, 96);
        CHECK(fabsf(hp->kq_scale - 0.25f) < 1e-7f);
        CHECK(fabsf(hp->rope_freq_base - 1e6f) < 1.0f);
        CHECK(l->is_moe && !l->attn_q_norm && l->bq && l->bk && l->bv && l->gate_inp_shexp);
        CHECK_EQ_INT(l->gate_sh.ne[1], 96);
        CHECK_EQ_INT(l->down_sh.ne[0], 96);
        moetax_model_free(m);
    } else {
        CHECK_MSG(0, "%s", moetax_last_error());
    }
    prefill_vs_steps(q8, 0);
    prefill_vs_steps(q4, 0);
    prefill_vs_steps(f32, 2e-5f);
    batch_vs_alone(q8, 0);
    batch_vs_alone(q4, 0);
    batch_vs_alone(f32, 2e-5f);
    store_vs_mapped(q8);
    store_vs_mapped(q4);
    /* a fused attn_qkv (one tensor renamed to it, same length): refused naming it */
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny", bad), 0);
    CHECK(rename_tensor(bad, "blk.1.ffn_norm.weight", "blk.1.attn_qkv.weight"));
    moetax_status st = moetax_model_load(bad, &m);
    CHECK_EQ_INT(st, MOETAX_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(moetax_last_error(), "tensor 'blk.1.attn_qkv.weight' (q, k and v fused"), "%s", moetax_last_error());
    if (!st) moetax_model_free(m);
    /* qwen2moe.expert_weights_norm (HF's norm_topk_prob; llama.cpp ignores it): renormalised */
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny --norm", bad), 0);
    if (moetax_model_load(bad, &m) == MOETAX_OK) {
        CHECK(m->hp.expert_weights_norm);
        moetax_model_free(m);
    } else {
        CHECK_MSG(0, "%s", moetax_last_error());
    }
    /* the shared expert's gate is required */
    CHECK_EQ_INT(gen("--arch qwen2moe --preset tiny", bad), 0);
    CHECK(rename_tensor(bad, "blk.2.ffn_gate_inp_shexp.weight", "blk.2.ffn_gate_inp_shexp.xxxxxx"));
    st = moetax_model_load(bad, &m);
    CHECK_MSG(st != MOETAX_OK && strstr(moetax_last_error(), "blk.2.ffn_gate_inp_shexp.weight"), "%s",
              moetax_last_error());
    if (!st) moetax_model_free(m);
}

/* Dense twins of the GQA architectures (gen --dense-twin-of): qwen3moe -> qwen3, qwen2moe -> qwen2,
 * Mixtral -> a dense llama, olmoe -> olmoe without experts; every layer a dense FFN of the routed
 * (plus shared) experts' width, the same attention; prefill = step-by-step. */
static void dense_twins(void) {
    const char *archs[] = {"qwen3moe", "qwen2moe", "olmoe", "mixtral"};
    const char *twin_arch[] = {"qwen3", "qwen2", "olmoe", "llama"};
    const int twin_ff[] = {2 * 32, 2 * 32 + 64, 2 * 32, 2 * 224}; /* k * F (+ qwen2moe's shared 64) */
    for (int i = 0; i < 4; i++) {
        char moe[512], twin[512], args[640];
        snprintf(moe, sizeof moe, "%s", tu_path("arch_twin_moe.gguf"));
        snprintf(twin, sizeof twin, "%s", tu_path("arch_twin.gguf"));
        snprintf(args, sizeof args, "--arch %s --preset tiny --type q8_0", archs[i]);
        CHECK_EQ_INT(gen(args, moe), 0);
        snprintf(args, sizeof args, "--dense-twin-of %s", moe);
        CHECK_EQ_INT(gen(args, twin), 0);
        struct moetax_model *m;
        if (moetax_model_load(twin, &m)) { CHECK_MSG(0, "%s twin: %s", archs[i], moetax_last_error()); continue; }
        const struct moetax_hparams *hp = &m->hp;
        CHECK_MSG(!strcmp(hp->arch, twin_arch[i]), "%s twin: architecture %s", archs[i], hp->arch);
        CHECK_EQ_INT(hp->attn, MOETAX_ATTN_GQA);
        CHECK_EQ_INT(hp->n_expert, 0);
        CHECK_EQ_INT(hp->n_layer_dense_lead, hp->n_layer);
        CHECK_MSG(!m->layers[0].is_moe && m->layers[0].ffn_gate.ne[1] == twin_ff[i], "%s twin: ffn width %lld",
                  archs[i], (long long)m->layers[0].ffn_gate.ne[1]);
        CHECK_EQ_INT(!!m->layers[0].bq, i == 1);
        CHECK_EQ_INT(!!m->layers[0].attn_q_norm, i == 0 || i == 2);
        moetax_model_free(m);
        prefill_vs_steps(twin, 0);
    }
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    char q8[512], f32[512], bad[512], ds[512];
    snprintf(q8, sizeof q8, "%s", tu_path("arch_qwen3moe_q8_0.gguf"));
    snprintf(f32, sizeof f32, "%s", tu_path("arch_qwen3moe_f32.gguf"));
    snprintf(bad, sizeof bad, "%s", tu_path("arch_qwen3moe_bad.gguf"));
    snprintf(ds, sizeof ds, "%s", tu_path("arch_deepseek2.gguf"));
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --type q8_0", q8), 0);
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny --heads 8 --heads-kv 2 --head-dim 32", f32), 0);

    struct moetax_model *m;
    if (moetax_model_load(f32, &m) == MOETAX_OK) {
        const struct moetax_hparams *hp = &m->hp;
        CHECK(!strcmp(hp->arch, "qwen3moe"));
        CHECK_EQ_INT(hp->attn, MOETAX_ATTN_GQA);
        CHECK_EQ_INT(hp->n_head, 8);
        CHECK_EQ_INT(hp->n_head_kv, 2);
        CHECK_EQ_INT(hp->n_embd_head_k, 32);
        CHECK_EQ_INT(hp->n_embd_head_v, 32);
        CHECK_EQ_INT(hp->n_rot, 32);
        CHECK_EQ_INT(hp->rope_mode, MOETAX_ROPE_MODE_NEOX);
        CHECK_EQ_INT(hp->qk_norm, MOETAX_QK_NORM_HEAD);
        CHECK_EQ_INT(hp->gating_func, 1);
        CHECK(hp->expert_weights_norm);
        CHECK_EQ_INT(hp->n_layer_dense_lead, 0);
        CHECK_EQ_INT(hp->n_expert_shared, 0);
        CHECK(fabsf(hp->kq_scale - 1.0f / sqrtf(32.0f)) < 1e-7f);
        CHECK(fabsf(hp->rope_freq_base - 1e6f) < 1.0f);
        CHECK(m->layers[0].is_moe && m->layers[0].attn_q_norm && m->layers[0].attn_k_norm && m->layers[0].wk.data);
        moetax_model_free(m);
    } else {
        CHECK_MSG(0, "%s", moetax_last_error());
    }
    prefill_vs_steps(q8, 0);
    prefill_vs_steps(f32, 2e-5f);

    /* heads 6 over 4 KV heads: gen refuses it, so write a good file and patch the key's value */
    CHECK_EQ_INT(gen("--arch qwen3moe --preset tiny", bad), 0);
    {
        FILE *f = fopen(bad, "r+b");
        char buf[16384];
        size_t got = f ? fread(buf, 1, sizeof buf, f) : 0;
        const char key[] = "qwen3moe.attention.head_count_kv";
        char *at = got ? memmem(buf, got, key, sizeof key - 1) : NULL;
        CHECK(at != NULL);
        if (at) { /* key, u32 type tag, u32 value */
            const uint32_t v = 3;
            fseek(f, (long)(at - buf) + (long)(sizeof key - 1) + 4, SEEK_SET);
            fwrite(&v, sizeof v, 1, f);
        }
        if (f) fclose(f);
        moetax_status st = moetax_model_load(bad, &m);
        CHECK_EQ_INT(st, MOETAX_ERR_FORMAT);
        CHECK_MSG(strstr(moetax_last_error(), "head_count_kv 3 must divide head_count 4"), "%s", moetax_last_error());
        if (!st) moetax_model_free(m);
    }
    /* an architecture moetax does not run: general.architecture's value patched (same length) */
    {
        FILE *f = fopen(bad, "r+b");
        char buf[16384];
        size_t got = f ? fread(buf, 1, sizeof buf, f) : 0;
        char *at = got ? memmem(buf, got, "qwen3moe", 8) : NULL; /* the first: general.architecture's value */
        CHECK(at != NULL);
        if (at) {
            fseek(f, (long)(at - buf), SEEK_SET);
            fwrite("qwen9moe", 1, 8, f);
        }
        if (f) fclose(f);
        moetax_status st = moetax_model_load(bad, &m);
        CHECK_EQ_INT(st, MOETAX_ERR_UNSUPPORTED);
        CHECK_MSG(strstr(moetax_last_error(), "'qwen9moe' is not supported yet (moetax runs deepseek2, qwen3moe, qwen2moe, qwen3, qwen2, olmoe, llama)"), "%s",
                  moetax_last_error());
        if (!st) moetax_model_free(m);
    }
    /* deepseek2 still loads through its own row of the table */
    CHECK_EQ_INT(gen("--preset tiny", ds), 0);
    if (moetax_model_load(ds, &m) == MOETAX_OK) {
        CHECK_EQ_INT(m->hp.attn, MOETAX_ATTN_MLA);
        CHECK_EQ_INT(m->hp.rope_mode, MOETAX_ROPE_MODE_NORM);
        moetax_model_free(m);
    }
    olmoe_mixtral();
    qwen2moe();
    dense_twins();
    return tu_finish("test_arch");
}
