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
 * llama file. Logits against the NumPy reference: test_model_ref.py; batches: test_batch.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/kernels.h"
#include "moetax/model.h"
#include "testutil.h"

static int gen(const char *args, const char *out) {
    char cmd[1024];
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
    /* a dense llama file: llama.expert_count renamed away */
    CHECK_EQ_INT(gen("--arch mixtral --preset tiny", bad), 0);
    CHECK(rename_tensor(bad, "llama.expert_count", "llama.expert_cxunt"));
    st = moetax_model_load(bad, &m);
    CHECK_EQ_INT(st, MOETAX_ERR_UNSUPPORTED);
    CHECK_MSG(strstr(moetax_last_error(), "a dense llama model (llama.expert_count is absent)"), "%s",
              moetax_last_error());
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
        CHECK_MSG(strstr(moetax_last_error(), "'qwen9moe' is not supported yet (moetax runs deepseek2, qwen3moe, olmoe, llama)"), "%s",
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
    return tu_finish("test_arch");
}
